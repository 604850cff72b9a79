"""Recomputation executed: the graph transform (cost/remat.py) and what it must keep true.

- Transform properties: the IR verifier passes; every forward value the backward still reads from the
  forward is one the mode keeps (an independent reading of the rules in cost/remat.py's docstring); copies
  carry their original's op and run after the loss; random outputs are never recomputed.
- Exactness: every example with recompute=full under dp=2 and dp=2,tp=2 (and selective on two), every
  rank's losses and state shards against single-device training in float64 at 1e-9 (in-process lockstep).
- Memory: the measured live peak of every rank within 5% of the cost model's (estimate_memory on the
  rewritten program, what ``estimate`` reports), and lower with full than without.
"""
import warnings
from bisect import bisect_left

import pytest
import torch

from conftest import EXAMPLES, ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.cost.cluster import parse_cluster
from rhino.cost.estimate import estimate
from rhino.cost.memory import estimate_memory
from rhino.cost.recompute import KEEP_KINDS, apply_recompute, full_segments
from rhino.cost.remat import remat, remat_plan, remat_resolved
from rhino.cost.step import NodeCost
from rhino.ir.analysis import analyze
from rhino.ir.registry import OpKind, is_random, lookup
from rhino.ir.verify import verify
from rhino.lower.simulate_spmd import simulate_peak_bytes, simulate_training
from rhino.lower.spmd import lower_rank
from rhino.runtime.compare import TOLERANCES
from rhino.runtime.run import compare_results, program_communication
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

WORKLOADS = ROOT / "tests" / "workloads" / "recompute.py"
_CAPTURED = {}


def captured(name: str):
    """An example (or a function of tests/workloads/recompute.py) captured in float64."""
    if name not in _CAPTURED:
        spec = f"{WORKLOADS}:{name}" if name in ("gpt", "llama") or "_" in name else \
            str(ROOT / "examples" / f"{name}.py")
        with warnings.catch_warnings(), default_dtype(torch.float64):
            warnings.simplefilter("ignore")
            _CAPTURED[name] = capture(load_workload(spec, dtype=torch.float64))
    return _CAPTURED[name]


def run_recompute(cap, strategy: str, steps: int = 1, overlap: bool = False):
    """(comparison with single-device training, lockstep result, rewritten graph, its resolved plan)."""
    plan = preset_plan(cap.graph, parse_strategy(strategy))
    new, origin = remat(cap.graph, plan.recompute)
    rp = resolve(new, remat_plan(plan, origin))
    with default_dtype(torch.float64):
        res = simulate_training(rp, cap.initial_state(), tuple(cap.workload.batch), steps, overlap=overlap)
    ranks = {r: {"losses": res["rank_losses"][r], "local": res["local"][r], "held": {}}
             for r in range(plan.mesh.world)}
    comm = program_communication(lower_rank(rp, 0))
    return compare_results(cap, rp, comm, ranks, steps, 0.0, TOLERANCES[torch.float64]), res, new, rp


def _root_of(graph):
    root = {i.value: i.value for i in graph.inputs}
    root.update({v: v for v in graph.constants})
    for node in graph.nodes:
        d = lookup(node.op)
        refs = node.input_refs()
        for v in node.outputs:
            if v is not None:
                root[v] = root[refs[0].id] if d is not None and d.kind is OpKind.VIEW and refs else v
    return root


def _keepable(graph, mode, cuts):
    """Forward storages the rules of cost/remat.py let the backward read from the forward (with the
    rewrite's cuts)."""
    b = analyze(graph).boundary
    seg = lambda i: bisect_left(cuts, i)  # noqa: E731
    root = _root_of(graph)
    made = {v: i for i, n in enumerate(graph.nodes[:b + 1]) for v in n.outputs if v is not None}
    ok = {root[o.value] for o in graph.outputs}
    ok |= {i.value for i in graph.inputs} | set(graph.constants)   # views of these alias what lives all step
    for i, node in enumerate(graph.nodes[:b + 1]):
        d = lookup(node.op)
        if seg(i) == len(cuts) or d is None or is_random(node.op) or (mode == "selective" and d.kind in KEEP_KINDS):
            ok.update(v for v in node.outputs if v is not None)
        for r in node.input_refs():
            if root[r.id] in made and seg(made[root[r.id]]) < seg(i):
                ok.add(root[r.id])
    if mode == "selective":  # a cheap op reading a kept value the backward never read stays kept
        saved = {root[r.id] for n in graph.nodes[b + 1:] for r in n.input_refs()} | ok_outputs(graph, root)
        for node in graph.nodes[:b + 1]:
            if any(root[r.id] in made and root[r.id] in ok and root[r.id] not in saved for r in node.input_refs()):
                ok.update(v for v in node.outputs if v is not None)
    return ok, made, root


