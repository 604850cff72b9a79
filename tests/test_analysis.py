"""``ir.analysis``: one definition of storages, last uses, the loss boundary and node roles, and the
three memory models built on it agreeing.

The three consumers measure:

- the cost model, ``cost.memory.estimate_memory``: bytes live on one rank while each node runs (its
  inputs, outputs and everything still live), state included, exact sizes, the functional update (new
  state beside the old), local shapes under a plan, plus the plan's redistributed copies;
- the search's memory rows, ``search.memrows`` (``Builder.memory_row(i)`` priced by ``row_bytes`` at a
  choice of the cone classes): the same bytes at node ``i`` as a function of the choice, with the
  copies modelled on the safe side (a copy's source counts until its own last reader);
- the memory planner, ``memory.from_graph.problem_from_graph`` replayed in program order
  (``memory.simulate.replay``): one device's bytes per step. It keeps the persistent state outside
  the arena, rounds sizes up to 64 bytes and writes new state in place; the common quantity is the
  functional, unrounded problem with the state as tensors (``include_state=True, inplace_state=False,
  align=1``), which is what is compared. The planner has no rank-local view, so under a plan the
  comparison is cost model against rows.

On one device all three must give the same bytes at every node (and so the same peak). Under a plan
the rows keep redistributed copies on the safe side, a named rule of both models
(``search.memrows.ROWS_COPY_RULE`` = ``cost.memory.CopyRule.SOURCE_HELD``: a copy's source lives to its
last reader, a copy a view is taken of to the view's reach, ``ir.analysis.view_reach``); so under every
preset of ``sharding.presets`` on 2 and 4 ranks (dp, tp, sp, zero=1/2/3 and their combinations; not
``pp``, whose stages the rows do not model) the rows, evaluated at the preset's own shardings (each cone
class given the candidate the plan makes; classes of tied layers that the preset splits differently are
untied), must equal the cost model under that rule at every node, and the cost model under the runtime
rule must be at or below them (measured on all 7 examples x 14 presets: equal under the rule at every
node; the rows up to 33% above the runtime rule, ResNet ``dp=4,zero=3``). Sampled to keep the file
fast: every preset on ``mlp``; on the six other examples 14 pairs, preset ``m`` of ``PRESETS`` on example
``m mod 6`` (each preset once more, each example two or three); about 200 nodes per program plus each
model's peak node.
"""
import warnings
from functools import lru_cache

import pytest

from conftest import EXAMPLES, ROOT
from rhino.capture import capture, load_workload
from rhino.cost.cluster import axis_links, parse_cluster
from rhino.cost.memory import CopyRule, estimate_memory
from rhino.cost.step import step_time
from rhino.ir import analysis
from rhino.ir.analysis import NodeRole, analyze
from rhino.ir.graph import Role
from rhino.memory.from_graph import problem_from_graph
from rhino.memory.simulate import replay
from rhino.search import SearchOptions
from rhino.search.ilp import row_bytes
from rhino.search.memrows import ROWS_COPY_RULE
from rhino.search.problem import Builder, Derived
from rhino.search.space import normalize
from rhino.sharding.mesh import Mesh
from rhino.sharding.plan import resolve
from rhino.sharding.presets import parse_strategy, preset_plan

PRESETS = ["dp=2", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3", "tp=2", "tp=2,sp=on",
           "dp=4", "dp=4,zero=1", "dp=4,zero=2", "dp=4,zero=3", "tp=4", "tp=4,sp=on", "dp=2,tp=2", "dp=2,tp=2,sp=on"]
_OTHERS = [e for e in EXAMPLES if e != "mlp"]
PAIRS = [("mlp", p) for p in PRESETS] + [(_OTHERS[m % len(_OTHERS)], p) for m, p in enumerate(PRESETS)]


