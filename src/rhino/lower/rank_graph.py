"""A rank's program of a parallel plan as an IR graph: what the memory planner and the arena executor take.

``rank_graph(rp, rank)`` lowers the rank's blocking program (``lower.spmd.lower_rank``, the torch.fx code
``RankStep`` runs) and converts it back to an IR ``Graph`` of exactly that program: its aten calls with
this rank's local shapes (found by running the program once on the meta device), custom lowerings as the
several aten calls they emit, and each communication step (``spmd_ops.redistribute(x, kind, axis, ...)``)
as one node of op ``COMM_OP`` with arguments ``[x, kind, axis, *params]``. ``COMM_OP`` is deliberately not
in the op registry: unregistered ops are opaque, and the graph analysis gives an opaque op exactly the
facts a communication step has (it reads its input, its output is a fresh storage: the communication
buffer), while the registry's entries are sharding-rule ops that the exhaustive rule check runs against
torch. Inputs keep their names and roles (batch, parameter, optimizer state, ...), outputs are the loss and
the new state, and constants keep their values, so ``memory.from_graph.problem_from_graph``,
``memory.plan.plan_memory`` and ``lower.arena.ArenaProgram`` apply unchanged.

``rank_problem`` adds one constraint to the memory problem, **collective order**: the communication nodes
keep their relative program order (an ``after`` edge from each to the previous one). Every rank emits the
same communication sequence in program order, and collectives of one process group must be issued in the
same order on every rank, so a reordered rank still meets its peers (a plan made for one rank is valid
for any other whose problem is equal).

``memory.step_report.plan_rank_memory`` plans each *distinct* rank problem once (ranks whose problems are
equal share one plan); ``lower.arena_ranks`` runs the ranks in their arenas.

``probed_rank_problems`` builds as few rank programs as it can (each takes seconds on a large model):
shards are even (``sharding.placement.local_shape`` refuses others), so every rank lowers the same ops on
the same local shapes, and a rank's mesh coordinates enter its program only as constants (the offsets of
its shard of a split vocabulary or class dimension, the ``keep`` factor of a partial sum). Hence the probe
ranks (``probe_ranks``: the first, the last, and the last along each mesh axis) are built; where their
problems are equal, every rank's is theirs, else every rank's program is built. On the 7 examples under
dp=2,tp=2, dp=4,zero=3, tp=4 and dp=2,tp=2,sp=on, building every rank gave one distinct problem each time.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from ..ir.graph import STATE_ROLES, Graph, GraphInput, GraphOutput, Node, Ref, Role
from ..ir.registry import is_known, lookup
from ..ir.types import TensorType
from ..memory.from_graph import GraphMemory, problem_from_graph
from ..memory.problem import MemProblem
from ..sharding.plan import ResolvedPlan
from ..capture.fallbacks import fake_fallbacks
from ..capture.to_ir import fx_arg, ir_dtype, torch_dtype
from ..sharding.steps import after_step
from .fx import overload_of
from .spmd import lower_rank
from .spmd_ops import redistribute, step_from_args

__all__ = ["COMM_OP", "RankMemory", "rank_graph", "rank_problem", "rank_memories", "probe_ranks",
           "probed_rank_problems", "comm_shape", "is_comm"]

COMM_OP = "rhino.redistribute.default"


def is_comm(op: str) -> bool:
    """Whether an IR op name is a rank graph's communication step."""
    return op == COMM_OP


@dataclass
class RankMemory:
    """One rank's program as a graph and its memory problem (``problem_from_graph`` + collective order)."""

    rank: int
    graph: Graph
    problem: MemProblem
    mapping: GraphMemory