def ok_outputs(graph, root):
    return {root[o.value] for o in graph.outputs}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_transform_keeps_only_what_the_mode_keeps(name, mode):
    g = captured(name).graph
    new, origin = remat(g, mode)
    verify(new)
    assert origin or (mode == "selective" and name == "mlp"), "nothing recomputed"  # mlp: relu reads addmm only
    b = analyze(g).boundary
    assert analyze(new).boundary <= b   # forward nodes only ran for the backward may go; none is added
    ok, made, root = _keepable(g, mode, new.meta["recompute"]["cuts"] if origin else [])
    by_name = {n.name: n for n in g.nodes}
    position = {n.name: i for i, n in enumerate(new.nodes)}
    for i, node in enumerate(new.nodes):
        if node.name in origin:
            assert node.op == by_name[origin[node.name]].op
            assert i > analyze(new).boundary, f"copy {node.name} runs in the forward"
            continue
        if i <= analyze(new).boundary:
            continue
        for r in node.input_refs():   # a backward node reading a forward value reads a kept one
            if r.id in made:
                assert root[r.id] in ok, f"{node.name} reads dropped value {r.id} of {g.nodes[made[r.id]].name}"
    # each copy is made before its first reader and at most once
    readers = {}
    for node in new.nodes:
        for r in node.input_refs():
            readers.setdefault(r.id, []).append(position[node.name])
    for cname in origin:
        node = new.nodes[position[cname]]
        assert all(min(readers.get(v, [len(new.nodes)])) > position[cname] for v in node.outputs if v is not None)
    assert len(set(origin.values())) == len(origin)


@pytest.mark.parametrize("strategy", ["dp=1,recompute=full", "dp=2,recompute=selective"])
def test_a_view_of_a_weight_read_across_a_cut_is_not_recomputed(strategy):
    """A weight's transpose made in one segment and read by a later segment's matmul aliases the weight: it
    is kept, not dropped (it was dropped, and the later segment's copy had no copy of it to read)."""
    cap = captured("im2col_net")
    r, _, new, _ = run_recompute(cap, strategy, steps=2)
    assert r.ok, r.first_mismatch
    assert new.meta["recompute"]["segments"] > 1


def test_random_outputs_are_never_recomputed():
    g = captured("dropout_mlp").graph
    new, origin = remat(g, "full")
    verify(new)
    by_name = {n.name: n for n in g.nodes}
    assert origin and not any(is_random(by_name[o].op) for o in origin.values())
    dropout = [n for n in g.nodes if is_random(n.op)]
    assert len(dropout) == 4
    # every random output the backward reads is the forward's own
    b = analyze(new).boundary
    reads = {r.id for n in new.nodes[b + 1:] for r in n.input_refs()}
    assert any(v in reads for n in dropout for v in n.outputs if v is not None)
    assert [n.name for n in new.nodes if is_random(n.op)] == [n.name for n in dropout]


def test_none_is_the_identity():
    g = captured("mlp").graph
    assert remat(g, "none") == (g, {})


