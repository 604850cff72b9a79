"""Cost model, first part: device presets, cluster strings, mesh-axis placement, collective times.

Oracles: closed-form alpha-beta formulas written out by hand; ``redistribute.step_volume`` (an
independent count of bytes sent) for the bandwidth term of flat rings; monotonicity properties.
"""
from __future__ import annotations

import subprocess
import sys
from math import isclose, log2

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhino.cost import DEVICES, INTER_NODE_LINKS, LinkKind, axis_links, parse_cluster, step_seconds, steps_seconds
from rhino.cost.collectives import all_reduce, ring_all_reduce, step_cost, tree_all_reduce
from rhino.sharding.mesh import Mesh
from rhino.sharding.placement import Partial, ReduceOp, Replicate, Shard
from rhino.sharding.redistribute import step_volume
from rhino.sharding.steps import (AllGather, AllReduce, AllToAll, LocalScale, LocalSlice, ReduceScatter,
                                  ZeroUnlessFirst)

GB = 1e9
NV3, NV_LAT, IB_LAT = 300e9, 5e-6, 10e-6
FAST = settings(max_examples=150, deadline=None)


def test_no_torch_import():
    code = "import sys, rhino.cost; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    import rhino.cost.cluster as cl, rhino.cost.collectives as co, rhino.cost.devices as de
    for m in (cl, co, de):
        assert len(open(m.__file__).read().splitlines()) < 400


# ----------------------------------------------------------------------------- presets

def test_presets_positive_and_sourced():
    assert set(DEVICES) == {"V100-32G", "A100-40G", "A100-80G", "H100-80G", "H200-141G", "cpu"}
    for d in DEVICES.values():
        assert d.peak_flops and all(v > 0 for v in d.peak_flops.values())
        assert d.memory_bytes > 0 and d.memory_bandwidth > 0 and d.source.strip()
        assert d.intra_node_link.bandwidth > 0 and d.intra_node_link.latency_s > 0
        assert d.intra_node_link.source.strip()
    for link in INTER_NODE_LINKS.values():
        assert link.bandwidth > 0 and link.latency_s > 0 and link.source.strip()
    assert "assumed" in DEVICES["cpu"].source and "rhino profile" in DEVICES["cpu"].source


