"""``rhino.Trainer``: one rank of a training job that runs a plan, without any single-device reference.

Usable wherever a process group exists or can be made: inside a ``torchrun`` script (one process per
rank; NCCL with CUDA, else gloo) and in the ranks that ``rhino train`` starts locally (``train`` below).

    trainer = rhino.Trainer("examples/gpt.py", strategy="dp=2")     # or plan=..., or cluster="8xA100-80G"
    for batch in loader:                                               # global batches
        loss = trainer.step(batch)                                     # each rank takes its share

What one construction does, on every rank: load the workload (a ``FILE[:FUNC]`` spec is recorded on the
meta device and each rank materialises only its own shards, see ``runtime/init.py``; an in-memory model is
sliced), capture the step (fake tensors), take the plan (given, a strategy preset, or searched on rank 0
for a cluster and broadcast, since a time-limited search need not be deterministic), build the mesh's
process groups and lower this rank's programs (``RankStep``: micro-batches, recomputation, overlapped
collectives).
"""
from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable

import torch
import torch.distributed as dist

from ..capture import Captured, Workload, capture, default_dtype
from ..capture.optim import SCHEDULABLE, changed_hyperparameter, hyperparameters
from ..capture.schedule import LrSchedule, set_rates
from ..ir.graph import Role
from ..sharding.plan import PlanError, ShardingPlan, resolve
from ..sharding.presets import parse_strategy, preset_notes, preset_plan
from .collectives import TORCH_COLLECTIVES, gather_tensor
from .data import batch_stream, check_batch, rank_batch, samples_in
from .groups import build_groups
from .launch import current_context, in_torchrun, init_from_env, launch, shutdown
from .microbatch import explain_microbatch_errors
from .pipeline import PIPELINE_MEMORY_PLAN
from ..lower.spmd_ops import set_context

__all__ = ["Trainer", "TrainResult", "train", "train_torchrun", "train_rank", "summarize", "peak_rss_bytes",
           "load_plan_file", "plan_world", "check_checkpointing"]

