"""The fault-tolerant controller (runtime/elastic.py, rhino train --max-restarts, rhino launch): jobs run under
torchrun's elastic agent; a rank killed with SIGKILL is restarted from the last checkpoint and the job's
losses equal an uninterrupted run's (float64); a job relaunched on fewer processes replans and reshards.

Launched jobs (torchrun start-up is slow on a busy machine): one uninterrupted reference run, two kill -9
jobs (``rhino train`` and ``rhino launch``), one relaunch on fewer processes and one two-node job that
loses a node."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rhino.cli.main import main
from rhino.runtime.elastic import (ElasticJob, _failure_reason, node_range, parse_fault, plan_for_world,
                                   resize_cluster)

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
RTOL = 1e-12


def _rhino(args, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "rhino.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted 10-step run: plain single-device PyTorch over the same batches(), float64 (in this
    process; it equals an uninterrupted ``rhino train --strategy dp=2`` to 1.6e-16 relative, measured)."""
    from conftest import eager_losses
    return eager_losses(GPT, 10)


def _assert_losses_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), (i, a, b)


# ---------------------------------------------------------------------------------------------- no processes

def test_parse_fault_and_node_range():
    assert parse_fault("") is None
    assert parse_fault("rank:1,step:5") == {"rank": 1, "step": 5, "attempt": 0, "node": 0}
    assert parse_fault("rank:0, step:3, attempt:1") == {"rank": 0, "step": 3, "attempt": 1, "node": 0}
    assert parse_fault("step:5,node:1") == {"step": 5, "attempt": 0, "node": 1}
    for bad in ("rank:1", "step:5", "rank=1,step=5", "rank:x,step:5", "host:1,step:5"):
        with pytest.raises(ValueError, match="RHINO_FAULT"):
            parse_fault(bad)
    assert node_range("2") == (2, 2) and node_range("1:4") == (1, 4)
    for bad in ("0", "3:2", "a:b", "1:"):
        with pytest.raises(ValueError, match="nnodes"):
            node_range(bad)


def _job(**kw):
    return ElasticJob(workload=GPT, checkpoint="ck", steps=4, nproc=2, **kw)


def test_plan_for_world_scales_dp_and_resizes_clusters_only_where_unambiguous(tmp_path):
    assert plan_for_world(_job(strategy="dp=2"), 2) == ({"strategy": "dp=2"}, None)
    kw, why = plan_for_world(_job(strategy="dp=4,tp=2,zero=1"), 4)
    assert kw == {"strategy": "dp=2,tp=2,zero=1"} and "dp scaled 4 -> 2" in why
    kw, why = plan_for_world(_job(strategy="dp=2,zero=3"), 1)
    assert kw == {"strategy": "dp=1"} and "needs 2 processes" in why      # zero shards over dp: none left
    with pytest.raises(ValueError, match="cannot be scaled to 3"):
        plan_for_world(_job(strategy="dp=2,tp=2"), 3)
    kw, why = plan_for_world(_job(cluster="cpu:4", level="O2"), 2)
    assert kw == {"cluster": "cpu:2", "level": "O2"} and "searching a plan for cpu:2" in why
    assert resize_cluster("2x8xH100-80G", 8) == "1x8xH100-80G"
    assert resize_cluster("2x8xH100-80G", 4) == "4xH100-80G"
    with pytest.raises(ValueError, match="cannot be resized"):
        resize_cluster("2x8xH100-80G", 12)
    from rhino.capture import capture, load_workload
    from rhino.sharding.presets import parse_strategy, preset_plan
    cap = capture(load_workload(str(ROOT / "examples" / "mlp.py")))
    plan = tmp_path / "p.json"
    plan.write_text(preset_plan(cap.graph, parse_strategy("dp=2")).to_json())
    assert plan_for_world(_job(plan=str(plan)), 2) == ({"plan": str(plan)}, None)
    with pytest.raises(ValueError, match="is for 2 devices but this attempt has 1 processes; give a strategy"):
        plan_for_world(_job(plan=str(plan)), 1)