def test_datasheet_numbers():
    a80, h100, h200, v100 = DEVICES["A100-80G"], DEVICES["H100-80G"], DEVICES["H200-141G"], DEVICES["V100-32G"]
    assert a80.peak_flops == {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
    assert a80.memory_bandwidth == 2039e9 and DEVICES["A100-40G"].memory_bandwidth == 1555e9
    assert a80.intra_node_link.bandwidth == 300e9
    assert h100.flops("fp8") == 1979e12 and h100.flops("bf16") == 989.5e12 and h100.memory_bandwidth == 3.35e12
    assert h200.peak_flops == h100.peak_flops and h200.memory_bandwidth == 4.8e12 and h200.memory_bytes == 141e9
    assert v100.peak_flops == {"fp32": 15.7e12, "fp16": 125e12} and v100.intra_node_link.bandwidth == 150e9
    assert INTER_NODE_LINKS["IB-HDR"].bandwidth == 25e9 and INTER_NODE_LINKS["IB-NDR"].bandwidth == 50e9
    with pytest.raises(ValueError, match="no fp8"):
        a80.flops("fp8")


# ----------------------------------------------------------------------------- cluster strings

@pytest.mark.parametrize("text, nodes, per_node, device, world", [
    ("8xA100-80G", 1, 8, "A100-80G", 8),
    ("4x8xH100", 4, 8, "H100-80G", 32),
    ("2x8xa100-40g", 2, 8, "A100-40G", 16),
    (" 2X4XH200 ", 2, 4, "H200-141G", 8),
    ("8xV100", 1, 8, "V100-32G", 8),
    ("cpu:4", 1, 4, "cpu", 4),
    ("cpu", 1, 1, "cpu", 1),
    ("2xcpu", 1, 2, "cpu", 2),
])
def test_parse_short_forms(text, nodes, per_node, device, world):
    c = parse_cluster(text)
    assert (c.nodes, c.devices_per_node, c.device.name, c.world) == (nodes, per_node, device, world)
    assert parse_cluster(str(c)) == c


def test_default_inter_node():
    a, h = parse_cluster("2x8xA100-80G"), parse_cluster("2x8xH100")
    assert (a.inter_node.name, a.nics_per_node) == ("IB-HDR", 8)
    assert (h.inter_node.name, h.nics_per_node) == ("IB-NDR", 8)
    assert a.inter_node_bandwidth_per_device == 8 * 25e9 / 8


def test_parse_yaml_text_and_file(tmp_path):
    text = "nodes: 2\ndevices_per_node: 8\ndevice: H100\ninter_node: IB-HDR\nnics_per_node: 4\n"
    c = parse_cluster(text)
    assert (c.nodes, c.world, c.device.name, c.inter_node.name, c.nics_per_node) == (2, 16, "H100-80G", "IB-HDR", 4)
    assert c.inter_node_bandwidth_per_device == 4 * 25e9 / 8
    p = tmp_path / "c.yaml"
    p.write_text(text + "intra_node: {bandwidth: 1.0e11, latency_s: 2.0e-6}\n")
    c2 = parse_cluster(str(p))
    assert c2.intra_node.bandwidth == 1e11 and c2.intra_node.latency_s == 2e-6 and c2.world == 16
    c3 = parse_cluster("devices_per_node: 4\ndevice: cpu\ninter_node: {bandwidth: 1.0e9, latency_s: 1.0e-4}\n")
    assert c3.nodes == 1 and c3.inter_node.bandwidth == 1e9


@pytest.mark.parametrize("text, message", [
    ("8xA999", r"cluster '8xA999' has unknown device 'A999'; known: .*A100-80G"),
    ("8xA100", "ambiguous device 'A100'; write A100-40G or A100-80G"),
    ("A100-80G", "is not of the form"),
    ("0xH100", "positive"),
    ("cpu:0", "at least one cpu"),
    ("", "must be a string"),
    ("missing.yaml", "does not exist"),
    ("devices_per_node: 8\ndevice: H100\ngpus: 3\n", "unknown keys \\['gpus'\\]"),
    ("nodes: 2\ndevice: H100\n", "missing 'devices_per_node'"),
    ("nodes: 0\ndevices_per_node: 8\ndevice: H100\n", "nodes must be a positive integer"),
    ("devices_per_node: 8\ndevice: H100\ninter_node: IB-XYZ\n", "unknown inter-node link 'IB-XYZ'"),
    ("devices_per_node: [8\n", "not valid YAML"),
])
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cluster(text)


# ----------------------------------------------------------------------------- axis links

def test_axis_links_tp_inside_dp_across():
    c = parse_cluster("2x8xA100-80G")
    dp, tp = axis_links(c, Mesh(("dp", "tp"), (2, 8)))
    assert (tp.kind, tp.intra_size, tp.inter_size, tp.intra_bandwidth) == (LinkKind.INTRA, 8, 1, NV3)
    assert (dp.kind, dp.intra_size, dp.inter_size, dp.inter_bandwidth) == (LinkKind.INTER, 1, 2, 25e9)
    assert dp.inter_latency == IB_LAT and tp.intra_latency == NV_LAT


@pytest.mark.parametrize("mesh", [Mesh(("dp",), (16,)), Mesh(("tp",), (16,))])
def test_axis_links_hierarchical(mesh):
    (link,) = axis_links(parse_cluster("2x8xA100-80G"), mesh)
    assert (link.kind, link.intra_size, link.inter_size) == (LinkKind.HIERARCHICAL, 8, 2)


def test_axis_links_other_layouts():
    c = parse_cluster("2x8xA100-80G")
    dp, tp = axis_links(c, Mesh(("dp", "tp"), (4, 4)))
    assert (dp.kind, dp.intra_size, dp.inter_size) == (LinkKind.HIERARCHICAL, 2, 2)
    assert tp.kind is LinkKind.INTRA
    a, b = axis_links(c, Mesh(("a", "b"), (1, 16)))
    assert a.kind is LinkKind.LOCAL and b.kind is LinkKind.HIERARCHICAL
    a, b = axis_links(parse_cluster("3x2xH100"), Mesh(("a", "b"), (2, 3)))  # b groups {0,1,2}: 2+1 per node
    assert b.kind is LinkKind.MIXED and (b.intra_size, b.inter_size) == (1, 3)
    with pytest.raises(ValueError, match="mesh dp8 has 8 devices but cluster 2x8xA100-80G has 16"):
        axis_links(c, Mesh(("dp",), (8,)))


# ----------------------------------------------------------------------------- collectives

def _one_axis(cluster: str, n: int, name: str = "x"):
    mesh = Mesh((name,), (n,))
    return mesh, axis_links(parse_cluster(cluster), mesh)


def test_all_reduce_1gb_8_gpus():
    mesh, links = _one_axis("8xA100-80G", 8)
    expected = 2 * 7 / 8 * GB / NV3 + 2 * 7 * NV_LAT
    cost = step_cost(AllReduce(0), GB, mesh, links)
    assert cost.algorithm == "ring" and isclose(cost.seconds, expected)


def test_ring_vs_tree_choice():
    n, bw, lat = 8, NV3, NV_LAT
    # tree wins when 2 (n-1 - log2 n) alpha > (2 - 2(n-1)/n) S/B, i.e. S < 32 alpha B for n = 8
    crossover = 2 * (n - 1 - log2(n)) * lat / ((2 - 2 * (n - 1) / n) / bw)
    assert isclose(crossover, 32 * lat * bw)
    small, big = all_reduce(crossover / 10, n, bw, lat), all_reduce(crossover * 10, n, bw, lat)
    assert small.algorithm == "tree" and isclose(small.seconds, tree_all_reduce(crossover / 10, n, bw, lat))
    assert big.algorithm == "ring" and isclose(big.seconds, ring_all_reduce(crossover * 10, n, bw, lat))
    assert isclose(tree_all_reduce(1e3, 8, bw, lat), 2 * 1e3 / bw + 6 * lat)


def test_flat_closed_forms_and_step_volume():
    mesh, links = _one_axis("8xH100", 8)
    bw, lat, s = 450e9, NV_LAT, 64 * 2**20
    cases = [(ReduceScatter(0, ReduceOp.SUM, 0), 7 / 8 * s / bw + 7 * lat),
             (AllGather(0, 0), 7 / 8 * (8 * s) / bw + 7 * lat),
             (AllToAll(0, 0, 1, 1, 1), 7 / 8 * s / bw + 7 * lat)]
    for step, expected in cases:
        assert isclose(step_seconds(step, s, mesh, links), expected)
        sent, _ = step_volume(step, s, mesh)  # independent byte count (itemsize 1)
        assert isclose(step_seconds(step, s, mesh, links) - 7 * lat, float(sent) / bw)
    for step in (LocalSlice(0, 0), LocalScale(0, 0.5), ZeroUnlessFirst(0)):
        assert step_seconds(step, s, mesh, links) == 0
    one, one_links = _one_axis("1xH100", 1)
    assert step_seconds(AllReduce(0), s, one, one_links) == 0


def test_inter_node_only_axis():
    mesh = Mesh(("dp", "tp"), (2, 8))
    links = axis_links(parse_cluster("2x8xA100-80G"), mesh)
    s = GB
    assert isclose(step_seconds(AllReduce(0), s, mesh, links), 2 * 1 / 2 * s / 25e9 + 2 * IB_LAT)
    assert isclose(step_seconds(AllGather(0, 0), s, mesh, links), 1 / 2 * 2 * s / 25e9 + IB_LAT)


def test_hierarchical_closed_forms():
    mesh, links = _one_axis("2x8xA100-80G", 16)
    k, m, n, s, bi, ai, be, ae = 8, 2, 16, GB, NV3, NV_LAT, 25e9, IB_LAT
    ar = step_cost(AllReduce(0), s, mesh, links)
    expected_ar = 2 * ((k - 1) / k * s / bi + (k - 1) * ai) + ring_all_reduce(s / k, m, be, ae)
    assert ar.algorithm == "hierarchical-ring" and isclose(ar.seconds, expected_ar)
    assert isclose(step_seconds(ReduceScatter(0, ReduceOp.SUM, 0), s, mesh, links),
                   (k - 1) / k * s / bi + (k - 1) * ai + (m - 1) / m * (s / k) / be + (m - 1) * ae)
    assert isclose(step_seconds(AllGather(0, 0), s, mesh, links),
                   (m - 1) / m * m * s / be + (m - 1) * ae + (k - 1) / k * n * s / bi + (k - 1) * ai)
    assert isclose(step_seconds(AllToAll(0, 0, 1, 1, 1), s, mesh, links),
                   (k - 1) / n * s / bi + (k - 1) * ai + (n - k) / n * s / be + (n - k) * ae)
    # hierarchical all-reduce beats a flat ring at the inter-node bandwidth
    assert ar.seconds < ring_all_reduce(s, n, be, ae)


def test_steps_seconds_tracks_local_size():
    mesh = Mesh(("dp", "tp"), (2, 8))
    links = axis_links(parse_cluster("2x8xA100-80G"), mesh)
    shape, itemsize = (1024, 4096), 2
    src = (Replicate(), Partial(ReduceOp.SUM))
    steps = [ReduceScatter(1, ReduceOp.SUM, 0), AllGather(1, 0)]
    full = 1024 * 4096 * itemsize
    expected = step_seconds(steps[0], full, mesh, links) + step_seconds(steps[1], full // 8, mesh, links)
    assert isclose(steps_seconds(steps, shape, itemsize, src, mesh, links), expected)
    sharded = (Shard(0), Replicate())
    assert isclose(steps_seconds([AllGather(0, 0)], shape, itemsize, sharded, mesh, links),
                   step_seconds(AllGather(0, 0), full // 2, mesh, links))
    assert steps_seconds([], shape, itemsize, src, mesh, links) == 0


def test_step_errors():
    mesh, links = _one_axis("8xA100-80G", 8)
    with pytest.raises(ValueError, match="names mesh axis 3"):
        step_seconds(AllReduce(3), 1e6, mesh, links)
    with pytest.raises(ValueError, match="axis links"):
        step_seconds(AllReduce(0), 1e6, mesh, [])
    with pytest.raises(ValueError, match="non-negative"):
        step_seconds(AllReduce(0), -1, mesh, links)
    with pytest.raises(ValueError, match="itemsize"):
        steps_seconds([], (8,), 0, (Replicate(),), mesh, links)


# ----------------------------------------------------------------------------- properties

STEPS = [AllReduce(0), ReduceScatter(0, ReduceOp.SUM, 0), AllGather(0, 0), AllToAll(0, 0, 1, 1, 1)]
CLUSTER_MESH = [("8xA100-80G", 8), ("2x8xA100-80G", 16), ("4x8xH100", 32), ("4x8xH100", 4),
                ("cpu:4", 4), ("2x4xV100", 8)]


def _links_for(cluster: str, n: int):
    c = parse_cluster(cluster)
    mesh = Mesh(("x", "rest"), (n, c.world // n))
    return mesh, axis_links(c, mesh)


@FAST
@given(st.sampled_from(STEPS), st.sampled_from(CLUSTER_MESH), st.integers(0, 10**11), st.integers(1, 10**11))
def test_more_bytes_more_time(step, cm, s, extra):
    mesh, links = _links_for(*cm)
    t0, t1 = step_seconds(step, s, mesh, links), step_seconds(step, s + extra, mesh, links)
    assert 0 < t0 < t1


@FAST
@given(st.sampled_from(CLUSTER_MESH), st.floats(1, 1e11))
def test_all_reduce_is_at_most_reduce_scatter_plus_all_gather(cm, s):
    # ring AR = RS + AG (flat and hierarchical); choosing tree instead can only lower it.
    mesh, links = _links_for(*cm)
    ar = step_seconds(AllReduce(0), s, mesh, links)
    rs = step_seconds(ReduceScatter(0, ReduceOp.SUM, 0), s, mesh, links)
    ag = step_seconds(AllGather(0, 0), s / mesh.sizes[0], mesh, links)
    assert 0 < ar <= (rs + ag) * (1 + 1e-9)
    if step_cost(AllReduce(0), s, mesh, links).algorithm.endswith("ring"):
        assert isclose(ar, rs + ag)


@FAST
@given(st.sampled_from(STEPS), st.floats(1, 1e10), st.sampled_from([2, 4, 8]))
def test_faster_link_less_time(step, s, n):
    a_mesh, a_links = _one_axis(f"{n}xA100-80G", n)
    h_mesh, h_links = _one_axis(f"{n}xH100", n)
    assert step_seconds(step, s, h_mesh, h_links) <= step_seconds(step, s, a_mesh, a_links)