def comm_shape(shape: tuple[int, ...], kind: str, axis: int, params: tuple, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """This rank's local shape after one communication step (``spmd_ops.step_args`` form)."""
    return after_step(shape, step_from_args(kind, axis, *params), sizes)



def _op_name(target) -> str:
    ns, name = target._schema.name.split("::")
    return f"{ns}.{name}.{target._overloadname or 'default'}"


class _Converter:
    """fx program -> IR graph, shapes from a meta-device run (module docstring)."""

    def __init__(self, rp: ResolvedPlan, rank: int) -> None:
        self.rp, self.rank = rp, rank
        self.g = Graph(meta={"workload": rp.graph.meta.get("workload", ""), "rank": rank})
        self.ref: dict[torch.fx.Node, Ref | list] = {}    # fx node -> Ref (or a multi node's [IR node, results])
        self.meta: dict[torch.fx.Node, object] = {}      # fx node -> meta tensor (or tuple of them)

    def _value(self, t: torch.Tensor) -> int:
        return self.g.new_value(TensorType(tuple(t.shape), ir_dtype(t.dtype)))

    def convert(self, prog) -> Graph:
        graph = self.rp.graph
        inputs = {i.name: i for i in graph.inputs}
        consts = {f"_const{v}": v for v in graph.constants}
        k = 0
        for n in prog.module.graph.nodes:
            if n.op == "placeholder":
                name = prog.input_names[k]
                k += 1
                src = inputs[name]
                t = torch.empty(self.rp.local_shape(src.value), dtype=getattr(torch, graph.types[src.value].dtype.value),
                                device="meta")
                vid = self._value(t)
                self.g.inputs.append(GraphInput(name, src.role, vid))
                self.ref[n], self.meta[n] = Ref(vid), t
            elif n.op == "get_attr":
                gv = consts[n.target]
                vid = self.g.new_value(graph.types[gv])
                self.g.constants[vid] = list(graph.constants[gv])
                self.ref[n] = Ref(vid)
                t = graph.types[gv]
                self.meta[n] = torch.empty(t.shape, dtype=getattr(torch, t.dtype.value), device="meta")
            elif n.op == "call_function":
                self._call(n)
            elif n.op == "output":
                self._outputs(prog, n.args[0], inputs)
        return self.g

    def _call(self, n: torch.fx.Node) -> None:
        if n.target is operator.getitem and isinstance(self.ref[n.args[0]], Ref):   # t[i]: a select view
            res = self.meta[n.args[0]][n.args[1]]
            vid = self._value(res)
            self.g.nodes.append(Node(n.name, _op_name(torch.ops.aten.select.int), [self.ref[n.args[0]], 0, n.args[1]], {}, [vid]))
            self.ref[n], self.meta[n] = Ref(vid), res
            return
        if n.target is operator.getitem:
            node, res = self.ref[n.args[0]]
            i = n.args[1]
            if node.outputs[i] is None:
                node.outputs[i] = self._value(res[i])
            self.ref[n], self.meta[n] = Ref(node.outputs[i]), res[i]
            return
        args = [fx_arg(a, self.ref) for a in n.args]
        kwargs = {k: fx_arg(v, self.ref) for k, v in n.kwargs.items()}
        if n.target is redistribute:
            x = self.meta[n.args[0]]
            shape = comm_shape(tuple(x.shape), n.args[1], n.args[2], tuple(n.args[3:]), self.rp.plan.mesh.sizes)
            t = torch.empty(shape, dtype=x.dtype, device="meta")
            vid = self._value(t)
            self.g.nodes.append(Node(n.name, COMM_OP, args, kwargs, [vid]))
            self.ref[n], self.meta[n] = Ref(vid), t
            return
        target = overload_of(n.target)
        if not isinstance(target, torch._ops.OpOverload):
            raise ValueError(f"the rank program calls {n.target!r}, which a rank graph cannot hold (gradient "
                             f"accumulation over micro-batches is not supported with a memory plan)")
        margs = torch.fx.node.map_arg(n.args, lambda a: self.meta[a])
        mkwargs = torch.fx.node.map_arg(n.kwargs, lambda a: self.meta[a])
        res = _meta_call(target, margs, mkwargs)
        if res is None:                 # an op returning nothing (a check such as _linalg_check_errors)
            self.g.nodes.append(Node(n.name, _op_name(target), args, kwargs, []))
            self.ref[n], self.meta[n] = None, None
            return
        if isinstance(res, (tuple, list)):
            node = Node(n.name, _op_name(target), args, kwargs, [None] * len(res), multi=True)
            self.g.nodes.append(node)
            self.ref[n], self.meta[n] = [node, res], res
            return
        vid = self._value(res)
        self.g.nodes.append(Node(n.name, _op_name(target), args, kwargs, [vid]))
        self.ref[n], self.meta[n] = Ref(vid), res

    def _outputs(self, prog, results, inputs: dict[str, GraphInput]) -> None:
        for name, r in zip(prog.output_names, results):
            src = inputs.get(name)
            role = src.role if src is not None and src.role in STATE_ROLES else Role.LOSS
            self.g.outputs.append(GraphOutput(name, role, self.ref[r].id))


def _meta_call(op, args, kwargs):
    """``op``'s outputs as meta tensors. An op with a sharding rule (``ir.registry.is_known``) runs on meta
    tensors (its rule is checked against torch), with the output dtypes capture found (``_cpu_dtypes``). An
    opaque op runs on fake CPU tensors, as capture ran it: its meta kernel may answer for the meta device
    (``_embedding_bag``'s ``max_indices``: empty on meta, one per bag on CPU) or be missing
    (``_ctc_loss_backward``: FakeTensorMode runs the CPU kernel on zeros)."""
    if is_known(_op_name(op)):
        out = op(*args, **kwargs)
        want = _cpu_outputs(op, args, kwargs)
        if want is None:
            return out
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        fixed = [t if not isinstance(t, torch.Tensor) or w is None else
                 torch.empty((0,), dtype=w[0], device="meta") if w[1] else
                 torch.empty_strided(t.shape, t.stride(), dtype=w[0], device="meta") for t, w in zip(outs, want)]
        return type(out)(fixed) if isinstance(out, (tuple, list)) else fixed[0]
    return _fake_cpu_call(op, args, kwargs)


def _fake_cpu_call(op, args, kwargs):
    """``op`` on fake CPU tensors, as capture ran it, with the output dtypes the CPU kernel gives where the fake
    kernel's differ (the registry's ``cpu_dtypes``); meta tensors out."""
    with FakeTensorMode():
        fake = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                        if isinstance(t, torch.Tensor) else t, (args, kwargs))
        out = op(*fake[0], **fake[1])
    fix = getattr(lookup(_op_name(op)), "cpu_dtypes", None)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    dtypes = [t.dtype if isinstance(t, torch.Tensor) else None for t in outs]
    if fix is not None:
        ins = [ir_dtype(t.dtype) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        fixed = fix(ins, [ir_dtype(d) if d is not None else None for d in dtypes])
        dtypes = [torch_dtype(f) if f is not None else d for f, d in zip(fixed, dtypes)]
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=d, device="meta") if isinstance(t, torch.Tensor) else t
             for t, d in zip(outs, dtypes)]
    return type(out)(metas) if isinstance(out, (tuple, list)) else metas[0]


