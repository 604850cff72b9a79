"""Overlapped communication (lower/overlap.py): asynchronous start/wait, buckets, ZeRO-3 re-gathers.

Exactness in float64 on every rank: the overlapped programs in lockstep (collectives simulated) against
one device at 1e-9 and against the blocking programs bit for bit; on 2 real gloo processes the
overlapped and blocking programs bit for bit and against one device at 1e-9."""
import importlib.util
import inspect
import operator
import time
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype
from rhino.capture.workload import Workload
from rhino.ir.graph import Graph, Role
from rhino.lower.overlap import OverlapOptions, overlap_program
from rhino.lower.simulate_spmd import simulate_training
from rhino.lower.spmd import lower_rank
from rhino.lower.spmd_ops import COMM_KINDS, redistribute, start, wait
from rhino.runtime.run import bytes_by_role, compare_results, program_communication
from rhino.sharding.plan import ShardingPlan, resolve
from rhino.sharding.presets import parse_strategy, preset_plan

_CAPS: dict = {}


def _cap(name: str, dtype=torch.float64, **kw):
    """An example captured in ``dtype`` (passed to its ``workload``, whose ``.to(dtype)`` would otherwise
    cast a float64 model back to its float32 default)."""
    key = (name, dtype, tuple(sorted(kw.items())))
    if key not in _CAPS:
        path = ROOT / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"ov_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        with warnings.catch_warnings(), default_dtype(dtype):
            warnings.simplefilter("ignore")
            if "dtype" in inspect.signature(mod.workload).parameters:
                kw = {**kw, "dtype": dtype}
            _CAPS[key] = capture(Workload(*mod.workload(**kw), str(path), "workload"))
        assert {p.dtype for p in _CAPS[key].workload.model.parameters()} == {dtype}
    return _CAPS[key]


def _nodes(prog, target):
    return [n for n in prog.module.graph.nodes if n.op == "call_function" and n.target is target]


def test_gradients_start_early_in_buckets_and_wait_late():
    cap = _cap("gpt", torch.float32)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2")))
    prog = lower_rank(rp, 0, overlap=True)
    assert not [n for n in _nodes(prog, redistribute) if n.args[1] in COMM_KINDS]  # nothing blocks
    order = {n: i for i, n in enumerate(prog.module.graph.nodes)}
    starts, waits = _nodes(prog, start), _nodes(prog, wait)
    assert len(starts) == len(waits) == prog.overlap.buckets
    assert prog.overlap.buckets < prog.overlap.collectives  # gradients share buckets
    assert max(len(s.args[0]) for s in starts) > 1
    for s in starts:
        (w,) = s.users
        assert order[s] < order[w]
    # compute runs between the biggest bucket's start and its wait
    big = max(starts, key=lambda s: len(s.args[0]))
    between = [n for n in prog.module.graph.nodes if order[big] < order[n] < order[next(iter(big.users))]
               and n.op == "call_function" and n.target not in (start, wait, operator.getitem)]
    assert between
    assert all(b <= 25 * 2**20 for b in prog.overlap.bucket_bytes)


def test_bucket_caps_split_buckets():
    cap = _cap("gpt", torch.float32)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2")))
    base = lower_rank(rp, 0)
    one = overlap_program(base, OverlapOptions(bucket_cap_mb=0, first_bucket_mb=0))
    many = overlap_program(base, OverlapOptions())
    assert one.overlap.buckets == one.overlap.collectives      # cap 0: every collective alone
    assert many.overlap.buckets < one.overlap.buckets
    small = overlap_program(base, OverlapOptions(bucket_cap_mb=0.05, first_bucket_mb=0.05))
    assert small.overlap.buckets > many.overlap.buckets
    for stats, cap_mb in ((small.overlap, 0.05), (many.overlap, 25)):
        for nbytes, members in zip(stats.bucket_bytes, stats.bucket_members):
            assert members == 1 or nbytes <= cap_mb * 2**20


def _simulate_both(cap, strategy):
    plan = preset_plan(cap.graph, parse_strategy(strategy))
    rp = resolve(cap.graph, plan)
    state = cap.initial_state()
    with default_dtype(torch.float64):
        blocking = simulate_training(rp, state, tuple(cap.workload.batch), 2)
        overlapped = simulate_training(rp, state, tuple(cap.workload.batch), 2, overlap=True)
    return rp, state, blocking, overlapped