@pytest.mark.parametrize("strategy", ["dp=2,recompute=full", "dp=2,tp=2,recompute=full"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_full_recompute_matches_single_device_on_every_rank(name, strategy):
    r, _, _, _ = run_recompute(captured(name), strategy)
    assert r.ok, r.first_mismatch
    assert r.max_abs_diff < 1e-9


def test_full_recompute_of_a_split_with_unused_chunks():
    """The recomputed copy of a GRU cell's gate split keeps only the chunks read again: its local split size came
    from its first output, which was gone (a traceback from rhino run --strategy dp=2,recompute=full)."""
    r, _, _, _ = run_recompute(captured("chunk_gru"), "dp=2,recompute=full")
    assert r.ok and r.max_abs_diff < 1e-9, r.first_mismatch


@pytest.mark.parametrize("strategy", ["dp=2,zero=3,recompute=full", "dp=2,tp=2,recompute=selective"])
def test_recompute_in_overlapped_programs_matches_single_device(strategy):
    """The overlapped programs (async bucketed collectives, ZeRO-3 gathers issued again after the loss)
    run the rewritten graph exactly too."""
    r, _, _, _ = run_recompute(captured("gpt"), strategy, steps=2, overlap=True)
    assert r.ok, r.first_mismatch
    assert r.max_abs_diff < 1e-9


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_selective_recompute_matches_single_device_on_every_rank(name):
    r, _, _, _ = run_recompute(captured(name), "dp=2,recompute=selective")
    assert r.ok, r.first_mismatch
    assert r.max_abs_diff < 1e-9


@pytest.mark.parametrize("name", ["gpt_activations", "resnet_activations"])
def test_measured_peak_within_5_percent_and_full_lowers_it(name):
    """Every rank's live peak in one lockstep step (exactness is checked above) against the cost model."""
    cap = captured(name)
    measured = {}
    for mode in ("none", "full", "selective"):
        plan = preset_plan(cap.graph, parse_strategy(f"dp=2,recompute={mode}"))
        new, origin = remat(cap.graph, mode)
        rp = resolve(new, remat_plan(plan, origin))
        with default_dtype(torch.float64):
            peaks = simulate_peak_bytes(rp, cap.initial_state(), tuple(cap.workload.batch))
        for rank, peak in enumerate(peaks):
            predicted = estimate_memory(new, rp, rank).peak
            assert predicted == pytest.approx(peak, rel=0.05), (mode, rank, predicted, peak)
        measured[mode] = max(peaks)
    assert measured["full"] < (0.8 if name == "gpt_activations" else 0.9) * measured["none"], measured
    assert measured["selective"] < measured["none"], measured


def test_estimate_prices_the_rewritten_program():
    """``estimate`` of a recompute plan reports the rewritten program's peak and its copies' compute."""
    cap = captured("gpt_activations")
    g = cap.graph
    cluster = parse_cluster("cpu:2")
    for mode in ("full", "selective"):
        plan = preset_plan(g, parse_strategy(f"dp=2,recompute={mode}"))
        new, origin = remat(g, mode)
        est = estimate(g, cluster, plan)
        rp = resolve(new, remat_plan(plan, origin))
        fast = remat_resolved(resolve(g, plan), new, origin)   # what estimate uses instead of resolving again
        assert fast.value == rp.value
        for node in new.nodes:
            a, b = fast.node[node.name], rp.node[node.name]
            assert a.inputs == b.inputs
            assert [p for v, p in zip(node.outputs, a.outputs) if v is not None] == \
                [p for v, p in zip(node.outputs, b.outputs) if v is not None]
        assert est.memory_bytes["peak"] == estimate_memory(new, rp).peak
        none = estimate(g, cluster, plan, recompute="none")
        assert est.recompute_seconds > 0 and est.step_seconds > none.step_seconds
        if mode == "full":
            assert est.memory_bytes["peak"] < 0.8 * none.memory_bytes["peak"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_search_reading_is_the_rewritten_program(name):
    """The search's plan-free reading (``apply_recompute`` at global sizes, whose keep fraction the
    search's memory rows use) keeps exactly the storages the rewritten program's backward reads, and
    reruns exactly its copies' originals."""
    g = captured(name).graph
    mem = estimate_memory(g)
    ones = [NodeCost("", 1.0, 0.0, "", 1.0)] * len(g.nodes)
    for mode in ("full", "selective"):
        new, origin = remat(g, mode)
        eff = apply_recompute(g, mem, ones, mode)
        assert eff.saved == estimate_memory(new).activations
        assert eff.saved < mem.activations if mode == "full" else eff.saved <= mem.activations
        assert eff.extra_seconds == len(origin)


@pytest.mark.parametrize("name", ["gpt_activations", "resnet_activations"])
def test_search_reading_agrees_with_a_ranks_rewritten_program(name):
    """At a data-parallel rank's sizes the reading is within 5% of the rank's rewritten program (under
    tp a checkpoint read in another sharding is held as its redistributed copy, a temporary: there
    ``estimate`` prices the rewritten program itself, checked against measured peaks above)."""
    g = captured(name).graph
    plan = preset_plan(g, parse_strategy("dp=2"))
    mem = estimate_memory(g, resolve(g, plan))
    zero = [NodeCost("", 0.0, 0.0, "", 0.0)] * len(g.nodes)
    for mode in ("full", "selective"):
        new, origin = remat(g, mode)
        exact = estimate_memory(new, resolve(new, remat_plan(plan, origin))).activations
        assert apply_recompute(g, mem, zero, mode).saved == pytest.approx(exact, rel=0.05), mode
