"""The exactness harness: float64 workloads, every rank's shards compared with one device."""
import json
import warnings

import pytest
import torch

from conftest import ROOT
from rhino.capture import capture, default_dtype, load_workload
from rhino.cli.main import main
from rhino.runtime.compare import TOLERANCES, compare_ranks, reference_run, tolerance_for
from rhino.runtime.exact import simulate_plan
from rhino.sharding.placement import Replicate
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

MLP = str(ROOT / "examples" / "mlp.py")


def _mlp(dtype):
    with warnings.catch_warnings(), default_dtype(dtype):
        warnings.simplefilter("ignore")
        return capture(load_workload(MLP, dtype=dtype))


def test_load_workload_builds_under_the_dtype_and_restores_the_default():
    before = torch.get_default_dtype()
    w = load_workload(MLP, dtype=torch.float64)
    assert {p.dtype for p in w.model.parameters()} == {torch.float64}
    assert w.batch[0].dtype == torch.float64 and w.batch[1].dtype == torch.long
    assert torch.get_default_dtype() == before


def test_tolerance_follows_the_state_dtype():
    assert tolerance_for(_mlp(torch.float64)) == TOLERANCES[torch.float64]
    assert tolerance_for(_mlp(torch.float32)) == TOLERANCES[torch.float32]


def test_float64_dp_and_tp_match_at_1e9_on_every_rank():
    cap = _mlp(torch.float64)
    for strategy in ("dp=4", "dp=2,tp=2"):
        r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy(strategy)))
        assert r.ok, r.first_mismatch
        assert r.max_abs_diff < 1e-12, (strategy, r.max_abs_diff)


def test_a_drifted_replica_on_the_last_rank_is_caught():
    """Rank 0 alone would look right: only the last rank's copy of a replicated weight drifts."""
    cap = _mlp(torch.float64)
    plan = preset_plan(cap.graph, parse_strategy("dp=4"))
    rp = resolve(cap.graph, plan)
    _, res = simulate_plan(cap, plan)
    name = cap.param_names[0]
    assert all(isinstance(p, Replicate) for p in rp.value[next(i.value for i in cap.graph.inputs
                                                              if i.name == name)])
    ranks = {r: {"losses": res["rank_losses"][r], "local": dict(res["local"][r])} for r in range(4)}
    ref = reference_run(cap, 2)
    assert compare_ranks(rp, ranks, ref, TOLERANCES[torch.float64]).ok
    ranks[3]["local"][name] = ranks[3]["local"][name] + 1e-8
    bad = compare_ranks(rp, ranks, ref, TOLERANCES[torch.float64])
    assert not bad.ok and bad.first_mismatch.startswith(f"rank 3: {name}")
    # float32's tolerance would not see a 1e-8 drift: float64 is what makes the check sharp
    assert compare_ranks(rp, ranks, ref, TOLERANCES[torch.float32]).ok


def test_a_wrong_loss_on_one_rank_is_caught():
    cap = _mlp(torch.float64)
    plan = preset_plan(cap.graph, parse_strategy("dp=2,tp=2"))
    _, res = simulate_plan(cap, plan)
    ranks = {r: {"losses": list(res["rank_losses"][r]), "local": res["local"][r]} for r in range(4)}
    ranks[2]["losses"][1] += 1e-6
    bad = compare_ranks(resolve(cap.graph, plan), ranks, reference_run(cap, 2), TOLERANCES[torch.float64])
    assert not bad.ok and bad.first_mismatch.startswith("rank 2: loss[step 2]")


@pytest.mark.multiprocess
def test_run_float64_on_real_processes_compares_every_rank(capsys):
    code = main(["run", MLP, "--strategy", "tp=2", "--dtype", "float64", "--json"])   # --nproc: the strategy's 2
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"], out["first_mismatch"]
    assert out["nproc"] == 2
    assert out["max_abs_diff"] < 1e-12
    assert len(out["state_bytes_per_rank"]) == 2


@pytest.mark.multiprocess
def test_a_mismatch_from_random_ops_says_so(capsys):
    """Dropout in a data-parallel run: the ranks draw their own masks; the mismatch names the random op."""
    variants = str(ROOT / "tests" / "workloads" / "variants.py")
    code = main(["run", f"{variants}:dropout", "--strategy", "dp=2", "--dtype", "float64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code != 0 and not out["ok"] and "draws random numbers (aten." in out["first_mismatch"]


def test_a_float32_mismatch_points_to_float64():
    """A float32 run's mismatch says how to tell rounding noise from a wrong result (rhino run on the GPT
    example under tp=4 in float32: 1.19e-5 against atol 1e-5; in float64 3e-14); float64's says nothing more."""
    from rhino.runtime.run import mismatch_notes
    assert "rerun with --dtype float64" in mismatch_notes(_mlp(torch.float32), 4, TOLERANCES[torch.float32])
    assert mismatch_notes(_mlp(torch.float64), 4, TOLERANCES[torch.float64]) == ""


def test_complex_state_is_compared_in_both_parts():
    """A complex tensor is compared on its real and imaginary parts (``.double()`` drops the imaginary part,
    with a warning): a difference in the imaginary part alone is seen, and checking and simulating a
    workload with a complex buffer raise no such warning."""
    from rhino.check import as_float64
    a = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex128)
    assert float((as_float64(a) - as_float64(a + 1e-3j)).abs().max()) == pytest.approx(1e-3)
    with default_dtype(torch.float64):
        cap = capture(load_workload(str(ROOT / "tests" / "workloads" / "variants.py") + ":complex_buffer"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from rhino.check import check_captured
        assert check_captured(cap, steps=2).ok
        r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2")))
    assert r.ok, r.first_mismatch


def test_check_float64(capsys):
    code = main(["check", MLP, "--dtype", "float64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["ok"] and out["max_abs_diff"] == 0.0


@pytest.mark.parametrize("cmd", ["run", "check"])
def test_unknown_dtype_is_a_usage_error(cmd, capsys):
    args = [cmd, MLP, "--dtype", "float16"] + (["--nproc", "2", "--strategy", "dp=2"] if cmd == "run" else [])
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
