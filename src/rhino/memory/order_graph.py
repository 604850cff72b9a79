"""Index arrays over a :class:`MemProblem` for the ordering algorithms (internal to ``order*.py``).

Ops become indices ``0..n-1`` in program order, tensors indices ``0..m-1``. Also here: the live-bytes
profile of an order (the lifetime rule of ``problem.py``, on indices), key points (ops every other op
is an ancestor or a descendant of: every order puts them at the same position and gives them the
same live set) and the "floating" ops (ops none of whose ancestors reads a graph input, e.g.
optimizer constants and parameter casts).
"""
from __future__ import annotations

from collections.abc import Sequence

from .problem import MemProblem, OpRole, TensorKind

__all__ = ["IndexedProblem"]


class IndexedProblem:
    """Plain index arrays of a validated problem."""

    def __init__(self, problem: MemProblem) -> None:
        problem.validate()
        self.problem = problem
        ops = problem.ops
        self.n = len(ops)
        self.op_ids = [op.id for op in ops]
        self.op_index = {o: i for i, o in enumerate(self.op_ids)}
        self.tensor_ids = list(problem.tensors)
        t_index = {t: j for j, t in enumerate(self.tensor_ids)}
        self.tensor_index = t_index
        self.m = len(self.tensor_ids)
        tens = [problem.tensors[t] for t in self.tensor_ids]
        self.size = [t.size for t in tens]
        self.is_input = [t.kind is TensorKind.INPUT for t in tens]
        self.keep = [t.kind is TensorKind.OUTPUT or (t.kind is TensorKind.INPUT and t.also_output) for t in tens]
        self.role = [op.role for op in ops]
        self.op_in = [tuple(dict.fromkeys(t_index[t] for t in op.inputs)) for op in ops]
        self.op_out = [tuple(t_index[t] for t in op.outputs) for op in ops]
        self.prod = [-1] * self.m
        for i, outs in enumerate(self.op_out):
            for j in outs:
                self.prod[j] = i
        cons: list[list[int]] = [[] for _ in range(self.m)]
        for i, ins in enumerate(self.op_in):
            for j in ins:
                cons[j].append(i)
        self.cons = [tuple(c) for c in cons]
        pr = problem.predecessors()
        self.preds = [tuple(self.op_index[p] for p in pr[o]) for o in self.op_ids]
        succs: list[list[int]] = [[] for _ in range(self.n)]
        for i, ps in enumerate(self.preds):
            for p in ps:
                succs[p].append(i)
        self.succs = [tuple(s) for s in succs]
        self.out_bytes = [sum(self.size[j] for j in outs) for outs in self.op_out]
        self.input_bytes = sum(s for s, inp in zip(self.size, self.is_input) if inp)
        loss = [i for i, r in enumerate(self.role) if r is OpRole.LOSS]
        self.loss = loss[-1] if loss else -1

    # -- orders ---------------------------------------------------------------------------------
    def to_ids(self, order: Sequence[int]) -> list[int]:
        return [self.op_ids[i] for i in order]

    def from_ids(self, order: Sequence[int]) -> list[int]:
        return [self.op_index[o] for o in order]

    def positions(self, order: Sequence[int]) -> list[int]:
        pos = [0] * self.n
        for s, i in enumerate(order):
            pos[i] = s
        return pos

    def intervals(self, order: Sequence[int]) -> list[tuple[int, int]]:
        """Per tensor index: ``[lo, hi)`` under the lifetime rule."""
        n = self.n
        pos = self.positions(order)
        out: list[tuple[int, int]] = []
        for j in range(self.m):
            c = self.cons[j]
            last = max(pos[i] for i in c) if c else -1
            if self.is_input[j]:
                out.append((0, max(n if self.keep[j] else last + 1, 1)))
            else:
                lo = pos[self.prod[j]]
                out.append((lo, n if self.keep[j] else max(last, lo) + 1))
        return out

    def profile(self, order: Sequence[int]) -> list[int]:
        """Live bytes at every step of ``order`` (op indices)."""
        n = self.n
        diff = [0] * (n + 2)
        for (lo, hi), s in zip(self.intervals(order), self.size):
            if s:
                diff[lo] += s
                diff[min(hi, n + 1)] -= s
        live, cur = [], 0
        for s in range(n):
            cur += diff[s]
            live.append(cur)
        return live

    def peak(self, order: Sequence[int]) -> int:
        prof = self.profile(order)
        return max(prof) if prof else 0

    def is_topological(self, order: Sequence[int]) -> bool:
        if len(order) != self.n or len(set(order)) != self.n:
            return False
        pos = self.positions(order)
        return all(pos[p] < pos[i] for i in range(self.n) for p in self.preds[i])

    # -- structure --------------------------------------------------------------------------------
    def floating(self) -> list[bool]:
        """Ops none of whose ancestors (nor themselves) reads a graph INPUT tensor.

        When the problem has no INPUT tensor at all, only ops without any tensor input and
        without predecessors count as floating.
        """
        if not any(self.is_input):
            return [not self.preds[i] and not self.op_in[i] for i in range(self.n)]
        anchored = [False] * self.n
        for i in range(self.n):  # program order is topological
            anchored[i] = any(self.is_input[j] for j in self.op_in[i]) or any(anchored[p] for p in self.preds[i])
        return [not a for a in anchored]

    def key_points(self, members: Sequence[bool] | None = None) -> list[int]:
        """Ops comparable to every other op of ``members`` (default: all ops), in program order.

        An op ``k`` at position ``i`` of a topological order is comparable to all others iff it is the
        only sink of the ops at positions ``<= i`` and the only source of the ops at positions ``>= i``
        (every op reaches a sink of a prefix, and is reached from a source of a suffix). Both counts
        come from one sweep each over the edges.
        """
        idx = [i for i in range(self.n) if members is None or members[i]]
        k = len(idx)
        if k == 0:
            return []
        local = {i: p for p, i in enumerate(idx)}
        sinks = [0] * (k + 1)
        sources = [0] * (k + 1)
        for p, i in enumerate(idx):
            succ = [local[s] for s in self.succs[i] if s in local]
            pred = [local[q] for q in self.preds[i] if q in local]
            hi = min(succ) if succ else k  # i is a sink of prefixes p .. hi-1
            sinks[p] += 1
            sinks[hi] -= 1
            lo = max(pred) + 1 if pred else 0  # i is a source of suffixes starting at lo .. p
            sources[lo] += 1
            sources[p + 1] -= 1
        out = []
        cs = cq = 0
        for p in range(k):
            cs += sinks[p]
            cq += sources[p]
            if cs == 1 and cq == 1:
                out.append(idx[p])
        return out

    def ancestors(self, i: int) -> list[bool]:
        """Per op: is it an ancestor of op ``i`` (``i`` itself excluded)."""
        out = [False] * self.n
        stack = [i]
        while stack:
            u = stack.pop()
            for q in self.preds[u]:
                if not out[q]:
                    out[q] = True
                    stack.append(q)
        return out

    def op_bytes(self, i: int) -> int:
        """Bytes of the tensors an op reads or writes (all live during its step)."""
        return sum(self.size[j] for j in self.op_in[i]) + self.out_bytes[i]

    def must_live(self, points: Sequence[int]) -> list[int]:
        """For ops ``points`` that form a chain (each an ancestor of the next), the bytes live at each
        one's step in every order: tensors produced by one of its ancestors (or itself, or graph inputs)
        and read by it or one of its descendants, or kept to the end; its unused outputs too.

        Ancestor sets grow and descendant sets shrink along a chain, so one backward sweep marks each
        op with the first point it precedes and one forward sweep with the last point it follows.
        """
        k = len(points)
        if k == 0:
            return []
        first = [k] * self.n
        for i, p in enumerate(points):
            stack = [p] if first[p] == k else []
            if stack:
                first[p] = i
            while stack:
                u = stack.pop()
                for q in self.preds[u]:
                    if first[q] == k:
                        first[q] = i
                        stack.append(q)
        last = [-1] * self.n
        for i in range(k - 1, -1, -1):
            p = points[i]
            stack = [p] if last[p] == -1 else []
            if stack:
                last[p] = i
            while stack:
                u = stack.pop()
                for q in self.succs[u]:
                    if last[q] == -1:
                        last[q] = i
                        stack.append(q)
        diff = [0] * (k + 1)
        where = {p: i for i, p in enumerate(points)}
        for j in range(self.m):
            if not self.size[j]:
                continue
            p = self.prod[j]
            a = 0 if p < 0 else first[p]
            if self.keep[j]:
                d = k - 1
            elif self.cons[j]:
                d = max(last[c] for c in self.cons[j])
            else:
                d = where.get(p, -1) if p >= 0 else -1  # an unused output lives during its producer
                a = d if d >= 0 else a
            if a <= d:
                diff[a] += self.size[j]
                diff[d + 1] -= self.size[j]
        out, cur = [], 0
        for i in range(k):
            cur += diff[i]
            out.append(cur)
        return out

    def spine(self) -> list[bool]:
        """Ops that are ancestors of (or are) the last op of a longest path, floating ops excepted.

        In a training step the longest path runs through the forward pass, the loss and the whole
        backward pass; what is off the spine are side branches that end the step: weight updates
        (and running-statistics updates). Found from the structure, not from the op roles.
        """
        n = self.n
        if n == 0:
            return []
        depth = [0] * n
        for i in range(n):  # program order is topological
            depth[i] = 1 + max((depth[p] for p in self.preds[i]), default=0)
        end = max(range(n), key=lambda i: (depth[i], i))
        on = [False] * n
        on[end] = True
        stack = [end]
        while stack:
            u = stack.pop()
            for q in self.preds[u]:
                if not on[q]:
                    on[q] = True
                    stack.append(q)
        floating = self.floating()
        return [on[i] and not floating[i] for i in range(n)]

    def chain_points(self) -> list[int]:
        """Key points of the spine (:meth:`spine`) and the LOSS op (comparable to all of them, as it is
        on the spine): a chain of ops, in program order."""
        spine = self.spine()
        pts = self.key_points(spine)
        if self.loss >= 0 and spine[self.loss] and self.loss not in pts:
            pts = sorted([*pts, self.loss])
        return pts

    def lower_bound(self) -> int:
        """A bound no order beats: each op's own bytes plus the inputs kept to the end, and the bytes
        that must be live at the key points of the core graph (:meth:`must_live`, which counts the
        activations live across the loss)."""
        n = self.n
        if n == 0:
            return 0
        always = {j for j in range(self.m) if self.is_input[j] and self.keep[j]}
        always_bytes = sum(self.size[j] for j in always)
        best = max(self.op_bytes(i) + always_bytes - sum(self.size[j] for j in self.op_in[i] if j in always)
                   for i in range(n))
        best = max(best, always_bytes)
        points = self.chain_points()
        ml = self.must_live(points)
        best = max(best, max(ml, default=0), self.either_live(points, ml))
        return max(best, self.op_must_live(best))

    # key points whose step ``either_live`` examines: the loss and those with the most must-live bytes
    # (each costs two graph walks)
    EITHER_LIVE_POINTS = 8

    def either_live(self, points: Sequence[int], must: Sequence[int]) -> int:
        """``must`` (:meth:`must_live` at ``points``) plus what ops off the key point's chain add there.

        At key point ``p``, an op ``u`` that is neither an ancestor nor a descendant of ``p`` runs before
        ``p`` in some orders and after it in others. Before: its outputs that a descendant of ``p`` reads
        (or that are kept to the end) are live at ``p`` (OUT). After: its inputs made at or before ``p``
        (by ``p``, an ancestor or as graph inputs) are live at ``p``, since ``u`` reads them later (IN; those
        :meth:`must_live` counts already are left out). So every order holds at least ``min(|OUT|, |IN|)``
        more bytes there. OUT sets of different ops are disjoint (one producer per tensor) and never
        counted by ``must_live`` (made by a non-ancestor); IN sets are kept disjoint by taking the ops
        greedily, largest term first, skipping one whose IN meets a taken one. E.g. a forward ``clone``
        kept for the backward: either the clone or what it copies is live across the loss."""
        if not points:
            return 0
        chosen = sorted(range(len(points)), key=lambda i: -must[i])[:self.EITHER_LIVE_POINTS]
        if self.loss in points:
            chosen.append(points.index(self.loss))
        best = 0
        for i in set(chosen):
            best = max(best, must[i] + self._either_live_at(points[i]))
        return best

    def _either_live_at(self, p: int) -> int:
        anc, desc = self.ancestors(p), self.descendants(p)
        early = [q < 0 or q == p or anc[q] for q in self.prod]  # made at or before p in every order
        counted = [self.keep[j] or (early[j] and any(c == p or desc[c] for c in self.cons[j]))
                   for j in range(self.m)]
        terms = []
        for u in range(self.n):
            if u == p or anc[u] or desc[u]:
                continue
            out = sum(self.size[j] for j in self.op_out[u] if self.keep[j] or any(desc[c] for c in self.cons[j]))
            ins = [j for j in self.op_in[u] if early[j] and not counted[j] and self.size[j]]
            term = min(out, sum(self.size[j] for j in ins))
            if term > 0:
                terms.append((term, ins))
        used: set[int] = set()
        add = 0
        for term, ins in sorted(terms, key=lambda t: -t[0]):
            if used.isdisjoint(ins):
                used.update(ins)
                add += term
        return add

    # ops whose own step is examined by op_must_live: the ones with the most bytes that could beat the
    # bound (each costs two graph walks); on AlexNet b1 the bound's op is the first examined
    MUST_LIVE_OPS = 64

    def op_must_live(self, floor: int) -> int:
        """At an op's step every order also holds the OUTPUT tensors its ancestors made (kept to the end)
        and the graph inputs a descendant still reads: the most of these over the ``MUST_LIVE_OPS`` ops
        with the largest ``op_bytes`` that could beat ``floor`` (never below ``floor``)."""
        outs = [j for j in range(self.m) if self.size[j] and self.keep[j] and not self.is_input[j]]
        ins = [j for j in range(self.m) if self.size[j] and self.is_input[j] and not self.keep[j]]
        always = sum(self.size[j] for j in range(self.m) if self.is_input[j] and self.keep[j])
        extra = sum(self.size[j] for j in outs + ins)
        own = [self.op_bytes(i) + always - sum(self.size[j] for j in self.op_in[i]
                                               if self.is_input[j] and self.keep[j]) for i in range(self.n)]
        best = floor
        for i in sorted(range(self.n), key=lambda i: -own[i])[:self.MUST_LIVE_OPS]:
            if own[i] + extra <= best:
                break
            anc, desc = self.ancestors(i), self.descendants(i)
            io = set(self.op_in[i]) | set(self.op_out[i])
            add = sum(self.size[j] for j in outs if j not in io and anc[self.prod[j]])
            add += sum(self.size[j] for j in ins if j not in io and any(desc[c] for c in self.cons[j]))
            best = max(best, own[i] + add)
        return best

    def descendants(self, i: int) -> list[bool]:
        """Per op: is it a descendant of op ``i`` (``i`` itself excluded)."""
        out = [False] * self.n
        stack = [i]
        while stack:
            u = stack.pop()
            for q in self.succs[u]:
                if not out[q]:
                    out[q] = True
                    stack.append(q)
        return out