# Steps left out of the median step time: the first steps pay one-time costs (allocator growth, lazy
# initialisation of collectives). Chosen from runs of the examples: step 1 is 1.5-3x later ones, step 2 not.
WARMUP_STEPS = 1


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ``ru_maxrss`` in KiB, macOS in bytes)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class Trainer:
    """One rank's trainer (see the module docstring). Exactly one of ``plan``, ``strategy``, ``cluster``.

    ``workload``: a ``FILE[:FUNC]`` spec, a ``Workload``, a ``(model, optimizer, loss_fn, batch)`` tuple
    or a function returning one. ``dtype``: default dtype while the workload is built (float64 for exact
    comparisons). ``overlap``: issue collectives asynchronously in buckets (off: blocking, one per tensor).
    ``release_memory``: freed tensors go back to the OS at once (``runtime.init.return_freed_memory``, glibc),
    so the resident set follows the live bytes; for models near the memory limit (costs page faults).
    ``memory_plan``: a memory-planning level (O1, O2): the step runs in its planned order inside one arena
    (``runtime.arena_step.ArenaRankStep``; blocking collectives, one micro-batch).
    ``lr_scheduler``: ``f(optimizer)`` returning a ``torch.optim.lr_scheduler`` scheduler (in place of the
    workload file's ``lr_scheduler``); each step runs at its current rates and then steps it
    (``capture/schedule.py``; ``self.schedule.scheduler`` is the scheduler).
    """

    def __init__(self, workload, plan: ShardingPlan | str | None = None, *, strategy: str | None = None,
                 cluster: str | None = None, level: str = "O1", time_limit: float = 20.0,
                 dtype: torch.dtype | None = None, overlap: bool = True, timeout_s: float = 300.0,
                 release_memory: bool = False, progress: Callable[[str], None] | None = None,
                 memory_plan: str | None = None, lr_scheduler: Callable | None = None) -> None:
        if sum(x is not None for x in (plan, strategy, cluster)) != 1:
            raise ValueError("give exactly one of plan, strategy or cluster")
        say = progress or (lambda message: None)
        if release_memory:
            from .init import return_freed_memory
            return_freed_memory()
        self.dtype = dtype
        self.ctx = _join(timeout_s)
        self.rank, self.world = self.ctx.rank, self.ctx.world_size
        self.device = self.ctx.device
        with default_dtype(dtype):
            self.workload, self._source = _load(workload, dtype)
            if lr_scheduler is not None:
                self.workload.lr_scheduler = lr_scheduler
            say("capturing the training step ...")
            self.cap: Captured = capture(self.workload)
            self.schedule = LrSchedule(self.workload.optimizer, self.workload.lr_scheduler, self.cap.scheduled,
                                       self.workload.spec) if self.cap.scheduled else None
            self._hyperparameters = hyperparameters(self.workload.optimizer, self.cap.scheduled)
            self.plan = self._plan(plan, strategy, cluster, level, time_limit, say)
        if self.plan.world != self.world:
            raise ValueError(f"the plan has {self.plan.world} devices ({self.plan.stages} stage(s) of mesh "
                             f"{self.plan.mesh}) but the job has {self.world} processes; start {self.plan.world} "
                             f"or choose another plan")
        self.rp = resolve(self.cap.graph, self.plan)
        for note in preset_notes(self.cap.graph, self.plan) if strategy is not None else []:
            say(f"note: {note}")
        self.microbatches = getattr(self.plan, "microbatches", 1)
        self.pipelined = self.plan.stages > 1
        self.mesh_rank = self.rank % self.plan.mesh.world     # this rank within its stage's mesh
        if self.pipelined:
            from .groups import build_stage_groups
            self.groups = build_stage_groups(self.plan.mesh, self.plan.stages, timeout_s)
        else:
            self.groups = build_groups(self.plan.mesh, timeout_s)
        set_context(self.plan.mesh, self.mesh_rank, self.groups, TORCH_COLLECTIVES)
        say("lowering the per-rank programs ...")
        if self.pipelined:
            if memory_plan:
                raise ValueError(PIPELINE_MEMORY_PLAN)
            from .pipeline import PipelineStep
            self.program = PipelineStep(self.cap, self.plan, self.rank, self.device)
        elif memory_plan:
            from .arena_step import ArenaRankStep
            self.program = ArenaRankStep(self.cap.graph, self.plan, self.rank, self.device, level=memory_plan)
        else:
            from .rank_step import RankStep
            self.program = RankStep(self.cap, self.plan, self.rank, self.device, overlap=overlap)
        say(f"materialising rank {self.rank}'s shards ...")
        self.state = self._local_state()
        self._stream = None
        self.steps_done = 0
        self.peak_live_bytes = 0          # of the last step run with measure=True
        self.last_rates: dict[str, float] = {}   # the scheduled inputs of the last step (lr, momenta), if any
        self.data_position = 0            # global batches taken from the stream by next_batch (checkpointed)

    # ------------------------------------------------------------------ set-up
    def _plan(self, plan, strategy, cluster, level, time_limit, say) -> ShardingPlan:
        graph = self.cap.graph
        if isinstance(plan, ShardingPlan):
            return plan
        if isinstance(plan, (str, Path)):
            path = Path(plan)
            if not path.is_file():
                raise ValueError(f"plan file {str(plan)!r} does not exist; make one with rhino plan ... --out FILE")
            loaded = ShardingPlan.from_json(path.read_text())
            if loaded.fingerprint and graph.fingerprint() != loaded.fingerprint:
                raise ValueError(f"plan file {str(plan)!r} was made for another workload (fingerprint "
                                 f"{loaded.fingerprint[:12]}, this one {graph.fingerprint()[:12]}); plan again "
                                 f"(under the same --dtype)")
            return loaded
        if strategy is not None:
            return preset_plan(graph, parse_strategy(strategy))
        return self._search(cluster, level, time_limit, say)

    def _search(self, cluster: str, level: str, time_limit: float, say) -> ShardingPlan:
        """Rank 0 searches; every rank gets its plan (the search is time-limited, hence not deterministic)."""
        box = [None]
        if self.rank == 0:
            from ..cost.cluster import parse_cluster
            from ..search.planning import plan_workload
            say(f"searching a plan for {cluster} ({level}) ...")
            plan, _ = plan_workload(self.cap.graph, parse_cluster(cluster), level=level, time_limit=time_limit,
                                    presets=True)
            box[0] = plan.to_json()
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return ShardingPlan.from_json(box[0])

    def _local_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards, one full tensor at a time (replayed from the recording, or copied from an
        in-memory model that this process holds anyway)."""
        from .init import local_state
        state = local_state(self.cap, self.rp, self.mesh_rank, self._source, self.device)
        if self.pipelined:   # the state this rank's stage holds (runtime.pipeline)
            held = set(self.program.state_names)
            state = {n: t for n, t in state.items() if n in held}
        return state

    # ------------------------------------------------------------------ training
    def next_batch(self) -> tuple:
        """The next global batch of the workload's ``batches()`` (the example batch if it has none)."""
        if self._stream is None:
            with default_dtype(self.dtype):
                self._stream = batch_stream(self.example_batch(), self.workload.batches)
        try:
            with default_dtype(self.dtype):
                batch = next(self._stream)
        except StopIteration:
            raise ValueError(f"batches() ran out after {self.data_position} batches; give fewer steps or more "
                             f"data") from None
        self.data_position += 1
        return batch

    def set_data_position(self, position: int) -> None:
        """Make ``next_batch`` continue after ``position`` batches: the stream is made again and that many
        batches skipped (``batches()`` must be deterministic, see ``runtime/data.py``)."""
        self._stream, self.data_position = None, 0
        for _ in range(position):
            self.next_batch()

    def example_batch(self) -> tuple:
        from .init import example_batch
        return example_batch(self._source, self.workload)

    def step(self, batch=None, measure: bool = False) -> float:
        """One training step on a global batch (``None``: the next one); returns the loss (same on every rank).
        ``measure``: run it node by node, counting live tensor bytes (``peak_live_bytes``, this rank's)."""
        changed = changed_hyperparameter(self._hyperparameters, self.workload.optimizer, self.cap.scheduled)
        if changed:
            raise ValueError(f"the optimizer's {changed} after the step was captured (a learning-rate "
                             f"scheduler?); the captured update keeps the value it was captured with: give the "
                             f"scheduler to Rhino (the workload file's lr_scheduler(optimizer), or Trainer(..., "
                             f"lr_scheduler=...)), which follows the learning rate and a cycled momentum, or build a new Trainer after "
                             f"the change (save and resume to carry the state over)")
        batch = check_batch(self.cap.graph, self.next_batch() if batch is None else batch,
                            f"the batch of step {self.steps_done + 1}")
        local = rank_batch(batch, self.rp, self.mesh_rank, self.microbatches, self.device)
        set_context(self.plan.mesh, self.mesh_rank, self.groups, TORCH_COLLECTIVES)   # another trainer in this process may have set its own
        if self.schedule is not None:
            self.last_rates = self.schedule.rates()
            set_rates(self.state, self.last_rates)
        with explain_microbatch_errors(self.microbatches):
            if measure:
                loss, self.peak_live_bytes = self.program.run_measured(self.state, local)
            else:
                loss = self.program.run(self.state, local)
        self.steps_done += 1
        if self.schedule is not None:
            self.schedule.advance()
        return float(loss)

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory) -> Path:
        """Save a sharded checkpoint of this step under ``directory`` (collective; ``runtime/checkpoint.py``)."""
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, directory)

    def resume(self, directory):
        """Load the latest checkpoint under ``directory`` under this trainer's plan (collective); returns its
        ``CheckpointInfo``, or None when there is none (the trainer stays at step 0)."""
        from .checkpoint import latest_checkpoint, load_checkpoint
        box = [None]
        if self.rank == 0:                      # one answer for every rank
            found = latest_checkpoint(directory)
            box[0] = None if found is None else str(found)
        if self.world > 1:
            dist.broadcast_object_list(box, src=0)
        return None if box[0] is None else load_checkpoint(self, box[0])

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every state tensor assembled whole (collective: all ranks must call it); for checks and tests."""
        self._no_pipeline("full_state")
        return {inp.name: gather_tensor(self.state[inp.name], self.rp.value[inp.value], self.plan.mesh, self.rank,
                                        self.groups).cpu()
                for inp in self.cap.graph.inputs if inp.role is not Role.BATCH}

    def _no_pipeline(self, what: str) -> None:
        if self.pipelined:
            raise ValueError(f"{what} of pipelined plans (stages > 1) are not supported yet; train without pp")

    def state_bytes(self) -> dict[str, int]:
        """This rank's state bytes by role (parameter, buffer, optimizer state)."""
        out: dict[str, int] = {}
        for inp in self.cap.graph.inputs:
            if inp.name in self.state:
                t = self.state[inp.name]
                out[inp.role.value] = out.get(inp.role.value, 0) + t.numel() * t.element_size()
        return out