def test_failure_reason_prefers_the_rank_killed_by_a_signal():
    def failure(pid, code, ts, message=""):
        return SimpleNamespace(pid=pid, exitcode=code, timestamp=ts, message=message,
                               signal_name=lambda: "SIGKILL" if code == -9 else "")
    reason = _failure_reason({0: failure(10, 1, 5, "RuntimeError: connection closed"), 1: failure(11, -9, 6)})
    assert reason == "rank 1 (pid 11) died with signal SIGKILL (exit code -9) (then rank(s) 0 failed too)"
    assert _failure_reason({0: failure(10, 1, 5, "RuntimeError: boom")}) == \
        "rank 0 (pid 10) exited with code 1: RuntimeError: boom"


BAD_JOBS = [
    ("workload: x.py\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\nfoo: 1\n", "unknown key 'foo'"),
    ("strategy: dp=2\nsteps: 2\ncheckpoint: c\n", "must name workload"),
    ("workload: {gpt}\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\nplan: p.json\n", "exactly one of strategy, plan"),
    ("workload: {gpt}\nsteps: 2\ncheckpoint: c\n", "exactly one of strategy, plan or cluster, got none"),
    ("workload: {gpt}\nsteps: two\ncheckpoint: c\nstrategy: dp=2\n", "steps must be an integer"),
    ("workload: {gpt}\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\nrestart: {{max_retries: 1}}\n",
     "unknown key restart.max_retries"),
    ("workload: {gpt}\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\nrestart: {{nnodes: '3:1'}}\n", "nnodes"),
    ("workload: {gpt}\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\ndtype: float16\n", "dtype must be one of"),
    ("workload: missing.py\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\n", "does not exist"),
    ("workload: {gpt}\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\nlevel: O2\n", "level applies only with cluster"),
    ("workload: {gpt}\nsteps: 2\ncheckpoint: c\nstrategy: dp=2\ntimeout: -5\n", "timeout must be a positive number"),
    ("a: [\n", "not valid YAML"),
    ("- 1\n- 2\n", "must be a mapping"),
]


