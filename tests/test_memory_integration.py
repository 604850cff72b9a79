"""Memory planning on captured steps: IR -> problem, the arena executor, and ``rhino memory``.

Oracles: the problem's own validator and ``simulate.check_order``; ``cost.memory.estimate_memory``
(an independent liveness count) for the replay peak; plain ``StepProgram`` for the arena executor's
results (bitwise: the same ops in another order on CPU); the executor's debug guard for overlaps.
"""
import json
import random
import resource
from functools import lru_cache
from types import SimpleNamespace

import pytest
import torch

from conftest import EXAMPLES, ROOT
from rhino.capture import capture, load_workload
from rhino.cli.main import main
from rhino.cost.memory import estimate_memory
from rhino.ir.graph import Role
from rhino.lower import StepProgram
from rhino.lower.arena import ArenaProgram, out_overload
from rhino.memory.from_graph import aligned_offsets, problem_from_graph
from rhino.memory.problem import OpRole, TensorKind, lifetimes
from rhino.memory.simulate import check_order, replay

META = ROOT / "tests" / "workloads" / "memory_meta.py"
VARIANTS = ROOT / "tests" / "workloads" / "variants.py"


@lru_cache(maxsize=None)
def _cap(spec: str):
    """An example by name, or a FILE:FUNC workload; captured once per test session."""
    return capture(load_workload(spec if ":" in spec else str(ROOT / "examples" / f"{spec}.py")))


def _greedy(problem, order):
    """A valid layout for ``order``: largest first, lowest offset that fits (the tests' trivial plan)."""
    lt = lifetimes(problem, order)
    placed, offsets = [], {}
    for t in sorted((t for t in problem.tensors.values() if t.size > 0), key=lambda t: (-t.size, t.id)):
        lo, hi = lt[t.id]
        off = 0
        for a, b in sorted((a, b) for (l2, h2, a, b) in placed if l2 < hi and lo < h2):
            if off + t.size <= a:
                break
            off = max(off, b)
        offsets[t.id] = off
        placed.append((lo, hi, off, off + t.size))
    height = max((o + problem.tensors[t].size for t, o in offsets.items()), default=0)
    return SimpleNamespace(order=list(order), offsets=offsets, height=height)


def _random_topo(problem, seed):
    rnd = random.Random(seed)
    preds, succs = problem.predecessors(), problem.successors()
    indeg = {o: len(ps) for o, ps in preds.items()}
    ready = [o for o, d in indeg.items() if d == 0]
    out = []
    while ready:
        o = ready.pop(rnd.randrange(len(ready)))
        out.append(o)
        for s in succs[o]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return out


def _run_both(cap, problem, mapping, plan, steps=2):
    """Arena vs StepProgram from the same initial state and seeds; returns (bitwise, max diff, program)."""
    prog = ArenaProgram(cap.graph, problem, mapping, plan.order, plan.offsets, plan.height, debug=True)
    ref = StepProgram(cap.graph)
    s_ref, s_ar = cap.initial_state(), cap.initial_state()
    bitwise, diff = True, 0.0
    for k in range(steps):
        torch.manual_seed(k)
        l_ref = ref.step(s_ref, cap.workload.batch)
        torch.manual_seed(k)
        l_ar = prog.step(s_ar, cap.workload.batch)
        for a, b in [(l_ref, l_ar)] + [(s_ref[n], s_ar[n]) for n in s_ref]:
            bitwise = bitwise and torch.equal(a, b)
            if a.numel():
                diff = max(diff, float((a.double() - b.double()).abs().max()))
    return bitwise, diff, prog