def _join(timeout_s: float):
    """This process's rank context: the existing process group, or the ``torchrun`` job's."""
    if dist.is_initialized():
        return current_context()
    if in_torchrun():
        return init_from_env(timeout_s)
    raise ValueError("Trainer needs a process group: run under torchrun, call torch.distributed."
                     "init_process_group first, or use rhino.train(..., nproc=N) to start local processes")


def _load(workload, dtype: torch.dtype | None) -> tuple[Workload, object | None]:
    """(the workload, the deferred source that materialises its tensors, or None for real tensors)."""
    if isinstance(workload, (str, Path)) or (callable(workload) and not isinstance(workload, torch.nn.Module)):
        from ..capture.deferred import load_deferred
        return load_deferred(workload, dtype)
    if isinstance(workload, Workload):
        w = workload
    elif isinstance(workload, (tuple, list)) and len(workload) == 4:
        model, opt, loss_fn, batch = workload
        w = Workload(model, opt, loss_fn, tuple(batch) if isinstance(batch, (tuple, list)) else (batch,),
                     "<in memory>", "workload")
    else:
        raise ValueError("workload must be a FILE[:FUNC] spec, a function returning (model, optimizer, loss_fn, "
                         "batch), such a tuple, or a rhino Workload")
    if w.on_meta:
        raise ValueError("this workload's model is on the meta device, so its values are unknown; pass the "
                         "FILE[:FUNC] spec or the function that builds it, and each rank builds its own shards")
    return w, None