@pytest.mark.parametrize("text,message", BAD_JOBS)
def test_bad_job_files_give_one_sentence_and_exit_2(tmp_path, capsys, text, message):
    job = tmp_path / "job.yaml"
    job.write_text(text.format(gpt=GPT))
    assert main(["launch", str(job)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# ---------------------------------------------------------------------------------------------- launched jobs

def _check_kill9(out, reference):
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert len(r["restarts"]) == 1, r["restarts"]
    restart = r["restarts"][0]
    assert restart["attempt"] == 1 and restart["resumed_from_step"] == 4 and restart["world_size"] == 2
    assert "rank 1" in restart["reason"] and "SIGKILL" in restart["reason"], restart
    assert "attempt 0 failed: rank 1" in out.stderr and "resumed from step 4" in out.stderr
    _assert_losses_equal(r["losses"], reference[:8])      # steps 1-4 from attempt 0, 5-8 after the restart


@pytest.mark.multiprocess
def test_kill9_during_step5_rhino_train_restarts_and_finishes_exactly(tmp_path, reference):
    """rhino train --checkpoint --every 2 --max-restarts 1, rank 1 SIGKILLed during step 5 of 8."""
    out = _rhino(["train", GPT, "--strategy", "dp=2", "--steps", "8", "--dtype", "float64", "--checkpoint",
                  str(tmp_path / "ck"), "--every", "2", "--max-restarts", "1", "--json"],
                 {"RHINO_FAULT": "rank:1,step:5"})
    _check_kill9(out, reference)


@pytest.mark.multiprocess
def test_kill9_from_a_yaml_job_file_then_a_relaunch_on_fewer_processes(tmp_path, reference):
    """The same scenario as a job file run by rhino launch; then the job, extended to 10 steps and naming the
    cluster cpu:2 instead of the strategy, is relaunched with --nproc 1 --resume: it replans (searches a plan
    for cpu:1; the log says why), resumes step 8 saved by 2 processes under dp=2, resharded, and steps 9-10
    equal the uninterrupted run's. (One node's agent keeps nproc_per_node fixed
    across restarts: fewer devices on one node arrive as a relaunch; a lost node of a range: next test. A
    4 -> 2 relaunch, dp=4 saved at step 4 and resumed as dp=2, also passes, but costs 70 s here.)"""
    job = tmp_path / "job.yaml"
    text = (f"workload: {GPT}\nstrategy: dp=2\nnproc: 2\nsteps: 8\ndtype: float64\ncheckpoint: ck\n"
            f"every: 2\nrestart:\n  max_restarts: 1\n")
    job.write_text(text)
    out = _rhino(["launch", str(job), "--json"], {"RHINO_FAULT": "rank:1,step:5"})
    _check_kill9(out, reference)
    assert (tmp_path / "ck").is_dir()                      # relative to the job file
    job.write_text(text.replace("steps: 8", "steps: 10").replace("strategy: dp=2", "cluster: cpu:2"))
    out = _rhino(["launch", str(job), "--nproc", "1", "--resume", "--json"])
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["ok"] is True
    assert "replanning: cluster cpu:2 has 2 devices, this attempt has 1: searching a plan for cpu:1 (O1)" in out.stderr
    (attempt,) = r["attempts"]
    assert attempt["resumed_from_step"] == 8 and attempt["saved_world_size"] == 2 and attempt["world_size"] == 1
    assert r["restarts"] == []
    _assert_losses_equal(r["losses"], reference[8:10])


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_a_lost_node_shrinks_the_job_which_replans_and_resumes_resharded(tmp_path, reference):
    """Two agents (nodes) on this machine, nnodes 1:2, one process each (dp=2); node B's agent and rank are
    SIGKILLed during step 5 of 8. The agent of node A (the rendezvous host) restarts alone: world 1, dp scaled
    2 -> 1, step 4 resumed resharded, and the losses of steps 5-8 equal the uninterrupted dp=2 run's."""
    port = _free_port()
    procs = []
    for host in ("true", "false"):
        job = tmp_path / f"job-{host}.yaml"
        job.write_text(f"workload: {GPT}\nstrategy: dp=2\nnproc: 1\nsteps: 8\ndtype: float64\ncheckpoint: ck\n"
                       f"every: 2\nrestart:\n  max_restarts: 1\n  nnodes: '1:2'\n  rdzv_endpoint: localhost:{port}\n"
                       f"  rdzv_conf: {{is_host: {host}, last_call_timeout: 5}}\n")
        env = dict(os.environ, OMP_NUM_THREADS="1", **({"RHINO_FAULT": "step:5,node:1"} if host == "false" else {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "rhino.cli.main", "launch", str(job), "--json"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT))
    try:
        (a_out, a_err), (_, b_err) = procs[0].communicate(timeout=300), procs[1].communicate(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == -9, b_err[-2000:]                      # node B was lost
    assert procs[0].returncode == 0, a_err[-3000:]
    r = json.loads(a_out)
    (restart,) = r["restarts"]
    assert restart["world_size"] == 1 and restart["resumed_from_step"] == 4 and restart["strategy"] == "dp=1"
    assert restart["replan"] == "strategy dp=2 needs 2 processes, this attempt has 1: dp scaled 2 -> 1, now dp=1"
    assert restart["reason"].startswith("rank 0 ")     # node A's rank: a gloo error or SIGABRT, by timing
    assert "attempt 1: replanning: strategy dp=2 needs 2 processes" in a_err
    _assert_losses_equal(r["losses"], reference[:8])


def test_train_max_restarts_checks_its_arguments_before_starting_processes(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert main(["train", GPT, "--strategy", "dp=2", "--max-restarts", "1"]) == 2
    assert "--max-restarts needs a checkpoint directory" in capsys.readouterr().err
    assert main(["train", GPT, "--strategy", "tp=2", "--nproc", "1", "--checkpoint", ck, "--max-restarts", "1"]) == 2
    assert "strategy tp=2 needs 2 processes and cannot be scaled to 1" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()
    old = tmp_path / "ck" / "step-00000002"                 # a complete checkpoint of an earlier job
    old.mkdir(parents=True)
    (old / ".metadata").write_text("")
    (old / "rhino.json").write_text("{}")
    assert main(["train", GPT, "--strategy", "dp=2", "--checkpoint", ck, "--max-restarts", "1"]) == 2
    assert "already holds step-00000002; resume it" in capsys.readouterr().err
