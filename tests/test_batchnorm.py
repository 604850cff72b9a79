"""Batch norm over a split batch (SyncBatchNorm semantics), checked against single-device PyTorch in
float64: each op's sharded outputs at 1e-12 (every rank's shard, replicas compared with each other),
whole BatchNorm CNNs under the presets at 1e-9 (losses, parameters, buffers with the running
statistics, optimizer state, every rank), the collectives the lowering emits, and the cost model."""
import warnings

import pytest
import torch
import torch.nn as nn

from conftest import ROOT
from rhino.capture import Workload, capture, default_dtype, load_workload
from rhino.cost.cluster import axis_links, parse_cluster
from rhino.cost.collectives import step_seconds
from rhino.cost.memory import estimate_memory
from rhino.cost.step import step_time
from rhino.ir.ops_nn import bn_training
from rhino.ir.registry import call_of
from rhino.lower.simulate_spmd import first_divergence
from rhino.lower.spmd import lower_rank
from rhino.lower.spmd_ops import redistribute
from rhino.runtime.exact import simulate_plan
from rhino.sharding.plan import resolve
from rhino.sharding.placement import ReduceOp
from rhino.sharding.presets import parse_strategy, preset_plan
from rhino.sharding.steps import AllReduce

_BN = ("aten._native_batch_norm_legit_functional.default", "aten._native_batch_norm_legit.no_stats",
       "aten._native_batch_norm_legit_no_training.default", "aten.native_batch_norm.default")
_BN_BACKWARD = "aten.native_batch_norm_backward.default"
_LOCAL_STEPS = ("LocalSlice", "LocalScale", "ZeroUnlessFirst")


def _capture64(build):
    """Capture a workload built in float64 (the default dtype restored after)."""
    with warnings.catch_warnings(), default_dtype(torch.float64):
        warnings.simplefilter("ignore")
        return capture(build())


# -- one batch norm, every split --------------------------------------------------------------------
class _Norm(nn.Module):
    """A batch norm after a learnt scale (so that its input gradient is needed)."""

    def __init__(self, bn, scaled: bool):
        super().__init__()
        self.bn = bn
        self.scale = nn.Parameter(torch.full((), 1.5)) if scaled else None

    def forward(self, x):
        return self.bn(x * self.scale if self.scale is not None else x)


def _single_bn(make, shape, eval_mode=False, scaled=True):
    def build():
        torch.manual_seed(0)
        bn = make()
        model = _Norm(bn, scaled)
        if bn.affine:
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
        if bn.track_running_stats:
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
        if eval_mode:
            model.eval()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(*shape, generator=g) * 3 + 2   # a mean far from zero tests the statistics' precision
        target = torch.randn(*shape, generator=g)
        opt = torch.optim.SGD([p for p in model.parameters()] or [nn.Parameter(torch.zeros(1))], lr=0.1)
        return Workload(model, opt, lambda m, a, t: (m(a) * t).sum(), (x.requires_grad_(False), target), "bn", "bn")
    return _capture64(build)


# (module, input shape, strategy of the batch norm nodes on a 2x2 mesh)
_CASES = [
    ("2d", lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), ("n", None)),
    ("2d", lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), ("n", "n")),
    ("2d", lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), ("n", "c")),
    ("2d", lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), ("c", "n")),
    ("2d", lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), ("n", "h0")),
    ("2d", lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), ("h1", "h0")),
    ("1d", lambda: nn.BatchNorm1d(6), (8, 6), ("n", "c")),
    ("1d-seq", lambda: nn.BatchNorm1d(6, momentum=0.3), (4, 6, 10), ("n", "h0")),
    ("no-affine", lambda: nn.BatchNorm2d(4, affine=False), (8, 4, 6, 6), ("n", "h0")),
    ("no-stats", lambda: nn.BatchNorm2d(4, track_running_stats=False), (8, 4, 6, 6), ("n", "n")),
    ("3d", lambda: nn.BatchNorm3d(2), (4, 2, 4, 2, 2), ("n", "h2")),
    ("input", lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), ("n", "h0")),   # no input gradient
]


