"""Mixed precision: bf16-autocast workloads (fp32 master weights) and bf16 models capture exactly, every
preset and the search keep a cast weight sharded, the cost model prices bf16 GEMMs at the bf16 rate, and
sharded autocast training matches single-device autocast training within the bf16 tolerance."""
import warnings

import pytest

from conftest import ROOT
from rhino.capture import capture, load_workload
from rhino.check import check_captured
from rhino.cost.cluster import parse_cluster
from rhino.cost.memory import estimate_memory
from rhino.sharding.plan import resolve
from rhino.sharding.placement import Shard, local_shape
from rhino.sharding.presets import parse_strategy, preset_plan

MP = ROOT / "tests" / "workloads" / "mixed_precision.py"
_CAPTURED = {}


def captured(spec: str):
    if spec not in _CAPTURED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CAPTURED[spec] = capture(load_workload(spec))
    return _CAPTURED[spec]


SMALL = ["mlp_autocast", "mlp_autocast_sgd", "mlp_bf16_adam", "mlp_bf16_adamw", "mlp_bf16_sgd", "mlp_bf16_rmsprop",
         "mlp_bf16_rmsprop_plain", "mlp_bf16_adagrad", "cast_chain", "mlp_autocast_cuda"]


@pytest.mark.parametrize("spec", [f"{MP}:{f}" for f in SMALL] +
                         [f"{ROOT / 'examples' / 'gpt.py'}:gpt_autocast", f"{ROOT / 'examples' / 'llama.py'}:llama_bf16"])
def test_check_is_bit_exact(spec):
    """The captured step runs the same kernels in the same order as eager autocast / bf16 training, and
    the functional optimizers round a bf16 update once, as torch's fused pointwise kernels do."""
    r = check_captured(captured(spec), steps=2, rtol=0.0, atol=0.0)
    assert r.ok, r.first_mismatch
    assert r.max_abs_diff == 0.0


def _param_bytes(cap, plan):
    """Per-rank bytes of each parameter under ``plan``."""
    out = {}
    for inp in cap.graph.inputs:
        if inp.name in cap.param_names:
            t = cap.graph.types[inp.value]
            out[inp.name] = t.dtype.itemsize * _prod(local_shape(t.shape, plan.inputs[inp.name], plan.mesh))
    return out


def _prod(xs):
    n = 1
    for x in xs:
        n *= x
    return n


@pytest.mark.parametrize("strategy", ["tp=4", "dp=2,tp=2", "dp=4,zero=3"])
def test_presets_keep_cast_weights_sharded(strategy):
    """Under autocast each weight reaches its matmul through a bf16 cast; the presets shard it exactly as
    in the fp32 model (every parameter holds the same bytes per rank), the matmul weights hold 1/tp."""
    fp32 = captured(f"{ROOT / 'examples' / 'gpt.py'}:workload")
    amp = captured(f"{ROOT / 'examples' / 'gpt.py'}:gpt_autocast")
    spec = parse_strategy(strategy)
    ours, ref = _param_bytes(amp, preset_plan(amp.graph, spec)), _param_bytes(fp32, preset_plan(fp32.graph, spec))
    assert ours == ref
    full = {i.name: amp.graph.types[i.value].nbytes for i in amp.graph.inputs if i.name in amp.param_names}
    split = spec.tp if spec.tp > 1 else spec.dp
    matmul_weights = [n for n in full if n.endswith(("qkv.weight", "proj.weight", "mlp.0.weight", "mlp.2.weight"))]
    assert len(matmul_weights) == 8
    for n in matmul_weights:
        assert ours[n] * split == full[n], n
    assert sum(ours.values()) < sum(full.values()) / split * 1.1


def test_cast_chain_weight_stays_sharded():
    """A weight converted twice (fp32 -> fp16 -> bf16) before its matmul is still split by tp."""
    cap = captured(f"{MP}:cast_chain")
    plan = preset_plan(cap.graph, parse_strategy("tp=2"))
    assert plan.inputs["w"] == (Shard(1),) and plan.inputs["v"] == (Shard(0),)


def test_search_shards_autocast_weights():
    """The search on an autocast model whose fp32 weights and Adam state (26 GB) do not fit one 40 GB
    device replicated with their activations splits every matmul weight."""
    from rhino.search import Level, SearchOptions, search
    cap = captured(f"{MP}:big_autocast")
    res = search(cap.graph, parse_cluster("4xA100-40G"), SearchOptions(level=Level.O1))
    big = [i.name for i in cap.graph.inputs if i.name in cap.param_names and cap.graph.types[i.value].rank == 2]
    assert len(big) == 5
    for n in big:
        assert any(isinstance(p, Shard) for p in res.plan.inputs[n]), (n, res.plan.inputs[n])


