"""Held-out pipeline cases (workloads unlike the examples), each a regression test of a bug found on them."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.runtime import pipeline_run
from rhino.runtime.compare import TOLERANCES, reference_run
from rhino.runtime.pipeline import PipelineStep, compare_stages
from rhino.runtime.pipeline_sim import simulate_pipeline
from rhino.sharding.plan import PlanError
from rhino.sharding.presets import parse_strategy, preset_plan

VARIANTS = str(ROOT / "tests" / "workloads" / "variants.py")
HELDOUT = str(ROOT / "tests" / "workloads" / "heldout.py")


def _cap(spec: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(load_workload(spec, dtype=torch.float64))


def test_a_pipelined_mismatch_from_random_ops_says_so(monkeypatch):
    """Dropout under pp=2: each stage draws its own masks; the mismatch named no random op (the note was added
    for sharded runs only, and a pipeline with one rank per stage has a mesh of one)."""
    cap = _cap(f"{VARIANTS}:dropout")
    plan = preset_plan(cap.graph, parse_strategy("pp=2,microbatches=2"))

    def launch(fn, nproc, graph_json, plan_json, state, batch, steps, *rest, timeout_s=None):
        torch.manual_seed(1234)        # another process's generator
        with default_dtype(torch.float64):
            res = simulate_pipeline(cap, plan, steps)
        return [{"losses": res["losses"][r], "local": res["local"][r], "held": {}, "stage_times": [(0.0, 0.0)] * steps,
                 "sent_bytes": [0] * steps} for r in range(nproc)]

    monkeypatch.setattr(pipeline_run, "launch", launch)
    with default_dtype(torch.float64):
        out = pipeline_run.run_pipeline(cap, plan, 2)
    assert not out.ok and "draws random numbers (aten." in out.first_mismatch, out.first_mismatch


def _split_norm_plan(cap, monkeypatch):
    """pp=2 cut where FLOPs balance, between the shared BatchNorm's two uses (the default cut before session 34,
    which now keeps a renewed buffer's uses on one stage: the cut a plan file may still give)."""
    from rhino.ir import stages
    plan = preset_plan(cap.graph, parse_strategy("pp=2,microbatches=2"))
    with monkeypatch.context() as m:
        m.setattr(stages, "_renewed_spans", lambda graph, a: [])
        plan.stage_of = stages.contiguous_cut(cap.graph, 2)
    return plan


def test_a_buffer_updated_on_two_stages_is_refused_in_one_sentence_naming_the_change(monkeypatch):
    """One BatchNorm applied at both ends, a cut between them: its running statistics are read on stage 0 and
    renewed on stage 1; the refusal said "held by stages [0]; put its readers on one stage" (no way to do that
    with a strategy). The default cut keeps both uses on one stage and runs."""
    cap = _cap(f"{HELDOUT}:shared_norm")
    with pytest.raises(PlanError) as err:
        PipelineStep(cap, _split_norm_plan(cap, monkeypatch), 0)
    msg = str(err.value)
    assert msg.startswith("buffer bn.running_mean is read on stage 0 but its new value is made on stage 1")
    assert "use fewer pipeline stages" in msg and msg.count(". ") == 0 and "[" not in msg
    plan = preset_plan(cap.graph, parse_strategy("pp=2,microbatches=2"))
    with default_dtype(torch.float64):
        res = simulate_pipeline(cap, plan, 2)
    st = res["steps"][0]
    results = {r: {"losses": res["losses"][r], "local": res["local"][r]} for r in res["losses"]}
    cmp = compare_stages(st.rp, st.spec, results, reference_run(cap, 2, plan.microbatches), TOLERANCES[torch.float64])
    assert cmp.ok and cmp.max_abs_diff < 1e-12, cmp.first_mismatch