# ---------------------------------------------------------------------------------------------- local runs

@dataclass
class TrainResult:
    """What ``train`` returns (and ``rhino train --json`` prints)."""

    nproc: int
    mesh: str
    strategy: str
    steps: int
    losses: list[float]
    step_seconds: float                   # median after warm-up, slowest rank per step
    samples_per_second: float
    peak_live_bytes: int                  # max over ranks (the first step, counted node by node)
    peak_rss_bytes: int                   # max over ranks
    seconds: float = 0.0
    all_step_seconds: list[float] = field(default_factory=list)
    state_bytes_per_rank: list[dict[str, int]] = field(default_factory=list)
    resumed_from_step: int | None = None  # the checkpoint's step this run resumed from (None: from step 0)
    checkpoints: list[str] = field(default_factory=list)   # the checkpoints this run saved

    def to_dict(self) -> dict:
        return {"nproc": self.nproc, "mesh": self.mesh, "strategy": self.strategy, "steps": self.steps,
                "losses": self.losses, "step_seconds": self.step_seconds,
                "samples_per_second": self.samples_per_second, "peak_live_bytes": self.peak_live_bytes,
                "peak_rss_bytes": self.peak_rss_bytes, "seconds": round(self.seconds, 2),
                "all_step_seconds": self.all_step_seconds, "state_bytes_per_rank": self.state_bytes_per_rank,
                "resumed_from_step": self.resumed_from_step, "checkpoints": self.checkpoints}


