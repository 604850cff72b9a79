"""Memory plans for every rank of a parallel plan (#14 item 4): rank graphs, their plans, the arena runs.

Fast tier: the MLP and GPT examples under dp=2,tp=2 and dp=4,zero=3 in float64 — every rank's program as a
graph (``lower.rank_graph``), each distinct problem planned at O1 and checked independently, and every rank
run in its planned arena in lockstep (``lower.arena_ranks``), compared with the plain rank programs on every
rank (losses and every state shard, bitwise). One case also runs a reordered plan (least-peak-first order,
greedy layout) so the arena runs an order other than the program's. Multi-process: ``rhino run
--memory-plan`` on the MLP example with 2 processes.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from rhino.capture import capture, load_workload
from rhino.lower.arena import ArenaProgram, out_overload
from rhino.lower.arena_ranks import compare_arena_ranks, local_inputs, lockstep_arenas, rank_arena
from rhino.lower.rank_graph import COMM_OP, rank_graph, rank_memories, rank_problem
from rhino.lower.simulate_spmd import simulate_ranks
from rhino.lower.spmd import lower_rank
from rhino.lower.spmd_ops import redistribute
from rhino.memory import least_peak_order
from rhino.memory.from_graph import aligned_offsets
from rhino.memory.layout import greedy_layout
from rhino.memory.problem import buffers
from rhino.memory.step_report import check_plan, plan_rank_memory
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

STRATEGIES = ("dp=2,tp=2", "dp=4,zero=3")


def _setup(example: str, strategy: str):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cap = capture(load_workload(f"examples/{example}.py"))
    finally:
        torch.set_default_dtype(old)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy(strategy)))
    return cap, rp


@pytest.mark.parametrize("example", ["mlp", "gpt"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_rank_plans_valid_and_arena_equals_plain(example, strategy):
    cap, rp = _setup(example, strategy)
    mems = rank_memories(rp)
    report = plan_rank_memory([(m.rank, m.problem, m.mapping) for m in mems], level="O1", time_limit=20)
    assert sorted(r for g in report.groups for r in g) == list(range(rp.plan.mesh.world))
    for m in mems:
        rep = report.of_rank(m.rank)
        assert check_plan(m.problem, rep.plan) is None and rep.valid
        assert rep.plan.order_lower_bound <= rep.plan.lower_bound <= rep.plan.height
    d = report.to_dict()
    assert [row["rank"] for row in d["ranks"]] == list(range(rp.plan.mesh.world))
    assert all(row["valid"] and row["order_lower_bound_bytes"] <= row["rhino_peak_bytes"] for row in d["ranks"])
    ex = compare_arena_ranks(rp, mems, report, cap.initial_state(), tuple(b.detach() for b in cap.workload.batch),
                             rtol=1e-12, atol=0.0, steps=1)
    assert ex["equal"] and ex["bitwise"], ex
    assert ex["arena_equals_plan"] and ex["arena_bytes"] == ex["plan_bytes"]


def test_an_out_overload_that_writes_past_its_slot_is_not_used():
    """``huber_loss.out`` (mean) writes the unreduced loss through its scalar out tensor before reducing; each
    out= overload is tried once beside its op (``ArenaProgram._out_safe``), so it runs as the op here and every
    rank's arena equals the plain program bitwise (it differed by 0.02 in the loss)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cap = capture(load_workload("tests/workloads/variants.py:huber_head"))
    finally:
        torch.set_default_dtype(old)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=4")))
    mems = rank_memories(rp)
    report = plan_rank_memory([(m.rank, m.problem, m.mapping) for m in mems], level="O1", time_limit=20)
    ex = compare_arena_ranks(rp, mems, report, cap.initial_state(), tuple(b.detach() for b in cap.workload.batch),
                             rtol=1e-12, atol=0.0, steps=2)
    assert ex["equal"] and ex["bitwise"], ex