# sampled (the suite's time): ZeRO-3 gathers, re-gathers and reduce-scatter buckets; two mesh axes with
# sequence parallelism. dp=2, dp=2,zero=3 and tp=2 also run on gloo processes below.
@pytest.mark.parametrize("name,strategy", [("gpt", "dp=2,zero=3"), ("gpt", "dp=2,tp=2,sp=on")])
def test_overlapped_programs_match_one_device_on_every_rank(name, strategy):
    cap = _cap(name)
    rp, state, blocking, overlapped = _simulate_both(cap, strategy)
    world = rp.plan.mesh.world
    for r in range(world):
        assert blocking["rank_losses"][r] == overlapped["rank_losses"][r]
        for k, v in blocking["local"][r].items():
            assert torch.equal(v, overlapped["local"][r][k]), (r, k)
    results = {r: {"losses": overlapped["rank_losses"][r], "local": overlapped["local"][r],
                   "held": bytes_by_role(cap.graph, {k: v for k, v in overlapped["local"][r].items() if k in state})}
               for r in range(world)}
    res = compare_results(cap, rp, program_communication(lower_rank(rp, 0)), results, 2, time.perf_counter())
    assert res.ok, res.first_mismatch
    assert res.max_abs_diff < 1e-9


def test_zero3_regathers_for_the_backward_and_lowers_the_peak():
    """Parameters dominate this MLP: keeping the forward's gathered copies until the backward holds
    every parameter whole at the peak; gathering again (FSDP2's reshard after forward) does not."""
    cap = _cap("mlp", torch.float32, inputs=256, hidden=512, layers=6, batch=8)
    plan = preset_plan(cap.graph, parse_strategy("dp=2,zero=3"))
    rp = resolve(cap.graph, plan)
    state = cap.initial_state()
    peaks = {}
    for label, opts in (("blocking", False), ("keep", OverlapOptions(reshard_after_forward=False)),
                        ("reshard", OverlapOptions())):
        peaks[label] = simulate_training(rp, state, tuple(cap.workload.batch), 1, overlap=opts)["peaks"][0]
    prog = lower_rank(rp, 0, overlap=True)
    assert prog.overlap.regathers > 0
    params = sum(v.numel() * v.element_size() for k, v in state.items() if k in set(cap.param_names))
    # the re-gathering program holds at least a quarter of the full parameters less at its peak, and
    # no more than the blocking program (which keeps one gathered copy from forward to backward)
    assert peaks["reshard"] < peaks["keep"] - params / 4, peaks
    assert peaks["reshard"] <= peaks["blocking"], peaks


def test_prefetch_issues_the_next_gather_one_use_ahead():
    cap = _cap("mlp", torch.float32, inputs=256, hidden=512, layers=6, batch=8)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2,zero=3")))
    prog = lower_rank(rp, 0, overlap=True)
    nodes = list(prog.module.graph.nodes)
    gathers = [n for n in _nodes(prog, start) if n.args[1] == "AllGather"]
    assert len(gathers) > 3
    # between consecutive gathers' starts there is the previous gather's wait, and at most one other
    # gather is in flight when a gather starts
    in_flight = 0
    for n in nodes:
        if n in gathers:
            in_flight += 1
            assert in_flight <= 2
        elif n.op == "call_function" and n.target is wait and n.args[0] in gathers:
            in_flight -= 1


def test_zero3_gathers_one_bucket_per_block():
    """FSDP2 gathers one ``fully_shard`` unit (a transformer block) per all-gather: so do the stored-state
    buckets, and every bucket holds parameters of one block only (``ir.modules.block_of``)."""
    from rhino.ir.modules import block_of
    cap = _cap("gpt", torch.float32)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2,zero=3")))
    prog = lower_rank(rp, 0, overlap=True)
    gathers = [n for n in _nodes(prog, start) if n.args[1] == "AllGather"]

    def root(x):
        while x.op != "placeholder":
            x = x.args[0]
        return x.meta["rhino_name"]
    blocks = [{block_of(root(x)) for x in n.args[0]} for n in gathers]
    assert all(len(b) == 1 for b in blocks), blocks
    members = sum(len(n.args[0]) for n in gathers)
    n_blocks = len({b for bs in blocks for b in bs})
    assert n_blocks >= 3 and members >= 3 * len(gathers), (n_blocks, members, len(gathers))
    # a block's gathers are one bucket per pass (forward, backward; every block is far under the cap):
    # two buckets in a row never hold the same block
    assert all(a != b for a, b in zip(blocks, blocks[1:])), blocks
    # smaller caps split the buckets, a cap of 0 gives one gather per parameter
    alone = lower_rank(rp, 0, overlap=OverlapOptions(gather_bucket_mb=0))
    assert all(len(n.args[0]) == 1 for n in _nodes(alone, start) if n.args[1] == "AllGather")
    assert len([n for n in _nodes(alone, start) if n.args[1] == "AllGather"]) == members


