"""Deferred initialisation: build a workload without memory, then make any one tensor's value alone.

``load_deferred(spec)`` runs the workload function under fake tensors (``FakeTensorMode``: every
tensor reports the CPU device but has no data), with a dispatch mode above them that logs how
each storage is made. The returned ``Workload`` holds meta tensors (what ``capture`` expects of a
model too large to build); the returned ``Deferred`` can rebuild the exact value of any of its
tensors (a parameter, a buffer, an example-batch tensor) later, one at a time:
``deferred.materialize(tensor)``.

The log: one entry per aten op that creates a storage or writes one (views are not logged: a
tensor argument is recorded as its storage and its geometry, so a view is re-read from the
replayed storage). Per entry: the op, its arguments (tensors as storage + size, stride, offset,
dtype; real tensors as copies), the default dtype at the call, and, for an op that draws random
numbers, the state of the generator it draws from just before the call. The generator itself is
advanced exactly as the plain run advances it by running the same op on real tensors of the same
geometry (a scratch tensor for what the op overwrites, replayed values for what it reads), freed at
once, so later ops see the plain run's stream. Ops whose result depends on tensor values
(``.item()``, ``bool(t)``, ``nonzero``: what ``nn.init.trunc_normal_``'s rejection loop calls) get
real values by replaying their inputs, so Python control flow takes the plain run's branches.

Replay of storage ``S``: the entries that create or write ``S`` before the end, plus, recursively,
those that create or write what they read before they read it, run in log order on real tensors,
each random op with its saved generator state (the caller's generators are left untouched). A
storage is dropped after its last use in the replay, so materialising one tensor holds that tensor
and the inputs of its construction (e.g. the fp32 original of a parameter cast to fp64), never the
whole model. Uninitialised memory (``torch.empty``) is replayed as zeros, so every rank gets the
same value of a tensor the workload never writes.

Every device a workload names is built as the CPU (a workload that builds on ``meta`` gets the
values its CPU build would have); random ops must draw from a CPU generator.
"""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .workload import Workload, WorkloadError, validate_workload, default_dtype, load_workload

__all__ = ["Deferred", "DeferredInitError", "load_deferred", "record"]

aten = torch.ops.aten
_CPU = torch.device("cpu")
# Ops that return uninitialised memory: replayed as zeros (every rank then agrees on a value the
# workload never wrote).
_EMPTY = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                    aten.new_empty.default, aten.new_empty_strided.default})
# Ops answered without touching data or making tensors: neither logged nor replayed.
_METADATA = frozenset({torch.ops.prim.device.default, aten.is_same_size.default, aten.sym_size.int,
                       aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default})


class DeferredInitError(WorkloadError):
    """The workload's construction cannot be recorded or replayed; the message names the op."""


@dataclass(frozen=True)
class _View:
    """A tensor argument of a logged op: a view of a recorded storage."""

    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Const:
    """A real tensor argument (made outside the recording, e.g. from Python data): its value, copied."""

    value: torch.Tensor


@dataclass
class _Entry:
    func: Any                                 # an aten OpOverload; None: ``const`` is the value
    args: tuple
    kwargs: dict
    default_dtype: torch.dtype
    creates: list[tuple[int, _View]] = field(default_factory=list)  # (flat output index, new storage)
    writes: tuple[int, ...] = ()
    reads: tuple[int, ...] = ()
    rng: tuple[str, torch.Tensor] | None = None  # ("default" | "kwarg", generator state before the op)
    const: torch.Tensor | None = None


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags or any(
        "Generator" in str(a.type) for a in func._schema.arguments)


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func``'s schema marks as mutated (``Tensor(a!)``), from its arguments."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