# -- IR -> problem ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", EXAMPLES)
def test_problem_from_every_example_validates(name):
    cap = _cap(name)
    problem, mapping = problem_from_graph(cap.graph)
    problem.validate()
    check_order(problem, problem.op_ids())
    g = cap.graph
    assert [o.id for o in problem.ops] == list(range(len(g.nodes)))
    # views create nothing; every tensor is a storage root; sizes are aligned and cover the exact bytes
    for i in mapping.view_nodes:
        assert problem.ops[i].outputs == ()
    for tid, t in problem.tensors.items():
        assert mapping.root[tid] == tid and t.size % mapping.align == 0 and t.size >= mapping.nbytes[tid]
    # persistent state is outside; batch inputs are INPUT tensors; the loss's storage is an OUTPUT
    state = {i.value for i in g.inputs if i.role is not Role.BATCH}
    assert not state & problem.tensors.keys()
    assert all(problem.tensors[i.value].kind is TensorKind.INPUT for i in g.inputs if i.role is Role.BATCH)
    assert problem.tensors[mapping.root[g.loss.value]].kind is TensorKind.OUTPUT
    assert mapping.state_bytes == sum(g.types[i.value].nbytes for i in g.inputs if i.role is not Role.BATCH)
    roles = [o.role for o in problem.ops]
    assert roles.count(OpRole.LOSS) == 1 and OpRole.OPTIMIZER in roles and OpRole.BACKWARD in roles
    loss_step = roles.index(OpRole.LOSS)
    opt_in = {i.value for i in g.inputs if i.role is Role.OPT_STATE}
    for i, (node, r) in enumerate(zip(g.nodes, roles)):
        if i < loss_step:  # forward (BatchNorm statistics updates included), unless it reads optimizer state
            assert r is OpRole.FORWARD or any(x.id in opt_in for x in node.input_refs())
        else:
            assert r is not OpRole.FORWARD
        if "_backward" in node.op:  # autograd's ops are backward work, never optimizer work
            assert r is OpRole.BACKWARD, node.name
    # every parameter is updated in place (an optimizer does that in eager PyTorch)
    params = {i.name for i in g.inputs if i.role is Role.PARAM}
    assert params <= set(mapping.inplace.values())


@pytest.mark.parametrize("name", EXAMPLES)
def test_replay_peak_relates_to_estimate_memory(name):
    """Same storages, same lifetimes: program-order replay + state == estimate_memory's peak with the state
    held all step (no in-place, exact sizes: ``release_state=False``); in-place state updates can only lower
    it, and so does the runtime's liveness (replaced state freed at its last read)."""
    g = _cap(name).graph
    est = estimate_memory(g, release_state=False)
    assert estimate_memory(g).peak <= est.peak
    plain, pm = problem_from_graph(g, inplace_state=False, align=1)
    plain.validate()
    assert replay(plain, plain.op_ids()).peak + pm.state_bytes == est.peak
    inpl, im = problem_from_graph(g, align=1)
    assert replay(inpl, inpl.op_ids()).peak <= replay(plain, plain.op_ids()).peak
    # including the state as INPUT tensors adds exactly the state bytes to the functional program's peak
    full, fm = problem_from_graph(g, inplace_state=False, include_state=True, align=1)
    full.validate()
    assert replay(full, full.op_ids()).peak == est.peak
    with_state, _ = problem_from_graph(g, include_state=True)
    with_state.validate()


def test_inplace_update_orders_reads_before_the_write():
    g = _cap("gpt").graph
    problem, mapping = problem_from_graph(g)
    state_in = {i.name: i.value for i in g.inputs}
    readers = {}
    for i, node in enumerate(g.nodes):
        for r in node.input_refs():
            readers.setdefault(mapping.root[r.id], set()).add(i)
    producer = {v: i for i, n in enumerate(g.nodes) for v in n.outputs if v is not None}
    for r, name in mapping.inplace.items():
        p = producer[r]
        assert r not in problem.tensors
        assert readers.get(state_in[name], set()) - {p} <= set(problem.ops[p].after)
        for j in readers.get(r, set()) - {p}:
            assert p in problem.ops[j].after


def test_random_ops_keep_their_order():
    cap = capture(load_workload(str(ROOT / "examples" / "bert.py")))
    problem, _ = problem_from_graph(cap.graph)
    rnd = [i for i, n in enumerate(cap.graph.nodes) if "dropout" in n.op or "rand" in n.op or "bernoulli" in n.op]
    for a, b in zip(rnd, rnd[1:]):
        assert a in problem.ops[b].after