def test_cost_model_prices_one_collective_per_runtime_bucket():
    """The step-time model groups ZeRO-3 gathers and reduce-scatters per block as the overlapped program
    issues them: one priced collective per issued one."""
    from rhino.cost.cluster import parse_cluster
    from rhino.cost.estimate import estimate_strategy
    cap = _cap("gpt", torch.float32)
    for strategy in ("dp=2,zero=3", "dp=2"):
        est = estimate_strategy(cap.graph, parse_cluster("2xA100-80G"), strategy)
        prog = lower_rank(resolve(cap.graph, preset_plan(cap.graph, parse_strategy(strategy))), 0, overlap=True)
        issued = [n.args[1] for n in _nodes(prog, start)]
        for kind in ("AllGather", "ReduceScatter"):
            assert est.collectives.get(kind, 0) == issued.count(kind), (strategy, kind, est.collectives)
    assert issued.count("AllGather") == 0          # data parallel: parameters stay whole


def test_a_collective_travels_while_an_independent_branch_computes():
    """A tensor-parallel redistribution starts when its input exists and is waited for at its reader, in the
    overlapped program and in the step-time model alike: the row-parallel output's reduce-scatter (forward)
    and the gather of the branch's gradient (backward) each hide behind the compute issued between them."""
    from rhino.capture import load_workload
    from rhino.cost.cluster import axis_links, parse_cluster
    from rhino.cost.step import StepOptions, step_time
    graph = capture(load_workload(str(ROOT / "tests" / "workloads" / "side_branch.py:side_branch"))).graph
    rp = resolve(graph, preset_plan(graph, parse_strategy("tp=2")))
    prog = lower_rank(rp, 0, overlap=True)
    nodes = [n for n in prog.module.graph.nodes if n.op == "call_function"]
    at = {n.name: i for i, n in enumerate(nodes)}
    starts = [i for i, n in enumerate(nodes) if n.target is start]
    waits = [i for i, n in enumerate(nodes) if n.target is wait]
    names = [n.name for n in graph.nodes]
    between = {}                              # reader -> graph nodes run while its collective travels
    for s, w in zip(starts, waits):
        inside = [n.name for n in nodes[s + 1:w] if n.name in names]
        if inside:
            reader = next(n.name for n in nodes[w:] if n.name in names)
            between[reader] = inside
    assert "n7_addmm_2" in between.get("n9_mul", []), between          # the side branch's matmul
    c = parse_cluster("2xA100-80G")
    links = axis_links(c, rp.plan.mesh)
    late, early = (step_time(rp, c.device, links, StepOptions(start_after_producer=o)) for o in (False, True))
    cost = {n.name: n for n in early.nodes}
    hidden = sum(min(cost[r].comm, sum(cost[m].compute for m in inside)) for r, inside in between.items())
    assert late.exposed_comm_seconds == pytest.approx(late.comm_seconds)   # every collective blocking
    assert hidden > 0
    assert early.exposed_comm_seconds == pytest.approx(late.exposed_comm_seconds - hidden, rel=1e-9)


# ----------------------------------------------------------------------------- real gloo processes

