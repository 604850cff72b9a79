"""``rhino launch job.yaml [--nproc N] [--resume] [--json]``: run a fault-tolerant training job described by
a YAML file under torchrun's elastic agent (``runtime/elastic.py``).

The job file's keys are described in ``runtime/job_file.py`` (``load_job``).
"""
from __future__ import annotations

from .common import emit_json, status

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="run a fault-tolerant training job from a YAML job file (elastic agent)")
    p.add_argument("job", metavar="JOB.yaml")
    p.add_argument("--nproc", type=int, help="override the job file's nproc (e.g. fewer devices after a failure)")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint on the first attempt")
    p.add_argument("--json", action="store_true", help="print one JSON object: losses, restarts, attempts, ...")
    p.set_defaults(run=run)


def run(args) -> int:
    from ..runtime.job_file import load_job
    job = load_job(args.job, nproc=args.nproc, resume=args.resume)
    status(f"launching {job.workload} on {job.nproc} process(es) per node for {job.steps} steps "
           f"(checkpoints in {job.checkpoint}, up to {job.max_restarts} restart(s)) ...")
    return run_job(job, args.json)


def run_job(job, as_json: bool) -> int:
    """Run an ``ElasticJob`` and print its result (shared with ``rhino train --max-restarts``)."""
    from ..runtime.elastic import ElasticJobError, run_elastic
    try:
        result = run_elastic(job)
    except ElasticJobError as exc:
        return failed(exc, as_json)
    report(result, as_json)
    return 0


def failed(exc, as_json: bool) -> int:
    """The job failed for good (more failures than restarts): one line, exit code 1."""
    if as_json:
        emit_json({"ok": False, "error": str(exc)})
    else:
        status(f"rhino: error: {exc}")
    return 1


def report(result, as_json: bool) -> None:
    """Print an ``ElasticResult``."""
    if as_json:
        emit_json({"ok": True, **result.to_dict()})
        return
    t = result.train
    if t.losses:
        print(f"trained {t.steps} steps on mesh {t.mesh}: loss {t.losses[0]:.6g} -> {t.losses[-1]:.6g}, "
              f"{len(result.restarts)} restart(s)")
    else:
        print("nothing to train: the latest checkpoint is already at the last step")
    for r in result.restarts:
        print(f"  restart {r.attempt}: {r.reason}; resumed from step {r.resumed_from_step} on {r.world_size} "
              f"processes under {r.strategy}" + (f" (replanned: {r.replan})" if r.replan else ""))
