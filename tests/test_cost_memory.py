"""Memory accounting with liveness: hand-computed peaks on tiny graphs, the captured MLP (single device
and sharded), and an independent check against a real execution that tracks live tensor storages."""
from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.fx

from conftest import ROOT
from rhino.capture import capture, load_workload
from rhino.cost.memory import estimate_memory
from rhino.ir.graph import Graph, GraphOutput, Node, Ref, Role
from rhino.ir.types import DType, TensorType
from rhino.lower.fx import lower
from rhino.sharding.mesh import Mesh
from rhino.sharding.placement import Shard
from rhino.sharding.plan import ShardingPlan, resolve
from rhino.sharding.presets import parse_strategy, preset_plan

F32 = DType.float32


def f32(*shape: int) -> TensorType:
    return TensorType(tuple(shape), F32)


def node(g: Graph, op: str, args: list, out: TensorType, kwargs=None) -> int:
    v = g.new_value(out)
    g.nodes.append(Node(f"n{len(g.nodes)}", op, args, kwargs or {}, [v]))
    return v


RELU, T, VIEW = "aten.relu.default", "aten.t.default", "aten.view.default"


# -- hand-built graphs ----------------------------------------------------------------------
def test_chain_frees_after_last_use():
    g = Graph()
    x = g.add_input("x", Role.BATCH, f32(100))          # 400 bytes
    a = node(g, RELU, [Ref(x)], f32(100))
    b = node(g, RELU, [Ref(a)], f32(100))
    c = node(g, RELU, [Ref(b)], f32(100))
    g.outputs.append(GraphOutput("loss", Role.LOSS, c))
    e = estimate_memory(g)
    assert e.peak == 800 and e.peak_node == "n0"       # input + output of one relu
    assert e.timeline == [400, 400, 400]
    assert e.batch == 400 and e.params == e.optimizer == e.gradients == 0


def _view_graph(with_view: bool) -> Graph:
    g = Graph()
    x = g.add_input("x", Role.BATCH, f32(10, 10))
    a = node(g, RELU, [Ref(x)], f32(10, 10))
    v = node(g, T, [Ref(a)], f32(10, 10)) if with_view else a
    b = node(g, RELU, [Ref(v)], f32(10, 10))
    g.outputs.append(GraphOutput("loss", Role.LOSS, b))
    return g


def test_views_add_no_memory():
    plain, viewed = estimate_memory(_view_graph(False)), estimate_memory(_view_graph(True))
    assert viewed.peak == plain.peak == 800
    assert viewed.timeline == [plain.timeline[0], plain.timeline[0], plain.timeline[1]]


def test_view_extends_lifetime_of_its_base():
    g = Graph()
    x = g.add_input("x", Role.BATCH, f32(100))
    a = node(g, RELU, [Ref(x)], f32(100))               # n0
    v = node(g, VIEW, [Ref(a), [10, 10]], f32(10, 10))  # n1: aliases a
    b = node(g, RELU, [Ref(a)], f32(100))               # n2: last direct use of a
    c = node(g, RELU, [Ref(b)], f32(100))               # n3: a (via v), b, c live
    d = node(g, "aten.add.Tensor", [Ref(c), Ref(v)], f32(100))  # n4: last use of v
    g.outputs.append(GraphOutput("loss", Role.LOSS, d))
    e = estimate_memory(g)
    assert e.timeline == [400, 400, 800, 800, 400]
    assert e.peak == 1200 and e.peak_node == "n3"


def train_graph() -> Graph:
    """loss = sum(relu(x @ w)); gw = x^T (h * loss); m' = m + gw; w' = w + m'."""
    g = Graph()
    w = g.add_input("w", Role.PARAM, f32(4, 4))          # 64
    m = g.add_input("opt/w/m", Role.OPT_STATE, f32(4, 4))  # 64
    x = g.add_input("batch/0", Role.BATCH, f32(2, 4))    # 32
    y = node(g, "aten.mm.default", [Ref(x), Ref(w)], f32(2, 4))          # n0 temporary
    h = node(g, RELU, [Ref(y)], f32(2, 4))                               # n1 activation
    loss = node(g, "aten.sum.dim_IntList", [Ref(h), [0, 1], False], f32())  # n2 loss (boundary)
    gh = node(g, "aten.mul.Tensor", [Ref(h), Ref(loss)], f32(2, 4))      # n3 temporary
    xt = node(g, T, [Ref(x)], f32(4, 2))                                 # n4 view
    gw = node(g, "aten.mm.default", [Ref(xt), Ref(gh)], f32(4, 4))      # n5 gradient
    m2 = node(g, "aten.add.Tensor", [Ref(m), Ref(gw)], f32(4, 4))        # n6 new state
    w2 = node(g, "aten.add.Tensor", [Ref(w), Ref(m2)], f32(4, 4))        # n7 new state
    g.outputs += [GraphOutput("loss", Role.LOSS, loss), GraphOutput("w", Role.PARAM, w2),
                  GraphOutput("opt/w/m", Role.OPT_STATE, m2)]
    return g