def _rank_main(ctx, graph_json, plans, state, batch):
    from rhino.lower.spmd_ops import set_context
    from rhino.runtime.collectives import TORCH_COLLECTIVES, apply_step, shard_tensor, start_step
    from rhino.runtime.groups import build_groups
    from rhino.sharding.placement import ReduceOp
    from rhino.sharding.steps import AllGather, AllReduce, ReduceScatter
    torch.set_default_dtype(torch.float64)
    graph = Graph.from_json(graph_json)
    out = {}
    for strategy, plan_json in plans.items():
        rp = resolve(graph, ShardingPlan.from_json(plan_json))
        mesh = rp.plan.mesh
        groups = build_groups(mesh)
        set_context(mesh, ctx.rank, groups, TORCH_COLLECTIVES)
        names = [i.name for i in graph.inputs if i.role is not Role.BATCH]
        bl = [shard_tensor(batch[int(i.name.split("/")[1])], rp.value[i.value], mesh, ctx.rank)
              for i in graph.inputs if i.role is Role.BATCH]
        runs = {}
        for label, overlap in (("blocking", False), ("overlap", True)):
            prog = lower_rank(rp, ctx.rank, overlap=overlap)
            local = {i.name: shard_tensor(state[i.name], rp.value[i.value], mesh, ctx.rank)
                     for i in graph.inputs if i.role is not Role.BATCH}
            losses = []
            with torch.no_grad():
                for _ in range(2):
                    outs = prog.module(*([local[n] for n in names] + bl))
                    losses.append(float(outs[0]))
                    local.update(zip(prog.output_names[1:], outs[1:]))
            runs[label] = {"losses": losses, "local": local}
        out[strategy] = runs
    # buckets of mixed layouts, averaged, and a strided reduce-scatter: equal to one tensor at a time
    mesh = rp.plan.mesh
    groups = build_groups(mesh)
    g = torch.Generator().manual_seed(ctx.rank)
    xs = [torch.randn(6, 4, generator=g).t(), torch.randn(3, generator=g), torch.randn(2, 4, 5, generator=g)]
    for step in (AllReduce(0, ReduceOp.AVG), AllReduce(0, ReduceOp.SUM)):
        got = start_step(xs, step, mesh, ctx.rank, groups).wait()
        want = [apply_step(x, step, mesh, ctx.rank, groups) for x in xs]
        out.setdefault("buckets", []).append(all(torch.equal(a, b) and a.stride() == b.stride()
                                                 for a, b in zip(got, want)))
    ys = [torch.randn(8, 3, generator=g), torch.randn(4, 2, generator=g)]
    step = ReduceScatter(0, ReduceOp.SUM, 0, 2)
    got = start_step(ys, step, mesh, ctx.rank, groups).wait()
    want = [apply_step(y, step, mesh, ctx.rank, groups) for y in ys]
    out["buckets"].append(all(torch.equal(a, b) for a, b in zip(got, want)))
    zs = [torch.randn(4, 6, generator=g), torch.randn(5, generator=g), torch.randn(3, 4, 2, generator=g).transpose(0, 1)]
    for step in (AllGather(0, 0, 1), AllGather(0, 1, 2)):     # members of mixed shapes and layouts
        members = zs if step.dim == 0 else [zs[0], torch.randn(2, 2, 4, generator=g).transpose(0, 2)]
        got = start_step(members, step, mesh, ctx.rank, groups).wait()
        want = [apply_step(z, step, mesh, ctx.rank, groups) for z in members]
        out["buckets"].append(all(torch.equal(a, b) for a, b in zip(got, want)))
    w = torch.randn(4, 3, dtype=torch.complex128, generator=g)   # a conjugated view travels as its values
    for step in (AllGather(0, 0, 1), AllReduce(0, ReduceOp.SUM)):
        want = apply_step(w.conj().resolve_conj(), step, mesh, ctx.rank, groups)
        got = [apply_step(w.conj(), step, mesh, ctx.rank, groups),
               start_step([w.conj()], step, mesh, ctx.rank, groups).wait()[0]]
        out["buckets"].append(all(torch.equal(x, want) for x in got))
    return out