def test_rank_graph_is_the_rank_program():
    """The graph has one node per aten call of the fx program (getitems folded) and one communication node
    per redistribute call, with this rank's local input shapes; the comm nodes are chained in program order."""
    _, rp = _setup("gpt", "dp=2,tp=2")
    prog = lower_rank(rp, 1, "meta")
    calls = [n for n in prog.module.graph.nodes if n.op == "call_function"]
    n_comm = sum(n.target is redistribute for n in calls)
    g = rank_graph(rp, 1)
    comm = [i for i, n in enumerate(g.nodes) if n.op == COMM_OP]
    assert n_comm > 0 and len(comm) == n_comm
    assert len(g.nodes) <= len(calls)
    for inp in g.inputs:
        src = next(i for i in rp.graph.inputs if i.name == inp.name)
        assert inp.role is src.role and g.types[inp.value].shape == rp.local_shape(src.value)
    problem, _ = rank_problem(g)
    for prev, i in zip(comm, comm[1:]):
        assert prev in problem.ops[i].after


def test_reordered_plan_runs_every_rank_exactly():
    """A plan in another order than the program's (least-peak-first, greedy layout) gives the same bits."""
    cap, rp = _setup("gpt", "dp=4,zero=3")
    mems = rank_memories(rp)
    arenas = []
    for m in mems:
        order = least_peak_order(m.problem)
        offsets, height = aligned_offsets(m.problem, order, greedy_layout(buffers(m.problem, order)), m.mapping.align)
        arenas.append(ArenaProgram(m.graph, m.problem, m.mapping, order, offsets, height, debug=True))
    assert arenas[0].order != list(range(len(mems[0].graph.nodes)))
    batch = tuple(b.detach() for b in cap.workload.batch)
    plain_losses = [[] for _ in mems]
    with torch.no_grad():
        _, _, _, plain = simulate_ranks(rp, cap.initial_state(), batch, 1, return_state=True, rank_losses=plain_losses)
    inputs = local_inputs(rp, cap.initial_state(), batch)   # the shards simulate_ranks makes
    states = [s for s, _ in inputs]
    losses = lockstep_arenas(arenas, states, [b for _, b in inputs], rp.plan.mesh)
    for r in range(len(mems)):
        assert float(losses[r]) == plain_losses[r][0]
        for k, t in states[r].items():
            assert torch.equal(t, plain[r][k]), (r, k)
        assert arenas[r].stats.arena_bytes == arenas[r].height


def test_memory_plan_with_microbatches_is_one_clear_error():
    cap, _ = _setup("mlp", "dp=2")
    from rhino.api import rank_memory_report
    with pytest.raises(ValueError, match="microbatches=2"):
        rank_memory_report(cap, strategy="dp=2,microbatches=2", level="O1")


def test_rank_memory_report_refuses_pipeline_stages():
    # pp=2 was planned as one program on one rank (mesh dp1): a report for a plan that runs on two devices
    cap, _ = _setup("mlp", "dp=2")
    from rhino.api import rank_memory_report
    with pytest.raises(ValueError, match="2 pipeline stages"):
        rank_memory_report(cap, strategy="pp=2", level="O1")


def test_only_the_probe_ranks_programs_are_built(monkeypatch):
    """``rank_memory_report`` without ``execute`` builds the probe ranks' programs (the first, the last, the last
    along each mesh axis: 4 of 8 on dp2 x tp4; on a large model each takes seconds, and building all 16
    ranks of a 48-layer LLaMA took 230 s of a 30 s limit) and gives every rank the plan of building them
    all; where the probes differ, every rank's is built."""
    from rhino.api import rank_memory_report
    from rhino.lower.rank_graph import probe_ranks, probed_rank_problems
    from rhino.sharding.mesh import Mesh
    assert probe_ranks(Mesh(("dp", "tp"), (2, 4))) == [0, 3, 4, 7] and probe_ranks(Mesh(("dp",), (4,))) == [0, 3]
    cap, rp = _setup("mlp", "dp=2,tp=4")
    rep = rank_memory_report(cap, strategy="dp=2,tp=4", level="O1", time_limit=20)
    built, rows = probed_rank_problems(rp, probe=False)
    full = plan_rank_memory(rows, mesh=str(rp.plan.mesh), strategy="dp=2,tp=4", level="O1", time_limit=20)
    got, want = rep.to_dict(), full.to_dict()
    assert got["built_ranks"] == [0, 3, 4, 7] and built == list(range(8))
    for a, b in zip(got["ranks"], want["ranks"]):
        assert (a["rank"], a["rhino_peak_bytes"], a["valid"]) == (b["rank"], b["rhino_peak_bytes"], b["valid"])
    import rhino.memory.step_report as step_report
    keys = iter(range(100))
    monkeypatch.setattr(step_report, "problem_key", lambda problem: next(keys))  # probes that differ
    assert probed_rank_problems(rp)[0] == list(range(8))