@lru_cache(maxsize=None)
def _graph(name: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(load_workload(str(ROOT / "examples" / f"{name}.py"))).graph


def _estimate_per_node(graph, rp=None, rule=CopyRule.RUNTIME, release_state=True) -> list[int]:
    """The cost model's bytes at each node (its peak over a one-node window)."""
    n = len(graph.nodes)
    mem = estimate_memory(graph, rp, windows=[(i, i + 1) for i in range(n)], copy_rule=rule,
                          release_state=release_state)
    return [b for b, _ in mem.window_peaks]


def _sample(n: int) -> list[int]:
    """About 200 nodes spread over the program (every node of a small one): a row costs a pass over
    every storage."""
    return list(range(0, n, max(1, n // 200)))


def _rows_per_node(builder: Builder, choice: list[int], nodes: list[int]) -> list[int]:
    return [row_bytes(builder.memory_row(i), choice) for i in nodes]


def _planner_per_node(graph) -> list[int]:
    problem, _ = problem_from_graph(graph, include_state=True, inplace_state=False, align=1)
    return replay(problem, problem.op_ids()).live


def _single_device(graph, release_state=True) -> tuple[list[int], list[int], list[int]]:
    """(cost model, rows, planner) bytes at the sampled nodes and at each model's own peak node. The rows
    free the replaced state at its last read, as the cost model does; the planner's functional problem
    (``inplace_state=False``) holds it to the end of the step, as the cost model's ``release_state=False``:
    ``release_state`` picks which of the two the cost model is compared with."""
    b = Builder(graph, Mesh(("a",), (1,)), parse_cluster("cpu:1"), SearchOptions())
    b.build()
    est, plan = _estimate_per_node(graph, release_state=release_state), _planner_per_node(graph)
    nodes = sorted(set(_sample(len(graph.nodes))) | {est.index(max(est)), plan.index(max(plan))})
    other = _rows_per_node(b, [0] * len(b.derived), nodes) if release_state else [plan[i] for i in nodes]
    return [est[i] for i in nodes], other, _estimate_per_node(graph, release_state=not release_state)


@pytest.mark.parametrize("name", EXAMPLES)
def test_cost_model_rows_and_planner_agree_on_one_device(name):
    g = _graph(name)
    est, rows, _ = _single_device(g)
    assert est == rows
    held, plan, _ = _single_device(g, release_state=False)
    assert held == plan
    assert max(_planner_per_node(g)) == estimate_memory(g, release_state=False).peak


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_the_runtime_rule_frees_replaced_state_at_its_last_read(name):
    """The runtime hands the state an update replaces to the program (``runtime.rank_step``), so the cost
    model frees it at its last read: the same bytes as with ``release_state=False`` until the first such read
    (less the state nothing reads: Adam's step counts), never more, and after the last node less by exactly the parameters, the optimizer state and the
    running statistics the step replaces (not the frozen ones)."""
    g = _graph(name)
    a = analyze(g)
    runtime, held = _estimate_per_node(g), _estimate_per_node(g, release_state=False)
    replaced = [i for i in g.inputs if i.name in {o.name for o in g.outputs}]
    unread = sum(g.types[i.value].nbytes for i in replaced if a.last_read[i.value] < 0)   # never live
    first = min(a.last_read[i.value] for i in replaced if a.last_read[i.value] >= 0) + 1
    assert first > min(a.optimizer) if name == "gpt" else first < a.boundary   # resnet: BatchNorm's statistics
    assert runtime[:first] == [h - unread for h in held[:first]] and all(r <= h for r, h in zip(runtime, held))
    state = sum(g.types[i.value].nbytes for i in replaced)
    assert state >= sum(g.types[i.value].nbytes for i in g.inputs if i.role is Role.PARAM) > 0
    end = estimate_memory(g).timeline[-1], estimate_memory(g, release_state=False).timeline[-1]
    assert end[1] - end[0] == state


def _plan_candidate(b: Builder, rp, members: list[int]) -> Derived | None:
    """The candidate of one cone class that the resolved plan ``rp`` makes: every slot's sharding as the
    plan produces or needs it; None if the class's cones (tied layers) get different ones."""
    g, mesh = b.graph, b.mesh
    seen = None
    for ci in members:
        cone = b.cones.cones[ci]
        produced = {("in", q): normalize(rp.value[b.inputs[name].value], mesh) for q, name in enumerate(cone.owned)}
        required = {}
        for pos, i in enumerate(cone.members):
            node = g.nodes[i]
            required.update({("m", pos, k): normalize(req, mesh) for k, req in enumerate(rp.node[node.name].inputs)})
            produced.update({("m", pos, j): normalize(rp.value[v], mesh) for j, v in enumerate(node.outputs)
                             if v is not None})
        if seen is not None and seen != (produced, required):
            return None
        seen = (produced, required)
    return Derived([], seen[0], seen[1], (0.0, 0.0, 0.0), {})


def _rows_at_plan(g, plan, rp) -> tuple[Builder, list[int]]:
    """A builder for the plan's mesh whose every class has the plan's candidate added, and that choice
    (layers untied if a tied class is split differently by the preset)."""
    for tie in (True, False):
        b = Builder(g, plan.mesh, parse_cluster(f"cpu:{plan.mesh.world}"), SearchOptions(tie_layers=tie))
        b.build()
        found = [_plan_candidate(b, rp, members) for members in b.cones.classes]
        if all(d is not None for d in found):
            for k, d in enumerate(found):
                b.derived[k].append(d)
            return b, [len(ders) - 1 for ders in b.derived]
    raise AssertionError("untied cones always take the plan's shardings")


@pytest.mark.parametrize("name,strategy", PAIRS)
def test_cost_model_and_rows_agree_under_presets(name, strategy):
    g = _graph(name)
    plan = preset_plan(g, parse_strategy(strategy))
    rp = resolve(g, plan)
    b, choice = _rows_at_plan(g, plan, rp)
    every, held = _estimate_per_node(g, rp), _estimate_per_node(g, rp, ROWS_COPY_RULE)
    nodes = sorted(set(_sample(len(g.nodes))) | {every.index(max(every)), held.index(max(held))})
    rows = _rows_per_node(b, choice, nodes)
    assert rows == [held[i] for i in nodes]
    assert all(every[i] <= r for i, r in zip(nodes, rows))
    assert max(every) == estimate_memory(g, rp).peak


def test_the_rows_copy_rule_is_a_safe_side_that_matters():
    """Under ``dp=2`` on the MLP the two rules differ (a gradient's partial sum held while its
    all-reduced copy exists: the rows above the runtime at some node, never below) and the rows follow
    the held one: rows priced under the runtime rule would fail the agreement."""
    g = _graph("mlp")
    plan = preset_plan(g, parse_strategy("dp=2"))
    rp = resolve(g, plan)
    b, choice = _rows_at_plan(g, plan, rp)
    every, held = _estimate_per_node(g, rp), _estimate_per_node(g, rp, CopyRule.SOURCE_HELD)
    rows = _rows_per_node(b, choice, list(range(len(g.nodes))))
    assert rows == held != every
    assert all(e <= h for e, h in zip(every, held))


def test_a_wrong_definition_fails_the_agreement(monkeypatch):
    """The agreement can fail: a last-use rule that frees every storage one node early (as if a
    reader did not count) makes the planner, which has its own replay, disagree."""
    g = _graph("mlp")
    real = analysis.GraphAnalysis.end_of

    def early(self, s, last_read):
        end = real(self, s, last_read)
        return end - 1 if 0 < end < self.n and self.born.get(s, -1) < end - 1 else end
    monkeypatch.setattr(analysis.GraphAnalysis, "end_of", early)
    analysis._CACHE.clear()
    try:
        held, plan, _ = _single_device(g, release_state=False)
        assert held != plan
    finally:
        monkeypatch.undo()
        analysis._CACHE.clear()


# -- definitions --------------------------------------------------------------------------------------
def test_roles_partition_the_step_around_the_loss():
    g = _graph("gpt")
    a = analyze(g)
    assert a is analyze(g)                        # computed once per graph
    assert a.roles[a.boundary] is NodeRole.LOSS
    assert all(r is NodeRole.FORWARD for r in a.roles[:a.boundary])
    assert {r for r in a.roles[a.boundary + 1:]} == {NodeRole.BACKWARD, NodeRole.OPTIMIZER}
    # every new state value is made by an optimizer node; one gradient per parameter
    made = {a.producer[o.value] for o in g.outputs if o.value in a.producer and o.name in a.updates}
    assert made <= a.optimizer
    params = [i for i in g.inputs if i.role.value == "param"]
    assert sum(g.types[s].nbytes for s in a.gradients) == sum(g.types[i.value].nbytes for i in params)


def test_views_share_their_base_storage_and_extend_its_life():
    g = _graph("mlp")
    a = analyze(g)
    for i, node in enumerate(g.nodes):
        if a.is_view[i]:
            base = a.root[node.input_refs()[0].id]
            assert all(a.root[v] == base for v in node.outputs if v is not None)
            assert a.last_use[base] >= i


def test_sgd_weight_decay_is_part_of_the_update_and_its_gradients_bucket():
    """``g + wd * p`` (SGD with weight decay, examples/mlp.py) reads a gradient and a parameter and feeds
    only the update: an optimizer node. The gradients it reads are then reduced in buckets, as the
    runtime (``lower/overlap.py``) buckets them, not one blocking all-reduce each."""
    g = _graph("mlp")
    a = analyze(g)
    params = {i.value for i in g.inputs if i.role.value == "param"}
    decay = [i for i, n in enumerate(g.nodes) if i > a.boundary and n.op == "aten.add.Tensor"
             and any(r.id in params for r in n.input_refs()) and not any(a.producer.get(r.id) in a.optimizer
                                                                         for r in n.input_refs())]
    assert len(decay) == len(params) and set(decay) <= a.optimizer
    rp = resolve(g, preset_plan(g, parse_strategy("dp=2")))
    cluster = parse_cluster("cpu:2")
    st = step_time(rp, cluster.device, axis_links(cluster, rp.plan.mesh))
    assert st.comm_by_kind["blocking"] == 0.0 and st.comm_by_kind["gradient"] > 0.0
    assert st.collectives.get("AllReduce", 0) < len(params)


def _forward_graph(with_loss: bool):
    """x -> n0 relu a -> n1 view v(a) -> n2 relu b(a) [the loss when ``with_loss``] -> n3 c = v + b."""
    from rhino.ir.graph import Graph, GraphOutput, Node, Ref, Role
    from rhino.ir.types import DType, TensorType
    g = Graph()
    t = TensorType((4, 4), DType.float32)
    x = g.add_input("x", Role.BATCH, t)
    vals = []
    for op, ins in [("aten.relu.default", ["x"]), ("aten.t.default", [0]), ("aten.relu.default", [0]),
                    ("aten.add.Tensor", [1, 2])]:
        v = g.new_value(t)
        g.nodes.append(Node(f"n{len(g.nodes)}", op, [Ref(x if k == "x" else vals[k]) for k in ins], {}, [v]))
        vals.append(v)
    if with_loss:
        g.outputs.append(GraphOutput("loss", Role.LOSS, vals[2]))
    return g, vals


def test_forward_queries_with_and_without_a_loss():
    """``at_or_before_loss`` (none without a loss: the search's critical classes and report) differs from
    ``is_forward`` (all without a loss) only there; ``last_forward_use`` follows views and stops at the
    loss; ``loss_node`` is None without a loss."""
    g, (a_, v_, b_, c_) = _forward_graph(True)
    a = analyze(g)
    assert a.loss_node == 2
    assert [a.at_or_before_loss(i) for i in range(4)] == [a.is_forward(i) for i in range(4)] == [True] * 3 + [False]
    assert a.last_forward_use(a_) == 2            # n1 (view) and n2 read a in the forward; n3 reads it via v after
    assert a.last_forward_use(b_) == 2            # only the backward-side n3 reads b: its producer
    g, (a_, v_, b_, c_) = _forward_graph(False)
    a = analyze(g)
    assert a.loss_node is None
    assert [a.at_or_before_loss(i) for i in range(4)] == [False] * 4
    assert [a.is_forward(i) for i in range(4)] == [True] * 4
    assert a.last_forward_use(a_) == 3 and a.last_forward_use(b_) == 3 and a.last_forward_use(c_) == 3


def test_draws_rng_names_the_sampling_ops():
    from rhino.ir.registry import draws_rng
    yes = ["aten.native_dropout.default", "aten.dropout.default", "aten.bernoulli_.float", "aten.rand.default",
           "aten.randn_like.default", "aten.randint.low", "aten.randperm.default", "aten.normal_.default",
           "aten.uniform_.default", "aten.multinomial.default", "aten.exponential_.default", "aten.random_.from",
           # torch.distributions' samplers
           "aten.poisson.default", "aten.binomial.default", "aten._standard_gamma.default",
           "aten._sample_dirichlet.default"]
    no = ["aten.relu.default", "aten.operand.default", "aten.abnormal.default", "aten.brand.default",
          "aten.randomize.default", "aten.mm.default"]
    assert [op for op in yes if not draws_rng(op)] == [] and [op for op in no if draws_rng(op)] == []
