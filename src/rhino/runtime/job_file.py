"""A fault-tolerant training job described by a YAML file -> ``elastic.ElasticJob`` (``rhino launch``).

A job file (relative paths are relative to the job file's directory)::

    workload: ../examples/gpt.py      # FILE[:FUNC]                              (required)
    strategy: dp=2                    # exactly one of strategy, plan (FILE), cluster (e.g. cpu:2)
    level: O1                         # search level with cluster
    nproc: 2                          # processes per node (default: the plan's device count)
    steps: 8                          #                                          (required)
    dtype: float64                    # float32 | float64
    checkpoint: ckpt                  # checkpoint directory                     (required)
    every: 2                          # save every N steps (and after the last)
    resume: false                     # resume from the latest checkpoint on the first attempt too
    restart:
      max_restarts: 1                 # restarts the agent may make after failures
      nnodes: "1"                     # N or MIN:MAX nodes (an elastic range; nproc processes each)
      rdzv_endpoint: localhost:0      # c10d rendezvous (port 0: a free port, one node)
      rdzv_conf: {is_host: true}      # torchrun's --rdzv-conf: is_host, last_call_timeout, join_timeout, ...
    log: train.jsonl                  # one JSON line per step
    overlap: true
    timeout: 300                      # seconds before a stuck collective fails
"""
from __future__ import annotations

from pathlib import Path

from ..capture import DTYPES
from .elastic import ElasticJob
from .trainer import plan_world

__all__ = ["load_job"]

_TOP = {"workload", "strategy", "plan", "cluster", "level", "nproc", "steps", "dtype", "checkpoint", "every",
        "resume", "restart", "log", "overlap", "timeout"}
_RESTART = {"max_restarts", "nnodes", "rdzv_endpoint", "rdzv_conf"}


def _kind(data: dict, key: str, types: tuple, what: str, where: str) -> None:
    value = data.get(key)
    if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
        raise ValueError(f"{where}: {key} must be {what}, got {value!r}")


def load_job(path: str, nproc: int | None = None, resume: bool = False) -> ElasticJob:
    """Read and validate a job file -> ``ElasticJob``; one clear ValueError sentence per mistake. ``nproc``
    overrides the file's nproc, ``resume`` its resume."""
    import yaml
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"job file {path!r} is a directory; give the path of a YAML job file")
    if not p.is_file():
        raise ValueError(f"job file {path!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"job file {path!r} is not valid YAML{line}; check its indentation and colons") from None
    where = f"job file {path}"
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of keys such as workload, strategy, steps, checkpoint")
    unknown = sorted(set(map(str, data)) - _TOP)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(_TOP))}")
    for key in ("workload", "steps", "checkpoint"):
        if data.get(key) is None:
            raise ValueError(f"{where} must name {key}")
    given = [k for k in ("strategy", "plan", "cluster") if data.get(k) is not None]
    if len(given) != 1:
        raise ValueError(f"{where} must give exactly one of strategy, plan or cluster, "
                         f"got {' and '.join(given) if given else 'none'}")
    restart = data.get("restart") or {}
    if not isinstance(restart, dict):
        raise ValueError(f"{where}: restart must be a mapping with max_restarts, nnodes, rdzv_endpoint")
    unknown = sorted(set(map(str, restart)) - _RESTART)
    if unknown:
        raise ValueError(f"{where}: unknown key restart.{unknown[0]}; known: {', '.join(sorted(_RESTART))}")
    for key in ("workload", "strategy", "plan", "cluster", "checkpoint", "log"):
        _kind(data, key, (str,), "a string", where)
    for key in ("steps", "nproc", "every"):
        _kind(data, key, (int,), "an integer", where)
    _kind(data, "timeout", (int, float), "a number of seconds", where)
    if data.get("timeout") is not None and not data["timeout"] > 0:
        raise ValueError(f"{where}: timeout must be a positive number of seconds, got {data['timeout']!r}")
    _kind(data, "resume", (bool,), "true or false", where)
    _kind(data, "overlap", (bool,), "true or false", where)
    _kind(restart, "max_restarts", (int,), "an integer", where)
    _kind(restart, "nnodes", (str, int), "N or MIN:MAX", where)
    _kind(restart, "rdzv_endpoint", (str,), "HOST:PORT", where)
    conf = restart.get("rdzv_conf") or {}
    if not isinstance(conf, dict) or not all(isinstance(v, (str, int, float, bool)) for v in conf.values()):
        raise ValueError(f"{where}: restart.rdzv_conf must be a mapping of rendezvous options to plain values")
    if data.get("level", "O1") not in ("O1", "O2"):
        raise ValueError(f"{where}: level must be O1 or O2, got {data['level']!r}")
    if data.get("dtype") is not None and data["dtype"] not in DTYPES:
        raise ValueError(f"{where}: dtype must be one of {', '.join(sorted(DTYPES))}, got {data['dtype']!r}")
    if data.get("level") is not None and "cluster" not in given:
        raise ValueError(f"{where}: level applies only with cluster")
    base = p.resolve().parent
    workload = _relative_spec(data["workload"], base)
    plan = str(base / data["plan"]) if data.get("plan") else None
    if plan is not None and not Path(plan).is_file():
        raise ValueError(f"{where}: plan file {plan!r} does not exist; make one with rhino plan ... --out FILE")
    job = ElasticJob(workload=workload, checkpoint=str(base / data["checkpoint"]), steps=data["steps"],
                     nproc=nproc if nproc is not None else data["nproc"] if data.get("nproc") is not None
                     else plan_world(plan, data.get("strategy"), data.get("cluster")),
                     plan=plan, strategy=data.get("strategy"), cluster=data.get("cluster"),
                     level=data.get("level") or "O1", every=data.get("every") or 0,
                     resume=bool(resume or data.get("resume")), max_restarts=restart.get("max_restarts") or 0,
                     nnodes=str(restart.get("nnodes") or "1"),
                     rdzv_endpoint=restart.get("rdzv_endpoint") or "localhost:0",
                     rdzv_conf={str(k): v for k, v in conf.items()}, dtype=DTYPES.get(data.get("dtype")),
                     overlap=data.get("overlap", True),
                     timeout_s=float(data.get("timeout") or 300.0),
                     log=str(base / data["log"]) if data.get("log") else None)
    job.check()
    return job


def _relative_spec(spec: str, base: Path) -> str:
    from ..capture.workload import parse_spec
    file, func = parse_spec(spec)
    full = file if file.is_absolute() else base / file
    if not full.is_file():
        raise ValueError(f"workload file {str(full)!r} (from the job file) does not exist")
    return f"{full}:{func}"
