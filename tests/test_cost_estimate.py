"""The composed estimate: step time split, recomputation, pipelines, profiles and `rhino estimate`."""
from __future__ import annotations

import json
import warnings

import pytest

from conftest import ROOT
from rhino.capture import capture, load_workload
from rhino.cli.main import main
from rhino.cost.cluster import parse_cluster
from rhino.cost.estimate import estimate, estimate_strategy
from rhino.cost.machine_profile import MachineProfile, load_profile
from rhino.cost.step import StepOptions

_CACHE = {}


def graph(name="gpt"):
    if name not in _CACHE:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CACHE[name] = capture(load_workload(str(ROOT / "examples" / f"{name}.py"))).graph
    return _CACHE[name]


A100 = parse_cluster("8xA100-80G")


def test_single_device_is_the_sum_of_op_times():
    g = graph()
    one = parse_cluster("1xA100-80G")
    e = estimate(g, one)
    assert e.comm_seconds == 0 and e.bubble_seconds == 0
    assert e.step_seconds == pytest.approx(e.compute_seconds)
    assert e.memory_bytes["peak"] <= e.capacity_bytes and e.fits
    assert 0 < e.mfu < 1


def test_split_adds_up_and_data_parallel_communicates():
    e = estimate_strategy(graph(), A100, "dp=8")
    total = e.compute_seconds + e.comm_seconds + e.bubble_seconds
    assert e.step_seconds == pytest.approx(total)
    t = estimate_strategy(graph(), A100, "dp=2,tp=4")
    assert t.collectives.get("AllReduce", 0) > 0 and t.comm_total_seconds > 0


def test_overlap_is_an_option_that_can_only_help():
    on = estimate_strategy(graph(), A100, "dp=2,tp=4")
    off = estimate_strategy(graph(), A100, "dp=2,tp=4", options=StepOptions(overlap_gradient_reduction=False))
    assert off.step_seconds >= on.step_seconds
    # overlapped gradients travel in buckets (one latency each, lower/overlap.py), blocking ones alone
    assert on.comm_total_seconds < off.comm_total_seconds
    assert on.collectives["AllReduce"] < off.collectives["AllReduce"]
    one = estimate_strategy(graph(), A100, "dp=2,tp=4", options=StepOptions(bucket_cap_mb=0, first_bucket_mb=0))
    assert one.comm_total_seconds == pytest.approx(off.comm_total_seconds)  # buckets of one: same traffic


def test_recompute_trades_compute_for_activations():
    base = estimate_strategy(graph(), A100, "tp=8")
    full = estimate_strategy(graph(), A100, "tp=8,recompute=full")
    sel = estimate_strategy(graph(), A100, "tp=8,recompute=selective")
    assert full.memory_bytes["activations"] < base.memory_bytes["activations"]
    assert sel.memory_bytes["activations"] < base.memory_bytes["activations"]
    assert full.step_seconds > sel.step_seconds > base.step_seconds
    assert full.hardware_tflops_per_device > full.tflops_per_device
    assert full.flops_per_device == pytest.approx(base.flops_per_device)


def test_pipeline_bubble_and_schedules():
    g = graph()
    m8 = estimate_strategy(g, A100, "tp=2,pp=4,microbatches=8")
    m16 = estimate_strategy(g, A100, "tp=2,pp=4,microbatches=16")
    # the bubble (simulated idle time) is a smaller share of the step with more micro-batches
    assert m8.bubble_seconds > 0
    assert m16.bubble_seconds / m16.step_seconds < m8.bubble_seconds / m8.step_seconds
    assert 0 < m16.bubble_fraction < m8.bubble_fraction < 1
    gpipe = estimate_strategy(g, A100, "tp=2,pp=4,microbatches=16", schedule="gpipe")
    # same work in another order: equal for balanced stages (test_pipeline_stages), within 10% on this cut
    assert gpipe.step_seconds == pytest.approx(m16.step_seconds, rel=0.10)
    assert gpipe.memory_bytes["activations"] > m16.memory_bytes["activations"]  # m vs pp in flight
    assert m16.mesh == {"pp": 4, "tp": 2}


