"""A sharding plan: the mesh, each graph input's sharding and each node's strategy.

Everything else (every value's sharding, the redistributions before each node, the per-rank local
shapes) is derived from these by ``resolve``. Plans are data: JSON with a format version and the
fingerprint of the graph they were made for.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..ir.graph import Graph, Role
from ..ir.stages import Schedule, StageError, check_stage_fields
from ..ir.registry import OpCall, OutputRule, annotate, call_of, call_signature, lookup
from .mesh import Mesh
from .placement import Partial, Replicate, Shard, Sharding, format_sharding, local_shape, parse_placement, replicated
from .rules import NodeShardings, StrategyError, shardings_for
from .vocab import RECOMPUTE_MODES

__all__ = ["ShardingPlan", "ResolvedPlan", "resolve", "PLAN_FORMAT", "PlanError", "lowered_outputs", "RECOMPUTE_MODES",
           "check_step_fields"]

PLAN_FORMAT = 1


class PlanError(ValueError):
    """A plan that cannot be executed; the message names the tensor, dim and axis."""


@dataclass
class ShardingPlan:
    mesh: Mesh
    inputs: dict[str, Sharding]                  # graph input name -> sharding
    strategies: dict[str, tuple]                 # node name -> letter (or None) per mesh axis
    fingerprint: str = ""
    strategy_string: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    microbatches: int = 1                        # gradient accumulation: micro-batches per step
    recompute: str = "none"                      # a ``vocab.Recompute`` value: none | full | selective
    stages: int = 1                              # pipeline stages; ``mesh`` is one stage's mesh
    schedule: str = Schedule.ONE_F_ONE_B.value   # an ``ir.stages.Schedule`` value: 1f1b | gpipe
    stage_of: dict[str, int] = field(default_factory=dict)  # forward node name -> stage (empty: default cut)
    chunks: int = 1                              # model chunks per stage (interleaved schedule): virtual stages
                                                 # ``stages * chunks``, ``stage_of`` in those

    def __post_init__(self) -> None:
        check_step_fields(self.microbatches, self.recompute)
        try:
            check_stage_fields(self.stages, self.schedule, self.stage_of, self.chunks)
        except StageError as exc:
            raise PlanError(str(exc)) from None

    @property
    def world(self) -> int:
        """Devices of the whole job: ``stages`` stage meshes (stage-major ranks: stage ``s`` has ranks
        ``[s * mesh.world, (s + 1) * mesh.world)``)."""
        return self.stages * self.mesh.world

    def pipeline_dict(self) -> dict:
        """The plan file's ``"pipeline"`` object (``stage_of`` only with more than one stage)."""
        d = {"stages": self.stages, "microbatches": self.microbatches, "schedule": str(Schedule(self.schedule).value)}
        if self.chunks > 1:
            d["chunks"] = self.chunks
        if self.stages > 1:
            d["stage_of"] = dict(self.stage_of)
        return d

    def to_json(self) -> str:
        return json.dumps({
            "format": PLAN_FORMAT, "fingerprint": self.fingerprint, "strategy": self.strategy_string,
            "mesh": {"names": list(self.mesh.names), "sizes": list(self.mesh.sizes)},
            "inputs": {k: [str(p) for p in v] for k, v in self.inputs.items()},
            "strategies": {k: list(v) for k, v in self.strategies.items()},
            "pipeline": self.pipeline_dict(), "recompute": self.recompute,
            "meta": self.meta,
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ShardingPlan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"the plan file is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(d, dict):
            raise PlanError("the plan file must hold one JSON object, as rhino plan --out writes it")
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan format {d.get('format')!r} is not supported (expected {PLAN_FORMAT})")
        _check_layout(d)
        mesh = Mesh(tuple(d["mesh"]["names"]), tuple(d["mesh"]["sizes"]))
        pipeline = d.get("pipeline") or {}
        if not isinstance(pipeline, dict) or not isinstance(pipeline.get("stage_of", {}), dict):
            raise PlanError("the plan's \"pipeline\" must be an object with stages, microbatches, schedule and "
                            "stage_of (forward node name -> stage)")
        return cls(mesh, {k: tuple(parse_placement(p) for p in v) for k, v in d["inputs"].items()},
                   {k: tuple(v) for k, v in d["strategies"].items()}, d.get("fingerprint", ""),
                   d.get("strategy", ""), d.get("meta", {}), pipeline.get("microbatches", 1),
                   d.get("recompute", "none"), pipeline.get("stages", 1),
                   pipeline.get("schedule", Schedule.ONE_F_ONE_B.value), dict(pipeline.get("stage_of", {})),
                   pipeline.get("chunks", 1))




def _check_layout(d: dict) -> None:
    """``PlanError`` naming the first key of a plan file's object that is missing or of the wrong type (the
    values themselves are checked where they are parsed)."""
    again = "; write the plan again with rhino plan --out"
    missing = [k for k in ("mesh", "inputs", "strategies") if k not in d]
    if missing:
        raise PlanError(f"the plan file lacks {', '.join(repr(k) for k in missing)}{again}")
    mesh = d["mesh"]
    if not (isinstance(mesh, dict) and isinstance(mesh.get("names"), list) and isinstance(mesh.get("sizes"), list)
            and all(isinstance(n, str) for n in mesh["names"])
            and all(isinstance(n, int) and not isinstance(n, bool) for n in mesh["sizes"])):
        raise PlanError(f"the plan's \"mesh\" must be {{\"names\": [axis names], \"sizes\": [integers]}}{again}")
    for key in ("inputs", "strategies"):
        if not isinstance(d[key], dict) or not all(isinstance(v, list) for v in d[key].values()):
            raise PlanError(f"the plan's {key!r} must map names to lists (one entry per mesh axis){again}")
    if not all(isinstance(p, str) for v in d["inputs"].values() for p in v):
        raise PlanError(f"the plan's 'inputs' must list placements as strings such as \"R\" or \"S(0)\"{again}")
    if not isinstance(d.get("meta", {}), dict):
        raise PlanError(f"the plan's 'meta' must be an object{again}")


def check_step_fields(microbatches, recompute) -> None:
    """``PlanError`` unless ``microbatches`` is a positive int and ``recompute`` one of ``RECOMPUTE_MODES``."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")
    if recompute not in RECOMPUTE_MODES:
        raise PlanError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")


@dataclass
class ResolvedPlan:
    """Every value's sharding and every node's required input shardings, checked."""

    plan: ShardingPlan
    graph: Graph
    value: dict[int, Sharding]                   # value id -> sharding as produced
    node: dict[str, NodeShardings]               # node name -> required inputs / produced outputs

    def local_shape(self, vid: int) -> tuple[int, ...]:
        return local_shape(self.graph.types[vid].shape, self.value[vid], self.plan.mesh)


def _replicated(ns: NodeShardings) -> tuple:
    """Every Partial output made Replicate (the lowering emits the all-reduces)."""
    return tuple(tuple(Replicate() if isinstance(p, Partial) else p for p in o) if o is not None else None
                 for o in ns.outputs)


def lowered_outputs(call: OpCall, ann, ns: NodeShardings) -> tuple:
    """The output shardings of a node whose strategy gives ``ns``, as its SPMD lowering produces them: the
    annotation's, unless the op's ``outputs`` fact (``ir.registry.OutputRule``) says otherwise. A mean-reduced
    nll_loss over split rows or classes is made replicated by its lowering (none / sum: the annotation is
    exact); batch norm with a split batch all-reduces its statistics (forward) and, in training, its weight
    and bias gradients (backward: custom letters), and the empty statistics of eval mode are the same on
    every rank (``lower/spmd_bn.py``)."""
    opdef = lookup(call.op)
    rule = opdef.outputs if opdef is not None else None
    if rule is OutputRule.REPLICATED or (rule is OutputRule.REPLICATED_IF_MEAN and call.args[3] == 1) or \
            (rule is OutputRule.REPLICATED_IF_CUSTOM and ann.custom):
        return _replicated(ns)
    return ns.outputs


def node_shardings(graph: Graph, node, strategy: tuple, mesh: Mesh) -> NodeShardings:
    call = call_of(graph, node)
    ann = annotate(call)
    if ann is None:  # opaque: replicated
        if any(s is not None for s in strategy):
            raise StrategyError(f"opaque op {node.op} runs replicated only")
        rep = replicated(mesh)
        return NodeShardings(tuple(rep for _ in call.in_types), tuple(rep if t is not None else None
                                                                      for t in call.out_types))
    ns = shardings_for(ann, [t.shape for t in call.in_types], strategy, mesh)
    return NodeShardings(ns.inputs, lowered_outputs(call, ann, ns))


def resolve(graph: Graph, plan: ShardingPlan, *, fingerprint: str | None = None) -> ResolvedPlan:
    """Derive and check all shardings. Raises PlanError naming what cannot run. ``fingerprint``: the graph's
    (``Graph.fingerprint``), when the caller has it (computing it takes about a second on 20,000 nodes)."""
    mesh = plan.mesh
    if plan.fingerprint:
        mine = fingerprint or graph.fingerprint()
        if plan.fingerprint != mine:
            raise PlanError(f"the plan was made for another workload (fingerprint {plan.fingerprint}, this "
                            f"workload has {mine}); plan this workload again (under the same --dtype)")
    value: dict[int, Sharding] = {}
    for inp in graph.inputs:
        sh = plan.inputs.get(inp.name, replicated(mesh))
        if len(sh) != mesh.ndim:
            raise PlanError(f"input {inp.name} has {len(sh)} placements for a {mesh.ndim}-axis mesh")
        _check_divisible(inp.name, graph.types[inp.value].shape, sh, mesh)
        if any(isinstance(p, Partial) for p in sh) and inp.role is not Role.BATCH:
            raise PlanError(f"state input {inp.name} cannot be Partial")
        value[inp.value] = sh
    for vid in graph.constants:
        value[vid] = replicated(mesh)
    nodes: dict[str, NodeShardings] = {}
    seen: dict[tuple, NodeShardings] = {}   # (call signature, strategy) -> shardings, checked (repeated layers)
    for node in graph.nodes:
        strategy = tuple(plan.strategies.get(node.name, (None,) * mesh.ndim))
        key = (call_signature(graph, node), strategy)
        ns = seen.get(key)
        if ns is None:
            try:
                ns = node_shardings(graph, node, strategy, mesh)
            except (StrategyError, ValueError) as exc:
                raise PlanError(f"node {node.name} ({node.op}) cannot use strategy {strategy}: {exc}") from None
            for ref, req in zip(node.input_refs(), ns.inputs):
                _check_divisible(f"input of {node.name}", graph.types[ref.id].shape, req, mesh)
            for vid, sh in zip(node.outputs, ns.outputs):
                if vid is not None:
                    _check_divisible(f"output of {node.name} ({node.op})", graph.types[vid].shape, sh, mesh)
            seen[key] = ns
        for vid, sh in zip(node.outputs, ns.outputs):
            if vid is not None:
                value[vid] = sh
        nodes[node.name] = ns
    return ResolvedPlan(plan, graph, value, nodes)


def _check_divisible(what: str, shape, sharding: Sharding, mesh: Mesh) -> None:
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard) and p.dim >= len(shape):
            raise PlanError(f"{what}: Shard({p.dim}) on mesh axis {mesh.names[axis]!r} but the tensor has rank "
                            f"{len(shape)}")
    try:
        local_shape(shape, sharding, mesh)
    except ValueError as exc:
        raise PlanError(f"{what} {format_sharding(sharding)}: {exc}") from None