def test_train_step_peak_and_categories_by_hand():
    e = estimate_memory(train_graph())
    # n6 is m's last read, n7 w's: the runtime hands both to the update, so each dies there (in place)
    assert e.timeline == [192, 192, 196, 196, 196, 196, 132, 132]
    assert e.peak == 260 and e.peak_node == "n5"
    held = estimate_memory(train_graph(), release_state=False)   # the functional program keeps them
    assert held.timeline == [192, 192, 196, 196, 196, 196, 196, 260] and held.peak == 260
    assert (e.params, e.optimizer, e.batch, e.buffers) == (64, 64, 32, 0)
    assert e.gradients == 64                 # gw
    assert e.activations == 32 + 4           # h (read in backward) and the loss
    assert e.updated_state == 128            # new w and m (each made as the old one is read last)
    assert e.temporaries == 32               # y, then gh
    assert e.breakdown == {"params": 64, "optimizer": 64, "buffers": 0, "batch": 32, "activations": 4,
                           "gradients": 64, "updated_state": 0, "temporaries": 32}
    assert sum(e.breakdown.values()) == e.peak


def test_redistributed_copy_replaces_its_source():
    """As the lowering runs it: the copy is made before the node (source and copy live), then a source
    read by nothing else is freed before the node runs."""
    g = Graph()
    x = g.add_input("x", Role.BATCH, f32(8))             # 32 bytes global, 16 local on dp=2
    a = node(g, RELU, [Ref(x)], f32(8))                  # replicated strategy: needs all of x
    g.outputs.append(GraphOutput("loss", Role.LOSS, a))
    rp = resolve(g, ShardingPlan(Mesh(("dp",), (2,)), {"x": (Shard(0),)}, {}))
    e = estimate_memory(g, rp, rank=1)
    assert e.batch == 16
    assert e.peak == 32 + 32                             # gathered copy + output (local x freed)
    assert e.timeline == [32] and e.temporaries == 32
    with pytest.raises(ValueError, match="rank 2"):
        estimate_memory(g, rp, rank=2)
    with pytest.raises(ValueError, match="without a plan"):
        estimate_memory(g, rank=1)


def b_name(g: Graph, index: int) -> str:
    return g.nodes[index].name


def test_redistributed_copy_is_shared_and_keeps_a_live_source():
    """One copy per value and target sharding, live from its first to its last reader; a source still
    read directly later stays live beside it."""
    g = Graph()
    x = g.add_input("x", Role.BATCH, f32(8))             # 16 local bytes on dp=2
    a = node(g, RELU, [Ref(x)], f32(8))                  # replicated: reads the gathered copy (32)
    b = node(g, RELU, [Ref(x)], f32(8))                  # split: reads local x directly (16 out)
    c = node(g, "aten.add.Tensor", [Ref(x), Ref(a)], f32(8))  # replicated again: the same copy
    g.outputs.append(GraphOutput("loss", Role.LOSS, c))
    g.outputs.append(GraphOutput("b", Role.BUFFER, b))
    plan = ShardingPlan(Mesh(("dp",), (2,)), {"x": (Shard(0),)}, {b_name(g, 1): ("e0",)})
    rp = resolve(g, plan)
    e = estimate_memory(g, rp, rank=0)
    # n1 runs with x 16 + copy 32 + a 32 + b 16 = 96; x's last reader is n1, so n2 runs with
    # copy 32 + a 32 + b 16 + its output 32 = 112
    assert e.peak == 32 + 32 + 16 + 32
    assert e.timeline == [16 + 32 + 32, 32 + 32 + 16, 16 + 32]
    assert e.temporaries == 32 + 32                      # the copy and a