# -- arena executor ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_arena_program_order_equals_step_program(name):
    cap = _cap(name)
    problem, mapping = problem_from_graph(cap.graph)
    plan = _greedy(problem, problem.op_ids())
    bitwise, diff, prog = _run_both(cap, problem, mapping, plan)
    assert bitwise, f"max abs diff {diff}"
    st = prog.stats
    assert st.arena_bytes == plan.height == prog._arena.numel()
    assert st.out_variant > st.copied > 0 and st.view_copies == 0
    assert st.inplace_state == len(mapping.inplace) and st.guard_checks > 0


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "llama", "moe"])
def test_arena_reordered_equals_step_program(name):
    """A random valid order (every dependency and ordering edge of the problem respected) gives bitwise the
    same training step: the problem's edges are all the executor needs."""
    cap = _cap(name)
    problem, mapping = problem_from_graph(cap.graph)
    order = _random_topo(problem, seed=len(name))
    assert order != problem.op_ids()
    bitwise, diff, prog = _run_both(cap, problem, mapping, _greedy(problem, order))
    assert bitwise, f"max abs diff {diff}"


@pytest.mark.parametrize("func", ["adam_amsgrad", "sgd_dampening", "rmsprop_centered"])
def test_arena_on_optimizer_variants(func):
    """Frozen and unused parameters, parameters outside the optimizer, BatchNorm-free corner cases."""
    cap = _cap(f"{VARIANTS}:{func}")
    problem, mapping = problem_from_graph(cap.graph)
    problem.validate()
    bitwise, diff, _ = _run_both(cap, problem, mapping, _greedy(problem, _random_topo(problem, 3)))
    assert bitwise, f"max abs diff {diff}"


def test_arena_keeps_an_out_overload_only_if_its_outputs_may_share_one_storage():
    """``linalg_qr.out`` with column-major Q and R in one storage (arena slots) writes a wrong R; alone each is right.
    The out= trial now also runs with the outputs in one buffer, so the arena computes QR and copies instead."""
    cap = _cap(str(ROOT / "tests" / "workloads" / "heldout33.py:qr_both"))
    problem, mapping = problem_from_graph(cap.graph)
    bitwise, diff, _ = _run_both(cap, problem, mapping, _greedy(problem, problem.op_ids()))
    assert bitwise, f"max abs diff {diff}"


def test_a_layer_norm_under_cpu_autocast_gets_the_kernels_float32_statistics():
    """A float32 LayerNorm on a bf16 activation (CPU autocast): the CPU kernel keeps mean and rstd in float32, the
    fake kernel capture traced with said bf16, so their arena slots were half their size and the arena refused the
    step ("returned torch.float32 ... but the graph gives it torch.bfloat16"). The graph now has the kernel's types
    (the registry's ``cpu_dtypes``) and the arena runs the step bitwise."""
    from rhino.ir.types import DType
    cap = _cap(str(ROOT / "tests" / "workloads" / "heldout34.py:autocast_layer_norm"))
    norm = next(n for n in cap.graph.nodes if n.op == "aten.native_layer_norm.default")
    assert [cap.graph.types[v].dtype for v in norm.outputs] == [DType.bfloat16, DType.float32, DType.float32]
    problem, mapping = problem_from_graph(cap.graph)
    bitwise, diff, _ = _run_both(cap, problem, mapping, _greedy(problem, problem.op_ids()))
    assert bitwise, f"max abs diff {diff}"


def test_aligned_offsets_repairs_an_unaligned_layout():
    cap = _cap("gpt")
    problem, mapping = problem_from_graph(cap.graph)
    order = _random_topo(problem, 5)
    plan = _greedy(problem, order)
    shifted = {t: o + 3 for t, o in plan.offsets.items()}  # still valid, not aligned, 3 bytes higher
    offsets, height = aligned_offsets(problem, order, shifted, mapping.align)
    assert height <= plan.height and all(o % mapping.align == 0 for o in offsets.values())
    ArenaProgram(cap.graph, problem, mapping, order, offsets, height)  # its layout check passes


def test_out_overloads_found_for_common_ops():
    assert out_overload("aten.add.Tensor")[0] is torch.ops.aten.add.out
    assert out_overload("aten.mm.default")[0] is torch.ops.aten.mm.out
    assert out_overload("aten.native_layer_norm.default")[1] == ("out0", "out1", "out2")
    assert out_overload("aten._to_copy.default") is None  # different arguments: copied in


