"""Fault-tolerant training: a job runs as tasks under torchrun's elastic agent.

``run_elastic(job)`` starts ``torch.distributed.elastic``'s ``LocalElasticAgent`` (the agent behind
``torchrun``) with a c10d rendezvous (``localhost:0`` on one node, as ``torchrun --standalone``),
``nproc_per_node`` workers, ``max_restarts`` and the ``nnodes`` range. The agent supervises: when a worker
dies (exit code or signal) it stops the others and restarts the whole group after a new rendezvous, up
to ``max_restarts`` times. Rhino adds only what the agent cannot know:

- each worker (``_worker``) joins the job, takes a plan *for the world size it got* (``plan_for_world``:
  the given plan, strategy or cluster; when the world differs, the cluster is searched again for the new
  world, a strategy's ``dp`` is scaled if that is the only choice, anything else stops with one sentence),
  resumes from the latest checkpoint (always after a restart; on the first attempt with ``resume``),
  which reshards it to the new plan, trains up to ``steps`` and saves every ``every`` steps and at the end;
- the agent is ``LocalElasticAgent`` with one hook (``_RecordingAgent``): it records each failed attempt's
  ``ProcessFailure``s (rank, exit code, signal, torchelastic error file) and logs the reason on stderr;
- rank 0 of each attempt writes a journal line (world size, step resumed from, plan, why it replanned)
  and one line per step, so the report lists every restart and the loss of every step.

Fault injection (tests, drills): ``RHINO_FAULT=rank:R,step:S[,attempt:A][,node:1]`` makes rank R kill
itself with SIGKILL during step S (after taking the step's batch, before computing it) of attempt A
(default 0, the first; read from ``TORCHELASTIC_RESTART_COUNT``), so the restarted job can finish; with
``node:1`` it first SIGKILLs its agent too, as if its whole node were lost (an ``nnodes`` range then
continues on fewer nodes); with ``node:1`` the rank may be left out: every rank under the agents whose
environment holds the variable.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

__all__ = ["ElasticJob", "ElasticResult", "Restart", "run_elastic", "plan_for_world", "parse_fault",
           "FAULT_ENV", "ElasticJobError"]

FAULT_ENV = "RHINO_FAULT"
JOURNAL = "journal.jsonl"
# Seconds between the agent's looks at its workers (torchrun's default, LaunchConfig.monitor_interval).
MONITOR_INTERVAL_S = 0.1
# The workers get a fresh TCPStore each attempt (hosted by their rank 0 on a free port) instead of sharing the
# agent's rendezvous store: with the shared store a restarted rank can read a key of the previous attempt
# (a dead peer's address: "Gloo connectFullMesh failed ... Connection refused", seen here with torch 2.13;
# pytorch/pytorch#135712, whose workaround this is).
UNSHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Characters of a failed worker's error message kept in a restart's reason (one readable line).
MESSAGE_CHARS = 200
# Seconds a rendezvous waits for more nodes once ``MIN`` of an ``nnodes`` range have joined (torchrun's
# default is 30; chosen so that a restart after a lost node does not idle long on a local test).
LAST_CALL_S = 3
# Seconds the agent waits for a worker to stop after SIGTERM before SIGKILL (torchrun's default is 30;
# our workers hold no resources that need longer than a second to release).
SHUTDOWN_TIMEOUT_S = 5


class ElasticJobError(RuntimeError):
    """The job failed for good: more failures than ``max_restarts`` (the message names the last reason)."""


@dataclass(frozen=True)
class ElasticJob:
    """Everything every worker needs (picklable). Exactly one of ``plan``, ``strategy``, ``cluster``."""

    workload: str
    checkpoint: str
    steps: int
    nproc: int
    plan: str | None = None
    strategy: str | None = None
    cluster: str | None = None
    level: str = "O1"
    every: int = 0
    resume: bool = False
    max_restarts: int = 0
    nnodes: str = "1"                    # "N" or "MIN:MAX" (elastic range of nodes, nproc workers each)
    rdzv_endpoint: str = "localhost:0"   # c10d rendezvous store; port 0: a free port (one node)
    rdzv_conf: dict = field(default_factory=dict)   # torchrun's --rdzv-conf (is_host, last_call_timeout, ...)
    dtype: torch.dtype | None = None
    overlap: bool = True
    timeout_s: float = 300.0
    log: str | None = None
    release_memory: bool = False

    def check(self) -> None:
        """One clear sentence for each mistake, before any process starts."""
        if sum(x is not None for x in (self.plan, self.strategy, self.cluster)) != 1:
            raise ValueError("give exactly one of plan, strategy or cluster")
        if self.steps < 1 or self.nproc < 1:
            raise ValueError("steps and nproc must be at least 1")
        if self.every < 0 or self.max_restarts < 0:
            raise ValueError("every and max_restarts must be 0 or more")
        if not self.checkpoint:
            raise ValueError("a fault-tolerant job needs a checkpoint directory to restart from")
        node_range(self.nnodes)
        parse_fault(os.environ.get(FAULT_ENV, ""))


def node_range(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:2"`` -> (1, 2) (torchrun's ``--nnodes``)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    lo, hi = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not m or lo < 1 or hi < lo:
        raise ValueError(f"nnodes {text!r} must be N or MIN:MAX with 1 <= MIN <= MAX, e.g. 1:2")
    return lo, hi


def parse_fault(text: str) -> dict[str, int] | None:
    """``RHINO_FAULT`` (``rank:R,step:S[,attempt:A][,node:1]``) -> {rank, step, attempt, node}; empty -> None."""
    if not text.strip():
        return None
    out = {"attempt": 0, "node": 0}
    for item in text.split(","):
        key, sep, val = item.strip().partition(":")
        if key not in ("rank", "step", "attempt", "node") or not sep or not val.strip().isdigit():
            raise ValueError(f"{FAULT_ENV}={text!r} must look like rank:1,step:5 (optionally ,attempt:0 "
                             f"and ,node:1)")
        out[key] = int(val)
    if "step" not in out or ("rank" not in out and not out["node"]):
        raise ValueError(f"{FAULT_ENV}={text!r} must name a rank and a step (e.g. rank:1,step:5), or a step and "
                         f"node:1 (every rank under this agent)")
    return out


# ---------------------------------------------------------------------------------------------- replanning

def plan_for_world(job: ElasticJob, world: int) -> tuple[dict, str | None]:
    """The Trainer's plan arguments for ``world`` processes, and why it replanned (None: it did not).

    A plan file must match the world. A cluster of another size is searched again as the same device
    type with ``world`` devices. A strategy of another size keeps tp, pp and the rest and scales dp, if
    ``world`` is a multiple of tp * pp (the one unambiguous choice); otherwise a ValueError.
    """
    if job.plan is not None:
        from ..sharding.plan import ShardingPlan
        n = ShardingPlan.from_json(Path(job.plan).read_text()).mesh.world
        if n != world:
            raise ValueError(f"plan file {job.plan} is for {n} devices but this attempt has {world} processes; "
                             f"give a strategy or a cluster so the job can replan")
        return {"plan": job.plan}, None
    if job.strategy is not None:
        from ..sharding.presets import parse_strategy
        spec = parse_strategy(job.strategy)
        if spec.world == world:
            return {"strategy": job.strategy}, None
        rest = spec.tp * spec.pp
        if world % rest:
            raise ValueError(f"strategy {job.strategy} needs {spec.world} processes and cannot be scaled to "
                             f"{world} (tp*pp = {rest} does not divide it); give a strategy or a cluster for {world}")
        new = replace(spec, dp=world // rest, zero=spec.zero if world // rest > 1 else 0)
        return {"strategy": str(new)}, (f"strategy {job.strategy} needs {spec.world} processes, this attempt has "
                                        f"{world}: dp scaled {spec.dp} -> {new.dp}, now {new}")
    from ..cost.cluster import parse_cluster
    n = parse_cluster(job.cluster).world
    if n == world:
        return {"cluster": job.cluster, "level": job.level}, None
    resized = resize_cluster(job.cluster, world)
    return {"cluster": resized, "level": job.level}, (f"cluster {job.cluster} has {n} devices, this attempt has "
                                                       f"{world}: searching a plan for {resized} ({job.level})")


def resize_cluster(text: str, world: int) -> str:
    """The cluster string for ``world`` devices of the same type: cpu:N -> cpu:W; NxGxT -> (W/G)xGxT when
    G divides W, WxT when W < G; a YAML cluster or any other shape: a ValueError."""
    t = text.strip()
    if re.fullmatch(r"cpu(:\d+)?", t, re.IGNORECASE):
        return f"cpu:{world}"
    m = re.fullmatch(r"(?:(\d+)[xX])?(\d+)[xX](.+)", t)
    if m and not t.lower().endswith((".yaml", ".yml")):
        per_node, kind = int(m.group(2)), m.group(3)
        if world < per_node:
            return f"{world}x{kind}"
        if world % per_node == 0:
            return f"{world // per_node}x{per_node}x{kind}"
    raise ValueError(f"cluster {text!r} cannot be resized to {world} devices unambiguously; give a cluster "
                     f"string for {world} devices")


# ---------------------------------------------------------------------------------------------- one worker

def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"rhino elastic: {message}", file=sys.stderr, flush=True)


def _journal(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _worker(job: ElasticJob, journal: str) -> dict:
    """One rank of one attempt (the agent's entrypoint): join, plan for this world, resume, train, save."""
    from .launch import init_from_env, shutdown
    from .trainer import Trainer, peak_rss_bytes
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "OMP_NUM_THREADS" not in os.environ:     # else the user's (or torchrun's) choice stands
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    fault = parse_fault(os.environ.get(FAULT_ENV, ""))
    ctx = init_from_env(job.timeout_s)
    rank, world = ctx.rank, ctx.world_size
    mine = journal if rank == 0 else None
    try:
        kwargs, why = plan_for_world(job, world)
        if why:
            _say(rank, f"attempt {attempt}: replanning: {why}")
        say = (lambda m: _say(rank, m)) if rank == 0 else None
        trainer = Trainer(job.workload, kwargs.get("plan"), strategy=kwargs.get("strategy"),
                          cluster=kwargs.get("cluster"), level=kwargs.get("level", "O1"), dtype=job.dtype,
                          overlap=job.overlap, timeout_s=job.timeout_s, release_memory=job.release_memory,
                          progress=say)
        info = trainer.resume(job.checkpoint) if (attempt > 0 or job.resume) else None
        start = info.step if info is not None else 0
        strategy = trainer.plan.strategy_string or str(trainer.plan.mesh)
        if info is not None:
            _say(rank, f"attempt {attempt}: resumed from step {start} of {info.path} (saved by "
                       f"{info.world_size} processes) under {strategy} on {world} processes")
        _journal(mine, {"event": "attempt", "attempt": attempt, "world_size": world, "resumed_from_step": start,
                        "strategy": strategy, "mesh": str(trainer.plan.mesh), "replan": why,
                        "saved_world_size": info.world_size if info is not None else None})
        losses, times, samples, saved = _train(trainer, job, start, attempt, fault, rank, mine)
        return {"losses": losses, "times": times, "peak_live": 0, "rss": peak_rss_bytes(), "samples": samples,
                "mesh": str(trainer.plan.mesh), "strategy": strategy, "state_bytes": trainer.state_bytes(),
                "resumed_from_step": info.step if info is not None else None, "checkpoints": saved}
    finally:
        shutdown()


def _train(trainer, job: ElasticJob, start: int, attempt: int, fault: dict | None, rank: int,
           journal: str | None) -> tuple[list[float], list[float], int, list[str]]:
    """Steps ``start + 1 .. job.steps``; checkpoints every ``job.every`` steps and after the last."""
    from .data import samples_in
    losses, times, samples, saved = [], [], 0, []
    logf = open(job.log, "a") if job.log and rank == 0 else None
    try:
        for step in range(start + 1, job.steps + 1):
            batch = trainer.next_batch()
            samples = samples_in(batch)
            if fault and fault.get("rank", rank) == rank and fault["step"] == step and fault["attempt"] == attempt:
                _say(0, f"{FAULT_ENV}: rank {rank} kills {'its agent and ' if fault['node'] else ''}itself with "
                        f"SIGKILL during step {step}")
                if fault["node"]:
                    os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.perf_counter()
            loss = trainer.step(batch)
            dt = time.perf_counter() - t0
            losses.append(loss)
            times.append(dt)
            _say(rank, f"step {step}/{job.steps}  loss {loss:.6g}  {dt * 1e3:.1f} ms")
            _journal(journal, {"event": "step", "attempt": attempt, "step": step, "loss": loss})
            if logf is not None:
                logf.write(json.dumps({"step": step, "loss": loss, "seconds": dt, "attempt": attempt}) + "\n")
                logf.flush()
            if (job.every and step % job.every == 0) or step == job.steps:
                path = trainer.save(job.checkpoint)
                saved.append(str(path))
                _say(rank, f"saved step {step} to {path}")
    finally:
        if logf is not None:
            logf.close()
    return losses, times, samples, saved


# ---------------------------------------------------------------------------------------------- the agent

def _failure_reason(failures: dict) -> str:
    """One sentence from an attempt's ``ProcessFailure``s: a rank killed by a signal is the likelier root
    cause (its peers then fail in collectives), else the earliest failure."""
    if not failures:
        return "the worker group became unhealthy"
    ranked = sorted(failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp, kv[0]))
    rank, f = ranked[0]
    if f.exitcode < 0:
        what = f"rank {rank} (pid {f.pid}) died with signal {f.signal_name()} (exit code {f.exitcode})"
    else:
        message = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message or "")
        message = "" if "errors.html" in message else message.strip().splitlines()[0][:MESSAGE_CHARS] if message else ""
        what = f"rank {rank} (pid {f.pid}) exited with code {f.exitcode}" + (f": {message}" if message else "")
    others = sorted(r for r in failures if r != rank)
    return what + (f" (then rank(s) {', '.join(map(str, others))} failed too)" if others else "")