def _cpu_outputs(op, args, kwargs) -> tuple | None:
    """Where ``op``'s outputs on CPU (fake) tensors, as capture traced it, differ from the meta kernel's: per
    output None (the same) or (its CPU dtype, whether the CPU gives an empty ``[0]`` tensor); ``None`` where all
    agree. A meta kernel may follow the CUDA kernel: ``native_layer_norm`` of a bf16 input gives float32 mean and
    rstd on meta but bf16 on the CPU (a meta-typed rank graph gave those values float32 arena slots and the CPU
    backward refused them), and batch norm without training statistics gives ``[C]`` saved statistics on meta
    but empty ones on the CPU. Asked once per op, argument dtypes and non-tensor arguments (neither answer
    depends on the shapes), so repeated layers and ranks cost one fake call."""
    key = (op, repr(tree_map(lambda t: t.dtype if isinstance(t, torch.Tensor) else t, (args, kwargs))))
    if key not in _CPU_OUTPUTS:
        try:
            out = _fake_cpu_call(op, args, kwargs)
            meta = op(*args, **kwargs)
        except (NotImplementedError, RuntimeError, TypeError, ValueError):
            out = meta = None
        outs, metas = ([list(x) if isinstance(x, (tuple, list)) else [x] for x in (out, meta)]
                       if out is not None else ([], []))
        fixes = tuple(None if not (isinstance(o, torch.Tensor) and isinstance(m, torch.Tensor)) else
                      (o.dtype, True) if o.shape == (0,) and m.numel() > 0 else
                      (o.dtype, False) if o.dtype != m.dtype else None for o, m in zip(outs, metas))
        _CPU_OUTPUTS[key] = fixes if len(outs) == len(metas) and any(f is not None for f in fixes) else None
    return _CPU_OUTPUTS[key]


