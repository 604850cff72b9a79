"""The plan in readable form: mesh and what each axis does, placements per layer kind (repeated
layers shown once), collectives per step, the predicted time and per-device memory splits, and the
expert presets next to it (with the reason the plan was chosen over them)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..cost.cluster import Cluster, axis_links
from ..cost.estimate import Estimate, stage_cluster
from ..ir.analysis import analyze
from ..ir.graph import Graph, Role
from ..ir.registry import Family, OpKind, lookup
from ..sharding.placement import Partial, Replicate, Shard
from ..sharding.plan import ResolvedPlan
from .experts import PresetScore

__all__ = ["Report", "build_report", "axis_roles", "layer_table", "fmt_bytes"]

_GB = 1e9


def fmt_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps three significant digits readable (decimal units)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_p(p) -> str:
    if isinstance(p, Shard):
        return f"S{p.dim}" + (f"/{p.blocks}" if p.blocks > 1 else "")
    if isinstance(p, Partial):
        return "P"
    return "R"


def fmt_sharding(sh, names) -> str:
    parts = [f"{_fmt_p(p)}@{n}" for p, n in zip(sh, names) if not isinstance(p, Replicate)]
    return " ".join(parts) if parts else "replicated"


def _family(name: str) -> tuple[str, str]:
    """("blocks.*.attn.qkv.weight", "0") for "blocks.0.attn.qkv.weight"; no index: (name, "")."""
    m = re.search(r"\.(\d+)\.", name)
    if not m:
        return name, ""
    return name[:m.start()] + ".*." + name[m.end():], m.group(1)


_LAYOUT = (Family.RESHAPE, Family.TRANSPOSE, Family.PERMUTE)


def _family_of(op: str) -> Family | None:
    opdef = lookup(op)
    return opdef.family if opdef is not None else None


def _uses(graph: Graph) -> tuple[dict[int, list], dict[int, int]]:
    """(value id -> [(user node, input position)], output of a layout op -> its input): the layout ops
    (reshapes, transposes, permutes) through which a weight is used as it is."""
    users: dict[int, list] = {}
    views: dict[int, int] = {}
    for node in graph.nodes:
        refs = node.input_refs()
        for k, r in enumerate(refs):
            users.setdefault(r.id, []).append((node, k))
        if refs and _family_of(node.op) in _LAYOUT:
            for v in node.outputs:
                if v is not None:
                    views[v] = refs[0].id
    return users, views


def _used_split(rp: ResolvedPlan, users: dict, views: dict, vid: int, axis: int) -> bool:
    """Every use of the value (through views) takes it split along ``axis`` (no gather first)."""
    todo, ok = [vid], True
    while todo:
        v = todo.pop()
        for node, k in users.get(v, ()):
            out = [o for o in node.outputs if o is not None and views.get(o) == v]
            if out:
                todo += out
                continue
            req = rp.node[node.name].inputs[k]
            if not isinstance(req[axis], Shard):
                ok = False
    return ok


def _param_values(graph: Graph, views: dict) -> set[int]:
    """Parameters (trained or frozen) and the layout views of them."""
    params = {inp.value for inp in graph.inputs if inp.role in (Role.PARAM, Role.FROZEN)}
    for v, src in views.items():
        root = src
        while root in views:
            root = views[root]
        if root in params:
            params.add(v)
    return params


def _batch_phrases(rp: ResolvedPlan, a: int, forward_heavy: list, params: set[int]) -> list[str]:
    """Data parallel (most forward matmuls/convolutions take their activation split by rows), or the batch
    or sequence split at the input, along mesh axis ``a``."""
    graph, parts = rp.graph, []
    batch = [i for i in graph.inputs if i.role is Role.BATCH]
    dims = {rp.value[i.value][a].dim for i in batch if isinstance(rp.value[i.value][a], Shard)}
    heavy = split_rows = 0
    for node in forward_heavy:
        acts = [k for k, r in enumerate(node.input_refs()) if r.id not in params]
        if not acts:
            continue
        heavy += 1
        req = rp.node[node.name].inputs[acts[0]][a]
        split_rows += isinstance(req, Shard) and req.dim == 0
    if heavy and 2 * split_rows >= heavy:
        parts.append(f"data parallel (batch split in {split_rows} of {heavy} forward matmuls/convolutions)")
    elif 0 in dims:
        parts.append("batch split at the input")
    if dims - {0}:
        parts.append("sequence split")
    return parts


def _weight_phrases(rp: ResolvedPlan, a: int, users: dict, views: dict) -> list[str]:
    """Tensor parallel (weights used split), ZeRO-3 (stored split, gathered before use) and ZeRO-1/2
    (optimizer state split) along mesh axis ``a``."""
    graph = rp.graph
    tp = zero3 = zero1 = 0
    special = set()
    for inp in graph.inputs:
        if inp.role is not Role.PARAM:
            continue
        p = rp.value[inp.value][a]
        if isinstance(p, Shard):
            if not _used_split(rp, users, views, inp.value, a):
                zero3 += 1
                continue
            tp += 1
            if p.dim == 0 and any(_family_of(n.op) is Family.EMBEDDING and k == 0
                                  for n, k in users.get(inp.value, ())):
                special.add("vocabulary-parallel embedding")
            if len(graph.types[inp.value].shape) == 3 and p.dim == 0:
                special.add("experts split")
        else:
            states = [s for s in graph.inputs if s.role is Role.OPT_STATE and s.name.split("/")[1:2] ==
                      [inp.name] and graph.types[s.value].rank > 0]
            if any(isinstance(rp.value[s.value][a], Shard) for s in states):
                zero1 += 1
    parts = [f"tensor parallel ({tp} weights used split)"] if tp else []
    parts += sorted(special)
    if zero3:
        parts.append(f"ZeRO-3 ({zero3} weights sharded, gathered before use)")
    if zero1:
        parts.append(f"ZeRO-1/2 ({zero1} optimizer states sharded)")
    return parts


def axis_roles(rp: ResolvedPlan) -> list[str]:
    """One phrase per mesh axis: what is split along it."""
    graph, mesh = rp.graph, rp.plan.mesh
    users, views = _uses(graph)
    an = analyze(graph)
    heavy_kinds = (OpKind.MATMUL, OpKind.CONV)
    forward_heavy = [n for i, n in enumerate(graph.nodes) if an.at_or_before_loss(i) and lookup(n.op) is not None
                     and lookup(n.op).kind in heavy_kinds]
    params = _param_values(graph, views)
    roles = []
    for a in range(mesh.ndim):
        if mesh.sizes[a] == 1:
            roles.append("unused")
            continue
        parts = _batch_phrases(rp, a, forward_heavy, params) + _weight_phrases(rp, a, users, views)
        roles.append(", ".join(parts) or "replicated (no split)")
    return roles


def layer_table(graph: Graph, rp: ResolvedPlan) -> list[dict]:
    """Per parameter family (repeated layers collapsed): shape, placement of the parameter and of its
    optimizer state, and the layer indices."""
    names = rp.plan.mesh.names
    fams: dict[tuple, dict] = {}
    states: dict[str, str] = {}
    for inp in graph.inputs:
        if inp.role is Role.OPT_STATE and graph.types[inp.value].rank > 0:
            parts = inp.name.split("/")
            if len(parts) >= 3:
                states.setdefault(parts[1], fmt_sharding(rp.value[inp.value], names))
    for inp in graph.inputs:
        if inp.role not in (Role.PARAM, Role.FROZEN):
            continue
        fam, idx = _family(inp.name)
        sh = fmt_sharding(rp.value[inp.value], names)
        key = (fam, sh, states.get(inp.name, "-"))
        row = fams.setdefault(key, {"name": fam, "shape": list(graph.types[inp.value].shape), "param": sh,
                                    "state": states.get(inp.name, "-"), "layers": []})
        if idx:
            row["layers"].append(int(idx))
    return list(fams.values())


def _ranges(xs: list[int]) -> str:
    if not xs:
        return ""
    xs = sorted(xs)
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(out)


def _stage_lines(e: Estimate) -> list[str]:
    """The pipeline: stages, micro-batches and schedule, then per stage its forward ops, parameters, time
    per micro-batch and peak memory (nothing for a single stage)."""
    if e.pp <= 1:
        return []
    lines = [f"pipeline {e.pp} stages x {e.microbatches} micro-batches ({e.schedule}), the mesh above per stage; "
             f"bubble {e.bubble_seconds * 1e3:.3f} ms ({e.bubble_fraction:.1%} idle)",
             "  stage  forward ops  params  fwd+bwd per micro-batch  sends per micro-batch  peak memory"]
    for k, s in enumerate(e.stages):
        lines.append(f"  {k:>5}  {s['forward_ops']:>11}  {s['params']:>6}  "
                     f"{(s['forward_seconds'] + s['backward_seconds']) * 1e3:>20.3f} ms  "
                     f"{fmt_bytes(s['send_bytes']):>21}  {fmt_bytes(s['peak_bytes']):>11}")
    return lines


@dataclass
class Report:
    workload: str
    cluster: str
    level: str
    mesh: dict[str, int]
    links: list[str]
    roles: list[str]
    estimate: Estimate
    search_seconds: float
    layers: list[dict]
    presets: list[PresetScore]
    best_preset: PresetScore | None
    source: str
    recompute: str
    candidates: list[dict] = field(default_factory=list)
    inputs: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        e = self.estimate
        bp = self.best_preset
        return {
            "workload": self.workload, "cluster": self.cluster, "level": self.level, "mesh": self.mesh,
            "axes": [{"name": n, "size": s, "link": link, "role": r}
                     for (n, s), link, r in zip(self.mesh.items(), self.links, self.roles)],
            "step_seconds": e.step_seconds, "compute_seconds": e.compute_seconds,
            "exposed_comm_seconds": e.comm_seconds, "comm_total_seconds": e.comm_total_seconds,
            "recompute_seconds": e.recompute_seconds, "mfu": e.mfu, "memory_bytes": e.memory_bytes,
            "capacity_bytes": e.capacity_bytes, "fits": e.fits, "collectives": e.collectives,
            "recompute": self.recompute, "search_seconds": self.search_seconds, "source": self.source,
            "best_preset": None if bp is None else {"strategy": bp.strategy, "step_seconds": bp.step_seconds,
                                                    "fits": bp.fits,
                                                    "ratio": bp.step_seconds / e.step_seconds if e.step_seconds else None},
            "presets": [{"strategy": p.strategy, "step_seconds": p.step_seconds if p.estimate else None,
                         "fits": p.fits, "peak_bytes": p.estimate.memory_bytes["peak"] if p.estimate else None,
                         "error": p.error or None} for p in self.presets],
            "layers": self.layers, "candidates": self.candidates,
            "pipeline": {"stages": e.pp, "microbatches": e.microbatches, "schedule": e.schedule},
            "stages": [dict(s, stage=k) for k, s in enumerate(e.stages)],
            "bubble_seconds": e.bubble_seconds, "bubble_fraction": e.bubble_fraction,
        }

    def text(self) -> str:
        e = self.estimate
        lines = [f"plan for {self.workload} on {self.cluster} ({self.level}, searched in {self.search_seconds:.1f} s"
                 + (f"; {self.source}" if self.source != "search" else "") + ")", ""]
        lines.append("mesh " + " x ".join(f"{n}={s}" for n, s in self.mesh.items()))
        for (n, s), link, role in zip(self.mesh.items(), self.links, self.roles):
            lines.append(f"  {n:<6} {s:>5}  {link:<13} {role}")
        if self.recompute != "none":
            lines.append(f"  activation recomputation: {self.recompute}")
        lines += _stage_lines(self.estimate)
        lines += ["", "placements (parameter | optimizer state), repeated layers once:"]
        width = max([len(r["name"]) for r in self.layers] + [10])
        for r in self.layers:
            where = f"  [layers {_ranges(r['layers'])}]" if r["layers"] else ""
            shape = "x".join(map(str, r["shape"]))
            lines.append(f"  {r['name']:<{width}} {shape:>14}  {r['param']:<22} | {r['state']}{where}")
        for name, sh in self.inputs:
            lines.append(f"  {name:<{width}} {'':>14}  {sh}")
        coll = ", ".join(f"{k} {v}" for k, v in sorted(e.collectives.items())) or "none"
        lines += ["", f"collectives per step: {coll}",
                  f"step time {e.step_seconds * 1e3:.3f} ms: compute {e.compute_seconds * 1e3:.3f} ms, exposed "
                  f"communication {e.comm_seconds * 1e3:.3f} ms (all communication {e.comm_total_seconds * 1e3:.3f} ms)"
                  + (f", recomputation {e.recompute_seconds * 1e3:.3f} ms" if e.recompute_seconds else "")
                  + f"; MFU {e.mfu:.1%}"]
        mem = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in e.memory_bytes.items() if k != "peak" and v)
        lines.append(f"memory per device: peak {fmt_bytes(e.memory_bytes['peak'])} of {fmt_bytes(e.capacity_bytes)}"
                     f" ({mem})")
        lines += [f"  {n}" for n in e.notes if n.startswith("fit_memory=")]   # fits by the planned peak
        bp = self.best_preset
        lines.append("")
        if bp is not None:
            ratio = bp.step_seconds / e.step_seconds if e.step_seconds else float("nan")
            state = "" if bp.fits else " (does not fit either)"
            lines.append(f"best expert preset: {bp.strategy}: {bp.step_seconds * 1e3:.3f} ms{state}; "
                         f"preset / plan = {ratio:.2f}x")
        lines.append("presets (why not):")
        for p in self.presets:
            if p.estimate is None:
                lines.append(f"  {p.strategy:<28} cannot be built: {p.error}")
            elif not p.fits:
                lines.append(f"  {p.strategy:<28} does not fit: {fmt_bytes(p.estimate.memory_bytes['peak'])} > "
                             f"{fmt_bytes(p.estimate.capacity_bytes)}")
            else:
                lines.append(f"  {p.strategy:<28} {p.step_seconds * 1e3:.3f} ms "
                             f"({p.step_seconds / e.step_seconds:.2f}x the plan)")
        return "\n".join(lines)


def build_report(graph: Graph, cluster: Cluster, rp: ResolvedPlan, est: Estimate, *, workload: str, level: str,
                 search_seconds: float, presets: list[PresetScore], best: PresetScore | None, source: str,
                 recompute: str, candidates: list[dict]) -> Report:
    mesh = rp.plan.mesh
    # a pipelined plan's mesh is one stage's: its links are those of the part of the cluster a stage occupies
    stage = stage_cluster(cluster, mesh.world) if est.pp > 1 else cluster
    links = [f"{lk.kind.value}" for lk in axis_links(stage, mesh)]
    inputs = [(i.name, fmt_sharding(rp.value[i.value], mesh.names)) for i in graph.inputs if i.role is Role.BATCH]
    return Report(workload, str(cluster), level, dict(zip(mesh.names, mesh.sizes)), links, axis_roles(rp), est,
                  search_seconds, layer_table(graph, rp), presets, best, source, recompute, candidates, inputs)
