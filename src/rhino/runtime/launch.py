"""Process launch: run one function on every rank, locally or inside a ``torchrun`` job.

- ``launch(fn, nproc, *args)`` starts ``nproc`` local processes, joins them in one process
  group (gloo on CPU by default) through a TCP store that the parent owns (port chosen by the OS, so
  no port race), runs ``fn(ctx, *args)`` on each and returns the results in rank order. Processes
  start from a fork server that has imported torch once (``START_METHOD``, ``PRELOAD``): every rank is
  a fresh interpreter as with spawn (nothing of the caller's state but its environment, which each
  rank takes over at start), without importing torch again per rank and per launch.
- ``init_from_env()`` / ``run_from_env(fn, *args)`` join a job started by ``torchrun`` (``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment): NCCL when CUDA is
  available, else gloo; this process is one rank.

Failure handling of ``launch`` (never a hang):
- every process group is created with ``timeout=timeout_s``, so a rank blocked in a collective whose
  peers are gone raises instead of waiting forever;
- each rank reports ``ok`` with its pickled result, or the error it raised, on its own pipe *before*
  tearing down its process group, so the root cause reaches the parent before the peers' follow-on
  errors ("connection closed") can;
- the parent waits on the pipes and on the process sentinels together: a rank that raised or died
  (``os._exit``, a signal) is seen at once; the parent then terminates the others and raises one
  ``RankFailedError`` naming the rank that failed first (a rank that died without reporting is
  preferred as the cause, else the earliest error by timestamp).
"""
from __future__ import annotations

import os
import pickle
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before any process group exists: see below)
import torch.multiprocessing as mp

from ..lower.spmd_ops import clear_context

# ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default argument when it is first imported
# (torch 2.13); fake-tensor capture imports it lazily. Imported after ``init_process_group``, it keeps the
# default group alive after ``destroy_process_group``, and at interpreter exit a gloo thread of that group
# freeing a finished collective's tensors aborts the process ("terminate called without an active
# exception"). Imported here, before any group exists, the defaults are None.

__all__ = ["Backend", "RankContext", "RankFailedError", "launch", "init_from_env", "run_from_env",
           "in_torchrun", "shutdown", "current_context"]

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# How ``launch`` starts ranks: "forkserver" (where the platform has it) forks each rank from a server
# process that imported ``PRELOAD`` once; measured on this 2-core machine at load 9, 4 ranks running one
# all-reduce: spawn 17.9-19.8 s per launch, forkserver 6.7 s the first launch and 0.24-0.29 s after it.
# "spawn" imports torch in every rank.
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
PRELOAD = ["torch", "torch.distributed", "rhino.runtime.launch"]
# After the first reported error, how long the parent keeps listening for a rank that died without
# reporting (the likelier root cause) before it terminates the rest. Chosen: well above the time
# gloo takes to notice a closed peer socket on localhost (milliseconds).
FAILURE_GRACE_S = 1.0
# How long the parent waits for ranks that returned their result to exit before terminating them.
EXIT_GRACE_S = 10.0


class Backend(str, Enum):
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class RankContext:
    """What ``fn`` receives: its rank, the world size, its device and the process-group backend."""

    rank: int
    world_size: int
    device: torch.device
    backend: Backend
    local_rank: int = 0