def test_layout_overlap_is_rejected_and_guard_catches_it(monkeypatch):
    cap = _cap("mlp")
    problem, mapping = problem_from_graph(cap.graph)
    plan = _greedy(problem, problem.op_ids())
    bad = {t: 0 for t in plan.offsets}
    height = max(t.size for t in problem.tensors.values())
    with pytest.raises(ValueError, match="overlap"):
        ArenaProgram(cap.graph, problem, mapping, plan.order, bad, height)
    with pytest.raises(ValueError, match="above the capacity"):
        ArenaProgram(cap.graph, problem, mapping, plan.order, plan.offsets, plan.height - 64)
    with pytest.raises(ValueError, match="alignment"):  # float32 slots 2 bytes off
        ArenaProgram(cap.graph, problem, mapping, plan.order, {t: o + 2 for t, o in plan.offsets.items()},
                     plan.height + 2)
    monkeypatch.setattr(ArenaProgram, "_check_layout", lambda self: None)
    prog = ArenaProgram(cap.graph, problem, mapping, plan.order, bad, height, debug=True)
    with pytest.raises(AssertionError, match="over live tensor"):
        prog.step(cap.initial_state(), cap.workload.batch)


def test_arena_rejects_meta_and_bad_orders():
    cap = _cap("mlp")
    problem, mapping = problem_from_graph(cap.graph)
    plan = _greedy(problem, problem.op_ids())
    with pytest.raises(ValueError, match="meta"):
        ArenaProgram(cap.graph, problem, mapping, plan.order, plan.offsets, plan.height, device="meta")
    with pytest.raises(ValueError):
        ArenaProgram(cap.graph, problem, mapping, plan.order[::-1], plan.offsets, plan.height)


# -- planned (plan_memory) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_planned_arena_equals_step_program(name):
    from rhino.memory.plan import plan_memory
    cap = _cap(name)
    problem, mapping = problem_from_graph(cap.graph)
    plan = plan_memory(problem, level="O1", time_limit=20)
    assert plan.valid and plan.height <= plan.pytorch_live_peak * 1.5
    bitwise, diff, prog = _run_both(cap, problem, mapping, plan)
    assert bitwise, f"max abs diff {diff}"
    assert prog.stats.arena_bytes == plan.height


# -- rhino memory ----------------------------------------------------------------------------------------------

def _cli(capsys, *argv):
    code = main(["memory", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


KEYS = {"pytorch_live_peak_bytes", "pytorch_peak_bytes", "bestfit_peak_bytes", "heuristic_peak_bytes",
        "rhino_peak_bytes", "lower_bound_bytes", "solve_seconds", "valid"}


def test_cli_json_execute_and_report(capsys, tmp_path):
    code, out, _ = _cli(capsys, ROOT / "examples" / "mlp.py", "--json", "--level", "O1", "--execute",
                        "--report", tmp_path / "rep")
    d = json.loads(out)
    assert code == 0 and KEYS <= d.keys() and d["valid"] is True and d["ok"] is True
    assert d["lower_bound_bytes"] <= d["rhino_peak_bytes"] <= d["pytorch_peak_bytes"]
    ex = d["execute"]
    assert ex["equal"] and ex["arena_equals_plan"] and ex["arena_bytes"] == d["rhino_peak_bytes"]
    assert ex["out_variant_ops"] > 0
    pngs = sorted(p.name for p in (tmp_path / "rep").iterdir())
    assert pngs == ["layout.png", "memory_over_time.png"]
    assert all((tmp_path / "rep" / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_cli_table(capsys):
    code, out, err = _cli(capsys, ROOT / "examples" / "gpt.py", "--level", "O1", "--execute")
    assert code == 0
    for phrase in ("PyTorch (live bytes)", "PyTorch (caching allocator)", "best-fit", "heuristic", "Rhino",
                   "lower bound", "solve seconds", "execute: OK"):
        assert phrase in out
    assert "planning" in err


def test_cli_plans_meta_workload_without_allocating(capsys):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    code, out, _ = _cli(capsys, META, "--json", "--level", "O1", "--time-limit", "20")
    d = json.loads(out)
    assert code == 0 and d["valid"] is True and d["state_bytes"] > 2 ** 31
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 512, f"planning a meta workload grew the process by {grown_mib:.0f} MiB"


def test_cli_execute_on_meta_is_a_clear_error(capsys):
    code, _, err = _cli(capsys, META, "--execute")
    assert code == 2 and "meta device" in err and "--execute" in err