def test_a_pipeline_prices_micro_batch_products_at_their_rows_and_the_gradient_accumulation():
    """mlp (batch 32, hidden 64), pp=2 with 8 micro-batches of 4 rows: with a measured ``thin_gemm_d0`` every
    product of a micro-batch is priced at its own smallest dimension (4: the rows of forward and input-gradient
    products, the contraction of weight-gradient ones), and each later
    micro-batch adds its gradients into the accumulators: the weights' (matmul-made) by the product, one pass
    over them, the biases' by an add, three passes."""
    from rhino.cost.compute import Profile
    from rhino.cost.pipeline import _accumulation_seconds, _micro_min_dims
    from rhino.ir.graph import Role
    from rhino.sharding.plan import resolve
    from rhino.sharding.presets import parse_strategy, preset_plan
    g = graph("mlp")
    dims = _micro_min_dims(g, 8, Profile(thin_gemm_d0=8.0))
    assert dims and set(dims.values()) == {4}
    assert _micro_min_dims(g, 8, Profile()) == {}          # nothing measured: nothing computed
    plan = preset_plan(g, parse_strategy("pp=2,microbatches=8"))
    rp = resolve(g, plan)
    cpu = parse_cluster("cpu:2")
    stage = [0 if i < len(g.nodes) // 2 else 1 for i in range(len(g.nodes))]  # any cut: the sum is per gradient
    acc = sum(_accumulation_seconds(g, rp, stage, 2, cpu, Profile(kind_bandwidth={"elementwise": 1e9})))
    params = [i for i in g.inputs if i.role is Role.PARAM]
    weights = sum(g.types[i.value].nbytes for i in params if g.types[i.value].rank == 2)
    biases = sum(g.types[i.value].nbytes for i in params if g.types[i.value].rank == 1)
    assert acc == pytest.approx((weights + 3 * biases) / 1e9)
    slow = estimate(g, cpu, plan, options=StepOptions(profile=Profile(thin_gemm_d0=8.0)))
    plain = estimate(g, cpu, plan)
    assert slow.stages[0]["forward_seconds"] > plain.stages[0]["forward_seconds"]


def test_bad_degrees_are_clear_errors():
    with pytest.raises(ValueError, match="dp\\*tp\\*pp = 8"):
        estimate_strategy(graph(), A100, "dp=3")


def test_fewer_microbatches_than_stages_are_priced_as_the_runtime_runs_them():
    # rhino run and rhino train run pp=4 with 1 or 2 micro-batches; the estimate prices it and says why it is slow
    ests = {m: estimate_strategy(graph(), A100, f"tp=2,pp=4,microbatches={m}") for m in (1, 2, 4)}
    assert "at most 1 of the 4 stages works at a time" in " ".join(ests[1].notes)
    assert "at most 2 of the 4 stages work at a time" in " ".join(ests[2].notes)
    assert not any("stages work" in n for n in ests[4].notes)
    assert ests[1].bubble_fraction > ests[2].bubble_fraction > ests[4].bubble_fraction
    assert all(e.fits and e.pp == 4 for e in ests.values())


def test_profile_replaces_the_datasheet(tmp_path):
    prof = MachineProfile("cpu (1 threads)", 1, 1e10, 1e5, 5e9, 3e-6, 0.5, 0.4, 2e9, 2e-5, 2)
    path = tmp_path / "p.json"
    path.write_text(prof.to_json())
    loaded = load_profile(path)
    assert loaded == prof
    cluster, cost = loaded.apply(parse_cluster("cpu:2"))
    assert cluster.device.peak_flops["fp32"] == 1e10 and cluster.device.memory_bandwidth == 5e9
    assert cluster.intra_node.bandwidth == 2e9 and cost.k0 == 1e5
    slow = estimate_strategy(graph(), cluster, "dp=2", profile=cost)
    fast = estimate_strategy(graph(), parse_cluster("cpu:2"), "dp=2")
    assert slow.step_seconds != fast.step_seconds
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_profile(path)
    with pytest.raises(FileNotFoundError, match="rhino profile"):
        load_profile(tmp_path / "missing.json")


def test_cli_json_has_the_contract_keys(capsys):
    assert main(["estimate", str(ROOT / "examples" / "gpt.py"), "--cluster", "2x8xA100-80G",
                 "--strategy", "tp=4,pp=2,microbatches=4,recompute=full", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("step_seconds", "compute_seconds", "comm_seconds", "bubble_seconds", "tflops_per_device", "mfu",
                "memory_bytes", "fits"):
        assert key in d
    assert {"params", "gradients", "optimizer", "activations", "temporaries", "peak"} <= set(d["memory_bytes"])
    assert d["mesh"] == {"pp": 2, "dp": 2, "tp": 4}


def test_cli_text_and_errors(capsys):
    assert main(["estimate", str(ROOT / "examples" / "mlp.py"), "--cluster", "cpu:4", "--strategy", "tp=4"]) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "memory/device" in out and "fits" in out
    assert main(["estimate", str(ROOT / "examples" / "mlp.py"), "--cluster", "cpu:4", "--strategy", "dp=3"]) == 2
    assert "dp*tp*pp = 4" in capsys.readouterr().err
    assert main(["estimate", str(ROOT / "examples" / "mlp.py"), "--cluster", "9xFOO"]) == 2


def test_api_estimate_of_a_pipelined_plan_prices_its_stages():
    """``rhino.estimate(cap, cluster, plan=P)`` (``rhino estimate --plan``) priced every plan with pp=1, so a plan
    file with pipeline stages (what ``rhino plan`` writes when a pipeline wins) was refused ("the plan uses 1
    devices x pp=1"); it takes the plan's stages, cut, micro-batches and recomputation, as its strategy does."""
    import rhino
    from rhino.sharding.presets import parse_strategy, preset_plan
    cap = rhino.capture_step(str(ROOT / "examples" / "mlp.py"))
    strategy = "pp=2,microbatches=4,recompute=full"
    e = rhino.estimate(cap, "cpu:2", plan=preset_plan(cap.graph, parse_strategy(strategy)))
    s = rhino.estimate(cap, "cpu:2", strategy=strategy)
    assert (e.pp, e.microbatches) == (s.pp, s.microbatches) == (2, 4)
    assert e.step_seconds == s.step_seconds and e.memory_bytes == s.memory_bytes
