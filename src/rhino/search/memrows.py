"""Memory rows: the per-device bytes live at a node, as a function of the cone classes' choices.

The liveness model is ``cost.memory``'s, on ``ir.analysis``'s storages and last uses: views alias their
input's storage, state lives from the start, to the end of the step where nothing replaces it, else to its
last read (through any reader: ``cost.memory.last_uses``; the runtime hands it to the update, which frees it
there), graph outputs (the new state among them) to the end, other values from the node that makes them to
their last reader. Redistributed copies (one per value
and needed sharding, alive from the first node that needs it to the last, or to the reach of a view
taken of it, ``ir.analysis.view_reach``) are ``CopyTerm``s. The copies follow ``ROWS_COPY_RULE``
(``cost.memory.CopyRule.SOURCE_HELD``), which differs from the runtime's in two ways, both on the
safe side: a value a copy was made from counts until its last reader even when the runtime frees it
once its last copy exists, and a view of a copy keeps the copy's *source* alive here as well as the
copy (the runtime keeps the copy only; which one a view aliases depends on the choice, and these
rows' storage liveness does not). At a plan the rows equal ``estimate_memory(...,
copy_rule=ROWS_COPY_RULE)`` at every node and are at or above the runtime rule's bytes
(tests/test_analysis.py; tests/test_search.py: the searched GPT plan on a 2x2 mesh within 5% of the
runtime rule, random plans up to 19%).
With recomputation, activations count with the fraction ``cost.recompute`` keeps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from ..cost.memory import CopyRule, estimate_memory, last_uses
from ..cost.recompute import KEEP_KINDS, Recompute, apply_recompute
from ..cost.step import NodeCost
from ..ir.analysis import analyze
from ..ir.registry import lookup
from ..sharding.placement import local_shape

__all__ = ["CopyTerm", "MemRow", "MemoryRows", "copy_bytes", "ROWS_COPY_RULE"]

#: how the rows keep redistributed copies and their sources alive (module docstring)
ROWS_COPY_RULE = CopyRule.SOURCE_HELD


@dataclass
class CopyTerm:
    """Redistributed copies of values alive at a row's node: the lowering keeps one copy per value and
    needed sharding from its first to its last use (``cost.memory``), so a copy to ``tau`` is alive
    when a use at or before the node and a use reaching the node (``MemoryRows.value_uses``) both need
    ``tau`` and the producer did not already make the value ``tau``."""

    producer: int
    sigma: list[int]                                   # producer candidate -> sharding index
    before: list[tuple[int, list[tuple[int, ...]]]]    # (class, candidate -> needed sharding indices)
    after: list[tuple[int, list[tuple[int, ...]]]]
    nbytes: list[int]                                  # sharding index -> local bytes of a copy
    count: int


@dataclass
class MemRow:
    node: int                                # the node (index) this row checks
    coef: dict[int, list[int]]               # class -> bytes per candidate
    const: int
    copies: list[CopyTerm] = field(default_factory=list)


def copy_bytes(ct: CopyTerm, choice: list[int]) -> int:
    """Bytes of the copies of ``ct`` alive under ``choice``."""
    s = ct.sigma[choice[ct.producer]]
    tb = {t for uc, need in ct.before for t in need[choice[uc]]}
    ta = {t for uc, need in ct.after for t in need[choice[uc]]}
    return ct.count * sum(ct.nbytes[t] for t in tb & ta if t != s)


class MemoryRows:
    """Memory-row building for ``problem.Builder`` (which provides graph, mesh, cones, derived, shared,
    boundary, recompute, options, space and ``slot_of_value``)."""

    def _recomputed(self, i: int) -> int:
        """1 if recomputation runs forward node ``i`` again (``cost.recompute``), else 0."""
        if self.recompute == Recompute.FULL:
            return 1
        if self.recompute == Recompute.SELECTIVE:
            d = lookup(self.graph.nodes[i].op)
            return int(d is not None and d.kind not in KEEP_KINDS)
        return 0

    def activation_scale(self, storage: int) -> float:
        """Fraction of an activation's bytes kept under recomputation (``cost.recompute``): full keeps
        the same share of every activation (its segment cuts), selective drops what cheap ops made."""
        if self.recompute == Recompute.NONE:
            return 1.0
        if self.recompute == Recompute.SELECTIVE:
            p = self._producer().get(storage)
            return 0.0 if p is not None and self._recomputed(p[0]) else 1.0
        if "keep" not in self.shared:
            mem = estimate_memory(self.graph)
            eff = apply_recompute(self.graph, mem, [NodeCost("", 0.0, 0.0, "", 0.0)] * len(self.graph.nodes),
                                  Recompute.FULL) if mem.activation_spans else None
            self.shared["keep"] = eff.keep_fraction if eff is not None else 1.0
        return self.shared["keep"]

    # -- memory ------------------------------------------------------------------------------------
    def liveness(self):
        """(storage root of each value, birth index, last-use index): ``ir.analysis``'s, with the replaced
        state's last use as ``cost.memory.last_uses`` gives it."""
        a = self._analysis
        if "last_uses" not in self.shared:
            self.shared["last_uses"] = last_uses(self.graph, a)
        return a.root, a.born, self.shared["last_uses"]

    @property
    def _analysis(self):
        return analyze(self.graph)

    def initial_checkpoints(self) -> list[int]:
        n = len(self.graph.nodes)
        if n == 0:
            return []
        points = {n - 1}
        loss = self._analysis.loss_node
        if loss is not None:
            points.add(loss)
        if "timeline" not in self.shared:
            self.shared["timeline"] = estimate_memory(self.graph).timeline
        timeline = self.shared["timeline"]
        peaks = [i for i in range(n) if (i == 0 or timeline[i] >= timeline[i - 1]) and
                 (i == n - 1 or timeline[i] >= timeline[i + 1])]
        peaks.sort(key=lambda i: -timeline[i])
        gap = max(1, n // 50)   # peaks closer than this to a chosen one add little
        chosen: list[int] = []
        for i in peaks:
            if len(chosen) >= self.options.memory_checkpoints:
                break
            if all(abs(i - j) >= gap for j in list(points) + chosen):
                chosen.append(i)
        points.update(chosen)
        return sorted(points)

    def memory_row(self, node: int) -> MemRow:
        """The bytes live while ``node`` runs, per cone class and candidate (module docstring), and the
        redistributed copies that may be alive there."""
        root, born, last = self.liveness()
        a = self._analysis
        counts: dict[tuple, float] = {}
        const = 0
        for s, b in born.items():
            if not (b <= node <= last[s]) or last[s] < 0:
                continue
            t = self.graph.types[s]
            scale = self.activation_scale(s) if a.is_activation(s) else 1.0
            if s in self.graph.constants:
                const += t.nbytes
                continue
            src = self.slot_of_value(s)
            if src is None:
                continue
            c, slot = src
            key = (self.cones.cones[c].cls, slot, t.shape, t.dtype.itemsize)
            counts[key] = counts.get(key, 0.0) + scale
        coef: dict[int, list[int]] = {}
        for (pc, slot, shape, itemsize), count in counts.items():
            row = coef.setdefault(pc, [0] * len(self.derived[pc]))
            for c, d in enumerate(self.derived[pc]):
                row[c] += int(count * prod(local_shape(shape, d.produced[slot], self.mesh)) * itemsize)
        return MemRow(node, coef, const, self._copy_terms(node))

    def value_uses(self) -> dict[int, list[tuple[int, tuple, int, int]]]:
        """value id -> (cone, slot key, node index, reach) of every node input that reads it; the reach is
        ``ir.analysis``'s ``view_reach`` for a view's first input (a copy it is taken of lives that
        long), else the node index."""
        if "vuses" not in self.shared:
            cones, a = self.cones, self._analysis
            out: dict[int, list[tuple[int, tuple, int, int]]] = {}
            for i in range(len(self.graph.nodes)):
                c, pos = cones.cone_of_node[i], cones.pos_of_node[i]
                for k, r in enumerate(self.space.info(i).refs):
                    if r.id not in self.graph.constants:
                        reach = a.view_reach[i] if k == 0 and a.is_view[i] else i
                        out.setdefault(r.id, []).append((c, ("m", pos, k), i, reach))
            self.shared["vuses"] = out
        return self.shared["vuses"]

    def _spans(self) -> list[tuple[int, int, int]]:
        """(first use, last reach, value) of every value read by a node."""
        if "spans" not in self.shared:
            self.shared["spans"] = [(min(u[2] for u in uses), max(u[3] for u in uses), vid)
                                    for vid, uses in self.value_uses().items() if uses]
        return self.shared["spans"]

    def _copy_terms(self, node: int) -> list[CopyTerm]:
        cls = [c.cls for c in self.cones.cones]
        agg: dict[tuple, list] = {}
        vuses = self.value_uses()
        for lo, hi, vid in self._spans():
            if lo > node or hi < node:
                continue
            uses = vuses[vid]
            src = self.slot_of_value(vid)
            if src is None:
                continue
            cp, pslot = src
            before = tuple(sorted({(cls[c], slot) for c, slot, i, _ in uses if i <= node}))
            after = tuple(sorted({(cls[c], slot) for c, slot, _, reach in uses if reach >= node}))
            key = (cls[cp], pslot, before, after)
            entry = agg.get(key)
            if entry is None:
                agg[key] = [vid, 1]
            else:
                entry[1] += 1
        out = []
        for (pc, pslot, before, after), (vid, count) in agg.items():
            shardings: list = []
            index: dict = {}

            def idx(sh) -> int:
                k = index.get(sh)
                if k is None:
                    k = index[sh] = len(shardings)
                    shardings.append(sh)
                return k

            sigma = [idx(d.produced[pslot]) for d in self.derived[pc]]
            sides = []
            for side in (before, after):
                sides.append([(uc, [(idx(d.required[uslot]),) for d in self.derived[uc]]) for uc, uslot in side])
            tb = {t for _, need in sides[0] for n in need for t in n}
            ta = {t for _, need in sides[1] for n in need for t in n}
            both = tb & ta
            if not both or all(all(s == t for s in set(sigma)) for t in both):
                continue
            t = self.graph.types[vid]
            nbytes = [prod(local_shape(t.shape, sh, self.mesh)) * t.dtype.itemsize if k in both else 0
                      for k, sh in enumerate(shardings)]
            out.append(CopyTerm(pc, sigma, sides[0], sides[1], nbytes, count))
        return out
