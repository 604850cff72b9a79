"""Exhaustive check of the sharding rules of one op call against torch.

For one call with real tensors (float64 for floating point), the call is recorded as a one-node IR
graph; every strategy the rules allow on a mesh is enumerated (per mesh axis: replicated, each letter
``candidate_letters`` allows, its strided split ``x/2`` where the local size divides, and each partial
passthrough ``partial_inputs`` allows; the product over axes, minus what ``node_shardings`` or the
divisibility check rejects). For each strategy the inputs are placed as the node requires
(``sharding.simulate.shard``: Replicate, Shard(d), strided Shard(d, blocks), Partial inputs split
into random integer addends that sum to the value), every rank's program comes from ``lower_rank``
(the runtime's lowering, custom lowerings included) and runs in lockstep with simulated collectives,
each output is assembled from the shards (replicas must agree, Partial outputs are reduced) and
compared with the unsharded op: ``ok`` when ``|got - want| <= tol * max(1, |want|)`` everywhere.

Ops whose values are random or unspecified (``rand``, ``empty``, ...) are checked by each rank's
local shape and dtype only. Outputs of a float type narrower than float64 (a cast) are compared at
a few units of their own rounding; everything else at ``TOL`` = 1e-12.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..ir.annotation import letter_sizes
from ..ir.graph import Graph, Node, Ref, Role
from ..ir.registry import OpKind, Values, annotate, call_of, lookup
from ..ir.types import Device, DType, Layout, MemoryFormat, TensorType
from ..sharding import simulate
from ..sharding.mesh import Mesh
from ..sharding.placement import Partial, local_shape
from ..sharding.plan import PlanError, ShardingPlan, node_shardings, resolve
from ..sharding.rules import StrategyError, candidate_letters, partial_inputs
from ..sharding.vocab import passthrough, strided
from .fx import resolve_op
from .simulate_spmd import lockstep
from .spmd import lower_rank

__all__ = ["RuleResult", "RecordedCall", "record_call", "strategies", "check_strategy", "check_call",
           "MESHES", "VALUES_UNSPECIFIED"]

#: The meshes of the check: 2 ranks, and 2 x 2.
MESHES = (Mesh(("x",), (2,)), Mesh(("x", "y"), (2, 2)))

#: Output values (``ir.registry.Values``) of which only shapes and dtypes are compared: unspecified, or
#: random independent of the inputs (random ops with parameters, as dropout, are checked at p = 0 or 1).
VALUES_UNSPECIFIED = frozenset({Values.UNINITIALIZED, Values.NOISE})


@dataclass
class RuleResult:
    op: str
    mesh: tuple[int, ...]
    strategy: tuple
    ok: bool
    max_diff: float
    error: str = ""


@dataclass
class RecordedCall:
    op: str
    graph: Graph
    node: Node
    inputs: list[torch.Tensor]          # graph input values, in graph input order
    outputs: list[torch.Tensor | None]  # torch's results, one per node output


def _dtype(t: torch.Tensor) -> DType:
    return DType(str(t.dtype).removeprefix("torch."))


def _to_ir(a: Any, g: Graph, tensors: list) -> Any:
    if isinstance(a, torch.Tensor):
        tensors.append(a)
        return Ref(g.add_input(f"in{len(g.inputs)}", Role.BATCH, TensorType(tuple(a.shape), _dtype(a))))
    if isinstance(a, (list, tuple)):
        items = [_to_ir(x, g, tensors) for x in a]
        return items if isinstance(a, list) else tuple(items)
    if isinstance(a, dict):
        return {k: _to_ir(v, g, tensors) for k, v in a.items()}
    if isinstance(a, torch.dtype):
        return _dtype(torch.empty((), dtype=a))
    if isinstance(a, torch.device):
        return Device(a.type)
    if isinstance(a, torch.layout):
        return Layout(str(a).removeprefix("torch."))
    if isinstance(a, torch.memory_format):
        return MemoryFormat(str(a).removeprefix("torch."))
    if a is not None and not isinstance(a, (bool, int, float, str)):
        raise ValueError(f"argument {a!r} of type {type(a).__name__} cannot be recorded")
    return a


def record_call(op: str, args: Sequence, kwargs: dict | None = None) -> RecordedCall:
    """Run ``op`` on real tensors and record it as a one-node graph (tensor arguments are inputs)."""
    kwargs = dict(kwargs or {})
    if lookup(op) is None:
        raise ValueError(f"op {op} is not registered")
    result = resolve_op(op)(*args, **kwargs)
    g = Graph()
    tensors: list[torch.Tensor] = []
    ir_args, ir_kwargs = _to_ir(list(args), g, tensors), _to_ir(kwargs, g, tensors)
    multi = isinstance(result, (tuple, list))
    vals = list(result) if multi else [result]
    outs = [g.new_value(TensorType(tuple(v.shape), _dtype(v))) if isinstance(v, torch.Tensor) else None
            for v in vals]
    node = Node("n1", op, ir_args, ir_kwargs, outs, multi)
    g.nodes.append(node)
    ann = annotate(call_of(g, node))
    # an output the annotation leaves out (a masked-out gradient) has no specified value
    if ann is not None:
        for k, spec in enumerate(ann.outputs):
            if spec is None and k < len(outs):
                outs[k] = None
    node.outputs = outs
    return RecordedCall(op, g, node, tensors, [v if o is not None else None for v, o in zip(vals, outs)])


def _axis_options(call: RecordedCall, n: int) -> list:
    """Strategy entries for one mesh axis of size ``n`` (module docstring)."""
    ann = annotate(call_of(call.graph, call.node))
    if ann is None:
        return [None]
    sizes = letter_sizes(ann, [t.shape for t in call.inputs])
    letters = candidate_letters(ann, sizes, n)
    opts: list = [None] + letters + [strided(x, 2) for x in letters if sizes[x] % (2 * n) == 0]
    n_in = len(call.inputs)
    kind = lookup(call.op).kind
    for group in partial_inputs(call.op, kind is OpKind.VIEW, n_in, call.node.args, call.node.kwargs,
                                call.inputs[0].dtype if call.inputs else None):
        if all(call.inputs[k].is_floating_point() for k in group):
            opts.append(passthrough(group, n_in))
    return opts


def strategies(call: RecordedCall, mesh: Mesh) -> list[tuple]:
    """Every strategy the rules allow for ``call`` on ``mesh`` (module docstring)."""
    out = []
    for s in itertools.product(*[_axis_options(call, n) for n in mesh.sizes]):
        try:
            ns = node_shardings(call.graph, call.node, s, mesh)
            for t, sh in zip(call.inputs, ns.inputs):
                local_shape(t.shape, sh, mesh)
            for v, sh in zip(call.node.outputs, ns.outputs):
                if v is not None:
                    local_shape(call.graph.types[v].shape, sh, mesh)
        except (StrategyError, ValueError):
            continue
        out.append(s)
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().resolve_conj().resolve_neg().numpy()


def _tolerance(dtype) -> float:
    """1e-12 for float64 and exact types; a float output of lower precision: a few units of its rounding
    (a partial passthrough of a down-cast rounds each addend)."""
    if np.issubdtype(dtype, np.floating) and np.finfo(dtype).bits < 64:
        return 4 * float(np.finfo(dtype).eps)
    return TOL


def _diff(got: np.ndarray, want: np.ndarray, tol: float) -> tuple[float, bool]:
    """(max abs difference, within tolerance) of two arrays of equal shape (NaNs must match; complex ones
    part by part)."""
    if np.iscomplexobj(got) or np.iscomplexobj(want):
        got, want = (np.stack([a.real, a.imag], -1) for a in (got, want))
    g, w = got.astype(np.float64), want.astype(np.float64)
    nan = np.isnan(w)
    if not np.array_equal(nan, np.isnan(g)):
        return float("inf"), False
    g, w = np.where(nan, 0.0, g), np.where(nan, 0.0, w)
    same_inf = np.isinf(w) & (g == w)
    d = np.where(same_inf, 0.0, np.abs(g - w))
    if d.size == 0:
        return 0.0, True
    scale = np.maximum(1.0, np.where(np.isinf(w), 1.0, np.abs(w)))
    return float(d.max()), bool(np.all(d <= tol * scale))


TOL = 1e-12


def check_strategy(call: RecordedCall, mesh: Mesh, strategy: tuple, seed: int = 0) -> RuleResult:
    """Run ``strategy`` on ``mesh`` and compare every output with torch (module docstring)."""
    node, graph = call.node, call.graph
    try:
        ns = node_shardings(graph, node, strategy, mesh)
        plan = ShardingPlan(mesh, {i.name: ns.inputs[k] for k, i in enumerate(graph.inputs)},
                            {node.name: tuple(strategy)})
        rp = resolve(graph, plan)
        world = mesh.world
        locs: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for k, (inp, t) in enumerate(zip(graph.inputs, call.inputs)):
            if t.dtype is torch.bool and any(isinstance(p, Partial) for p in rp.value[inp.value]):
                raise ValueError("a bool input cannot be Partial")
            for r, piece in enumerate(simulate.shard(_np(t), rp.value[inp.value], mesh, seed + k)):
                locs[r].append(torch.from_numpy(np.array(piece)))
        progs = [lower_rank(rp, r) for r in range(world)]
        envs, _ = lockstep(progs, locs, mesh)
    except (StrategyError, PlanError, ValueError, RuntimeError, IndexError, TypeError, AssertionError) as exc:
        return RuleResult(call.op, mesh.sizes, tuple(strategy), False, float("inf"), f"{type(exc).__name__}: {exc}")
    worst, ok, error = 0.0, True, ""
    for vid, want in zip(node.outputs, call.outputs):
        if vid is None or want is None:
            continue
        pieces = [_np(envs[r][progs[r].value_nodes[vid]]) for r in range(world)]
        if lookup(call.op).values in VALUES_UNSPECIFIED:
            expect = local_shape(tuple(want.shape), rp.value[vid], mesh)
            if any(p.shape != expect or p.dtype != _np(want).dtype for p in pieces):
                return RuleResult(call.op, mesh.sizes, tuple(strategy), False, float("inf"),
                                  f"output {vid}: local shapes {[p.shape for p in pieces]} != {expect}")
            continue
        try:
            got = simulate.assemble(pieces, rp.value[vid], mesh)
        except (ValueError, AssertionError) as exc:
            return RuleResult(call.op, mesh.sizes, tuple(strategy), False, float("inf"),
                              f"output {vid} {rp.value[vid]}: {exc}")
        w = _np(want)
        if got.shape != w.shape or got.dtype != w.dtype:
            return RuleResult(call.op, mesh.sizes, tuple(strategy), False, float("inf"),
                              f"output {vid}: {got.dtype}{list(got.shape)} != {w.dtype}{list(w.shape)}")
        d, good = _diff(got, w, _tolerance(w.dtype))
        worst, ok = max(worst, d), ok and good
        if not good and not error:
            error = f"output {vid} {rp.value[vid]} differs by {d:.3g}"
    return RuleResult(call.op, mesh.sizes, tuple(strategy), ok, worst, error)


def check_call(op: str, args: Sequence, kwargs: dict | None = None, meshes: Sequence[Mesh] = MESHES,
               limit: int | None = None, seed: int = 0) -> list[RuleResult]:
    """Check every strategy of one call on each mesh; ``limit``: at most that many strategies per mesh,
    sampled deterministically (``seed``) when there are more (the replicated one always included)."""
    call = record_call(op, args, kwargs)
    out = []
    for mesh in meshes:
        cands = strategies(call, mesh)
        if limit is not None and len(cands) > limit:
            rng = np.random.default_rng(seed)
            keep = sorted(rng.choice(len(cands) - 1, size=limit - 1, replace=False) + 1)
            cands = [cands[0]] + [cands[i] for i in keep]
        out.extend(check_strategy(call, mesh, s, seed) for s in cands)
    return out
