"""RNNs in float32 (oneDNN's RNN op has no workspace without grad mode): captured to aten cells that
every rule covers, equal to eager training, and sharded runs with a memory plan exact."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from rhino.capture import capture, load_workload
from rhino.check import check_captured
from rhino.cli.main import main

RNN = str(Path(__file__).parent / "workloads" / "recurrent.py")


@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_float32_rnn_captures_to_known_ops_and_matches_eager(name):
    cap = capture(load_workload(f"{RNN}:{name}"))
    assert cap.opaque_ops == [] and not any("rnn" in n.op for n in cap.graph.nodes)
    res = check_captured(cap)
    assert res.ok, res.first_mismatch


@pytest.mark.multiprocess
def test_float32_lstm_runs_sharded_in_its_arena(capsys):
    code = main(["run", f"{RNN}:lstm", "--strategy", "dp=2,tp=2", "--memory-plan", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["ok"], d.get("first_mismatch") or d.get("error")
    assert all(m["arena_bytes"] == m["plan_bytes"] for m in d["memory_plan"])
