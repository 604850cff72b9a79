"""The plain memory-planning problem: operators, tensors (storages) and their sizes.

A :class:`MemProblem` is what every memory planner in this package works on. It is plain data (no
framework objects): ``ops`` in program order (a valid topological order), ``tensors`` by id. An op
lists the tensor ids it reads (``inputs``) and the ones it creates (``outputs``). Tensors are
*storages*: the converter folds views into their base, so an op may list a tensor it only reads
through a view. Persistent state (parameters, optimizer state) is not in the problem unless the
converter puts it in as an ``INPUT``. An op that writes a tensor in place lists it as an input only.
``MemOp.after`` holds extra ordering edges (op ids that must run earlier, e.g. all reads of a
parameter before its in-place update); data edges need not be repeated there.

Lifetime rule (the one contract every planner, simulator and executor shares). For an *order* (a
permutation of the op ids), the step of an op is its position in the order; a tensor occupies its
bytes on the half-open step interval ``[lo, hi)``:

- ``INTERMEDIATE``: ``[step(producer), step(last consumer) + 1)``; an intermediate nobody reads lives
  only during its producer's step, ``[step(producer), step(producer) + 1)``.
- ``INPUT`` (graph input, no producer): ``[0, step(last consumer) + 1)``; an input nobody reads lives
  ``[0, 1)``; an input that is also returned (``also_output=True``) lives ``[0, len(ops))``.
- ``OUTPUT`` (returned by the step): ``[step(producer), len(ops))``.

So all inputs and outputs of an op are live during its step, and the live bytes at step ``s`` are the
sum of the sizes of the tensors whose interval contains ``s``. :func:`lifetimes` computes the intervals
and :func:`buffers` turns them into layout buffers; ``simulate.replay`` recomputes the live bytes
independently, event by event.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .layout import Buffer

__all__ = [
    "MemOp",
    "MemProblem",
    "MemTensor",
    "OpRole",
    "TensorKind",
    "buffers",
    "lifetimes",
]


class TensorKind(str, Enum):
    """Where a tensor comes from and how long it must stay (see the module docstring)."""

    INPUT = "input"  # graph input: live from the start until its last use (if not also an output)
    INTERMEDIATE = "intermediate"  # live from its producer to its last consumer
    OUTPUT = "output"  # live from its producer to the end of the step


class OpRole(str, Enum):
    """Part of the training step an op belongs to (set by the converter; the ordering rules use it)."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    OTHER = "other"


@dataclass(frozen=True)
class MemTensor:
    """One storage: ``size`` in bytes. ``also_output`` marks an INPUT returned by the step (lives to the end)."""

    id: int
    size: int
    kind: TensorKind
    name: str = ""
    also_output: bool = False


@dataclass(frozen=True)
class MemOp:
    """One operator: the tensor ids it reads and creates, its role, and extra ordering edges."""

    id: int
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    role: OpRole = OpRole.OTHER
    after: tuple[int, ...] = ()  # op ids that must run before this one (besides the data edges)