def _make_agent_class():
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class _RecordingAgent(LocalElasticAgent):
        """torchrun's agent, plus a record of each failed attempt's failures and a log line with the reason."""

        failed_attempts: list

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                spec = worker_group.spec
                attempt = spec.max_restarts - self._remaining_restarts
                reason = _failure_reason(result.failures)
                self.failed_attempts.append((attempt, reason))
                then = (f"restarting from the last checkpoint ({self._remaining_restarts} of {spec.max_restarts} "
                        f"restarts left)" if self._remaining_restarts > 0 else "no restarts left: the job fails")
                print(f"rhino elastic: attempt {attempt} failed: {reason}; {then}", file=sys.stderr, flush=True)
            return result

    return _RecordingAgent


@dataclass
class Restart:
    """One restart: the attempt it started, why, and what the new attempt did."""

    attempt: int
    reason: str
    world_size: int | None = None
    resumed_from_step: int | None = None
    strategy: str | None = None
    replan: str | None = None

    def to_dict(self) -> dict:
        return {"attempt": self.attempt, "reason": self.reason, "world_size": self.world_size,
                "resumed_from_step": self.resumed_from_step, "strategy": self.strategy, "replan": self.replan}


@dataclass
class ElasticResult:
    """What ``run_elastic`` returns (``rhino train --max-restarts`` / ``rhino launch`` print it)."""

    train: object                        # TrainResult of the final attempt (its losses: every step of the job)
    restarts: list[Restart] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return self.train.losses

    def to_dict(self) -> dict:
        out = self.train.to_dict()
        out["restarts"] = [r.to_dict() for r in self.restarts]
        out["attempts"] = self.attempts
        return out