@pytest.mark.parametrize("kind,make,shape,strategy", _CASES, ids=[f"{c[0]}-{'-'.join(map(str, c[3]))}" for c in _CASES])
def test_batch_norm_split_matches_one_device_per_op(kind, make, shape, strategy):
    """Forward and backward batch norm with the batch, spatial or channel dims split: every output of
    every node (assembled from all ranks, replicas equal) equals one device at 1e-12."""
    cap = _single_bn(make, shape, scaled=kind != "input")
    g = cap.graph
    plan = preset_plan(g, parse_strategy("dp=2,tp=2"))
    bn = [n for n in g.nodes if n.op in _BN or n.op == _BN_BACKWARD]
    assert len(bn) == 2
    for n in bn:
        plan.strategies[n.name] = strategy
    rp = resolve(g, plan)
    assert first_divergence(rp, cap.initial_state(), tuple(cap.workload.batch), rtol=1e-12, atol=1e-12) is None
    if "n" in strategy:   # a split batch: the statistics are all-reduced (one forward, one backward)
        stats = [x for x in lower_rank(rp, 0).module.graph.nodes if x.target is redistribute]
        assert len([x for x in stats if x.args[1] == "AllReduce"]) >= 2


def test_eval_mode_batch_norm_splits_the_batch_without_communication():
    cap = _single_bn(lambda: nn.BatchNorm2d(4), (8, 4, 6, 6), eval_mode=True)
    g = cap.graph
    forward = [n for n in g.nodes if n.op in _BN]
    assert len(forward) == 1 and not bn_training(call_of(g, forward[0]))
    plan = preset_plan(g, parse_strategy("dp=2,tp=2"))
    for n in g.nodes:
        if n.op in _BN or n.op == _BN_BACKWARD:
            plan.strategies[n.name] = ("n", "h0")
    rp = resolve(g, plan)
    assert first_divergence(rp, cap.initial_state(), tuple(cap.workload.batch), rtol=1e-12, atol=1e-12) is None
    bn_nodes = {lower_rank(rp, 0).value_nodes[v] for n in g.nodes if n.op in _BN for v in n.outputs if v is not None}
    prog = lower_rank(rp, 0).module.graph
    for x in prog.nodes:   # nothing communicated before the forward batch norm's output
        if x.name in bn_nodes:
            break
        assert x.target is not redistribute or x.args[1] in _LOCAL_STEPS, x.args


# -- whole models -------------------------------------------------------------------------------------
_MODELS = {"resnet": "resnet.py", "unet-bn": "unet.py:batchnorm"}
_CAPTURED = {}


def _model(name):
    if name not in _CAPTURED:
        _CAPTURED[name] = _capture64(lambda: load_workload(str(ROOT / "examples" / _MODELS[name])))
    return _CAPTURED[name]


@pytest.mark.parametrize("preset", ["dp=4", "dp=2,tp=2", "dp=4,zero=3"])
@pytest.mark.parametrize("name", sorted(_MODELS))
def test_batchnorm_cnns_under_presets_equal_one_device_in_float64(name, preset):
    """Every rank's losses and state shards (parameters, running statistics, optimizer state) against
    single-device training at 1e-9; the cost model's per-rank memory within 5% of the measured peak."""
    cap = _model(name)
    plan = preset_plan(cap.graph, parse_strategy(preset))
    r, res = simulate_plan(cap, plan)
    assert r.ok, r.first_mismatch
    assert r.max_abs_diff < 1e-9
    rp = resolve(cap.graph, plan)
    for rank, measured in enumerate(res["peaks"]):
        assert estimate_memory(cap.graph, rp, rank).peak == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_data_parallel_batchnorm_cnn_gathers_no_activation(name):
    """dp=4 splits every layer: the only collectives are all-reduces, of parameter gradients and of
    batch norm statistics ([2, C], one forward and one backward per batch norm)."""
    cap = _model(name)
    g = cap.graph
    rp = resolve(g, preset_plan(g, parse_strategy("dp=4")))
    for n in g.nodes:
        if n.op in _BN or n.op == "aten.convolution.default":
            assert rp.plan.strategies[n.name] == ("n",), n.name
    prog = lower_rank(rp, 0)
    kinds = [x.args[1] for x in prog.module.graph.nodes if x.target is redistribute]
    assert set(kinds) == {"AllReduce"}, kinds
    n_bn = sum(n.op in _BN for n in g.nodes)
    n_params = len(cap.param_names)
    assert n_bn > 0
    # statistics: 2 per batch norm; gradients: at most one per parameter (batch norm weight and bias
    # gradients come out of the statistics all-reduce already summed); the loss: its nll mean
    assert 2 * n_bn <= len(kinds) <= 2 * n_bn + n_params + 2
    assert len(kinds) < 2 * n_bn + n_params