class RankFailedError(RuntimeError):
    """One rank of a launch failed; ``rank`` names it, ``remote_traceback`` holds its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


# ----------------------------------------------------------------------------- torchrun

def in_torchrun() -> bool:
    """True when the environment describes a ``torchrun`` job this process belongs to."""
    return all(k in os.environ for k in TORCHRUN_ENV)


def init_from_env(timeout_s: float = 60.0) -> RankContext:
    """Join the ``torchrun`` job described by the environment (NCCL with CUDA, else gloo)."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(f"init_from_env needs {', '.join(TORCHRUN_ENV)} in the environment (torchrun "
                         f"sets them); missing: {', '.join(missing)}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():                   # already joined: describe that group
        backend = Backend(dist.get_backend())
        return RankContext(rank, world, _device_for(backend, local_rank), backend, local_rank)
    backend = Backend.NCCL if torch.cuda.is_available() else Backend.GLOO
    device = _device_for(backend, local_rank)
    dist.init_process_group(backend.value, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return RankContext(rank, world, device, backend, local_rank)


def current_context() -> RankContext:
    """The context of the process group this process already belongs to (``LOCAL_RANK`` picks the CUDA
    device under NCCL; with gloo the device is the CPU)."""
    if not dist.is_initialized():
        raise ValueError("no process group: call torch.distributed.init_process_group (or run under torchrun) first")
    backend = Backend(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return RankContext(dist.get_rank(), dist.get_world_size(), _device_for(backend, local_rank), backend, local_rank)


def run_from_env(fn: Callable[..., Any], *args: Any, timeout_s: float = 60.0) -> Any:
    """``fn(ctx, *args)`` as this rank of a ``torchrun`` job; the process group is destroyed after."""
    ctx = init_from_env(timeout_s)
    try:
        out = fn(ctx, *args)
        if ctx.world_size > 1:   # every rank done communicating before any tears its groups down
            dist.barrier()
        return out
    finally:
        shutdown()


def shutdown() -> None:
    """Destroy the default process group (and all groups made from it) if there is one, after dropping the
    per-rank programs' reference to them (``lower.spmd_ops.clear_context``)."""
    clear_context()
    if dist.is_initialized():
        dist.destroy_process_group()


def _device_for(backend: Backend, local_rank: int) -> torch.device:
    if backend is Backend.NCCL:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} has no CUDA device: only "
                             f"{torch.cuda.device_count()} visible; start fewer processes per node")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


# ----------------------------------------------------------------------------- local launch

def launch(fn: Callable[..., Any], nproc: int, *args: Any, timeout_s: float = 60.0,
           backend: Backend | str = Backend.GLOO) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``nproc`` local ranks; return their results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function), and so must each result (return
    CPU tensors). ``timeout_s`` is the process-group timeout: a collective that waits longer raises.
    Raises ``RankFailedError`` naming the rank when one raises or dies; the others are terminated.
    """
    backend = Backend(backend)
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    if backend is Backend.NCCL and nproc > torch.cuda.device_count():
        raise ValueError(f"launch with nccl needs one CUDA device per process: nproc={nproc}, "
                         f"{torch.cuda.device_count()} visible")
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"launch needs a picklable fn (a module-level function, not a lambda or a "
                         f"local function): {exc}") from exc
    try:   # the arguments go as one plain pickle (tensors by value): the start method's own pickler shares
        # each tensor's storage as a file descriptor, and a fork server takes at most ~250 of them per process
        # (a 274-tensor model's state failed with "too many fds")
        blob = pickle.dumps(args)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"the processes cannot receive the arguments ({exc}); give the workload as a "
                         f"'FILE[:FUNC]' spec or a module-level function of an importable module") from None

    store = dist.TCPStore("127.0.0.1", 0, nproc, True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    spawn = _start_context()
    env = dict(os.environ)
    procs, conns = [], []
    try:
        for rank in range(nproc):
            parent_end, child_end = spawn.Pipe(duplex=False)
            p = spawn.Process(target=_worker, name=f"rhino-rank{rank}",
                              args=(rank, nproc, store.port, backend, timeout_s, fn, blob, child_end, env))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        results = _Watcher(procs, conns).results()
        _stop(procs, EXIT_GRACE_S)          # finished ranks exit by themselves
        return results
    finally:
        _stop(procs, 0.0)                   # after a failure: terminate the rest at once
        for c in conns:
            c.close()
        del store


def _start_context():
    """The multiprocessing context ranks start from (``START_METHOD``; the fork server preloads ``PRELOAD``)."""
    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


@dataclass
class _Report:
    ok: bool
    payload: Any            # the result (ok) or the one-line error message
    when: float             # time.time() in the rank when the error was caught
    traceback: str = ""


class _Watcher:
    """Collects per-rank reports and exits; decides the root cause when something fails."""

    def __init__(self, procs: list, conns: list[Connection]) -> None:
        self.procs, self.conns = procs, conns
        self.reports: dict[int, _Report] = {}
        self.dead: dict[int, int | None] = {}       # rank -> exit code, for ranks that never reported
        self.open: dict[Any, int] = {c: r for r, c in enumerate(conns)}
        self.live: dict[Any, int] = {p.sentinel: r for r, p in enumerate(procs)}

    def results(self) -> list[Any]:
        first_failure: float | None = None
        while len(self.reports) < len(self.procs):
            if first_failure is None and self._failed():
                first_failure = time.monotonic()
            if first_failure is not None:
                left = FAILURE_GRACE_S - (time.monotonic() - first_failure)
                if self.dead or left <= 0 or not (self.open or self.live):
                    break
                self._poll(left)
            else:
                assert self.open or self.live, "a rank neither reported nor exited"
                self._poll(None)
        if self._failed():
            raise self._error()
        return [self.reports[r].payload for r in range(len(self.procs))]

    def _failed(self) -> bool:
        return bool(self.dead) or any(not rep.ok for rep in self.reports.values())

    def _poll(self, timeout: float | None) -> None:
        ready = wait(list(self.open) + list(self.live), timeout)
        for obj in ready:
            if obj in self.open:
                self._read(obj)
        for obj in ready:
            if obj in self.live:
                rank = self.live.pop(obj)
                conn = self.conns[rank]
                if conn in self.open:           # drain what it sent before it exited
                    self._read(conn)
                if rank not in self.reports:
                    self.procs[rank].join(1.0)
                    self.dead[rank] = self.procs[rank].exitcode

    def _read(self, conn: Connection) -> None:
        rank = self.open[conn]
        try:
            data = conn.recv_bytes()
        except EOFError:                        # the rank closed its pipe (exited): no report
            del self.open[conn]
            return
        del self.open[conn]
        ok, payload, when, tb = pickle.loads(data)
        self.reports[rank] = _Report(ok, pickle.loads(payload) if ok else payload, when, tb)

    def _error(self) -> RankFailedError:
        errors = sorted((rep.when, r) for r, rep in self.reports.items() if not rep.ok)
        if self.dead:
            rank, code = next(iter(self.dead.items()))
            msg = f"rank {rank} exited with code {code} before returning a result"
            tb = ""
        else:
            rank = errors[0][1]
            msg = f"rank {rank} failed: {self.reports[rank].payload}"
            tb = self.reports[rank].traceback
        others = sorted((set(self.dead) | {r for _, r in errors}) - {rank})
        if len(errors) == len(self.procs) > 1 and len({rep.payload for rep in self.reports.values()}) == 1:
            # the same error everywhere (a workload the capture refuses): one sentence, no rank to blame
            msg = f"every rank failed with {self.reports[rank].payload}"
        elif others:
            msg += f" (then rank(s) {', '.join(map(str, others))} failed too)"
        err = RankFailedError(rank, msg, tb)
        if tb and hasattr(err, "add_note"):
            err.add_note(f"traceback of rank {rank}:\n{tb}")
        return err


def _stop(procs: list, wait_s: float) -> None:
    """Give running ranks ``wait_s`` seconds to exit, then terminate (and if need be kill) them."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()