@pytest.mark.multiprocess
def test_gloo_overlapped_equals_blocking_bit_for_bit_and_one_device():
    from rhino.runtime.launch import launch
    cap = _cap("gpt")
    strategies = ["dp=2", "dp=2,zero=3", "tp=2"]
    plans = {s: preset_plan(cap.graph, parse_strategy(s)) for s in strategies}
    state = cap.initial_state()
    batch = tuple(b.detach() for b in cap.workload.batch)
    ranks = launch(_rank_main, 2, cap.graph.to_json(), {s: p.to_json() for s, p in plans.items()}, state, batch,
                   timeout_s=120)
    for r, out in enumerate(ranks):
        assert all(out["buckets"]), (r, out["buckets"])
        for s in strategies:
            a, b = out[s]["blocking"], out[s]["overlap"]
            assert a["losses"] == b["losses"], (s, r)
            for k in a["local"]:
                assert torch.equal(a["local"][k], b["local"][k]), (s, r, k)
    for s in strategies:
        rp = resolve(cap.graph, plans[s])
        results = {r: {"losses": ranks[r][s]["overlap"]["losses"], "local": ranks[r][s]["overlap"]["local"],
                       "held": bytes_by_role(cap.graph, ranks[r][s]["overlap"]["local"])} for r in range(2)}
        res = compare_results(cap, rp, program_communication(lower_rank(rp, 0)), results, 2, time.perf_counter())
        assert res.ok, (s, res.first_mismatch)
        assert res.max_abs_diff < 1e-9


def test_released_inputs_free_the_old_state_during_the_update():
    from rhino.lower.overlap import release_inputs
    from rhino.lower.spmd_ops import set_context
    from rhino.runtime.collectives import TORCH_COLLECTIVES
    from rhino.runtime.groups import MeshGroups
    cap = _cap("mlp", torch.float32, inputs=256, hidden=512, layers=6, batch=8)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=1")))
    prog = lower_rank(rp, 0, overlap=True)
    boxed = release_inputs(prog)
    set_context(rp.plan.mesh, 0, MeshGroups(rp.plan.mesh, 0, [[((0,), None)]]), TORCH_COLLECTIVES)
    state = cap.initial_state()
    names = [i.name for i in cap.graph.inputs if i.role is not Role.BATCH]
    batch = list(cap.workload.batch)
    with torch.no_grad():
        want = prog.module(*([state[n] for n in names] + batch))
        args = [state[n].clone() for n in names] + batch
        got = boxed.module(args)
    assert args == []
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_one_reduce_scatter_in_flight():
    """A pending reduce-scatter holds its full-size packed gradients: the next waits for it (FSDP2)."""
    cap = _cap("gpt", torch.float32)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2,zero=3")))
    base = lower_rank(rp, 0)
    for limit in (1, 2):
        prog = overlap_program(base, OverlapOptions(bucket_cap_mb=0.01, first_bucket_mb=0.01,
                                                    reduce_scatters_in_flight=limit))
        pending, most, count = set(), 0, 0
        for n in prog.module.graph.nodes:
            if n.op == "call_function" and n.target is start and n.args[1] == "ReduceScatter":
                pending.add(n)
                count += 1
                most = max(most, len(pending))
            elif n.op == "call_function" and n.target is wait:
                pending.discard(n.args[0])
        assert count > limit + 1 and most == limit


def test_custom_lowered_all_reduces_are_sized_and_the_loss_sums_share_one():
    """The all-reduces a custom lowering emits (a split mean ``nll_loss``'s summed loss and total weight,
    a split ``_log_softmax``'s max and sum, batch-norm statistics) carry their local size, so no issued
    collective is reported as 0 bytes (``mlp dp=2`` reported ``[0, 0, 44328]``: the two 4-byte loss sums,
    unsized, each in its own collective). The two loss sums now travel in one; batch-norm statistics
    stay apart from the gradients (one collective per statistics all-reduce)."""
    cap = _cap("mlp", torch.float32)
    prog = lower_rank(resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2"))), 0, overlap=True)
    params = sum(p.numel() * 4 for p in cap.workload.model.parameters())
    assert (prog.overlap.bucket_bytes, prog.overlap.bucket_members) == ([8, params], [2, 8])
    for name, strategy in (("gpt", "tp=2"), ("resnet", "dp=2")):
        cap = _cap(name, torch.float32)
        prog = lower_rank(resolve(cap.graph, preset_plan(cap.graph, parse_strategy(strategy))), 1, overlap=True)
        assert min(prog.overlap.bucket_bytes) > 0, (name, strategy)
        for s in _nodes(prog, start):
            stacked = [x for x in s.args[0] if x.target is torch.ops.aten.stack.default]   # batch-norm statistics
            assert not stacked or len(s.args[0]) == 1, (name, s.args[0])