@dataclass
class MemProblem:
    """Ops in program order (a valid topological order) and the tensors they read and create."""

    ops: list[MemOp]
    tensors: dict[int, MemTensor]
    name: str = ""
    _cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- checks ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first problem found; return None when the problem is well formed."""
        self._cache.clear()
        op_ids: set[int] = set()
        for op in self.ops:
            if op.id in op_ids:
                raise ValueError(f"op id {op.id} ({op.name!r}) appears twice; give every op its own id")
            op_ids.add(op.id)
        for tid, t in self.tensors.items():
            if tid != t.id:
                raise ValueError(f"tensors[{tid}] holds tensor id {t.id}; key the dict by MemTensor.id")
            if not isinstance(t.kind, TensorKind):
                raise ValueError(f"tensor {tid} ({t.name!r}) has kind {t.kind!r}; use a TensorKind")
            if t.size < 0:
                raise ValueError(f"tensor {tid} ({t.name!r}) has negative size {t.size}")
            if t.also_output and t.kind is not TensorKind.INPUT:
                raise ValueError(f"tensor {tid} ({t.name!r}): also_output is only for INPUT tensors")
        producer: dict[int, int] = {}
        for op in self.ops:
            for tid in (*op.inputs, *op.outputs):
                if tid not in self.tensors:
                    raise ValueError(f"op {op.id} ({op.name!r}) lists unknown tensor id {tid}")
            for dep in op.after:
                if dep not in op_ids:
                    raise ValueError(f"op {op.id} ({op.name!r}) must run after unknown op id {dep}")
            if len(set(op.outputs)) != len(op.outputs):
                raise ValueError(f"op {op.id} ({op.name!r}) lists an output twice: {op.outputs}")
            for tid in op.outputs:
                if tid in producer:
                    raise ValueError(
                        f"tensor {tid} ({self.tensors[tid].name!r}) is produced twice "
                        f"(ops {producer[tid]} and {op.id}); a tensor has one producer")
                if self.tensors[tid].kind is TensorKind.INPUT:
                    raise ValueError(f"tensor {tid} ({self.tensors[tid].name!r}) is an INPUT but op {op.id} "
                                     f"produces it; make it INTERMEDIATE or OUTPUT")
                producer[tid] = op.id
            if set(op.inputs) & set(op.outputs):
                raise ValueError(f"op {op.id} ({op.name!r}) reads a tensor it produces "
                                 f"({sorted(set(op.inputs) & set(op.outputs))}); list in-place writes as inputs only")
        for tid, t in self.tensors.items():
            if t.kind is not TensorKind.INPUT and tid not in producer:
                raise ValueError(f"tensor {tid} ({t.name!r}) is {t.kind.value} but no op produces it")
        if _has_cycle(self.ops, producer):
            raise ValueError("the ops' dependencies contain a cycle")
        pos = {op.id: i for i, op in enumerate(self.ops)}
        for i, op in enumerate(self.ops):
            for tid in op.inputs:
                p = producer.get(tid)
                if p is not None and pos[p] >= i:
                    raise ValueError(f"op {op.id} ({op.name!r}) reads tensor {tid} before op {p} produces it "
                                     f"in program order; list ops in a topological order")
            for dep in op.after:
                if pos[dep] >= i:
                    raise ValueError(f"op {op.id} ({op.name!r}) must run after op {dep}, which comes later "
                                     f"in program order; list ops in a topological order")

    # -- derived maps (cached; call validate() again after mutating ops or tensors) ---------------
    def producers(self) -> dict[int, int]:
        """Tensor id -> id of the op that produces it (INPUT tensors are absent)."""
        if "producers" not in self._cache:
            self._cache["producers"] = {tid: op.id for op in self.ops for tid in op.outputs}
        return self._cache["producers"]

    def consumers(self) -> dict[int, list[int]]:
        """Tensor id -> ids of the ops that read it, in program order, each once (every tensor present)."""
        if "consumers" not in self._cache:
            cons: dict[int, list[int]] = {tid: [] for tid in self.tensors}
            for op in self.ops:
                for tid in dict.fromkeys(op.inputs):
                    cons[tid].append(op.id)
            self._cache["consumers"] = cons
        return self._cache["consumers"]

    def op_ids(self) -> list[int]:
        """Op ids in program order."""
        return [op.id for op in self.ops]

    def op(self, op_id: int) -> MemOp:
        """The op with this id."""
        if "by_id" not in self._cache:
            self._cache["by_id"] = {op.id: op for op in self.ops}
        return self._cache["by_id"][op_id]

    def predecessors(self) -> dict[int, tuple[int, ...]]:
        """Op id -> ids of the ops it directly depends on (data edges and ``after`` edges), deduplicated."""
        if "preds" not in self._cache:
            prod = self.producers()
            preds: dict[int, tuple[int, ...]] = {}
            for op in self.ops:
                ds = dict.fromkeys(prod[t] for t in op.inputs if t in prod)
                ds.update(dict.fromkeys(op.after))
                preds[op.id] = tuple(ds)
            self._cache["preds"] = preds
        return self._cache["preds"]

    def successors(self) -> dict[int, tuple[int, ...]]:
        """Op id -> ids of the ops that directly depend on it."""
        if "succs" not in self._cache:
            succs: dict[int, list[int]] = {op.id: [] for op in self.ops}
            for o, ps in self.predecessors().items():
                for p in ps:
                    succs[p].append(o)
            self._cache["succs"] = {o: tuple(s) for o, s in succs.items()}
        return self._cache["succs"]

    def total_bytes(self) -> int:
        """Sum of all tensor sizes (an upper bound on any peak)."""
        return sum(t.size for t in self.tensors.values())

    # -- plain-data round trip ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (see :meth:`from_dict`)."""
        return {
            "name": self.name,
            "tensors": [{"id": t.id, "size": t.size, "kind": t.kind.value, "name": t.name,
                         **({"also_output": True} if t.also_output else {})}
                        for t in self.tensors.values()],
            "ops": [{"id": o.id, "name": o.name, "inputs": list(o.inputs), "outputs": list(o.outputs),
                     "role": o.role.value, **({"after": list(o.after)} if o.after else {})}
                    for o in self.ops],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemProblem:
        """Inverse of :meth:`to_dict`."""
        tensors = {int(t["id"]): MemTensor(int(t["id"]), int(t["size"]), TensorKind(t["kind"]),
                                           t.get("name", ""), bool(t.get("also_output", False)))
                   for t in data["tensors"]}
        ops = [MemOp(int(o["id"]), o.get("name", ""), tuple(int(x) for x in o["inputs"]),
                     tuple(int(x) for x in o["outputs"]), OpRole(o.get("role", "other")),
                     tuple(int(x) for x in o.get("after", ())))
               for o in data["ops"]]
        return cls(ops=ops, tensors=tensors, name=data.get("name", ""))


def _has_cycle(ops: Sequence[MemOp], producer: dict[int, int]) -> bool:
    """Kahn's algorithm over data and ``after`` edges."""
    preds: dict[int, set[int]] = {}
    for op in ops:
        ds = {producer[t] for t in op.inputs if t in producer}
        ds.update(op.after)
        ds.discard(op.id)  # a self edge is caught as "reads what it produces"
        preds[op.id] = ds
    succs: dict[int, list[int]] = {op.id: [] for op in ops}
    for o, ds in preds.items():
        for d in ds:
            succs[d].append(o)
    indeg = {o: len(ds) for o, ds in preds.items()}
    stack = [o for o, d in indeg.items() if d == 0]
    seen = 0
    while stack:
        o = stack.pop()
        seen += 1
        for s in succs[o]:
            indeg[s] -= 1
            if indeg[s] == 0:
                stack.append(s)
    return seen != len(ops)


def lifetimes(problem: MemProblem, order: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Tensor id -> half-open step interval ``[lo, hi)`` for this order (the module docstring's rule).

    ``order`` must be a permutation of the op ids (not checked here; see ``simulate.check_order``).
    Every tensor of the problem gets an interval.
    """
    order = list(order)
    step = {o: s for s, o in enumerate(order)}
    n = len(order)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for o in order:
        op = problem.op(o)
        s = step[o]
        for t in op.outputs:
            first[t] = s
        for t in op.inputs:
            if last.get(t, -1) < s:
                last[t] = s
    out: dict[int, tuple[int, int]] = {}
    for tid, t in problem.tensors.items():
        if t.kind is TensorKind.INPUT:
            hi = n if t.also_output else last.get(tid, 0) + 1
            out[tid] = (0, max(hi, 1))
        elif t.kind is TensorKind.OUTPUT:
            out[tid] = (first[tid], n)
        else:
            lo = first[tid]
            out[tid] = (lo, max(last.get(tid, lo), lo) + 1)
    return out


def buffers(problem: MemProblem, order: Iterable[int], alignment: int = 1) -> list[Buffer]:
    """Layout buffers (``layout.Buffer``) of the tensors for this order; zero-size tensors are left out.

    The buffer id is the tensor id; lifetimes follow :func:`lifetimes`.
    """
    from .layout import Buffer

    return [Buffer(tid, lo, hi, problem.tensors[tid].size, alignment)
            for tid, (lo, hi) in lifetimes(problem, order).items() if problem.tensors[tid].size > 0]