def train(workload: str, nproc: int, *, plan: str | None = None, strategy: str | None = None,
          cluster: str | None = None, level: str = "O1", steps: int = 10, dtype: torch.dtype | None = None,
          overlap: bool = True, timeout_s: float = 300.0, log: str | None = None, progress: bool = True,
          measure_live: bool = True, release_memory: bool = False, checkpoint: str | None = None, every: int = 0,
          resume: bool = False, memory_plan: str | None = None) -> TrainResult:
    """Train ``workload`` (a ``FILE[:FUNC]`` spec) for ``steps`` steps on ``nproc`` local processes (gloo).

    Rank 0 prints progress on stderr (step, loss, step time, samples/s) and appends one JSON line per
    step to ``log``. ``measure_live``: count the first step's peak of live tensor bytes node by node
    (slower step; excluded from the step times). ``checkpoint``: a directory to save sharded checkpoints in,
    every ``every`` steps (0: only at the end) and after the last step; ``resume``: continue from its latest
    checkpoint (under this run's plan, which may differ from the saver's) up to ``steps`` steps in total,
    or start from step 0 when it holds none. ``memory_plan``: each rank runs in its planned arena (``Trainer``).
    """
    if nproc < 1 or steps < 1:
        raise ValueError("nproc and steps must be at least 1")
    check_checkpointing(checkpoint, every, resume)
    _check_world(nproc, plan, strategy, cluster)
    _check_memory_plan(memory_plan, plan, strategy)
    start = time.perf_counter()
    results = launch(train_rank, nproc, workload, plan, strategy, cluster, level, steps, dtype, overlap,
                     timeout_s, log, progress, measure_live, release_memory, checkpoint, every, resume,
                     memory_plan, timeout_s=timeout_s)
    return summarize(results, measure_live, time.perf_counter() - start)


def train_torchrun(workload: str, *, plan: str | None = None, strategy: str | None = None,
                   cluster: str | None = None, level: str = "O1", steps: int = 10, dtype: torch.dtype | None = None,
                   overlap: bool = True, timeout_s: float = 300.0, log: str | None = None, progress: bool = True,
                   measure_live: bool = True, release_memory: bool = False, checkpoint: str | None = None,
                   every: int = 0, resume: bool = False, memory_plan: str | None = None) -> TrainResult | None:
    """``train`` as one rank of a ``torchrun`` job: every rank trains; rank 0 returns the summary (others None)."""
    start = time.perf_counter()
    check_checkpointing(checkpoint, every, resume)
    ctx = init_from_env(timeout_s)
    _check_world(ctx.world_size, plan, strategy, cluster)
    try:
        mine = train_rank(ctx, workload, plan, strategy, cluster, level, steps, dtype, overlap, timeout_s, log,
                          progress, measure_live, release_memory, checkpoint=checkpoint, every=every,
                          resume=resume, memory_plan=memory_plan)
        results = [None] * ctx.world_size
        dist.all_gather_object(results, mine)
    finally:
        shutdown()
    return summarize(results, measure_live, time.perf_counter() - start) if ctx.rank == 0 else None


def summarize(results: list[dict], measure_live: bool, seconds: float) -> TrainResult:
    """One ``TrainResult`` from every rank's ``train_rank`` result (in rank order)."""
    first = results[0]
    per_step = [max(ts) for ts in zip(*[r["times"] for r in results])]
    timed = per_step[WARMUP_STEPS + (1 if measure_live else 0):] or per_step
    step_s = median(timed) if timed else 0.0
    return TrainResult(len(results), first["mesh"], first["strategy"], len(per_step), first["losses"], step_s,
                       first["samples"] / step_s if step_s > 0 else 0.0,
                       max(r["peak_live"] for r in results), max(r["rss"] for r in results),
                       seconds, per_step, [r["state_bytes"] for r in results],
                       first.get("resumed_from_step"), first.get("checkpoints", []))


