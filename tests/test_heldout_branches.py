"""Pipelines (#12) and per-rank memory plans (#14) on multi-branch workloads the examples do not have
(tests/workloads/heldout_branches.py): a shared encoder used twice, an encoder-decoder with cross-attention
and a tied head, dense and inception blocks, a multi-task trunk with an auxiliary loss, a long skip, one
weight in the first and the last layer, GroupNorm with a downsample path, two towers with a frozen layer, a
buffer and a parameter read only by the loss.

One pipelined strategy per workload (the full matrix is in docs/benchmarks.md, "held-out multi-branch
workloads (session 11)"), every rank compared with PyTorch's accumulation loop in float64, in one process
(``runtime.pipeline_sim``); a cut the search chose (not the default cut); every rank of two SPMD plans in its
planned arena; one real multi-process run. The two convolutional cases and the search are marked slow (about 52 s
of CPU for the whole file without the multi-process test, 11 min of wall time at nice 19 under load 10-12)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.cli.main import main
from rhino.cost.cluster import parse_cluster
from rhino.lower.arena_ranks import compare_arena_ranks
from rhino.lower.rank_graph import rank_memories
from rhino.memory.step_report import check_plan, plan_rank_memory
from rhino.runtime.compare import TOLERANCES, reference_run
from rhino.runtime.pipeline import compare_stages
from rhino.runtime.pipeline_sim import simulate_pipeline
from rhino.search import SearchOptions, search
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

HELDOUT = str(ROOT / "tests" / "workloads" / "heldout_branches.py")

#: one strategy per workload, covering dp / tp / ZeRO-3 / recomputation inside stages, 4 stages, GPipe and
#: the interleaved schedule
CASES = [("siamese", "pp=2,dp=2,microbatches=4"), ("t5", "pp=2,microbatches=4"),
         pytest.param("densenet", "pp=2,tp=2,microbatches=4", marks=pytest.mark.slow),   # convolutions: the
         pytest.param("inception", "pp=2,microbatches=4,schedule=gpipe", marks=pytest.mark.slow),  # slowest here
         ("multitask", "pp=2,dp=2,zero=3,microbatches=4"), ("longskip", "pp=2,tp=2,microbatches=4"),
         ("sandwich", "pp=4,microbatches=4"), ("gnresnet", "pp=2,recompute=full,microbatches=4"),
         ("towers", "pp=2,microbatches=4,schedule=interleaved,chunks=2")]


def _cap(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(load_workload(f"{HELDOUT}:{name}", dtype=torch.float64))


def _simulate(cap, plan, steps: int = 2):
    with default_dtype(torch.float64):
        res = simulate_pipeline(cap, plan, steps)
    ref = reference_run(cap, steps, plan.microbatches)
    st = res["steps"][0]
    results = {r: {"losses": res["losses"][r], "local": res["local"][r]} for r in res["losses"]}
    return compare_stages(st.rp, st.spec, results, ref, TOLERANCES[torch.float64]), st


@pytest.mark.parametrize("name,strategy", CASES)
def test_heldout_pipelines_match_single_device_training_on_every_rank(name, strategy):
    cap = _cap(name)
    plan = preset_plan(cap.graph, parse_strategy(strategy))
    cmp, st = _simulate(cap, plan)
    assert cmp.ok, cmp.first_mismatch
    assert cmp.compared >= plan.world * 2            # every rank's 2 losses, and the state shards
    holders = st.spec.assignment.holders
    if name == "sandwich":      # the weight of the first and the last layer: held by both end stages
        assert holders["w"] == frozenset({0, plan.stages * plan.chunks - 1})
    if name == "towers":        # the frozen layer's weight is state without an update
        assert "frozen.weight" in holders


def test_a_micro_batch_too_small_for_the_stage_mesh_is_refused_in_one_sentence():
    """pp=2,dp=2,tp=2 at 2-row micro-batches: the tp preset splits the rows of the siamese encoder's LayerNorm
    over tp as well as dp (an all-to-all after the column-parallel matmul), so 2 rows do not split 4 ways; the
    error says what to change."""
    cap = _cap("siamese")
    plan = preset_plan(cap.graph, parse_strategy("pp=2,dp=2,tp=2,microbatches=4"))
    with pytest.raises(ValueError, match="microbatches=4: a micro-batch cannot be split.*use fewer micro-batches"):
        simulate_pipeline(cap, plan, 1)


@pytest.mark.slow
def test_searched_stage_cut_of_a_tied_encoder_decoder_runs_exactly():
    """The search's own stage cut (search/stages.py, not the default contiguous cut) of the T5-like model,
    pipelines priced on every mesh (rule ``pipeline="always"``): the fastest fitting pipelined candidate runs
    exactly."""
    cap = _cap("t5")
    r = search(cap.graph, parse_cluster("cpu:4"), SearchOptions(level="O1", time_limit=10, pipeline="always"))
    piped = [c for c in r.candidates if c.estimate is not None and c.estimate.pp > 1 and c.fits]
    assert piped
    plan = min(piped, key=lambda c: c.step_seconds).plan
    assert plan.stage_of and len(set(plan.stage_of.values())) == plan.stages
    cmp, _ = _simulate(cap, plan)
    assert cmp.ok, cmp.first_mismatch


@pytest.mark.parametrize("name,strategy", [("sandwich", "dp=2,tp=2"), ("towers", "dp=4,zero=3")])
def test_heldout_rank_plans_valid_and_arena_equals_plain(name, strategy):
    cap = _cap(name)
    rp = resolve(cap.graph, preset_plan(cap.graph, parse_strategy(strategy)))
    mems = rank_memories(rp)
    report = plan_rank_memory([(m.rank, m.problem, m.mapping) for m in mems], level="O1", time_limit=20)
    for m in mems:
        rep = report.of_rank(m.rank)
        assert check_plan(m.problem, rep.plan) is None and rep.valid
        assert rep.plan.order_lower_bound <= rep.plan.lower_bound <= rep.plan.height
    ex = compare_arena_ranks(rp, mems, report, cap.initial_state(), tuple(b.detach() for b in cap.workload.batch),
                             rtol=1e-12, atol=0.0, steps=1)
    assert ex["equal"] and ex["bitwise"], ex
    assert ex["arena_equals_plan"] and ex["arena_bytes"] == ex["plan_bytes"]


@pytest.mark.multiprocess
def test_rhino_run_heldout_pipeline_with_a_weight_on_both_stages(capsys):
    """Real point-to-point: the weight of the first and the last layer on two processes."""
    code = main(["run", f"{HELDOUT}:sandwich", "--nproc", "2", "--strategy", "pp=2,microbatches=4",
                 "--dtype", "float64", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["ok"], d.get("first_mismatch") or d.get("error")
    assert d["max_abs_diff"] <= 1e-9 and d["pipeline"]["stages"] == 2
