"""The compute roofline (rhino.cost.compute): closed forms, monotone efficiency, views, tf32,
local shapes, profiles, and a captured GPT graph."""
from __future__ import annotations

import ast
import importlib.util
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhino.cost import compute as C
from rhino.cost.compute import (BW_EFFICIENCY, EFF_MAX, LAUNCH_OVERHEAD_CPU_S, LAUNCH_OVERHEAD_GPU_S,
                                OpTime, Profile, efficiency, graph_compute_time, op_time)
from rhino.cost.devices import get_device
from rhino.ir.graph import Graph, Node, Ref, Role
from rhino.ir.registry import OpKind, bytes_of, call_of
from rhino.ir.types import DType, TensorType

ROOT = Path(__file__).resolve().parents[1]
A100 = get_device("A100-80G")
CPU = get_device("cpu")


def one_op(op: str, in_shapes, out_shapes, dtype=DType.float16, args=None):
    """A one-node graph; returns (graph, node)."""
    g = Graph()
    ins = [g.add_input(f"x{i}", Role.BATCH, TensorType(tuple(s), dtype)) for i, s in enumerate(in_shapes)]
    outs = [g.new_value(TensorType(tuple(s), dtype)) for s in out_shapes]
    node = Node("n0", op, [Ref(v) for v in ins] + list(args or []), {}, outs)
    g.nodes.append(node)
    return g, node


def mm(m, k, n, dtype=DType.float16):
    g, node = one_op("aten.mm.default", [(m, k), (k, n)], [(m, n)], dtype)
    return call_of(g, node)


# -- closed forms ---------------------------------------------------------------------------
def test_large_fp16_matmul_runs_at_eff_max():
    n = 4096
    t = op_time(mm(n, n, n), A100)
    expected = 2 * n ** 3 / (312e12 * EFF_MAX[OpKind.MATMUL])
    assert t.bound == "compute" and t.flops == 2 * n ** 3
    assert abs(t.seconds - expected) / expected < 0.01
    assert abs((t.seconds - LAUNCH_OVERHEAD_GPU_S) - expected) / expected < 0.001


def test_elementwise_is_memory_bound_closed_form():
    shape = (4096, 4096)
    g, node = one_op("aten.add.Tensor", [shape, shape], [shape], DType.float32)
    call = call_of(g, node)
    t = op_time(call, A100)
    nbytes = 3 * 4096 * 4096 * 4
    assert t.bytes == nbytes == bytes_of(call) and t.bound == "memory"
    assert t.seconds == pytest.approx(nbytes / (A100.memory_bandwidth * BW_EFFICIENCY) + LAUNCH_OVERHEAD_GPU_S,
                                      rel=1e-12)
    # flops are charged at the fp32 vector rate, which stays far below the memory term
    assert t.flops / A100.flops("fp32") < nbytes / (A100.memory_bandwidth * BW_EFFICIENCY)


def test_tiny_op_is_latency_bound_and_cpu_overhead():
    g, node = one_op("aten.relu.default", [(4,)], [(4,)], DType.float32)
    call = call_of(g, node)
    t = op_time(call, A100)
    assert t.bound == "latency" and t.seconds == pytest.approx(LAUNCH_OVERHEAD_GPU_S, rel=1e-3)
    assert op_time(call, CPU).seconds == pytest.approx(LAUNCH_OVERHEAD_CPU_S, rel=1e-2)


def test_views_cost_zero():
    g, node = one_op("aten.view.default", [(8, 16)], [(128,)], DType.float32, args=[[128]])
    t = op_time(call_of(g, node), A100)
    assert t == OpTime(0.0, 0.0, 0.0, t.bound) and t.seconds == 0


def test_opaque_op_is_memory_bound_on_its_bytes():
    g, node = one_op("mylib.custom.default", [(1024, 1024)], [(1024, 1024)], DType.float32)
    t = op_time(call_of(g, node), A100)
    nbytes = 2 * 1024 * 1024 * 4
    assert t.flops == 0 and t.bytes == nbytes
    assert t.seconds == pytest.approx(nbytes / (A100.memory_bandwidth * BW_EFFICIENCY) + LAUNCH_OVERHEAD_GPU_S)


