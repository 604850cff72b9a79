"""The IR graph: SSA values, nodes calling registered (or opaque) ops, and a
training-step signature (which inputs are parameters, buffers, optimizer state
or batch, and which outputs are the loss and the new state).

A graph is a pure function: every state input named ``n`` has exactly one
state output named ``n`` holding its value after the step.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator

from .types import Device, DType, Layout, MemoryFormat, TensorType

__all__ = ["Ref", "Role", "GraphInput", "GraphOutput", "Node", "Graph", "FORMAT_VERSION"]

FORMAT_VERSION = 1


@dataclass(frozen=True)
class Ref:
    """A reference to an SSA value (a tensor) by id."""

    id: int


class Role(str, Enum):
    PARAM = "param"          # trainable parameter (updated by the optimizer)
    FROZEN = "frozen"        # parameter the optimizer does not update
    BUFFER = "buffer"        # module buffer (may be updated, e.g. BatchNorm stats)
    OPT_STATE = "opt_state"  # optimizer state (moments, step counters)
    BATCH = "batch"          # one element of the global batch
    CONST = "const"          # a constant tensor embedded in the graph
    LOSS = "loss"            # output: the scalar loss


STATE_ROLES = (Role.PARAM, Role.FROZEN, Role.BUFFER, Role.OPT_STATE)


@dataclass
class GraphInput:
    name: str
    role: Role
    value: int


@dataclass
class GraphOutput:
    name: str   # for state outputs: the name of the input it replaces
    role: Role
    value: int


@dataclass
class Node:
    """One op call. ``args``/``kwargs`` hold constants and ``Ref``s.

    ``outputs`` lists the value ids the op defines (``None`` for an output that
    is absent or unused); ``multi`` says whether the op returns a tuple/list.
    """

    name: str
    op: str
    args: list
    kwargs: dict
    outputs: list[int | None]
    multi: bool = False

    def input_refs(self) -> list[Ref]:
        out: list[Ref] = []
        _collect(self.args, out)
        _collect(self.kwargs, out)
        return out


def _collect(obj: Any, out: list[Ref]) -> None:
    """Append the ``Ref``s in ``obj`` (nested lists, tuples and dicts) to ``out``, in order (``_refs``'s
    order; a loop with exact-type fast paths: ``input_refs`` is called millions of times in a search)."""
    t = type(obj)
    if t is Ref:
        out.append(obj)
    elif t is list or t is tuple:
        for item in obj:
            ti = type(item)
            if ti is Ref:
                out.append(item)
            elif ti is int or ti is float or ti is str or ti is bool or item is None:
                continue
            else:
                _collect(item, out)
    elif t is dict:
        for item in obj.values():
            _collect(item, out)
    elif isinstance(obj, Ref):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _collect(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, out)


def _refs(obj: Any) -> Iterator[Ref]:
    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _refs(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _refs(item)


@dataclass
class Graph:
    types: dict[int, TensorType] = field(default_factory=dict)
    inputs: list[GraphInput] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[GraphOutput] = field(default_factory=list)
    # Constant tensors (value id -> flat list of numbers), e.g. a torch.tensor()
    # literal in model code. Their values are part of the program.
    constants: dict[int, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    # -- building -------------------------------------------------------
    def new_value(self, ttype: TensorType) -> int:
        vid = len(self.types)
        while vid in self.types:
            vid += 1
        self.types[vid] = ttype
        return vid

    def add_input(self, name: str, role: Role, ttype: TensorType) -> int:
        vid = self.new_value(ttype)
        self.inputs.append(GraphInput(name, role, vid))
        return vid

    # -- queries ----------------------------------------------------------
    def producers(self) -> dict[int, Node]:
        return {v: n for n in self.nodes for v in n.outputs if v is not None}

    def users(self) -> dict[int, list[Node]]:
        out: dict[int, list[Node]] = {}
        for n in self.nodes:
            for r in n.input_refs():
                out.setdefault(r.id, []).append(n)
        return out

    def inputs_by_role(self, *roles: Role) -> list[GraphInput]:
        return [i for i in self.inputs if i.role in roles]

    def outputs_by_role(self, *roles: Role) -> list[GraphOutput]:
        return [o for o in self.outputs if o.role in roles]

    @property
    def loss(self) -> GraphOutput:
        return next(o for o in self.outputs if o.role is Role.LOSS)

    def fingerprint(self) -> str:
        """A hash of the program (structure, types, constants); independent of ``meta`` and key order."""
        d = self.to_dict()
        d.pop("meta")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    # -- JSON ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "types": {str(k): [list(t.shape), t.dtype.value] for k, t in self.types.items()},
            "inputs": [[i.name, i.role.value, i.value] for i in self.inputs],
            "nodes": [
                {"name": n.name, "op": n.op, "args": _enc(n.args), "kwargs": _enc(n.kwargs),
                 "outputs": n.outputs, "multi": n.multi}
                for n in self.nodes
            ],
            "outputs": [[o.name, o.role.value, o.value] for o in self.outputs],
            "constants": {str(k): _enc(v) for k, v in self.constants.items()},
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Graph":
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"unsupported graph format {d.get('format')!r}; expected {FORMAT_VERSION}")
        g = cls()
        g.types = {int(k): TensorType(tuple(s), DType(dt)) for k, (s, dt) in d["types"].items()}
        g.inputs = [GraphInput(n, Role(r), v) for n, r, v in d["inputs"]]
        g.nodes = [
            Node(n["name"], n["op"], _dec(n["args"]), _dec(n["kwargs"]), list(n["outputs"]), n["multi"])
            for n in d["nodes"]
        ]
        g.outputs = [GraphOutput(n, Role(r), v) for n, r, v in d["outputs"]]
        g.constants = {int(k): _dec(v) for k, v in d["constants"].items()}
        g.meta = dict(d.get("meta", {}))
        return g

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        return cls.from_dict(json.loads(text))


_SPECIAL_FLOATS = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def _enc(obj: Any) -> Any:
    """Encode op arguments as JSON: tagged objects for non-JSON constants."""
    if isinstance(obj, Ref):
        return {"ref": obj.id}
    if isinstance(obj, DType):  # before str: DType is a str enum
        return {"dtype": obj.value}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            return {"float": "nan" if obj != obj else ("inf" if obj > 0 else "-inf")}
        return obj
    if isinstance(obj, complex):        # a backward's scalar (polar, angle: mul by 1j)
        return {"complex": [_enc(obj.real), _enc(obj.imag)]}
    if isinstance(obj, Device):
        return {"device": obj.name}
    if isinstance(obj, Layout):
        return {"layout": obj.name}
    if isinstance(obj, MemoryFormat):
        return {"memory_format": obj.name}
    if isinstance(obj, tuple):
        return {"tuple": [_enc(x) for x in obj]}
    if isinstance(obj, list):
        return [_enc(x) for x in obj]
    if isinstance(obj, dict):
        return {"dict": {k: _enc(v) for k, v in obj.items()}}
    raise TypeError(f"cannot encode IR argument of type {type(obj).__name__}: {obj!r}")


def _dec(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_dec(x) for x in obj]
    if not isinstance(obj, dict):
        return obj
    (tag, val), = obj.items()
    if tag == "ref":
        return Ref(val)
    if tag == "float":
        return _SPECIAL_FLOATS[val]
    if tag == "complex":
        return complex(*(_dec(x) for x in val))
    if tag == "dtype":
        return DType(val)
    if tag == "device":
        return Device(val)
    if tag == "layout":
        return Layout(val)
    if tag == "memory_format":
        return MemoryFormat(val)
    if tag == "tuple":
        return tuple(_dec(x) for x in val)
    if tag == "dict":
        return {k: _dec(v) for k, v in val.items()}
    raise ValueError(f"unknown tag {tag!r} in IR JSON")