class _Log:
    """The recorded entries, the storages they make, and replay."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.keys: dict[int, int] = {}        # StorageImpl address -> storage key
        self.keep: list[Any] = []             # recorded storages, kept alive so addresses stay unique
        self.makers: dict[int, list[int]] = {}  # storage key -> entries creating or writing it

    # ------------------------------------------------------------------ recording
    def key_of(self, t: torch.Tensor) -> int | None:
        return self.keys.get(StorageWeakRef(t.untyped_storage()).cdata)

    def view_of(self, t: torch.Tensor) -> _View:
        key = self.key_of(t)
        if key is None:
            raise DeferredInitError(f"a fake tensor of shape {list(t.shape)} was made outside the recording; "
                                    f"build every tensor inside the workload function")
        return _View(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def new_storage(self, t: torch.Tensor) -> _View:
        s = t.untyped_storage()
        key = len(self.keys)
        self.keys[StorageWeakRef(s).cdata] = key
        self.keep.append(s)
        return self.view_of(t)

    def ref(self, x):
        """A logged argument: fake tensors by view, real tensors by value, anything else as is."""
        if isinstance(x, FakeTensor):
            return self.view_of(x)
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                raise DeferredInitError(f"a meta tensor of shape {list(x.shape)} reached the recording; build "
                                        f"the workload's tensors inside its function")
            with unset_fake_temporarily():
                return _Const(x.detach().clone())
        return x

    def add(self, entry: _Entry) -> None:
        index = len(self.entries)
        self.entries.append(entry)
        for key in dict.fromkeys([v.storage for _, v in entry.creates] + list(entry.writes)):
            self.makers.setdefault(key, []).append(index)

    # ------------------------------------------------------------------ replay
    def needed(self, targets: list[int], end: int) -> list[int]:
        """Indices of the entries that give the ``targets`` storages their values at log position ``end``."""
        bound: dict[int, int] = {}
        included: set[int] = set()
        work = []
        for key in targets:
            bound[key] = end
            work.append(key)
        while work:
            key = work.pop()
            for i in self.makers.get(key, []):
                if i >= bound[key] or i in included:
                    continue
                included.add(i)
                e = self.entries[i]
                for other in list(e.reads) + list(e.writes):
                    if bound.get(other, -1) < i:
                        bound[other] = i
                        work.append(other)
        return sorted(included)

    def replay(self, targets: list[int], end: int | None = None) -> dict[int, torch.UntypedStorage]:
        """Real storages of ``targets`` (as after log position ``end``, default: the whole log)."""
        end = len(self.entries) if end is None else end
        order = self.needed(targets, end)
        last: dict[int, int] = {}
        for i in order:
            e = self.entries[i]
            for key in list(e.reads) + list(e.writes) + [v.storage for _, v in e.creates]:
                last[key] = i
        keep = set(targets)
        env: dict[int, torch.UntypedStorage] = {}
        with torch.no_grad(), unset_fake_temporarily():
            for i in order:
                self._run(self.entries[i], env)
                for key in [k for k, at in last.items() if at == i and k not in keep]:
                    env.pop(key, None)
        missing = [k for k in targets if k not in env]
        assert not missing, f"no entry makes storage(s) {missing}"
        return env

    def _run(self, e: _Entry, env: dict[int, torch.UntypedStorage]) -> None:
        if e.func is None:
            env[e.creates[0][1].storage] = e.const.clone().untyped_storage()
            return
        real = lambda x: _real_view(env, x) if isinstance(x, _View) else (  # noqa: E731
            x.value.clone() if isinstance(x, _Const) else x)
        args, kwargs = tree_map(real, e.args), tree_map(real, e.kwargs)
        with default_dtype(e.default_dtype), _generator_state(e.rng, kwargs):
            out = e.func(*args, **kwargs)
        flat = tree_flatten(out)[0]
        for index, view in e.creates:
            t = flat[index]
            if e.func in _EMPTY:
                t.zero_()
            env[view.storage] = _in_layout(t, view)


def _real_view(env: dict[int, torch.UntypedStorage], v: _View) -> torch.Tensor:
    return torch.empty(0, dtype=v.dtype).set_(env[v.storage], v.offset, v.size, v.stride)


def _in_layout(t: torch.Tensor, v: _View) -> torch.UntypedStorage:
    """``t``'s storage when ``t`` has the recorded geometry, else a copy of ``t`` laid out as recorded."""
    if (tuple(t.shape), tuple(t.stride()), t.storage_offset()) == (v.size, v.stride, v.offset):
        return t.untyped_storage()
    extent = 0 if 0 in v.size else sum((n - 1) * s for n, s in zip(v.size, v.stride)) + 1
    nbytes = (v.offset + extent) * t.element_size()
    storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    torch.empty(0, dtype=v.dtype).set_(storage, v.offset, v.size, v.stride).copy_(t)
    return storage


