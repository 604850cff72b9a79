"""runtime/pipeline: pipelined steps against single-device training, in one process (runtime/pipeline_sim:
each stage's ranks in lockstep, boundary values handed over) and once on real processes.

Sampled for time (the full 7 x 3 matrix is in docs/benchmarks.md, "Pipelines: exactness"): the MLP under
pp=2 with dp=2, tp=2, GPipe, three stages, full recomputation and ZeRO-3, and GPT (tied embedding/head: the weight lives on both
stages) under pp=2."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.cli.main import main
from rhino.runtime.compare import TOLERANCES, reference_run
from rhino.runtime.pipeline import PipelineStep, compare_stages, stage_order
from rhino.runtime.pipeline_sim import PipelineDeadlock, simulate_pipeline
from rhino.sharding.presets import parse_strategy, preset_plan

PIPES = str(ROOT / "tests" / "workloads" / "pipelines.py")


def _cap(name: str):
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(load_workload(f"{PIPES}:{name}", dtype=torch.float64))


@pytest.fixture(scope="module")
def mlp():
    return _cap("mlp")


def _check(cap, strategy: str, steps: int = 2):
    plan = preset_plan(cap.graph, parse_strategy(strategy))
    with default_dtype(torch.float64):
        res = simulate_pipeline(cap, plan, steps)
    ref = reference_run(cap, steps, plan.microbatches)
    st = res["steps"][0]
    results = {r: {"losses": res["losses"][r], "local": res["local"][r]} for r in res["losses"]}
    cmp = compare_stages(st.rp, st.spec, results, ref, TOLERANCES[torch.float64])
    return cmp, res, plan


@pytest.mark.parametrize("strategy", ["pp=2,dp=2,microbatches=4", "pp=2,tp=2,microbatches=4",
                                      "pp=2,microbatches=4,schedule=gpipe", "pp=3,microbatches=2",
                                      "pp=2,recompute=full,microbatches=4", "pp=2,dp=2,zero=3,microbatches=4"])
def test_mlp_pipelines_match_single_device_training_on_every_rank(mlp, strategy):
    cmp, res, plan = _check(mlp, strategy)
    assert cmp.ok, cmp.first_mismatch
    params = sum(1 for i in mlp.graph.inputs if i.role.value != "batch")
    assert cmp.compared == plan.mesh.world * (2 * plan.stages + params)   # every rank: 2 losses; each state once per mesh rank
    assert res["messages"] > 0


def test_a_sent_view_of_a_gradient_accumulator_is_not_added_into_before_it_is_sent():
    """A hypernetwork's generated weight: its gradient, sent from stage 1 to stage 0 for each micro-batch, is a view
    of stage 1's accumulator, which the next micro-batch adds into while ``dist.isend`` may still read it (wrong
    values in 3 of 10 gloo runs). The simulator now fails a step whose sent tensors change before the step ends."""
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload(str(ROOT / "tests" / "workloads" / "heldout33.py:hypernet"), dtype=torch.float64))
    for strategy in ("pp=2,microbatches=2", "pp=2,microbatches=4"):
        cmp, _, _ = _check(cap, strategy)
        assert cmp.ok and cmp.max_abs_diff < 1e-12, (strategy, cmp.first_mismatch)


def test_the_default_cut_keeps_a_buffer_renewed_in_the_forward_on_one_stage():
    """An EMA codebook read at the start of the forward and renewed at its end: the FLOP-balanced cut fell
    between them and the runtime refused the plan ("buffer embed is read on stages 0, 1 but its new value is
    made on stage 1"); the cut now avoids a renewed buffer's span, and every rank equals one device."""
    from rhino.cost.pipeline import stage_refusal
    from rhino.ir.stages import assign_stages, contiguous_cut
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        cap = capture(load_workload(str(ROOT / "tests" / "workloads" / "heldout34.py:ema_codebook"),
                                    dtype=torch.float64))
    g = cap.graph
    assert stage_refusal(g, assign_stages(g, contiguous_cut(g, 2), 2)) is None
    for strategy in ("pp=2,microbatches=2", "pp=2,microbatches=4,schedule=gpipe"):
        cmp, _, _ = _check(cap, strategy)
        assert cmp.ok and cmp.max_abs_diff < 1e-12, (strategy, cmp.first_mismatch)


@pytest.fixture(scope="module")
def gpt():
    return _cap("gpt")


def test_gpt_with_a_tied_embedding_matches_single_device_training(gpt):
    cmp, res, plan = _check(gpt, "pp=2,microbatches=2")
    assert cmp.ok, cmp.first_mismatch
    holders = res["steps"][0].spec.assignment.holders
    assert holders["tok.weight"] == {0, 1}
    assert "tok.weight" in res["local"][0] and "tok.weight" in res["local"][1]


def _stash_bytes(step: PipelineStep) -> int:
    """Bytes of the forward values this rank keeps per micro-batch in flight for its backward (a view of a
    graph input, such as a weight's transpose, aliases it: no bytes of its own)."""
    from rhino.ir.analysis import analyze
    g = step.rp.graph
    root, inputs = analyze(g).root, {i.value for i in g.inputs}
    return sum(g.types[v].nbytes for kind, v in step.st.forward.outputs
               if kind == "export" and root.get(v, v) not in inputs)


def test_recompute_inside_stages_runs_copies_in_the_backward_and_stashes_less(mlp):
    """recompute=full: the step is rewritten (cost.remat) before the stage cut, so the backward programs
    recompute forward values (copies named ``*_rc``) and the stages keep fewer bytes per micro-batch. Stage 0
    reruns its first layer; stage 1 holds only the last segment, which is kept, and a weight's transpose is
    never recomputed (it aliases the weight)."""
    from rhino.runtime.rank_step import microbatch_graph
    micro = microbatch_graph(mlp, 4)
    steps = {rc: [PipelineStep(mlp.graph, preset_plan(mlp.graph, parse_strategy(f"pp=2,recompute={rc},microbatches=4")),
                               r, micro_graph=micro) for r in (0, 1)] for rc in ("none", "full")}
    for r in (0, 1):
        assert not any(n.endswith("_rc") for n in steps["none"][r].st.backward.nodes)
        assert not any(n.endswith("_rc") and "_t" in n for n in steps["full"][r].st.backward.nodes)
    assert {"n2_addmm_rc", "n3_relu_rc"} <= set(steps["full"][0].st.backward.nodes)
    assert _stash_bytes(steps["full"][0]) < _stash_bytes(steps["none"][0])
    assert sum(map(_stash_bytes, steps["full"])) < sum(map(_stash_bytes, steps["none"]))


def test_recomputed_copies_stay_on_their_stage_and_add_no_crossings(gpt):
    """GPT, cut right after the fused QKV matmul: under recompute=full every copy runs on its original's
    stage, the crossing QKV value is read itself (not recomputed on stage 0 and sent back), and the stage
    boundaries carry the same bytes as without recomputation."""
    from rhino.runtime.rank_step import microbatch_graph
    micro = microbatch_graph(gpt, 2)
    out = {}
    for rc in ("none", "full"):
        plan = preset_plan(gpt.graph, parse_strategy(f"pp=2,recompute={rc},microbatches=2"))
        out[rc] = PipelineStep(gpt.graph, plan, 0, micro_graph=micro).spec.assignment
    stage = out["full"].node_stage
    copies = [n for n in stage if n.endswith("_rc")]
    assert len(copies) > 20 and all(stage[n] == stage[n[:-3]] for n in copies)
    assert out["full"].boundary_bytes() == out["none"].boundary_bytes()


def test_a_wrong_update_on_one_stage_is_caught(mlp):
    """The comparison can fail: stage 1's update program dropped (its state keeps its old values)."""
    plan = preset_plan(mlp.graph, parse_strategy("pp=2,microbatches=2"))
    with default_dtype(torch.float64):
        res = simulate_pipeline(mlp, plan, 1)
    ref = reference_run(mlp, 1, 2)
    st = res["steps"][0]
    state = mlp.initial_state()
    res["local"][1] = {n: state[n] for n in res["local"][1]}
    cmp = compare_stages(st.rp, st.spec, {r: {"losses": res["losses"][r], "local": res["local"][r]} for r in (0, 1)},
                         ref, TOLERANCES[torch.float64])
    assert not cmp.ok and cmp.first_mismatch.startswith("stage 1, global rank 1")


def test_schedules_order_and_in_flight_micro_batches():
    assert stage_order("gpipe", 0, 2, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2)]
    assert stage_order("1f1b", 0, 2, 3) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]
    assert stage_order("1f1b", 1, 2, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    for stages, m in ((4, 8), (3, 2)):
        for s in range(stages):
            order = stage_order("1f1b", s, stages, m)
            assert sorted(order) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
            in_flight = peak = 0
            for key, _ in order:
                in_flight += 1 if key == "F" else -1
                peak = max(peak, in_flight)
            assert peak == min(stages - s, m)


def test_a_schedule_that_would_deadlock_is_reported(mlp, monkeypatch):
    plan = preset_plan(mlp.graph, parse_strategy("pp=2,microbatches=2"))
    real = PipelineStep.__init__

    def backward_first(self, *a, **k):
        real(self, *a, **k)
        if self.stage == 0:
            self.order = [("B", 0, 0)] + [x for x in self.order if x != ("B", 0, 0)]
    monkeypatch.setattr(PipelineStep, "__init__", backward_first)
    with pytest.raises(PipelineDeadlock, match="no stage can advance"):
        simulate_pipeline(mlp, plan, 1)


@pytest.mark.parametrize("argv, match", [(["--strategy", "pp=2,microbatches=2", "--nproc", "3"], "--nproc 2"),
                                         (["--strategy", "pp=2,microbatches=2", "--nproc", "2", "--emit", "x"], "--emit"),
                                         (["--strategy", "pp=2", "--nproc", "2", "--memory-plan"], "--memory-plan does not")])
def test_unsupported_pipeline_runs_are_one_clear_error(capsys, argv, match):
    code = main(["run", str(ROOT / "examples" / "mlp.py"), *argv, "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code != 0 and match in d["error"]


@pytest.mark.parametrize("strategy, match", [("pp=2", "--memory-plan does not run pipeline stages"),
                                             ("dp=2,microbatches=2", "one micro-batch per step, but the plan has "
                                                                     "microbatches=2")])
def test_rhino_train_refuses_a_memory_plan_with_stages_before_starting_processes(capsys, monkeypatch, strategy, match):
    # (micro-batches were refused by every rank after it started)
    import rhino.runtime.trainer as trainer
    monkeypatch.setattr(trainer, "launch", lambda *a, **k: pytest.fail("processes were started"))
    code = main(["train", str(ROOT / "examples" / "mlp.py"), "--strategy", strategy, "--memory-plan", "--steps", "1"])
    assert code == 2 and match in capsys.readouterr().err


@pytest.mark.multiprocess
def test_rhino_run_pipeline_on_four_processes(capsys):
    code = main(["run", str(ROOT / "examples" / "mlp.py"), "--nproc", "4", "--strategy", "pp=2,dp=2,microbatches=4",
                 "--dtype", "float64", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["ok"], d.get("first_mismatch") or d.get("error")
    assert d["mesh"] == "pp2xdp2" and d["max_abs_diff"] <= 1e-9
    p = d["pipeline"]
    assert (p["stages"], p["microbatches"], p["schedule"]) == (2, 4, "1f1b")
    assert len(p["busy_s"]) == 2 and all(len(b) == 2 and min(b) > 0 for b in p["busy_s"])
    # point-to-point: per micro-batch of each dp rank (32 / 2 / 4 = 4 rows), one 64-wide float64 activation
    # forward and its gradient back (collectives alone, comm_bytes_per_step, miss these)
    assert p["p2p_bytes_per_step"] == 4 * 2 * 2 * (4 * 64 * 8)
    assert 0 < p["idle_fraction"] < 1