def check_checkpointing(checkpoint, every: int, resume: bool) -> None:
    """Before starting processes: checkpoint options that make sense together, and no fresh run into a directory
    that holds another run's checkpoints."""
    if every < 0:
        raise ValueError(f"--every must be >= 0 (0: save only after the last step), got {every}")
    if checkpoint is None and (every or resume):
        raise ValueError(f"{'--every' if every else '--resume'} needs a checkpoint directory: add --checkpoint DIR")
    if checkpoint is not None:
        _check_checkpoint_path(Path(checkpoint))
    if checkpoint is not None and not resume:
        from .checkpoint import latest_checkpoint
        found = latest_checkpoint(checkpoint)
        if found is not None:           # a later --resume would mix this run's checkpoints with that one's
            raise ValueError(f"checkpoint directory {checkpoint} already holds {found.name}; resume it (--resume) "
                             f"or choose an empty directory")


def _check_checkpoint_path(root: Path) -> None:
    """A checkpoint directory that rank 0 can create (or that exists) and write into, so that a run does not
    fail at its first save, after its steps: the nearest existing path on the way must be a writable directory."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"--checkpoint {str(root)!r} is a file, not a directory; choose a directory")
    existing = next(p for p in (root, *root.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"--checkpoint {str(root)!r} cannot be created: {str(existing)!r} is a file, not a "
                         f"directory; choose another directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == root else f"cannot be created: {str(existing)!r} is not writable"
        raise ValueError(f"--checkpoint {str(root)!r} {what}; choose a directory you can write to")


def load_plan_file(path: str | Path) -> ShardingPlan:
    """A plan file written by ``rhino plan --out``; a ValueError naming it when it does not exist, is a
    directory or does not hold a plan."""
    if Path(path).is_dir():
        raise ValueError(f"plan file {str(path)!r} is a directory; give the JSON file rhino plan --out wrote")
    if not Path(path).is_file():
        raise ValueError(f"plan file {str(path)!r} does not exist; make one with rhino plan ... --out {path}")
    try:
        return ShardingPlan.from_json(Path(path).read_text())
    except UnicodeDecodeError:
        raise PlanError(f"plan file {str(path)!r} is not a text (JSON) file; give the file rhino plan --out wrote") from None


def plan_world(plan: str | Path | None = None, strategy: str | None = None, cluster: str | None = None) -> int:
    """The device count of a plan file, else of a strategy string, else of a cluster; 1 with none of them."""
    if plan is not None:
        return load_plan_file(plan).world
    if strategy is not None:
        return parse_strategy(strategy).world
    if cluster is not None:
        from ..cost.cluster import parse_cluster
        return parse_cluster(cluster).world
    return 1


def _check_world(nproc: int, plan, strategy, cluster) -> None:
    """Before starting processes: the plan's device count must be the number of processes."""
    if strategy is not None:
        world, what = parse_strategy(strategy).world, f"strategy {strategy}"
    elif plan is not None:
        world, what = load_plan_file(plan).world, f"plan {plan}"
    else:
        from ..cost.cluster import parse_cluster
        world, what = parse_cluster(cluster).world, f"cluster {cluster}"
    if world != nproc:
        raise ValueError(f"the {what} has {world} devices but the job has {nproc} processes; "
                         f"pass --nproc {world} or another {'plan' if strategy is None else 'strategy'}")


def _check_memory_plan(memory_plan, plan, strategy) -> None:
    """Before starting processes: no memory plan with pipeline stages (``PIPELINE_MEMORY_PLAN``) or micro-batches
    (each rank refused it after starting)."""
    from .arena_step import MICROBATCH_MEMORY_PLAN
    if not memory_plan or (plan is None and strategy is None):
        return
    spec = load_plan_file(plan) if plan is not None else parse_strategy(strategy)
    pp, micro = (spec.stages if plan is not None else spec.pp), spec.microbatches
    if pp > 1:
        raise ValueError(PIPELINE_MEMORY_PLAN)
    if micro > 1:
        raise ValueError(MICROBATCH_MEMORY_PLAN.format(micro))