def test_a_stage_cut_the_runtime_refuses_does_not_fit_and_is_not_chosen(monkeypatch):
    """The shared BatchNorm under pp=2: ``rhino estimate`` priced the cut as fitting (the refusal lived in the
    runtime alone), so a search could pick a plan that cannot run. The estimate now carries the runtime's
    sentence and does not fit; a search told to try pipelines returns a plan that runs."""
    from rhino.cost.cluster import parse_cluster
    from rhino.cost.estimate import estimate
    from rhino.search import SearchOptions, search
    cap = _cap(f"{HELDOUT}:shared_norm")
    cluster = parse_cluster("cpu:2")
    plan = _split_norm_plan(cap, monkeypatch)
    with pytest.raises(PlanError) as err:
        PipelineStep(cap, plan, 0)
    est = estimate(cap.graph, cluster, plan)
    assert est.refused == str(err.value) and not est.fits
    assert est.memory_bytes["peak"] <= est.capacity_bytes            # it is not the memory
    assert "CANNOT RUN     buffer bn.running_mean" in est.text()
    ok = estimate(cap.graph, cluster, preset_plan(cap.graph, parse_strategy("dp=2")))
    assert ok.refused is None and ok.fits
    found = search(cap.graph, cluster, SearchOptions(level="O1", pipeline="always", time_limit=10))
    assert found.estimate.refused is None and found.estimate.fits
    assert all(not c.fits for c in found.candidates if c.estimate is not None and c.estimate.refused)


HELDOUT36 = str(ROOT / "tests" / "workloads" / "heldout36.py")


@pytest.mark.parametrize("name,buffer", [("write_only_buffer", "last"),
                                         ("spectral_last", "4.parametrizations.weight.0._u")])
def test_a_buffer_the_forward_writes_without_reading_is_held_where_it_is_renewed(name, buffer):
    """A buffer written through ``out=`` (``torch.mean(h, 0, out=buf)``; spectral_norm's power iteration writes
    ``_u`` so) has no reader: it was held by stage 0 while stage 1 renewed it, and every pipeline refused the
    step ("read on stage 0 but its new value is made on stage 1"). It is held by the stage renewing it, and
    every stage matches PyTorch's accumulation loop (float64)."""
    from rhino.cost.pipeline import stage_refusal
    from rhino.ir.stages import assign_stages, contiguous_cut
    cap = _cap(f"{HELDOUT36}:{name}")
    g = cap.graph
    sa = assign_stages(g, contiguous_cut(g, 2), 2)
    assert sa.holders[buffer] == {1} and stage_refusal(g, sa) is None
    plan = preset_plan(g, parse_strategy("pp=2,microbatches=2"))
    with default_dtype(torch.float64):
        res = simulate_pipeline(cap, plan, 2)
    st = res["steps"][0]
    assert any(buffer in res["local"][r] for r in res["local"])
    results = {r: {"losses": res["losses"][r], "local": res["local"][r]} for r in res["losses"]}
    cmp = compare_stages(st.rp, st.spec, results, reference_run(cap, 2, plan.microbatches), TOLERANCES[torch.float64])
    assert cmp.ok and cmp.max_abs_diff < 1e-12, cmp.first_mismatch


def test_a_step_no_pipeline_can_cut_names_pp_not_micro_batches():
    """nn.Embedding(max_norm=...) under pp=2,microbatches=1: the refusal advised "use microbatches=1", which it
    had; a pipeline always runs the update apart from the gradient part, so the sentence now says pp=1."""
    from rhino.cost.accumulate import SplitError
    cap = _cap(f"{HELDOUT36}:maxnorm")
    with pytest.raises(SplitError) as err:
        PipelineStep(cap, preset_plan(cap.graph, parse_strategy("pp=2,microbatches=1")), 0)
    msg = str(err.value)
    assert msg.startswith("a pipeline runs the step's gradient part per micro-batch") and msg.endswith("; use pp=1")
    assert "embedding_renorm" in msg and "microbatches=1" not in msg