def _worker(rank: int, world: int, port: int, backend: Backend, timeout_s: float,
            fn: Callable[..., Any], blob: bytes, conn: Connection, env: dict[str, str]) -> None:
    """One rank: join the group, run ``fn`` on the arguments pickled in ``blob``, report the result or the
    error, then tear down."""
    failed = False
    if os.environ != env:       # the fork server's environment is the one it started with: take the caller's
        os.environ.clear()
        os.environ.update(env)
    # A rank started from the fork server inherits "forkserver" as its default start method; a process the user
    # starts (torchrun's ranks, a plain loop) has the platform's. The rank's own children (a DataLoader's workers
    # in batches()) must start as they would there: from the fork server they unpickle the workload's classes
    # by module name, and the workload file's module (capture/workload.py) exists only in this process.
    mp.set_start_method(None, force=True)
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        device = _device_for(backend, rank)
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend.value, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        result = fn(RankContext(rank, world, device, backend, rank), *pickle.loads(blob))
        message = (True, pickle.dumps(result), time.time(), "")
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which re-raises it
        failed = True
        first = str(exc).splitlines()[0] if str(exc) else ""
        text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        message = (False, text, time.time(), traceback.format_exc())
    conn.send_bytes(pickle.dumps(message))     # before teardown: the root cause arrives first
    conn.close()
    shutdown()
    if failed:
        os._exit(1)