def test_rejects_bad_graphs():
    g = Graph()
    g.nodes.append(Node("n0", RELU, [Ref(7)], {}, [None]))
    with pytest.raises(ValueError, match="before it is defined"):
        estimate_memory(g)
    with pytest.raises(ValueError, match="Graph"):
        estimate_memory("not a graph")


def _chain(n: int) -> Graph:
    g = Graph()
    prev = g.add_input("x", Role.BATCH, f32(64, 64))
    w = g.add_input("w", Role.PARAM, f32(64, 64))
    for i in range(n):
        if i % 3 == 2:
            prev = node(g, T, [Ref(prev)], f32(64, 64))
        else:
            prev = node(g, "aten.add.Tensor", [Ref(prev), Ref(w)], f32(64, 64))
    g.outputs.append(GraphOutput("loss", Role.LOSS, prev))
    return g


def test_near_linear_on_15000_nodes():
    """10x the nodes costs well under 100x the time (a quadratic pass would): a ratio of the fastest of
    three runs each, measured back to back, so machine load hits both sizes alike."""
    small, large = _chain(1_500), _chain(15_000)
    estimate_memory(small)  # warm the op registry

    def fastest(g):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            e = estimate_memory(g)
            best = min(best, time.perf_counter() - start)
        return best, e
    t_small, _ = fastest(small)
    t_large, e = fastest(large)
    assert e.peak == 3 * 64 * 64 * 4
    assert t_large / t_small < 40, f"15,000 nodes took {t_large / t_small:.0f}x the time of 1,500"


# -- the captured MLP --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(load_workload(str(ROOT / "examples" / "mlp.py")))


def _bytes(graph: Graph, *roles: Role) -> int:
    return sum(graph.types[i.value].nbytes for i in graph.inputs_by_role(*roles))


def test_mlp_state_categories(mlp):
    g = mlp.graph
    e = estimate_memory(g)
    assert e.params == _bytes(g, Role.PARAM, Role.FROZEN)
    assert e.optimizer == _bytes(g, Role.OPT_STATE)
    assert e.gradients == e.params          # one gradient per trainable parameter (SGD)
    assert e.updated_state == e.params + e.optimizer
    assert e.peak >= e.params + e.optimizer + e.buffers
    assert e.activations > 0 and len(e.timeline) == len(g.nodes)


def test_mlp_sharded(mlp):
    g = mlp.graph
    single = estimate_memory(g)
    zero = estimate_memory(g, resolve(g, preset_plan(g, parse_strategy("dp=4,zero=3"))))
    ratio = (zero.params + zero.optimizer) / (single.params + single.optimizer)
    assert ratio == pytest.approx(0.25, rel=0.05)
    dp = estimate_memory(g, resolve(g, preset_plan(g, parse_strategy("dp=4"))))
    assert dp.params == single.params and dp.optimizer == single.optimizer
    assert dp.activations / single.activations == pytest.approx(0.25, rel=0.05)
    assert dp.batch * 4 == single.batch


# -- independent check: real execution, live storages ----------------------------------------
class _Meter(torch.fx.Interpreter):
    """Runs the lowered graph node by node (fx frees each value after its last use) and records the
    bytes of distinct tensor storages live while each node runs (its inputs, outputs, held state)."""

    def __init__(self, gm, held):
        super().__init__(gm, garbage_collect_values=True)
        self.held = held
        self.peak = 0

    def run_node(self, n):
        result = super().run_node(n)
        storages = {}
        stack = list(self.env.values()) + [result] + list(self.held)
        while stack:
            v = stack.pop()
            if isinstance(v, torch.Tensor):
                s = v.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
        self.peak = max(self.peak, sum(storages.values()))
        return result


def test_mlp_peak_matches_real_execution(mlp):
    g = mlp.graph
    state = mlp.initial_state()
    batch = mlp.workload.batch
    args = [batch[int(i.name.split("/")[1])] if i.role is Role.BATCH else state[i.name] for i in g.inputs]
    replaced = {o.name for o in g.outputs}         # handed to the program, as the runtime does: not held
    held = [a for a, i in zip(args, g.inputs) if i.role is not Role.BATCH and i.name not in replaced]
    meter = _Meter(lower(g), held)
    with torch.no_grad():
        meter.run(*args)
    est = estimate_memory(g).peak
    ratio = meter.peak / est
    print(f"measured peak {meter.peak} B, estimated {est} B, ratio {ratio:.4f}")
    assert ratio == pytest.approx(1.0, abs=0.10)