def _generator_as_kwarg(func, args: tuple, kwargs: dict) -> tuple:
    """``func``'s positional arguments without a generator passed by position (``torch.poisson(x, g)`` calls
    ``aten.poisson(x, g)``): it moves to ``kwargs``, with the arguments after it, by name, where recording and
    replay look for it."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Generator):
            kwargs.update(zip([x.name for x in func._schema.arguments][i:], args[i:]))
            return tuple(args[:i])
    return args


@contextlib.contextmanager
def _generator_state(rng: tuple[str, torch.Tensor] | None, kwargs: dict):
    """Run a random op with its recorded generator state; the caller's generators are left as they were."""
    if rng is None:
        yield
        return
    kind, state = rng
    if kind == "kwarg":
        g = torch.Generator()
        g.set_state(state)
        kwargs["generator"] = g
        yield
        return
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(saved)


class _Recorder(TorchDispatchMode):
    """Logs every op that makes or writes a storage (see the module docstring); runs above fake tensors."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.log = _Log()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _METADATA:
            return func(*args, **kwargs)
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = _CPU                 # every device is built as the CPU (see module docstring)
        log = self.log
        random = _is_random(func)
        if random:
            args = _generator_as_kwarg(func, args, kwargs)
        written = _written(func, args, kwargs)
        entry = _Entry(func, tree_map(log.ref, args), tree_map(log.ref, kwargs), torch.get_default_dtype(),
                       writes=tuple(dict.fromkeys(k for k in map(log.key_of, written) if k is not None)))
        entry.reads = tuple(dict.fromkeys(
            v.storage for v in tree_flatten((entry.args, entry.kwargs))[0] if isinstance(v, _View)))
        if random:
            entry.rng = self._advance(func, args, kwargs, written, entry)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            return self._real(func, entry)
        for index, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, FakeTensor) and log.key_of(t) is None:
                entry.creates.append((index, log.new_storage(t)))
        if entry.creates or entry.writes:
            log.add(entry)
        # fake tensors memoise conversions by weak reference; a weakly referenced parameter cannot be
        # swapped by ``Module._apply`` (``model.to(dtype)``), which swaps fake parameters
        self.fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        return out

    def _advance(self, func, args, kwargs, written, entry: _Entry) -> tuple[str, torch.Tensor]:
        """Save the generator state ``func`` draws from, then advance that generator as the plain run
        would: the same op on real tensors (scratch for what it writes, replayed values for what it reads)."""
        g = kwargs.get("generator")
        if g is not None and g.device.type != "cpu":
            raise DeferredInitError(f"{func} draws from a {g.device.type} generator; deferred initialisation "
                                    f"replays CPU generators only: build the workload on the CPU")
        rng = ("kwarg", g.get_state()) if g is not None else ("default", torch.get_rng_state())
        scratch = {self.log.view_of(t): t.untyped_storage().nbytes() for t in written}
        end = len(self.log.entries)

        def real(ref):
            if isinstance(ref, _View) and ref in scratch:   # overwritten: only its geometry matters
                storage = torch.zeros(scratch[ref], dtype=torch.uint8).untyped_storage()
                return torch.empty(0, dtype=ref.dtype).set_(storage, ref.offset, ref.size, ref.stride)
            return self._value(ref, end)

        with unset_fake_temporarily(), torch.no_grad(), default_dtype(entry.default_dtype):
            func(*tree_map(real, entry.args), **tree_map(real, entry.kwargs))
        return rng

    def _value(self, ref, end: int):
        """The real value of a logged argument at log position ``end`` (anything but a tensor: as is)."""
        if isinstance(ref, _Const):
            return ref.value.clone()
        if not isinstance(ref, _View):
            return ref
        env = self.log.replay([ref.storage], end)
        return _real_view(env, ref)

    def _real(self, func, entry: _Entry):
        """``func`` computed on real values (its result depends on them); tensors it returns are logged
        as constants."""
        end = len(self.log.entries)
        value = lambda r: self._value(r, end)  # noqa: E731
        with unset_fake_temporarily(), torch.no_grad(), default_dtype(entry.default_dtype):
            out = func(*tree_map(value, entry.args), **tree_map(value, entry.kwargs))
        flat, spec = tree_flatten(out)
        result = []
        for t in flat:
            if isinstance(t, torch.Tensor):
                fake = self.fake_mode.from_tensor(t)
                self.log.add(_Entry(None, (), {}, entry.default_dtype, creates=[(0, self.log.new_storage(fake))],
                                    const=t.clone()))
                t = fake
            result.append(t)
        return tree_unflatten(result, spec)


# ---------------------------------------------------------------------------------------------- results

class Deferred:
    """The recorded construction of a workload: ``materialize(t)`` is the real value of one of its
    tensors (bitwise what the plain workload function gives), built alone."""

    def __init__(self, log: _Log, refs: dict[int, tuple[torch.Tensor, _View]], workload: Workload) -> None:
        self.workload = workload              # on meta tensors
        self._log = log
        self._refs = refs                     # id(meta tensor) -> (the meta tensor, kept alive; its view)
        self.replays = 0

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        """The value of ``t`` (a meta tensor of the deferred workload; a real tensor is returned as is),
        a fresh CPU tensor: a view of the replayed storage when it spans it, else a copy."""
        if t.device.type != "meta":
            return t.detach()
        found = self._refs.get(id(t))
        if found is None or found[0] is not t:
            raise DeferredInitError(f"the meta tensor of shape {list(t.shape)} is not one of this workload's "
                                    f"recorded tensors (parameters, buffers, optimizer state, batch)")
        view = found[1]
        self.replays += 1
        env = self._log.replay([view.storage])
        out = _real_view(env, view)
        spans = out.is_contiguous() and out.storage_offset() == 0 and \
            out.numel() * out.element_size() == env[view.storage].nbytes()
        return out if spans else out.clone()

    @property
    def entries(self) -> int:
        return len(self._log.entries)


def _other_device(x) -> bool:
    return isinstance(x, torch.device) and x.type != "cpu" or isinstance(x, str) and \
        x.split(":")[0] in ("meta", "cuda", "mps", "xpu", "hpu")


class _CpuDevices(TorchFunctionMode):
    """Every device a torch function is asked for is the CPU (``torch.tensor(data, device="meta")`` under
    ``with torch.device("meta")`` would drop its data before the dispatcher sees it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _other_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to:
            args = tuple(_CPU if _other_device(a) else a for a in args)
        return func(*args, **kwargs)


def record(fn: Callable[[], Any]) -> tuple[Any, _Log]:
    """Run ``fn()`` under fake tensors with the recorder; (its result, with fake tensors; the log)."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = _Recorder(fake_mode)
    with fake_mode, recorder, _CpuDevices():
        result = fn()
    return result, recorder.log


def load_deferred(workload, dtype: torch.dtype | None = None) -> tuple[Workload, Deferred]:
    """``(workload on meta tensors, its Deferred)`` for a ``FILE[:FUNC]`` spec (``dtype``: as in
    ``load_workload``) or a function returning ``(model, optimizer, loss_fn, batch)``."""
    box: dict[str, _Log] = {}

    def call(fn):
        result, box["log"] = record(fn)
        return result

    if isinstance(workload, (str, Path)):
        w = load_workload(str(workload), dtype, call=call)
    elif callable(workload):
        with default_dtype(dtype):
            result = call(workload)
        name = getattr(workload, "__name__", "workload")
        w = validate_workload(result, Path("<in memory>"), name)
    else:
        raise ValueError(f"load_deferred takes a FILE[:FUNC] spec or a function, not a {type(workload).__name__}")
    return _to_meta(w, box["log"])


def _fake_value(log: _Log, t: FakeTensor) -> torch.Tensor:
    """The real value of a fake tensor of the finished recording (a copy)."""
    view = log.view_of(t)
    return _real_view(log.replay([view.storage]), view).clone()


def _to_meta(w: Workload, log: _Log) -> tuple[Workload, Deferred]:
    """Replace every fake tensor of the workload by a meta tensor that the Deferred can materialise."""
    refs: dict[int, tuple[torch.Tensor, _View]] = {}
    memo: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, FakeTensor):
            return t
        if id(t) not in memo:
            m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            if isinstance(t, torch.nn.Parameter):
                m = torch.nn.Parameter(m, requires_grad=t.requires_grad)
            memo[id(t)] = m
            refs[id(m)] = (m, log.view_of(t))
        return memo[id(t)]

    deferred = Deferred(log, refs, w)
    for module in w.model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = meta(p)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = meta(b)
        for name, value in list(vars(module).items()):   # plain tensor attributes: their (small) real values
            if isinstance(value, FakeTensor):
                setattr(module, name, _fake_value(log, value))
    opt = w.optimizer
    for group in opt.param_groups:
        group["params"] = [meta(p) for p in group["params"]]
        for k, v in group.items():
            if k != "params" and isinstance(v, FakeTensor):
                group[k] = _fake_value(log, v)
    state = {meta(p): {k: meta(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in opt.state.items()}
    opt.state.clear()
    opt.state.update(state)
    w.batch = tuple(meta(b) for b in w.batch)
    skip = {id(m) for m in w.model.modules()} | {id(opt)}
    _Realiser(log, skip).realise(w.loss_fn)
    return w, deferred


class _Realiser:
    """Real values for the fake tensors a loss function reaches outside the model: class weights in a closure
    (``F.cross_entropy(..., weight=w)``), a loss module's buffers (``nn.CrossEntropyLoss(weight=w)``), default
    arguments, ``functools.partial`` arguments, a bound method's object, the file's globals it names, and
    lists, tuples and dicts of those. Holders are changed in place (closure cells, defaults, attributes);
    the model and the optimizer (``skip``) keep their meta tensors."""

    def __init__(self, log: _Log, skip: set[int]) -> None:
        self.log, self.skip, self.seen = log, skip, set()

    def realise(self, x):
        """``x`` itself, or (a fake tensor, a tuple holding one) its replacement."""
        if isinstance(x, FakeTensor):
            real = _fake_value(self.log, x)
            return torch.nn.Parameter(real, requires_grad=x.requires_grad) if isinstance(x, torch.nn.Parameter) \
                else real
        if id(x) in self.skip or id(x) in self.seen or isinstance(x, (str, bytes, int, float, type, torch.Tensor)):
            return x
        self.seen.add(id(x))
        if isinstance(x, tuple):
            items = [self.realise(v) for v in x]
            return x if all(a is b for a, b in zip(items, x)) else type(x)(items) if type(x) is tuple else x
        if isinstance(x, list):
            x[:] = [self.realise(v) for v in x]
        elif isinstance(x, dict):
            for k in list(x):
                x[k] = self.realise(x[k])
        elif isinstance(x, functools.partial):
            func, args, kw = self.realise(x.func), self.realise(x.args), dict(x.keywords)
            self.realise(kw)
            x.__setstate__((func, args, kw, x.__dict__ or None))
        elif isinstance(x, types.MethodType):
            self.realise(x.__self__)
        elif isinstance(x, types.FunctionType):
            self._function(x)
        elif isinstance(x, torch.nn.Module):
            for m in x.modules():
                for store in (m._parameters, m._buffers):
                    self.realise(store)
                self._attributes(m)
        elif hasattr(x, "__dict__") and not isinstance(x, types.ModuleType):
            self._attributes(x)
        return x

    def _function(self, fn: types.FunctionType) -> None:
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:   # a cell not yet filled
                continue
            new = self.realise(value)
            if new is not value:
                cell.cell_contents = new
        if fn.__defaults__:
            fn.__defaults__ = self.realise(fn.__defaults__)
        if fn.__kwdefaults__:
            self.realise(fn.__kwdefaults__)
        for name in fn.__code__.co_names:   # the file's globals it names (set by the workload function)
            value = fn.__globals__.get(name)
            if isinstance(value, (FakeTensor, types.FunctionType)):
                fn.__globals__[name] = self.realise(value)

    def _attributes(self, obj) -> None:
        for k, v in list(vars(obj).items()):
            if not isinstance(v, torch.nn.Module) or id(v) not in self.skip:
                new = self.realise(v)
                if new is not v:
                    setattr(obj, k, new)