def train_rank(ctx, workload, plan, strategy, cluster, level, steps, dtype, overlap, timeout_s, log, progress,
                measure_live, release_memory=False, checkpoint=None, every=0, resume=False, memory_plan=None):
    """One rank of ``train``: build the trainer, resume (``resume``) from ``checkpoint``'s latest checkpoint,
    train up to ``steps`` steps in total, saving every ``every`` steps and after the last one."""
    import os
    os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))
    say = (lambda m: print(f"rhino train: {m}", file=sys.stderr, flush=True)) if progress and ctx.rank == 0 \
        else (lambda m: None)
    trainer = Trainer(workload, plan, strategy=strategy, cluster=cluster, level=level, dtype=dtype,
                      overlap=overlap, timeout_s=timeout_s, release_memory=release_memory, progress=say,
                      memory_plan=memory_plan)
    resumed = _resume(trainer, checkpoint, say) if resume else None
    first = trainer.steps_done
    losses, times, peak_live, samples, saved = [], [], 0, 0, []
    logf = open(log, "a") if log and ctx.rank == 0 else None
    try:
        for step in range(first, steps):
            batch = trainer.next_batch()
            samples = samples_in(batch)
            t0 = time.perf_counter()
            loss = trainer.step(batch, measure=measure_live and step == first)
            if measure_live and step == first:
                peak_live = trainer.peak_live_bytes
            dt = time.perf_counter() - t0
            losses.append(float(loss))
            times.append(dt)
            line = {"step": step + 1, "loss": float(loss), "seconds": dt, "samples_per_second": samples / dt}
            scheduled = _by_key(trainer.cap.scheduled, trainer.last_rates)   # lr (and momentum, beta1) per group
            line.update(scheduled)
            rates = "".join(f"  {k} {' '.join(f'{r:.4g}' for r in v)}" for k, v in scheduled.items())
            say(f"step {step + 1}/{steps}  loss {float(loss):.6g}{rates}  {dt * 1e3:.1f} ms  "
                f"{samples / dt:.1f} samples/s")
            if logf is not None:
                import json
                logf.write(json.dumps(line) + "\n")
                logf.flush()
            if checkpoint and ((every and (step + 1) % every == 0) or step + 1 == steps):
                saved.append(str(trainer.save(checkpoint)))
                say(f"saved checkpoint {saved[-1]}")
    finally:
        if logf is not None:
            logf.close()
    return {"losses": losses, "times": times, "peak_live": peak_live, "rss": peak_rss_bytes(),
            "samples": samples, "mesh": (f"pp{trainer.plan.stages}x" if trainer.pipelined else "") + str(trainer.plan.mesh), "strategy": trainer.plan.strategy_string,
            "state_bytes": trainer.state_bytes(), "resumed_from_step": resumed, "checkpoints": saved}


def _resume(trainer: Trainer, checkpoint: str, say) -> int | None:
    """Load ``checkpoint``'s latest checkpoint into ``trainer``; its step, or None (start at step 0) when none."""
    info = trainer.resume(checkpoint)
    if info is None:
        say(f"no checkpoint in {checkpoint}: starting from step 0")
        return None
    say(f"resumed from {info.path} (step {info.step}, saved on {info.world_size} process(es), mesh {info.mesh}"
        f"{', ' + info.strategy if info.strategy else ''})")
    return info.step


def _by_key(scheduled: dict[str, tuple[int, str]], values: dict[str, float]) -> dict[str, list[float]]:
    """A step's scheduled values by hyper-parameter (``lr``, ``momentum``, ``beta1``), in param-group order."""
    out: dict[str, list[float]] = {}
    for name, (_, key) in sorted(scheduled.items(), key=lambda kv: kv[1]):
        if name in values:
            out.setdefault(key, []).append(values[name])
    return {k: out[k] for k in sorted(out, key=SCHEDULABLE.index)}