@pytest.mark.parametrize("spec,strategy", [
    ("examples/gpt.py:gpt_autocast", "dp=2,tp=2"), ("examples/gpt.py:gpt_autocast", "dp=4,zero=3"),
    ("tests/workloads/mixed_precision.py:mlp_autocast", "tp=4"),
    ("tests/workloads/mixed_precision.py:mlp_bf16_adamw", "dp=2,tp=2"),
    ("tests/workloads/mixed_precision.py:bn_autocast", "dp=2,tp=2"),
    ("tests/workloads/mixed_precision.py:bn_autocast", "dp=4,zero=3"),
])
def test_sharded_autocast_matches_single_device_within_bf16_tolerance(spec, strategy):
    """Every rank's loss and state shards after 2 steps against single-device autocast (or bf16) training, at
    ``bf16_tolerance(4)`` (in-process lockstep simulation of the ranks' real programs)."""
    from rhino.runtime.compare import bf16_tolerance, tolerance_for
    from rhino.runtime.exact import simulate_plan
    cap = captured(str(ROOT / spec))
    assert tolerance_for(cap, 4) == bf16_tolerance(4)
    assert bf16_tolerance(4).rtol == 16 * 2.0 ** -8 and bf16_tolerance(4).normwise
    plan = preset_plan(cap.graph, parse_strategy(strategy))
    r, res = simulate_plan(cap, plan)
    assert r.ok, r.first_mismatch
    assert r.max_abs_diff > 0  # bf16 rounding differs between the sharded and the single-device step
    # the memory model counts fp32 master weights and state and bf16 activations and casts as they live
    rp = resolve(cap.graph, plan)
    for rank, measured in enumerate(res["peaks"]):
        assert estimate_memory(cap.graph, rp, rank).peak == pytest.approx(measured, rel=0.05), rank


def test_cost_model_prices_bf16_gemms_and_memory_bound_casts():
    """Under autocast every matmul reads bf16 tensors and runs at the bf16 tensor-core rate; each cast is
    memory-bound, charged the bytes it reads (fp32) and writes (bf16)."""
    from rhino.cost.compute import op_time, peak_dtype
    from rhino.cost.devices import get_device
    from rhino.ir.registry import OpKind, call_of, lookup
    cap = captured(f"{MP}:big_autocast")
    dev = get_device("A100-80G")
    matmuls = casts = 0
    for node in cap.graph.nodes:
        d = lookup(node.op)
        call = call_of(cap.graph, node)
        if d is not None and d.kind is OpKind.MATMUL:
            matmuls += 1
            assert peak_dtype(call, dev) == "bf16", node.name
        if node.op == "aten._to_copy.default" and call.in_types[0].numel >= 2 ** 20:
            casts += 1
            t = op_time(call, dev)
            assert t.bound == "memory" and t.flops <= call.in_types[0].numel, node.name
            assert t.bytes == call.in_types[0].nbytes + call.out_types[0].nbytes, node.name
    assert matmuls >= 15 and casts >= 10


def test_bf16_tolerance_catches_ranks_training_on_wrong_data():
    """The bf16 comparison is not vacuous: ranks that train on other rows than their share of the batch (as
    if their gradients were never all-reduced with the right data) fail it."""
    import torch
    from rhino.lower.simulate_spmd import simulate_training
    from rhino.lower.spmd import lower_rank
    from rhino.runtime.run import bytes_by_role, compare_results, program_communication
    from rhino.sharding.plan import resolve
    cap = captured(f"{MP}:mlp_autocast")
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=4")))
    x, y = cap.workload.batch
    g = torch.Generator().manual_seed(7)
    wrong = (torch.cat([x[:4], torch.randn(4, x.shape[1], generator=g)]), y)
    state = cap.initial_state()
    res = simulate_training(rp, state, wrong, 2)
    results = {r: {"losses": res["rank_losses"][r], "local": res["local"][r],
                   "held": bytes_by_role(cap.graph, res["local"][r])} for r in range(4)}
    out = compare_results(cap, rp, program_communication(lower_rank(rp, 0)), results, 2, 0.0)
    assert not out.ok and "differs" in out.first_mismatch


def test_cuda_autocast_is_captured_on_the_cpu():
    """``torch.autocast("cuda")`` in a workload acts on the fake CPU tensors capture traces: its matmuls are
    captured in float16 (CUDA's default autocast dtype) and bfloat16, not left in fp32."""
    from rhino.ir.registry import OpKind, lookup
    cap = captured(f"{MP}:mlp_autocast_cuda")
    g = cap.graph
    dtypes = [g.types[n.outputs[0]].dtype.value for n in g.nodes
              if lookup(n.op) is not None and lookup(n.op).kind is OpKind.MATMUL]
    assert "float16" in dtypes and "bfloat16" in dtypes and "float32" not in dtypes
