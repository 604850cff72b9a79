"""``runtime.pipeline_messages``: which sends a pipeline rank may wait on (and free) once a message arrives.

Oracle: the messages ``PipelineStep.schedule`` really yields while ``simulate_pipeline`` runs every rank in one
process. The schedule's mirror (``message_events``) must list exactly those, in order; every release must
follow from them (the peer received the send before it sent the releasing message); and under 1F1B every
forward activation is released when its micro-batch's gradient comes back, before the update."""
from __future__ import annotations

import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.ir.stages import schedule_order
from rhino.runtime.pipeline import PipelineStep, Recv, Send
from rhino.runtime.pipeline_messages import message_events
from rhino.runtime.pipeline_sim import simulate_pipeline
from rhino.sharding.presets import parse_strategy, preset_plan

PIPES = str(ROOT / "tests" / "workloads" / "pipelines.py")


@pytest.fixture(scope="module")
def workloads():
    """The GPT has a tied embedding (its gradient is also a message, in the update phase); the MLP is small."""
    out = {}
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        for name in ("gpt", "mlp"):
            out[name] = capture(load_workload(f"{PIPES}:{name}", dtype=torch.float64))
    return out


def _logged_run(cap, strategy: str, monkeypatch) -> tuple[dict, list[PipelineStep]]:
    """Every rank's messages as the schedule yields them: rank -> [(kind, peer stage, tag)]."""
    log: dict[int, list] = {}
    real = PipelineStep.schedule

    def logged(self, local_state, local_batch):
        gen, reply = real(self, local_state, local_batch), None
        while True:
            try:
                act = gen.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(act, (Send, Recv)):
                kind, peer = ("send", act.dst) if isinstance(act, Send) else ("recv", act.src)
                log.setdefault(self.rank, []).append((kind, peer, act.tag))
            reply = yield act
    monkeypatch.setattr(PipelineStep, "schedule", logged)
    plan = preset_plan(cap.graph, parse_strategy(strategy))
    with default_dtype(torch.float64):
        res = simulate_pipeline(cap, plan, 1)
    return log, res["steps"]


@pytest.mark.parametrize("name, strategy", [("gpt", "pp=2,microbatches=4"), ("mlp", "pp=3,microbatches=4,schedule=gpipe"),
                                            ("mlp", "pp=2,dp=2,microbatches=4"),
                                            ("mlp", "pp=2,microbatches=4,schedule=interleaved,chunks=2")])
def test_releases_follow_the_messages_the_schedule_makes(workloads, name, strategy, monkeypatch):
    log, steps = _logged_run(workloads[name], strategy, monkeypatch)
    plan = steps[0].plan
    W, m = plan.mesh.world, plan.microbatches
    for step in steps:
        order = schedule_order(plan.schedule, step.stage, plan.stages, m, plan.chunks)
        mirror = message_events(step.spec, plan.stages, m, order, step.spec.device_stages(step.stage), step.stage)
        assert mirror == log.get(step.rank, []), step.rank
        for (peer, later), sends in step.releases.items():
            theirs = log[peer * W + step.local]           # the peer stage's rank of the same mesh position
            for _, tag in sends:
                assert theirs.index(("recv", step.stage, tag)) < theirs.index(("send", step.stage, later))
    if plan.schedule == "1f1b" and plan.chunks == 1:
        first = steps[0]
        forward = [t for k, p, t in log[0] if k == "send" and p == 1 and t % (m + 1) < m]
        released = {t for sends in first.releases.values() for _, t in sends}
        assert forward and set(forward) <= released, (forward, released)