def run_elastic(job: ElasticJob) -> ElasticResult:
    """Run ``job`` under torchrun's elastic agent (this process is the agent of one node); see the module doc."""
    job.check()
    lo, hi = node_range(job.nnodes)
    if lo == hi:                                # the first attempt's world is known: a plan for it must exist
        plan_for_world(job, job.nproc * lo)
    from .checkpoint import latest_checkpoint
    found = None if job.resume else latest_checkpoint(job.checkpoint)
    if found is not None:                       # a restart would otherwise resume that older job
        raise ValueError(f"checkpoint directory {job.checkpoint} already holds {found.name}; resume it (--resume, "
                         f"or resume: true in a job file) or choose an empty directory")
    Path(job.checkpoint).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rhino-elastic-") as tmp:
        journal = os.path.join(tmp, JOURNAL)
        start = time.perf_counter()
        agent, values = _run_agent(job, journal)
        seconds = time.perf_counter() - start
        records = _read_journal(journal)
    return _result(agent.failed_attempts, records, values, seconds)


def _run_agent(job: ElasticJob, journal: str):
    """``torch.distributed.launcher.api.launch_agent`` with the recording agent: c10d rendezvous, spawn."""
    from torch.distributed.elastic import rendezvous  # noqa: F401 -- registers the rendezvous backends
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    lo, hi = node_range(job.nnodes)
    conf = {"join_timeout": int(job.timeout_s), "last_call_timeout": LAST_CALL_S, **job.rdzv_conf}
    params = RendezvousParameters(backend="c10d", endpoint=job.rdzv_endpoint, run_id=f"rhino-{uuid.uuid4().hex[:12]}"
                                  if job.rdzv_endpoint.endswith(":0") else "rhino", min_nodes=lo, max_nodes=hi, **conf)
    spec = WorkerSpec(role="trainer", local_world_size=job.nproc, entrypoint=_worker, args=(job, journal),
                      rdzv_handler=get_rendezvous_handler(params), max_restarts=job.max_restarts,
                      monitor_interval=MONITOR_INTERVAL_S)
    agent = _make_agent_class()(spec=spec, logs_specs=DefaultLogsSpecs(), start_method="spawn",
                                shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    agent.failed_attempts = []
    shared = os.environ.get(UNSHARE_STORE_ENV)
    os.environ[UNSHARE_STORE_ENV] = "1"
    try:
        result = agent.run()
    except RendezvousError as exc:
        raise ElasticJobError(f"the rendezvous at {job.rdzv_endpoint} failed (the node that hosts its store may "
                              f"be gone): {str(exc).splitlines()[0]}") from exc
    finally:
        spec.rdzv_handler.shutdown()
        if shared is None:
            os.environ.pop(UNSHARE_STORE_ENV, None)
        else:
            os.environ[UNSHARE_STORE_ENV] = shared
    if result.is_failed():
        last = agent.failed_attempts[-1][1] if agent.failed_attempts else _failure_reason(result.failures)
        raise ElasticJobError(f"the job failed after {len(agent.failed_attempts) - 1} restart(s) "
                              f"(--max-restarts {job.max_restarts}): {last}")
    return agent, result.return_values


def _read_journal(path: str) -> list[dict]:
    """The journal's records; a last line cut short by a killed rank 0 is left out."""
    if not os.path.exists(path):
        return []
    lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise
    return out


def _result(failed: list, records: list[dict], values: dict, seconds: float) -> ElasticResult:
    """The job's result: every step's loss from the journal (on the node of rank 0; another node's agent keeps
    its final attempt's losses), each restart's reason from the agent and its outcome from the journal."""
    from .trainer import summarize
    train = summarize([values[r] for r in sorted(values)], False, seconds)
    by_step: dict[int, float] = {}
    for rec in records:
        if rec["event"] == "step":
            by_step[rec["step"]] = rec["loss"]    # a step trained again after a restart: its later loss
    if by_step:
        train.losses = [by_step[s] for s in sorted(by_step)]
        train.steps = len(train.losses)
    attempts = [{k: v for k, v in rec.items() if k != "event"} for rec in records if rec["event"] == "attempt"]
    by_attempt = {a["attempt"]: a for a in attempts}
    restarts = []
    for attempt, reason in failed:
        nxt = by_attempt.get(attempt + 1, {})
        restarts.append(Restart(attempt + 1, reason, nxt.get("world_size"), nxt.get("resumed_from_step"),
                                nxt.get("strategy"), nxt.get("replan")))
    return ElasticResult(train, restarts, attempts)
