"""The trainer: data sharding, batches(), the Python API, and ``rhino train`` against plain PyTorch loops."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import eager_losses, torchrun_train
from rhino.capture import capture, load_workload
from rhino.runtime.data import batch_stream, check_batch, rank_batch
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")
GPT = str(ROOT / "examples" / "gpt.py")


@pytest.fixture(scope="module")
def mlp_dp2():
    cap = capture(load_workload(MLP))
    return cap, resolve(cap.graph, preset_plan(cap.graph, parse_strategy("dp=2")))


def test_rank_batch_takes_each_ranks_rows_of_every_microbatch(mlp_dp2):
    cap, rp = mlp_dp2
    x, y = cap.workload.batch                                     # 32 rows
    rows = torch.arange(32)
    batch = (x + rows[:, None] * 0 + rows[:, None].to(x.dtype), y)  # row i of x is x[i] + i
    for m, want in ((1, [list(range(0, 16)), list(range(16, 32))]),
                    (2, [list(range(0, 8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))]),
                    (4, [[r for k in range(4) for r in range(8 * k, 8 * k + 4)],
                         [r for k in range(4) for r in range(8 * k + 4, 8 * k + 8)]])):
        for rank in (0, 1):
            lx, ly = rank_batch(batch, rp, rank, m)
            assert torch.equal(lx, batch[0][want[rank]]), (m, rank)
            assert torch.equal(ly, y[want[rank]]), (m, rank)


def test_rank_batch_rejects_an_indivisible_microbatch_count(mlp_dp2):
    cap, rp = mlp_dp2
    with pytest.raises(ValueError, match="does not split into 3 micro-batches"):
        rank_batch(tuple(cap.workload.batch), rp, 0, 3)


def test_check_batch_names_the_wrong_tensor(mlp_dp2):
    cap, _ = mlp_dp2
    x, y = cap.workload.batch
    assert check_batch(cap.graph, (x, y))[0] is not None
    with pytest.raises(ValueError, match="tensor 0 has shape"):
        check_batch(cap.graph, (x[:3], y))
    with pytest.raises(ValueError, match="has 1 tensors"):
        check_batch(cap.graph, (x,))
    with pytest.raises(ValueError, match="tensor 1 has dtype"):
        check_batch(cap.graph, (x, y.float()))


def test_batches_come_from_the_workload_file_or_repeat_the_example():
    w = load_workload(GPT)
    assert w.batches is not None
    a, b = next(batch_stream(w.batch, w.batches)), next(batch_stream(w.batch, w.batches))
    assert torch.equal(a[0], b[0])                                 # deterministic: every rank sees the same data
    it = batch_stream(w.batch, w.batches)
    first, second = next(it), next(it)
    assert not torch.equal(first[0], second[0])
    m = load_workload(MLP)
    assert m.batches is None
    it = batch_stream(m.batch, None)
    assert next(it)[0] is m.batch[0] and next(it)[0] is m.batch[0]


def test_a_workload_function_the_processes_cannot_receive_is_one_sentence():
    """``rhino.train(lambda: ..., nproc=2)``: the processes cannot unpickle a lambda; refused before any starts
    (it was a PicklingError traceback from inside multiprocessing)."""
    from rhino.runtime.trainer import train
    with pytest.raises(ValueError, match="cannot receive the arguments.*'FILE\\[:FUNC\\]' spec"):
        train(lambda: None, 2, strategy="dp=2", steps=1)


def test_the_pure_packages_load_without_torch():
    code = ("import sys, rhino, rhino.ir, rhino.sharding, rhino.cost, rhino.search, rhino.search.planning, "
            "rhino.memory; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_api_capture_estimate_plan_memory():
    import rhino
    cap = rhino.capture_step(MLP)
    assert len(cap.graph.nodes) > 10
    est = rhino.estimate(cap, "cpu:2", strategy="dp=2")
    assert est.step_seconds > 0
    plan, report = rhino.plan(cap, "cpu:2", level="O1", time_limit=5)
    assert plan.mesh.world == 2 and report.text()
    mem = rhino.memory_plan(cap, level="O1", time_limit=5)
    assert mem.valid and mem.height > 0


@pytest.mark.multiprocess
def test_rhino_train_with_batches_equals_a_plain_pytorch_loop():
    """20 steps of ``rhino train --strategy dp=2`` over ``batches()``, float64: every step's loss equals the
    plain single-device loop's over the same batches."""
    out = subprocess.run([sys.executable, "-m", "rhino.cli.main", "train", GPT, "--strategy", "dp=2",
                          "--steps", "20", "--dtype", "float64", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["ok"] is True
    want = eager_losses(GPT, 20)
    assert len(r["losses"]) == 20
    for step, (got, ref) in enumerate(zip(r["losses"], want)):
        assert abs(got - ref) <= 1e-9 * max(1.0, abs(ref)), (step, got, ref)
    assert len(set(r["losses"])) > 10                              # the data changes from step to step
    for key in ("step_seconds", "samples_per_second", "peak_live_bytes", "peak_rss_bytes"):
        assert r[key] > 0, key
    assert "step 20/20" in out.stderr


def test_rhino_train_errors_are_one_sentence(capsys):
    """Refused before any process starts (``_check_world``): rhino's main in this process, not a fresh
    interpreter importing torch."""
    from rhino.cli.main import main
    code = main(["train", MLP, "--strategy", "dp=2", "--nproc", "4", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "has 2 devices but the job has 4 processes" in err, err[-1000:]


@pytest.mark.multiprocess
def test_rhino_train_under_torchrun_matches_the_local_launcher(tmp_path):
    """The same command as one rank per process of a torchrun job: same losses as ``rhino train --nproc``."""
    a, b, lines = torchrun_train(tmp_path, MLP, "dp=2", 3)
    assert a["nproc"] == 2 and a["losses"] == b["losses"]
    assert [x["step"] for x in lines] == [1, 2, 3] and [x["loss"] for x in lines] == a["losses"]


@pytest.mark.multiprocess
def test_rhino_train_with_microbatches_and_recompute_equals_the_whole_batch_loop():
    """dp=2 with 2 micro-batches and full recomputation: GPT has no BatchNorm and no ignored targets, so the
    accumulated step equals whole-batch training (float64, every step)."""
    out = subprocess.run([sys.executable, "-m", "rhino.cli.main", "train", GPT, "--strategy",
                          "dp=2,microbatches=2,recompute=full", "--steps", "4", "--dtype", "float64", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    for step, (got, ref) in enumerate(zip(r["losses"], eager_losses(GPT, 4))):
        assert abs(got - ref) <= 1e-9 * max(1.0, abs(ref)), (step, got, ref)


def _loader_batches(ctx, spec):
    """One rank: the start method its own children get, and the workload's batches() (a DataLoader with a
    worker process over a Dataset class of the workload file)."""
    import multiprocessing
    w = load_workload(spec)
    return multiprocessing.get_start_method(), [tuple(t.clone() for t in b) for b in w.batches()]


@pytest.mark.multiprocess
def test_a_dataloader_with_workers_in_batches_runs_inside_a_rank():
    """Ranks came from the launcher's fork server with "forkserver" as their default start method, so a
    DataLoader's workers started from a fresh server that cannot import the workload file's module
    (``rhino_workload_<hash>``): 'DataLoader worker exited unexpectedly' in every rank. Ranks now give their
    children the platform's start method, as torchrun's ranks and a plain loop do."""
    from multiprocessing import get_context
    from rhino.runtime.launch import launch
    spec = str(ROOT / "tests" / "workloads" / "loader_workers.py")
    method, got = launch(_loader_batches, 1, spec, timeout_s=120)[0]
    assert method == get_context().get_start_method()
    want = list(load_workload(spec).batches())
    assert len(got) == len(want) == 4
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))


def _scheduled_rank(ctx):
    """One rank: a Trainer over an in-memory workload whose optimizer a learning-rate scheduler drives."""
    import importlib.util
    import warnings
    from rhino.runtime.trainer import Trainer
    spec = importlib.util.spec_from_file_location("mlp_sched", MLP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    workload = mod.workload()
    scheduler = torch.optim.lr_scheduler.StepLR(workload[1], step_size=1, gamma=0.5)
    trainer = Trainer(workload, strategy="dp=1")
    first = trainer.step()
    with warnings.catch_warnings():          # (torch: the scheduler stepped before optimizer.step())
        warnings.simplefilter("ignore")
        scheduler.step()
    try:
        trainer.step()
    except ValueError as exc:
        return first, str(exc), trainer.steps_done
    return first, None, trainer.steps_done


@pytest.mark.multiprocess
def test_a_changed_learning_rate_is_refused_not_ignored():
    """The update is captured with the optimizer's hyper-parameters; a scheduler changing one afterwards
    would otherwise train on silently with the old value."""
    from rhino.runtime.launch import launch
    [(first, message, done)] = launch(_scheduled_rank, 1, timeout_s=240)
    assert first > 0 and done == 1
    assert message is not None and "param_groups[0]['lr'] changed from 0.05 to 0.025" in message, message
    assert "learning-rate scheduler" in message and "\n" not in message
