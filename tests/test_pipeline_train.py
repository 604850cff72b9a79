"""Pipelined plans under ``rhino train`` / ``Trainer``: sharded checkpoints saved by every stage and resumed
(same plan, or another plan), and a pipeline under ``torchrun``.

Oracle: an uninterrupted float64 run of the GPT example (tied embedding/head: the weight lives on both
stages) under ``pp=2,microbatches=4``, 4 steps, saving after step 2; and PyTorch's single-device loop over
the same batches. Resumed runs must give the same losses and, on every rank, the same held state."""
from __future__ import annotations


import pytest
import torch

from conftest import ROOT, eager_losses, torchrun_train
from rhino.runtime.launch import launch

GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")
TOL = 1e-9          # float64, relative to max(1, |value|) (runtime/compare.py)


def _run(ctx, strategy, steps, directory, save_at, resume, measure=False):
    """One rank: (resume,) train up to ``steps`` on the workload's batches, saving after the steps in ``save_at``;
    ``measure``: the first step node by node (``run_measured``), with the cost model's prediction for the stage."""
    from rhino.runtime.trainer import Trainer
    trainer = Trainer(GPT, strategy=strategy, dtype=torch.float64)
    info = trainer.resume(directory) if resume else None
    losses, peak, predicted = [], None, None
    while trainer.steps_done < steps:
        if measure and peak is None:
            from rhino.cost.cluster import parse_cluster
            from rhino.cost.estimate import estimate
            from rhino.runtime.data import rank_batch
            batch = rank_batch(trainer.next_batch(), trainer.rp, trainer.mesh_rank, trainer.microbatches,
                               trainer.device)
            loss, peak = trainer.program.run_measured(trainer.state, batch)
            trainer.steps_done += 1
            losses.append(loss)
            est = estimate(trainer.cap.graph, parse_cluster(f"cpu:{trainer.plan.world}"), trainer.plan)
            predicted = est.stages[trainer.rank // trainer.plan.mesh.world]["peak_bytes"]
        else:
            losses.append(trainer.step())
        if trainer.steps_done in save_at:
            trainer.save(directory)
    return {"losses": losses, "local": {k: v.clone() for k, v in trainer.state.items()},
            "info": None if info is None else info.to_dict(), "peak": peak, "predicted": predicted}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


@pytest.mark.multiprocess
def test_pipeline_checkpoint_resumes_under_the_same_and_another_plan(tmp_path):
    """pp=2 (4 micro-batches) saves after step 2 (each stage its held state; the tied weight from both stages); resuming under
    pp=2 gives steps 3-4 bit for bit on every rank, resuming under dp=2 (no stages) gives the same losses and
    state; every loss equals the single-device loop's. The first step is measured node by node: stage 0's peak
    within 5% of the cost model's."""
    d = tmp_path / "ck"
    whole = launch(_run, 2, "pp=2,microbatches=4", 4, str(d), (2,), False, True, timeout_s=300)
    assert "tok.weight" in whole[0]["local"] and "tok.weight" in whole[1]["local"]   # held by both stages
    # the cost model's peak of stage 0 (the larger) against the first step's, measured node by node: it left out
    # the update phase (the peak here), split the tied weight between the stages and left out the boundary
    # values the runtime holds: 26% under in float32; the examples are within 25% (docs/benchmarks.md)
    assert whole[0]["peak"] == pytest.approx(whole[0]["predicted"], rel=0.15), whole[0]
    assert set(whole[0]["local"]) != set(whole[1]["local"])
    want = eager_losses(GPT, 4)
    assert all(_close(a, b) for a, b in zip(whole[0]["losses"], want)), (whole[0]["losses"], want)
    same = launch(_run, 2, "pp=2,microbatches=4", 4, str(d), (), True, timeout_s=300)
    for rank in range(2):
        assert same[rank]["info"]["step"] == 2 and same[rank]["info"]["mesh"] == "dp1"
        assert same[rank]["losses"] == whole[rank]["losses"][2:]
        assert set(same[rank]["local"]) == set(whole[rank]["local"])
        for name, t in same[rank]["local"].items():
            assert torch.equal(t, whole[rank]["local"][name]), (rank, name)
    other = launch(_run, 2, "dp=2", 4, str(d), (), True, timeout_s=300)
    held = {**whole[0]["local"], **whole[1]["local"]}           # pp=2 of one-rank meshes: whole tensors
    for rank in range(2):
        assert all(_close(a, b) for a, b in zip(other[rank]["losses"], whole[0]["losses"][2:]))
        assert set(other[rank]["local"]) == set(held)
        for name, t in other[rank]["local"].items():            # dp=2 replicates every tensor
            err = (t - held[name]).abs().max().item()
            assert err <= TOL * max(1.0, held[name].abs().max().item()), (rank, name, err)


@pytest.mark.multiprocess
def test_rhino_train_pipeline_under_torchrun_matches_the_local_launcher(tmp_path):
    """``rhino train --strategy pp=2,microbatches=2`` as the 2 ranks of a torchrun job: the local launcher's
    losses, each step's loss in the log, and a peak of live bytes above the state (it was 0 for pipelines)."""
    a, b, lines = torchrun_train(tmp_path, MLP, "pp=2,microbatches=2", 3)
    assert a["nproc"] == 2 and a["mesh"] == "pp2xdp1" and a["losses"] == b["losses"]
    assert len(set(a["losses"])) == 3
    assert [x["step"] for x in lines] == [1, 2, 3] and [x["loss"] for x in lines] == a["losses"]
    for r in (a, b):   # the first step is measured node by node: state, stashed micro-batches, accumulators
        assert r["peak_live_bytes"] > max(sum(d.values()) for d in r["state_bytes_per_rank"]), r


def _measure_update(ctx, strategy):
    """One rank of the MLP: the first step node by node and the cost model's stage peak, float64."""
    from rhino.cost.cluster import parse_cluster
    from rhino.cost.estimate import estimate
    from rhino.runtime.data import rank_batch
    from rhino.runtime.trainer import Trainer
    trainer = Trainer(MLP, strategy=strategy, dtype=torch.float64)
    batch = rank_batch(trainer.next_batch(), trainer.rp, trainer.mesh_rank, trainer.microbatches, trainer.device)
    _, peak = trainer.program.run_measured(trainer.state, batch)
    est = estimate(trainer.cap.graph, parse_cluster(f"cpu:{trainer.plan.world}"), trainer.plan)
    stage = est.stages[trainer.rank // trainer.plan.mesh.world]
    return peak, stage["peak_bytes"], [p["phase"] for p in stage["phases"] if p["bytes"] == stage["peak_bytes"]]


@pytest.mark.multiprocess
def test_a_stage_update_phase_is_counted_over_its_own_program():
    """The MLP under pp=2 peaks in each stage's update (the replaced state handed to it, as in training): the cost
    model counts that phase over the stage's own update program, byte for byte what the runtime holds (scaled
    from the whole step's update peak it was 22% and 28% under: a stage's largest weight is not the step's)."""
    for peak, predicted, phase in launch(_measure_update, 2, "pp=2,microbatches=4", timeout_s=300):
        assert phase == ["update"] and peak == predicted