@pytest.mark.multiprocess
def test_rhino_run_memory_plan(tmp_path, capsys):
    from rhino.cli.main import main
    rc = main(["run", "examples/mlp.py", "--nproc", "2", "--strategy", "dp=2", "--steps", "2", "--dtype", "float64",
               "--memory-plan", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and out["max_abs_diff"] <= 1e-9
    assert [m["rank"] for m in out["memory_plan"]] == [0, 1]
    assert all(m["arena_bytes"] == m["plan_bytes"] > 0 for m in out["memory_plan"])
    assert len({m["arena_bytes"] for m in out["memory_plan"]}) == 1   # equal programs, one plan (plan_ranks)


def test_plans_made_before_the_ranks_start_are_checked_on_each_rank():
    """``rhino run --memory-plan`` plans each distinct rank program once before the ranks start
    (``plan_ranks``); a rank runs the plan it is handed after checking it against its own program, and
    refuses one made for another program."""
    from rhino.runtime.arena_step import ArenaRankStep, plan_ranks
    cap, rp = _setup("mlp", "dp=2")
    plans = plan_ranks(cap.graph, rp.plan, "O1", 20)
    assert sorted(plans) == [0, 1] and plans[0] is plans[1] and plans[0].valid
    step = ArenaRankStep(cap.graph, rp.plan, 1, planned=plans[1])
    assert step.plan_bytes == plans[1].plan.height
    tp = preset_plan(cap.graph, parse_strategy("tp=2"))
    with pytest.raises(AssertionError, match="rank 0's memory plan is invalid"):
        ArenaRankStep(cap.graph, rp.plan, 0, planned=plan_ranks(cap.graph, tp, "O1", 20)[0])


def test_recompute_plan_per_rank_runs_exactly():
    """Recomputation is applied before the rank programs are built (as ``RankStep`` does); arena = plain, bitwise."""
    cap, _ = _setup("mlp", "dp=2")
    from rhino.api import rank_memory_report
    rep = rank_memory_report(cap, strategy="dp=2,recompute=full", level="O1", execute=True)
    plain = rank_memory_report(cap, strategy="dp=2", level="O1")
    assert rep.ok and rep.execute["bitwise"] and rep.execute["arena_equals_plan"]
    assert rep.reports[0].problem.ops != plain.reports[0].problem.ops   # the recomputing program was planned


def _tied_autoencoder(strategy: str = "dp=2,tp=2"):
    import warnings
    from conftest import ROOT
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cap = capture(load_workload(str(ROOT / "tests" / "workloads" / "heldout23.py") + ":tied_autoencoder"))
    finally:
        torch.set_default_dtype(old)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy(strategy)))
    mems = rank_memories(rp)
    report = plan_rank_memory([(m.rank, m.problem, m.mapping) for m in mems], level="O1", time_limit=20)
    return cap, rp, mems, report


def test_an_out_overload_that_resizes_its_out_tensor_is_not_used(capfd):
    """``mse_loss.out`` (mean) resizes its scalar out tensor to the unreduced [4, 8] before reducing into it
    (PyTorch's C++ "An output with one or more elements was resized" warning on stderr): in the arena that
    resize claims the bytes after the loss's slot, or reallocates the whole arena when the slot is at its end.
    The out= trial (``ArenaProgram._out_safe``) sees the growth with empty out tensors, so the op runs plainly:
    no resize on any rank, arena = plain program bitwise, arena bytes = plan."""
    cap, rp, mems, report = _tied_autoencoder()
    capfd.readouterr()
    ex = compare_arena_ranks(rp, mems, report, cap.initial_state(), tuple(b.detach() for b in cap.workload.batch),
                             rtol=1e-12, atol=0.0, steps=2)
    err = capfd.readouterr().err
    assert "was resized" not in err, err
    assert ex["equal"] and ex["bitwise"], ex
    assert ex["arena_equals_plan"], ex
    a = torch.randn(4, 8, dtype=torch.float64)
    ov = out_overload("aten.mse_loss.default")
    assert ArenaProgram._grows_out(ov, [a, a.flip(0), 1], {}, [torch.empty((), dtype=torch.float64)])
    assert not ArenaProgram._grows_out(out_overload("aten.add.Tensor"), [a, a], {}, [torch.empty_like(a)])