# -- dtype / tf32 ---------------------------------------------------------------------------
def test_tf32_switch_changes_fp32_matmul_time():
    call = mm(4096, 4096, 4096, DType.float32)
    off, on = op_time(call, A100), op_time(call, A100, allow_tf32=True)
    assert off.seconds > 5 * on.seconds  # 19.5 vs 156 TFLOP/s
    eff = efficiency(OpKind.MATMUL, off.flops)
    assert off.seconds == pytest.approx(off.flops / (19.5e12 * eff) + LAUNCH_OVERHEAD_GPU_S)
    assert on.seconds == pytest.approx(on.flops / (156e12 * eff) + LAUNCH_OVERHEAD_GPU_S)
    # fp16 ignores the switch; a device without tf32 (V100) ignores it too
    h = mm(4096, 4096, 4096, DType.float16)
    assert op_time(h, A100).seconds == op_time(h, A100, allow_tf32=True).seconds
    v100 = get_device("V100-32G")
    assert op_time(call, v100).seconds == op_time(call, v100, allow_tf32=True).seconds


def test_bf16_uses_tensor_core_rate_and_falls_back_without_one():
    call = mm(4096, 4096, 4096, DType.bfloat16)
    assert C.peak_dtype(call, A100) == "bf16"
    assert C.peak_dtype(call, get_device("V100-32G")) == "fp32"
    assert op_time(call, A100).seconds == pytest.approx(op_time(mm(4096, 4096, 4096), A100).seconds)


# -- shape-dependent efficiency -------------------------------------------------------------
dims = st.integers(1, 8192)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(dims, dims, dims, st.sampled_from(["m", "k", "n"]), st.integers(2, 64))
def test_efficiency_monotone_in_every_dim(m, k, n, which, factor):
    small = mm(m, k, n)
    big = mm(*(d * factor if name == which else d for name, d in zip("mkn", (m, k, n))))
    e_small = efficiency(OpKind.MATMUL, 2 * m * k * n)
    e_big = efficiency(OpKind.MATMUL, 2 * m * k * n * factor)
    assert 0 < e_small < e_big <= EFF_MAX[OpKind.MATMUL]
    # achieved FLOP/s (excluding launch overhead) grows with size
    ts, tb = op_time(small, A100), op_time(big, A100)
    assert tb.flops / (tb.seconds - LAUNCH_OVERHEAD_GPU_S) >= ts.flops / (ts.seconds - LAUNCH_OVERHEAD_GPU_S) * (1 - 1e-9)


def test_small_matmul_well_below_peak():
    assert efficiency(OpKind.MATMUL, 2 * 64 ** 3) < 0.02 * EFF_MAX[OpKind.MATMUL]
    assert efficiency(OpKind.MATMUL, 2 * 256 ** 3) == pytest.approx(0.5 * EFF_MAX[OpKind.MATMUL])
    assert efficiency(OpKind.ELEMENTWISE, 10) == 1.0


# -- profile --------------------------------------------------------------------------------
def test_profile_overrides_constants():
    call = mm(4096, 4096, 4096)
    base = op_time(call, A100)
    p = Profile(matmul_efficiency=0.375, launch_overhead_s=0.0)
    t = op_time(call, A100, profile=p)
    assert (t.seconds) == pytest.approx(2 * (base.seconds - LAUNCH_OVERHEAD_GPU_S))
    g, node = one_op("aten.add.Tensor", [(1 << 20,)] * 2, [(1 << 20,)], DType.float32)
    e = op_time(call_of(g, node), A100, profile=Profile(memory_bandwidth_efficiency=0.4, launch_overhead_s=1e-5))
    assert e.seconds == pytest.approx(3 * 4 * (1 << 20) / (A100.memory_bandwidth * 0.4) + 1e-5)
    # conv/attention follow a measured matmul efficiency proportionally
    assert p.eff_max(OpKind.ATTENTION) == pytest.approx(0.375 * EFF_MAX[OpKind.ATTENTION] / EFF_MAX[OpKind.MATMUL])
    with pytest.raises(ValueError):
        Profile(matmul_efficiency=1.5)