def test_cost_model_prices_two_statistics_all_reduces_per_batch_norm():
    """The lowering emits one [2, C] all-reduce per batch norm forward and backward; the cost model
    prices exactly those nodes, each at one all-reduce of 2 * C values."""
    cap = _model("resnet")
    g = cap.graph
    cluster = parse_cluster("8xA100-80G")
    rp = resolve(g, preset_plan(g, parse_strategy("dp=8")))
    links = axis_links(cluster, rp.plan.mesh)
    st = step_time(rp, cluster.device, links)
    prog = lower_rank(rp, 0)
    stacked = {x for x in prog.module.graph.nodes if x.target is torch.ops.aten.stack.default}
    stats = [x for x in prog.module.graph.nodes if x.target is redistribute and x.args[1] == "AllReduce"
             and (x.args[0] in stacked or x.args[0].args[0] in stacked)]
    bn = [n for n in g.nodes if n.op in _BN or n.op == _BN_BACKWARD]
    assert len(stats) == len(bn) == 16
    costs = {c.name: c for c in st.nodes}
    for n in bn:
        channels = g.types[n.input_refs()[0].id].shape[1]
        want = step_seconds(AllReduce(0, ReduceOp.SUM), 2 * channels * 8, rp.plan.mesh, links)
        assert costs[n.name].comm == pytest.approx(want), n.name
    priced = sum(1 for c in st.nodes if c.comm > 0 and c.kind == "")   # custom all-reduces only
    assert priced == len(bn)
    # the gradients (weight decay included, an optimizer node) are reduced in buckets, as the runtime does
    assert st.collectives["AllReduce"] > len(bn) and st.comm_by_kind["gradient"] > 0


# -- search ---------------------------------------------------------------------------------------------
_UNET_64 = []


def _bn_unet_64():
    """The BatchNorm U-Net at batch 64 (64x64 images) on the meta device: compute dominates the per-step
    all-reduces, so data parallelism is the fastest plan. Captured once for the module (3 s): the O1 and O2
    searches read the same graph."""
    if not _UNET_64:
        _UNET_64.append(_capture_bn_unet_64())
    return _UNET_64[0]


def _capture_bn_unet_64():
    import sys
    sys.path.insert(0, str(ROOT / "examples"))
    import unet
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(Workload(*unet.batchnorm(batch=64, image=64, width=16, device="meta"), "unet-bn", "unet-bn")).graph


def _non_data_parallel(graph, plan):
    """Forward convolutions and batch norms whose batch is not split on every mesh axis."""
    rp = resolve(graph, plan)
    bad = []
    for n in graph.nodes:
        if n.op == "aten.convolution.default" or n.op in _BN:
            x = rp.node[n.name].inputs[0]
            if [getattr(p, "dim", None) for p in x] != [0] * plan.mesh.ndim:
                bad.append((n.name, plan.strategies.get(n.name)))
    return bad


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_search_returns_data_parallelism_for_a_batchnorm_unet_on_8_gpus(level):
    """Issue #13: with batch norm splittable, ``rhino plan`` on 8xA100-80G splits every convolution's
    and batch norm's batch on every mesh axis; at O1 the search itself finds it (rule ``dp_follow``:
    without it the greedy starts leave data parallelism at the first batch norm)."""
    from rhino.search.planning import plan_workload
    from rhino.search import Level, SearchOptions, search
    from rhino.search.report import axis_roles
    g = _bn_unet_64()
    cluster = parse_cluster("8xA100-80G")
    plan, report = plan_workload(g, cluster, level=level, time_limit=8 if level == "O1" else 15)
    assert _non_data_parallel(g, plan) == []
    roles = axis_roles(resolve(g, plan))
    assert all("data parallel" in x and "tensor parallel" not in x for x in roles), roles
    d = report.to_dict()
    assert d["source"] == "search"   # the searched plan, not a preset that priced faster
    if level == "O1":
        off = search(g, cluster, SearchOptions(level=Level.O1, time_limit=8, dp_follow=False))
        assert _non_data_parallel(g, off.plan) != []
        assert off.estimate.step_seconds > d["step_seconds"]


def test_bfloat16_batch_norm_over_a_split_batch_matches_one_device():
    """A bf16 model: statistics and per-channel arithmetic in float32 as the kernels do, outputs in the
    dtypes one device gives; equal within the bf16 tolerance of ``runtime.compare``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 1))
    model = model.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 6, 6, generator=g).to(torch.bfloat16)
    t = torch.randn(8, 4, 6, 6, generator=g).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Workload(model, opt, lambda m, a, b: ((m(a) - b) ** 2).mean(), (x, t), "bf16", "bf16"))
    plan = preset_plan(cap.graph, parse_strategy("dp=4"))
    assert all(plan.strategies[n.name] == ("n",) for n in cap.graph.nodes if n.op in _BN or n.op == _BN_BACKWARD)
    r, _ = simulate_plan(cap, plan)
    assert r.ok, r.first_mismatch
