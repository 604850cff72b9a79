import itertools
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
sys.path.insert(0, str(Path(__file__).parent))


def pytest_configure(config):
    """Under pytest-xdist (``make test``: 2 workers on 2 cores) each worker gets its share of the cores for torch's
    intra-op threads: the default (every core in every worker) oversubscribes them, and OpenMP's spinning threads
    then made a sample of 8 sharding tests 3.7x slower on a loaded machine (20 s against 75 s)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // workers))


class Stopwatch:
    """Seconds a block of code worked, for the tests of time limits: the lesser of its wall time and its process CPU
    time (every thread). On an idle machine a single-threaded block's CPU time is its wall time, and a solver's worker
    threads make CPU time exceed it, so this is the wall time; on a machine shared with other jobs the process may
    get a third of a core, its wall time then triples while its CPU time does not. Code that ignores its limit
    exceeds it in both, so the check still fails for it (one fresh-clone run beside a helper's jobs took 6.28 s
    of wall time for a 3 s limit that it kept on an idle machine)."""

    def __enter__(self) -> "Stopwatch":
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu
        self.seconds = min(self.wall, self.cpu)

    def __str__(self) -> str:
        return f"{self.wall:.2f} s of wall time, {self.cpu:.2f} s of CPU"


@pytest.fixture
def root() -> Path:
    return ROOT


def eager_losses(spec: str, steps: int) -> list[float]:
    """PyTorch's plain single-device loop over the workload file's batches() (its example batch every step where it
    has none), float64, on the workload's own objects (no copy), its lr_scheduler stepped after each step: the
    oracle of the trainer, checkpoint, pipeline and schedule tests."""
    import torch
    from rhino.capture import default_dtype, load_workload
    with default_dtype(torch.float64):
        w = load_workload(spec)
        scheduler = w.lr_scheduler(w.optimizer) if w.lr_scheduler else None
        it, losses = w.batches() if w.batches is not None else itertools.repeat(w.batch), []
        for _ in range(steps):
            w.optimizer.zero_grad(set_to_none=True)
            loss = w.loss_fn(w.model, *next(it))
            loss.backward()
            w.optimizer.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(loss.item())
    return losses


def simulated_pipeline(cap, strategy: str, steps: int):
    """``strategy`` (with stages) run in one process (``runtime.pipeline_sim``) and compared, stage by stage, with
    PyTorch's accumulation loop in float64: ``runtime.pipeline.compare_stages``'s result."""
    import torch
    from rhino.capture import default_dtype
    from rhino.runtime.compare import TOLERANCES, reference_run
    from rhino.runtime.pipeline import compare_stages
    from rhino.runtime.pipeline_sim import simulate_pipeline
    from rhino.sharding.presets import parse_strategy, preset_plan
    plan = preset_plan(cap.graph, parse_strategy(strategy))
    with default_dtype(torch.float64):
        res = simulate_pipeline(cap, plan, steps)
        results = {r: {"losses": res["losses"][r], "local": res["local"][r]} for r in res["losses"]}
        return compare_stages(res["steps"][0].rp, res["steps"][0].spec, results,
                              reference_run(cap, steps, plan.microbatches), TOLERANCES[torch.float64])


def torchrun_train(tmp_path: Path, spec: str, strategy: str, steps: int) -> tuple[dict, dict, list[dict]]:
    """``rhino train`` as the 2 ranks of a ``torchrun --standalone`` job and with the local launcher:
    (torchrun's result, the local result, the torchrun job's log lines)."""
    import json
    import subprocess
    args = ["train", spec, "--strategy", strategy, "--steps", str(steps), "--dtype", "float64", "--json"]
    torchrun = Path(sys.executable).with_name("torchrun")
    job = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rhino.cli.main", "--", *args,
                          "--log", str(tmp_path / "log.jsonl")], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert job.returncode == 0, job.stderr[-2000:]
    local = subprocess.run([sys.executable, "-m", "rhino.cli.main", *args], capture_output=True, text=True,
                           cwd=ROOT, timeout=600)
    assert local.returncode == 0, local.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    return json.loads(job.stdout.strip().splitlines()[-1]), json.loads(local.stdout), lines