_CPU_OUTPUTS: dict = {}   # (op, argument dtypes and values) -> _cpu_outputs' answer


def rank_graph(rp: ResolvedPlan, rank: int) -> Graph:
    """The IR graph of the whole-step program rank ``rank`` runs under ``rp`` (blocking collectives)."""
    if rp.plan.microbatches > 1:
        raise ValueError(f"a memory plan per rank needs one micro-batch; the plan has "
                         f"microbatches={rp.plan.microbatches}")
    with torch.no_grad(), fake_fallbacks():   # opaque ops run on fake tensors, as in capture (``_meta_call``)
        prog = lower_rank(rp, rank, "meta")
        return _Converter(rp, rank).convert(prog)


def rank_problem(graph: Graph, *, inplace_state: bool = True) -> tuple[MemProblem, GraphMemory]:
    """``problem_from_graph`` of a rank graph plus the collective-order constraint (module docstring)."""
    problem, mapping = problem_from_graph(graph, inplace_state=inplace_state,
                                          name=f"{graph.meta.get('workload', '')} rank {graph.meta.get('rank', 0)}")
    comm = [i for i, n in enumerate(graph.nodes) if is_comm(n.op)]
    if len(comm) > 1:
        ops = list(problem.ops)
        for prev, i in zip(comm, comm[1:]):
            ops[i] = dataclasses.replace(ops[i], after=tuple(sorted(set(ops[i].after) | {prev})))
        problem = MemProblem(ops, problem.tensors, problem.name)
    problem.validate()
    return problem, mapping


def rank_memories(rp: ResolvedPlan, ranks=None) -> list[RankMemory]:
    """Each rank's graph and memory problem (all ranks of the mesh by default)."""
    out = []
    for r in (range(rp.plan.mesh.world) if ranks is None else ranks):
        g = rank_graph(rp, r)
        problem, mapping = rank_problem(g)
        out.append(RankMemory(r, g, problem, mapping))
    return out


def probe_ranks(mesh) -> list[int]:
    """Rank 0, the last rank, and for each mesh axis the rank at its last coordinate (0 on the others): the
    first and last shard along every axis."""
    last = [mesh.rank_of(tuple(s - 1 if a == b else 0 for b, s in enumerate(mesh.sizes))) for a in range(mesh.ndim)]
    return sorted({0, mesh.world - 1, *last})


def probed_rank_problems(rp: ResolvedPlan, say=lambda message: None, probe: bool = True) -> tuple[
        list[int], list[tuple[int, MemProblem, GraphMemory]]]:
    """(the ranks whose programs were built, (rank, problem, mapping) for every rank): the probe ranks'
    programs, and the others' only where those differ (module docstring; ``probe=False``: every rank's)."""
    from ..memory.step_report import problem_key
    world = rp.plan.mesh.world
    first = probe_ranks(rp.plan.mesh) if probe else list(range(world))
    built: dict[int, RankMemory] = {}
    for k, r in enumerate(first):
        say(f"building rank {r}'s program ({k + 1} of {len(first)}) ...")
        built[r] = rank_memories(rp, [r])[0]
    if len({problem_key(m.problem) for m in built.values()}) > 1:
        for r in range(world):
            if r not in built:
                say(f"building rank {r}'s program (the probe ranks' programs differ) ...")
                built[r] = rank_memories(rp, [r])[0]
    shared = built[first[0]]
    rows = [(r, built.get(r, shared).problem, built.get(r, shared).mapping) for r in range(world)]
    return sorted(built), rows