@pytest.mark.parametrize("trial", [True, False])
def test_a_slot_of_the_wrong_shape_is_an_error_naming_the_node(trial):
    """A graph type that is not what the op returns (a 0-dim slot where a matmul writes a matrix) is refused with
    the node named, whether the op runs through out= (the trial skipped: PyTorch would resize the slot off its
    planned bytes) or is copied into its slot (``copy_`` would broadcast or fail far from the cause)."""
    cap, rp, mems, report = _tied_autoencoder()
    arenas = [rank_arena(m, report) for m in mems]
    inputs = local_inputs(rp, cap.initial_state(), tuple(b.detach() for b in cap.workload.batch))
    prog, g = arenas[0], mems[0].graph
    prog._make_arena({v: tuple(t.stride()) for v, t in prog._given_inputs(*inputs[0]).items()})
    i, v = next((i, n.outputs[0]) for i, n in enumerate(g.nodes) if n.op == "aten.mm.default")
    shape = list(g.types[v].shape)
    assert len(shape) == 2 and v in prog._slots
    prog._slots[v] = prog._slots[v].view(-1)[0]     # the slot of a value typed () in a wrong graph
    if not trial:
        prog._out_safe = lambda *a, **k: True
    with pytest.raises(RuntimeError, match=rf"node {i} \(aten\.mm\.default\) .*{re.escape(str(shape))}"):
        lockstep_arenas(arenas, [s for s, _ in inputs], [b for _, b in inputs], rp.plan.mesh)


def _bf16_layer_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g).to(torch.bfloat16), torch.randn(4, 4, generator=g).to(torch.bfloat16)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x, y: ((m(x) - y) ** 2).mean(), (x, y)


def test_rank_graph_types_follow_the_cpu_kernels_of_a_bf16_layer_norm():
    # the meta kernel of native_layer_norm gives float32 mean/rstd for a bf16 input, the CPU kernel (and capture)
    # bf16: the rank graph typed them float32, their arena slots were float32, and the CPU backward refused them
    from rhino.api import capture_step
    cap = capture_step(_bf16_layer_norm())
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2")))
    g = rank_graph(rp, 0)
    ln = next(n for n in g.nodes if n.op == "aten.native_layer_norm.default")
    assert [g.types[v].dtype.value for v in ln.outputs] == ["bfloat16"] * 3
    from rhino.api import rank_memory_report
    rep = rank_memory_report(cap, strategy="dp=2", level="O1", time_limit=10, execute=True)
    assert rep.execute["equal"] and rep.execute["arena_equals_plan"]


def _frozen_batch_norm():
    """A conv net whose BatchNorm is in eval() (frozen running statistics) while the rest trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 4))
    model[1].eval()
    x, y = torch.randn(4, 3, 4, 4), torch.randint(0, 4, (4,))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), \
        lambda m, a, t: torch.nn.functional.cross_entropy(m(a), t), (x, y)


def test_rank_graph_types_follow_the_cpu_kernels_of_a_frozen_batch_norm():
    # batch norm without training statistics: the meta kernel gives [C] saved mean and invstd, the CPU kernel
    # empty ones; the rank graph gave them [C] arena slots and the run refused the [0] results
    from rhino.api import capture_step, rank_memory_report
    cap = capture_step(_frozen_batch_norm())
    rep = rank_memory_report(cap, strategy="dp=2", level="O1", time_limit=10, execute=True)
    assert rep.execute["equal"] and rep.execute["arena_equals_plan"], rep.execute


def test_an_op_returning_nothing_is_a_rank_graph_node():
    # torch.linalg.inv checks its result with _linalg_check_errors, which returns nothing: the rank graph took its
    # missing result for a tensor (a traceback from rhino memory --strategy)
    from rhino.api import capture_step, rank_memory_report
    from conftest import ROOT
    cap = capture_step(str(ROOT / "tests" / "workloads" / "heldout29.py") + ":batched_inverse")
    rep = rank_memory_report(cap, strategy="dp=2,tp=2", level="O1", time_limit=10, execute=True)
    assert rep.execute["equal"] and rep.execute["arena_equals_plan"], rep.execute