def test_a_measured_thin_gemm_d0_slows_thin_products_only():
    """``Profile.thin_gemm_d0``: a product whose smallest dimension is d runs at d / (d + d0) of the rate of a
    square one of equal work; without it (the default) shapes of equal work cost the same."""
    thin, square = mm(32, 1024, 1024, DType.float32), mm(256, 256, 512, DType.float32)   # both 2**25 multiply-adds
    assert C.gemm_min_dim(thin) == 32 and C.gemm_min_dim(square) == 256
    plain = Profile(matmul_efficiency=1.0, k0=0.0, launch_overhead_s=0.0)
    measured = Profile(matmul_efficiency=1.0, k0=0.0, launch_overhead_s=0.0, thin_gemm_d0=8.0)
    assert op_time(thin, CPU, profile=plain).seconds == pytest.approx(op_time(square, CPU, profile=plain).seconds)
    assert op_time(thin, CPU, profile=measured).seconds == pytest.approx(
        op_time(thin, CPU, profile=plain).seconds * (32 + 8) / 32)
    assert op_time(square, CPU, profile=measured).seconds == pytest.approx(
        op_time(square, CPU, profile=plain).seconds * (256 + 8) / 256)
    # the caller's own smallest dimension (a micro-batch's rows) replaces the shapes'
    assert op_time(thin, CPU, profile=measured, min_dim=4).seconds == pytest.approx(
        op_time(thin, CPU, profile=plain).seconds * (4 + 8) / 4)
    with pytest.raises(ValueError):
        Profile(thin_gemm_d0=-1.0)


# -- graphs ---------------------------------------------------------------------------------
def test_local_shapes_scale_the_op():
    g, node = one_op("aten.add.Tensor", [(4096, 4096)] * 2, [(4096, 4096)], DType.float32)
    full, _ = graph_compute_time(g, A100)
    half, kinds = graph_compute_time(g, A100, {node.outputs[0]: (2048, 4096)})
    assert set(kinds) == {"elementwise"}
    assert half - LAUNCH_OVERHEAD_GPU_S == pytest.approx((full - LAUNCH_OVERHEAD_GPU_S) / 2)
    assert graph_compute_time(g, "A100-80G")[0] == full


def _gpt_graph(**cfg):
    from rhino.capture import Workload, capture
    path = ROOT / "examples" / "gpt.py"
    spec = importlib.util.spec_from_file_location("rhino_test_cost_gpt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, opt, loss_fn, batch = mod.workload(**cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(Workload(model, opt, loss_fn, tuple(batch), str(path), "workload")).graph


def test_gpt_graph_compute_time():
    small_total, small_kinds = graph_compute_time(_gpt_graph(), A100)
    assert small_total > 0 and abs(sum(small_kinds.values()) - small_total) < 1e-12

    g = _gpt_graph(layers=2, hidden=512, seq=256, batch=8, device="meta")
    total, kinds = graph_compute_time(g, A100)
    assert total > small_total
    heavy = kinds.get("matmul", 0.0) + kinds.get("attention", 0.0)
    assert heavy > 0.5 * total, kinds
    assert heavy > max(v for k, v in kinds.items() if k not in ("matmul", "attention"))
    # the same graph with TF32 allowed is faster (its matmuls are fp32)
    assert graph_compute_time(g, A100, allow_tf32=True)[0] < total


# -- house rules ----------------------------------------------------------------------------
def test_module_is_pure_and_small():
    src = Path(C.__file__).read_text()
    assert len(src.splitlines()) < 400
    imported = set()
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.Import):
            imported |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            imported.add(n.module.split(".")[0])
    assert "torch" not in imported
