"""``lower.accumulate``: gradient accumulation fused into the matmul making the gradient."""
import torch
import torch.fx

from rhino.lower.accumulate import fuse_matmul_accumulation

MM, T = torch.ops.aten.mm.default, torch.ops.aten.t.default


def _program(transposes: int, extra_reader: bool) -> torch.fx.Graph:
    """acc.add_(t^k(mm(a, b))); with ``extra_reader`` the product is also returned (not fusable)."""
    g = torch.fx.Graph()
    acc, a, b = g.placeholder("acc"), g.placeholder("a"), g.placeholder("b")
    x = prod = g.call_function(MM, (a, b))
    for _ in range(transposes):
        x = g.call_function(T, (x,))
    g.call_function(torch.Tensor.add_, (acc, x))
    g.output([prod] if extra_reader else [])
    return g


def _run(g: torch.fx.Graph, acc: torch.Tensor, a, b) -> torch.Tensor:
    acc = acc.clone()
    torch.fx.GraphModule(torch.nn.Module(), g)(acc, a, b)
    return acc


def test_a_matmul_gradient_is_added_by_the_matmul_and_the_sum_is_unchanged():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(3, 4, generator=gen, dtype=torch.float64)
    for k in (0, 1, 2, 3):
        shape = (5, 4) if k % 2 == 0 else (4, 5)
        acc = torch.randn(shape, generator=gen, dtype=torch.float64)
        want = _run(_program(k, False), acc, a, b)
        g = _program(k, False)
        removed = fuse_matmul_accumulation(g)
        targets = [n.target for n in g.nodes if n.op == "call_function"]
        assert len(removed) == k + 2 and torch.Tensor.addmm_ in targets, k
        assert MM not in targets and torch.Tensor.add_ not in targets
        assert targets.count(T) == k % 2          # the accumulator seen through one transpose, or itself
        got = _run(g, acc, a, b)
        assert torch.allclose(got, want, rtol=1e-14, atol=1e-14), (k, (got - want).abs().max())


def test_a_product_read_elsewhere_is_not_fused():
    g = _program(2, True)
    assert fuse_matmul_accumulation(g) == set()
    assert torch.Tensor.add_ in [n.target for n in g.nodes]


def test_the_micro_batch_programs_of_a_pipeline_fuse_every_weight_gradient():
    """mlp, pp=2 with 4 micro-batches: each later backward adds its weights' gradients with addmm_ (the
    biases' remain add_ of a sum)."""
    import warnings
    from conftest import ROOT
    from rhino.capture import capture, default_dtype, load_workload
    from rhino.runtime.pipeline import PipelineStep
    from rhino.sharding.presets import parse_strategy, preset_plan
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload(str(ROOT / "examples" / "mlp.py"), dtype=torch.float64))
    step = PipelineStep(cap, preset_plan(cap.graph, parse_strategy("pp=2,microbatches=4")), 0)
    prog = step.programs[("B", False, 0)].module
    calls = [n.target for n in prog.graph.nodes if n.op == "call_function"]
    weights = [n for n in step.state_names if n.endswith("weight") and not n.startswith("opt")]
    assert weights and calls.count(torch.Tensor.addmm_) == len(weights)
    assert calls.count(torch.Tensor.add_) == len([n for n in step.state_names if n.endswith("bias")
                                                  and not n.startswith("opt")])
