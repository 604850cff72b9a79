"""Arena executor: run a captured step in a planned order with every tensor at its planned offset.

Given the graph, its memory problem and value mapping (``memory.from_graph.problem_from_graph``) and a
plan (an ``order`` of op ids, an ``offsets`` dict tensor id -> byte offset, and a ``height``),
:class:`ArenaProgram` allocates ONE ``torch.empty(height, dtype=torch.uint8)`` buffer and runs the nodes
in the planned order:

- Each problem tensor is a *slot*: ``arena[off:off + nbytes].view(dtype).as_strided(shape, strides)``,
  with the strides the op produces by itself (found once by running the graph on the meta device), so
  the views that follow behave exactly as in the plain program.
- A non-view node writes its outputs into their slots: through the op's ``out=`` overload when aten has
  one with the same arguments (``torch.ops.aten.add.out`` for ``add.Tensor``), otherwise the op runs
  normally and its result is copied into the slot (``ArenaStats.out_variant`` / ``copied``). Each out=
  overload is first tried once per call signature beside the op, into guarded scratch copies of its slots,
  and used only where it wrote exactly its slots' bytes and the op's values (``_out_safe``: ``huber_loss.out``
  with a reduction writes the unreduced loss through its scalar out tensor first; ``mse_loss.out`` only resizes
  it to the unreduced shape first, which an empty out tensor shows without PyTorch's resize warning). After an
  out= call every slot must be unmoved and the arena its planned size, and a result copied into a slot must
  have the slot's shape: otherwise an error names the node (a wrong graph type never runs outside the arena).
- View nodes run on the slot tensors (they alias the arena); a registered view that copies after all
  (``reshape`` of a non-viewable input) is counted in ``view_copies``.
- Batch inputs are copied into their slots at the start. State inputs and constants stay outside the
  arena (``state`` is passed in, as for ``StepProgram``). A new state value that the mapping marks
  in-place is written straight into the state tensor (``out=`` when the op is elementwise and reads that
  tensor only as an exact alias, else computed and copied in): ``step`` updates ``state``'s tensors in
  place, as ``optimizer.step()`` does. Other new state values and the loss are cloned out of the arena.

**Rank graphs** (``lower.rank_graph``: a rank's program of a parallel plan): a communication node
(``rank_graph.COMM_OP``) runs its step with ``communicate(x, kind, axis, *params)`` (default
``spmd_ops.redistribute``: the collectives of the process context that ``spmd_ops.set_context`` set; blocking,
one step at a time, in program order) and its result is copied into its slot. ``steps`` is the same step as a
generator that yields each communication request instead, so a driver can run several ranks in lockstep
(``lower.arena_ranks``).

``debug=True`` adds two runtime guards: before an output is written, its byte range is checked against
every tensor live at that step (the lifetime rule of ``memory/problem.py``), and the bytes of every
tensor whose lifetime ends are filled with 0xFF (NaN for floats), so a plan that frees a tensor too early
changes the results instead of passing silently.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..ir.graph import Graph, Role
from ..ir.registry import OpKind, draws_rng, lookup, storage_offset_arg
from ..memory.from_graph import GraphMemory
from ..memory.problem import MemProblem, TensorKind, lifetimes
from ..memory.simulate import check_order
from .execute import StepProgram
from .fx import OnContiguous, constant_tensor, convert_arg, resolve_op, runnable_op
from .rank_graph import is_comm
from .spmd_ops import redistribute

__all__ = ["ArenaProgram", "ArenaStats", "out_overload", "compare_arena_step", "compare_pairs"]


@dataclass
class ArenaStats:
    """What the last ``step`` did."""

    arena_bytes: int = 0
    out_variant: int = 0      # non-view nodes that wrote through their out= overload
    copied: int = 0           # non-view nodes whose result was copied into its slot
    views: int = 0            # view nodes run on slots
    view_copies: int = 0      # registered views whose torch result did not alias their base
    input_copies: int = 0     # batch tensors copied into their slots
    inplace_state: int = 0    # state tensors written in place
    guard_checks: int = 0     # overlap checks done (debug)


@lru_cache(maxsize=None)
def out_overload(op: str) -> tuple[torch._ops.OpOverload, tuple[str, ...]] | None:
    """The out= overload of ``op`` taking the same arguments (an ``fx.OnContiguous`` of it where ``op`` is
    called so), and the names of its out arguments."""
    fn = resolve_op(op)
    schema = fn._schema
    sig = [(a.name, str(a.type)) for a in schema.arguments]
    n_ret = len(schema.returns)
    if n_ret == 0 or any(str(r.type) != "Tensor" for r in schema.returns):
        return None
    packet = getattr(getattr(torch.ops, op.split(".")[0]), op.split(".")[1])
    for name in packet.overloads():
        ovl = getattr(packet, name)
        args = ovl._schema.arguments
        outs = [a for a in args if a.is_out]
        rest = [(a.name, str(a.type)) for a in args if not a.is_out]
        if outs and rest == sig and len(outs) == n_ret:
            return (OnContiguous(ovl, fn.layout) if isinstance(fn, OnContiguous) else ovl), tuple(a.name for a in outs)
    return None


def _signature(x):
    """A hashable stand-in for a call's arguments: tensors by geometry and dtype, containers item by item."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype, x.stride()
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    return repr(x)


def _same_values(got: torch.Tensor, want) -> bool:
    """Bitwise-equal values (NaN where NaN) of one output."""
    if not isinstance(want, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.is_floating_point() or got.is_complex():
        return torch.equal(got.isnan(), want.isnan()) and torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    return torch.equal(got, want)


def _dense(shape, stride) -> bool:
    """Non-overlapping and dense: the elements fill exactly ``numel`` consecutive slots."""
    dims = sorted((st, sz) for sz, st in zip(shape, stride) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _contiguous_strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


class ArenaProgram:
    """One training step per ``step(state, batch)`` call, every intermediate in one planned arena."""

    def __init__(self, graph: Graph, problem: MemProblem, mapping: GraphMemory, order, offsets: dict[int, int],
                 height: int, device: torch.device | str = "cpu", debug: bool = False, communicate=None) -> None:
        self.device = torch.device(device)
        if self.device.type == "meta":
            raise ValueError("the arena executor runs real tensors; the meta device has no data "
                             "(plan on meta, execute on cpu or cuda with real tensors)")
        if mapping.include_state:
            raise ValueError("the arena executor keeps the state outside the arena; build the problem with "
                             "include_state=False")
        if len(problem.ops) != len(graph.nodes):
            raise ValueError("the memory problem was not built from this graph (op counts differ)")
        self.graph, self.problem, self.mapping = graph, problem, mapping
        self.order = [int(o) for o in order]
        check_order(problem, self.order)
        self.offsets = {int(k): int(v) for k, v in offsets.items()}
        self.height = int(height)
        self.debug = debug
        self.stats = ArenaStats()
        self.lifetimes = lifetimes(problem, self.order)
        self._check_layout()
        self.communicate = communicate or redistribute
        self._fns = [None if is_comm(n.op) else resolve_op(runnable_op(n.op)) for n in graph.nodes]
        self._strides: dict[int, tuple[int, ...]] = {}   # set with the arena, from the first step's inputs
        self._input_offsets: dict[int, int] = {}           # graph input -> its tensor's storage offset this step
        self._no_out: set[int] = set()   # nodes whose out= call failed once: copy from then on
        self._out_checked: dict[tuple, bool] = {}   # out_signature -> out= overload equals the op (_out_safe)
        self._constants = {v: constant_tensor(graph, v, self.device) for v in graph.constants}
        self._arena: torch.Tensor | None = None
        self._slots: dict[int, torch.Tensor] = {}

    # -- plan checks ----------------------------------------------------------------------------
    def _check_layout(self) -> None:
        """``layout.validate_layout`` with each tensor's element size as its alignment and the arena as capacity."""
        from ..memory.layout import Buffer, validate_layout
        types = self.graph.types
        bufs = [Buffer(tid, lo, hi, self.problem.tensors[tid].size, types[tid].dtype.itemsize)
                for tid, (lo, hi) in self.lifetimes.items() if self.problem.tensors[tid].size > 0]
        errors = validate_layout(bufs, self.offsets, capacity=self.height)
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise ValueError(f"the plan's layout cannot run in an arena of {self.height} bytes: {errors[0]}{more}")

    # -- strides each op produces on its own ------------------------------------------------------
    def _natural_strides(self, inputs: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
        """Each value's strides when the graph runs on meta tensors whose inputs have this run's strides
        (``inputs``; capture saw the same): slots then have the layouts the captured program assumes, which its
        ``as_strided`` views read (those of a channels-last convolution's output)."""
        graph = self.graph
        meta = torch.device("meta")
        env: dict[int, torch.Tensor] = {}
        strides: dict[int, tuple[int, ...]] = {}
        for inp in graph.inputs:
            t = graph.types[inp.value]
            st = inputs.get(inp.value)
            dense = st is not None and _dense(t.shape, st)
            env[inp.value] = torch.empty_strided(t.shape, st if dense else _contiguous_strides(t.shape),
                                                 dtype=getattr(torch, t.dtype.value), device=meta)
            if dense:
                strides[inp.value] = st
        for v in graph.constants:
            t = graph.types[v]
            env[v] = torch.empty(t.shape, dtype=getattr(torch, t.dtype.value), device=meta)
        with torch.no_grad():
            for i, node in enumerate(graph.nodes):
                conv = lambda a: convert_arg(a, lambda r: env[r.id], meta)  # noqa: E731
                try:   # a communication step is not run here: its result is contiguous
                    res = None if self._fns[i] is None else self._fns[i](*conv(node.args), **conv(node.kwargs))
                except (NotImplementedError, RuntimeError, TypeError, ValueError):
                    res = None
                vals = list(res) if node.multi and res is not None else [res]
                for k, v in enumerate(node.outputs):
                    if v is None:
                        continue
                    t = graph.types[v]
                    r = vals[k] if k < len(vals) else None
                    if not isinstance(r, torch.Tensor) or tuple(r.shape) != tuple(t.shape):
                        r = torch.empty(t.shape, dtype=getattr(torch, t.dtype.value), device=meta)
                    env[v] = r
                    if i not in self.mapping.view_nodes:
                        st = tuple(r.stride())
                        strides[v] = st if _dense(t.shape, st) else _contiguous_strides(t.shape)
        return strides

    # -- the arena and its slots ---------------------------------------------------------------------
    def _make_arena(self, inputs: dict[int, tuple[int, ...]]) -> None:
        self._strides = self._natural_strides(inputs)
        self._arena = torch.empty(self.height, dtype=torch.uint8, device=self.device)
        assert self._arena.numel() == self.height
        types = self.graph.types
        for tid, t in self.problem.tensors.items():
            tt = types[tid]
            dtype = getattr(torch, tt.dtype.value)
            stride = self._strides.get(tid, _contiguous_strides(tt.shape))
            if t.size == 0 or tt.numel == 0:
                self._slots[tid] = torch.empty_strided(tt.shape, stride, dtype=dtype, device=self.device)
                continue
            off = self.offsets[tid]
            nbytes = self.mapping.nbytes[tid]
            flat = self._arena[off:off + nbytes].view(dtype)
            self._slots[tid] = flat.as_strided(tt.shape, stride)

    # -- one step --------------------------------------------------------------------------------------
    def step(self, state: dict[str, torch.Tensor], batch: tuple) -> torch.Tensor:
        """One step in the planned order; ``state``'s tensors are updated (in place where planned); returns the loss."""
        gen = self.steps(state, batch)
        result = None
        while True:
            try:
                x, kind, axis, params = gen.send(result)
            except StopIteration as stop:
                return stop.value
            result = self.communicate(x, kind, axis, *params)

    def steps(self, state: dict[str, torch.Tensor], batch: tuple):
        """``step`` as a generator: yields ``(x, kind, axis, params)`` at each communication node and takes
        the step's result back (``send``); returns the loss."""
        graph, mapping = self.graph, self.mapping
        n_batch = sum(1 for i in graph.inputs if i.role is Role.BATCH)
        if len(batch) != n_batch:
            raise ValueError(f"the step takes {n_batch} batch tensors, got {len(batch)}")
        given = self._given_inputs(state, batch)
        self._input_offsets = {v: t.storage_offset() for v, t in given.items()}
        if self._arena is None:
            self._make_arena({v: tuple(t.stride()) for v, t in given.items()})
        stats = self.stats = ArenaStats(arena_bytes=self._arena.numel())
        env: dict[int, torch.Tensor] = dict(self._constants)
        inplace_slot: dict[int, torch.Tensor] = {}
        for inp in graph.inputs:
            slot = self._slots.get(inp.value) if inp.role is Role.BATCH else None
            if slot is None:
                env[inp.value] = given[inp.value]
            else:
                slot.copy_(given[inp.value])
                env[inp.value] = slot
                stats.input_copies += 1
        for r, name in mapping.inplace.items():
            t = state[name]
            if tuple(t.shape) != graph.types[r].shape:
                raise ValueError(f"state tensor {name!r} has shape {tuple(t.shape)}, the graph expects "
                                 f"{graph.types[r].shape}")
            inplace_slot[r] = t

        guard = _Guard(self) if self.debug else None
        with torch.no_grad():
            for s, i in enumerate(self.order):
                node = graph.nodes[i]
                conv = lambda a: convert_arg(a, lambda r: env[r.id], self.device)  # noqa: E731
                args, kwargs = conv(node.args), conv(node.kwargs)
                if i in mapping.view_nodes:
                    self._run_view(i, node, args, kwargs, env, stats)
                else:
                    if guard is not None:
                        guard.before_write(s, i)
                    res = (yield args[0], args[1], args[2], tuple(args[3:])) if self._fns[i] is None else None
                    self._run_node(i, node, args, kwargs, env, inplace_slot, stats, res)
                if guard is not None:
                    guard.after_step(s)
            loss = None
            for o in graph.outputs:
                val = env[o.value]
                r = mapping.root[o.value]
                if o.role is Role.LOSS:
                    loss = val.clone()
                elif r in mapping.inplace and mapping.inplace[r] == o.name:
                    stats.inplace_state += 1  # already written into state[o.name]
                elif r in mapping.persistent and mapping.state_value.get(o.name) == r:
                    state[o.name] = val      # unchanged (or a view of itself)
                else:
                    state[o.name] = val.clone()
        if loss is None:
            raise ValueError("the graph has no loss output")
        return loss

    def _given_inputs(self, state: dict[str, torch.Tensor], batch: tuple) -> dict[int, torch.Tensor]:
        """The tensors this step gives the graph's inputs (the batch's, the state's)."""
        missing = next((i.name for i in self.graph.inputs if i.role is not Role.BATCH and i.name not in state), None)
        if missing is not None:
            raise ValueError(f"the state has no tensor {missing!r}; pass Captured.initial_state()")
        b = iter(batch)
        return {inp.value: next(b) if inp.role is Role.BATCH else state[inp.name] for inp in self.graph.inputs}

    def _storage_offset(self, node, args: list, kwargs: dict, env) -> tuple[list, dict]:
        """``as_strided`` (and its scatter and copy) count the storage offset from the start of the input's
        storage (``as_strided_scatter`` clones it with its offset): capture's was the root tensor's own
        (offset 0 for an intermediate, the given tensor's for an input); here the root may be a slot in the
        arena, so the offset moves by where the root now starts."""
        at = storage_offset_arg(node.op)
        if at is None:
            return args, kwargs
        given = args[at] if len(args) > at else kwargs.get("storage_offset")
        if given is None:
            return args, kwargs
        first = node.args[0].id
        root = self.mapping.root.get(first, first)
        delta = env[root].storage_offset() - self._input_offsets.get(root, 0)
        if len(args) > at:
            return [*args[:at], given + delta, *args[at + 1:]], kwargs
        return args, {**kwargs, "storage_offset": given + delta}

    def _run_view(self, i, node, args, kwargs, env, stats) -> None:
        args, kwargs = self._storage_offset(node, args, kwargs, env)
        res = self._fns[i](*args, **kwargs)
        vals = list(res) if node.multi else [res]
        base = env[node.input_refs()[0].id]
        stats.views += 1
        for v, t in zip(node.outputs, vals):
            if v is None:
                continue
            if t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                stats.view_copies += 1
            env[v] = t

    def _run_node(self, i, node, args, kwargs, env, inplace_slot, stats, result=None) -> None:
        """Write node ``i``'s outputs into their slots (``result``: a communication step's, computed already)."""
        slots: list[torch.Tensor | None] = []
        state_out = False
        for v in node.outputs:
            if v is None:
                slots.append(None)
            elif v in inplace_slot:
                slots.append(inplace_slot[v])
                state_out = True
            else:
                slots.append(self._slots.get(v))
        if result is None:
            args, kwargs = self._storage_offset(node, args, kwargs, env)
        ov = None if i in self._no_out or result is not None else out_overload(node.op)
        use_out = ov is not None and all(s is not None for s in slots) and len(ov[1]) == len(slots)
        if use_out and state_out:
            use_out = self._alias_ok(node, env, [s for v, s in zip(node.outputs, slots) if v in inplace_slot])
        elif use_out and not self._out_safe(i, node, ov, args, kwargs, slots):
            self._no_out.add(i)
            use_out = False
        if use_out:
            fn, names = ov
            where = [(s.data_ptr(), s.shape) for s in slots]
            try:
                fn(*args, **kwargs, **dict(zip(names, slots)))
            except RuntimeError:
                self._no_out.add(i)
                use_out = False
            else:
                stats.out_variant += 1
                self._check_out_slots(i, node, slots, where)
        if not use_out:
            res = result if result is not None else self._fns[i](*args, **kwargs)
            vals = list(res) if node.multi else [res]
            for v, slot, t in zip(node.outputs, slots, vals):
                if slot is not None and isinstance(t, torch.Tensor):
                    if t.shape != slot.shape or t.dtype != slot.dtype:
                        raise RuntimeError(f"node {i} ({node.op}) returned {t.dtype} {list(t.shape)} for value {v}, "
                                           f"but the graph gives it {slot.dtype} {list(slot.shape)} (its arena slot): "
                                           f"the graph's type of that value is wrong, so the plan's bytes are not what "
                                           f"runs")
                    slot.copy_(t)
            stats.copied += 1
        for v, slot in zip(node.outputs, slots):
            if v is not None:
                env[v] = slot

    def _check_out_slots(self, i, node, slots: list[torch.Tensor], where: list) -> None:
        """After an out= call: every out tensor is still its slot (same address and shape) and the arena was not
        grown. An out= kernel that resizes its out tensor (PyTorch's "An output with one or more elements was
        resized" warning) moves it off its planned bytes, or reallocates the whole arena past its planned height."""
        arena = self._arena.untyped_storage()
        for v, s, (ptr, shape) in zip(node.outputs, slots, where):
            if s.data_ptr() != ptr or s.shape != shape or arena.nbytes() != self.height:
                raise RuntimeError(f"node {i} ({node.op}) resized its out= tensor for value {v} from the slot's "
                                   f"shape {list(shape)} to {list(s.shape)}: it no longer lies at its planned "
                                   f"offset in the arena ({arena.nbytes()} bytes, planned {self.height})")

    def _out_safe(self, i, node, ov, args, kwargs, slots: list[torch.Tensor]) -> bool:
        """Whether the out= overload writes exactly its slots' bytes, and the op's values: tried once per call
        signature on the step's inputs, into guarded scratch copies of the slots, against the op itself. An out=
        overload may differ: ``huber_loss.out`` with a reduction resizes its out tensor to the unreduced shape,
        writes the elementwise loss there (past a scalar slot, over its neighbours in the arena), then reduces.
        Sampling ops are trusted (a second run would draw other numbers and move the generator's stream)."""
        if draws_rng(node.op):
            return True
        key = (node.op, _signature((args, kwargs)), _signature(slots))
        if key not in self._out_checked:
            with warnings.catch_warnings():   # the resize warning of an out= that differs
                warnings.simplefilter("ignore")
                self._out_checked[key] = self._out_equal(i, node, ov, args, kwargs, slots)
        return self._out_checked[key]

    def _out_equal(self, i, node, ov, args, kwargs, slots: list[torch.Tensor]) -> bool:
        """``_out_safe``'s trial: the op, then its out= overload into scratch copies of the slots, each at the very
        end of its own buffer behind guard bytes; equal when no guard byte changed, no slot moved or changed shape,
        no buffer grew, and the values are bitwise the op's. A slot ends where its buffer ends, so an out= kernel
        that grows its out tensor even for a moment reallocates the buffer and is seen: ``mse_loss.out`` with a
        reduction resizes its scalar out tensor to the unreduced shape before reducing into it (no write past the
        slot, but in the arena that resize claims the bytes after the slot, or reallocates the arena at its end).
        That is probed first with empty out tensors (``_grows_out``), which PyTorch resizes without its warning."""
        if self._grows_out(ov, args, kwargs, slots):
            return False
        ref = self._fns[i](*args, **kwargs)
        refs = list(ref) if node.multi else [ref]
        pad = 256
        bufs = [torch.full((pad + t.numel() * t.element_size(),), 0xA5, dtype=torch.uint8, device=t.device)
                for t in slots]
        views = [b[pad:].view(t.dtype).as_strided(t.shape, t.stride()) for b, t in zip(bufs, slots)]
        ptrs = [v.data_ptr() for v in views]
        try:
            ov[0](*args, **kwargs, **dict(zip(ov[1], views)))
        except RuntimeError:
            return False
        return all(v.data_ptr() == q and v.shape == t.shape and v.stride() == t.stride() and
                   b.untyped_storage().nbytes() == b.numel() and bool((b[:pad] == 0xA5).all()) and
                   _same_values(v, r) for v, q, t, b, r in zip(views, ptrs, slots, bufs, refs)) and \
            self._shared_out_equal(ov, args, kwargs, slots, refs, pad)

    @staticmethod
    def _shared_out_equal(ov, args, kwargs, slots: list[torch.Tensor], refs: list, pad: int) -> bool:
        """Several out tensors in one buffer (as the arena's slots share its storage), guard bytes between them:
        the op's values, and no guard byte changed. ``linalg_qr.out`` writes R as zeros when Q and R are views
        of one storage (PyTorch 2.13, CPU), though each alone is right."""
        if len(slots) < 2:
            return True
        sizes = [t.numel() * t.element_size() for t in slots]
        starts = [pad]
        for n in sizes[:-1]:      # the next slot after guard bytes, 64-byte aligned
            starts.append(starts[-1] + -(-(n + pad) // 64) * 64)
        buf = torch.full((starts[-1] + sizes[-1],), 0xA5, dtype=torch.uint8, device=slots[0].device)
        views = [buf[a:a + n].view(t.dtype).as_strided(t.shape, t.stride()) for a, n, t in zip(starts, sizes, slots)]
        try:
            ov[0](*args, **kwargs, **dict(zip(ov[1], views)))
        except RuntimeError:
            return False
        guards = [buf[a - pad:a] for a in starts]
        return buf.untyped_storage().nbytes() == buf.numel() and all(bool((g == 0xA5).all()) for g in guards) and \
            all(v.shape == t.shape and _same_values(v, r) for v, t, r in zip(views, slots, refs))

    @staticmethod
    def _grows_out(ov, args, kwargs, slots: list[torch.Tensor]) -> bool:
        """Whether the out= overload, given empty out tensors, grows any of them past its slot's bytes or leaves it
        in another shape: a kernel that sizes its out tensor for an intermediate result (``mse_loss.out``'s
        unreduced loss) before the final one. An empty out tensor is resized silently, a slot with PyTorch's
        "An output with one or more elements was resized" warning; storage never shrinks, so its final size is
        the largest the kernel asked for. A kernel that refuses empty out tensors is left to the slot trial."""
        outs = [torch.empty(0, dtype=t.dtype, device=t.device) for t in slots]
        try:
            ov[0](*args, **kwargs, **dict(zip(ov[1], outs)))
        except RuntimeError:
            return False
        return any(o.shape != t.shape or o.untyped_storage().nbytes() > t.numel() * t.element_size()
                   for o, t in zip(outs, slots))

    def _alias_ok(self, node, env, outs: list[torch.Tensor]) -> bool:
        """out= may write into a state tensor the op also reads only for elementwise ops and exact aliases."""
        d = lookup(node.op)
        ins = [env[r.id] for r in node.input_refs()]
        for out in outs:
            ptr = out.untyped_storage().data_ptr()
            for x in ins:
                if x.untyped_storage().data_ptr() != ptr:
                    continue
                if d is None or d.kind is not OpKind.ELEMENTWISE:
                    return False
                if x.shape != out.shape or x.stride() != out.stride() or x.storage_offset() != out.storage_offset():
                    return False
        return True


class _Guard:
    """Debug guard: live byte ranges per step (lifetime rule); writes checked, dead bytes poisoned."""

    def __init__(self, prog: ArenaProgram) -> None:
        self.prog = prog
        self.live: dict[int, tuple[int, int]] = {}
        self.dies: dict[int, list[int]] = {}
        for tid, (lo, hi) in prog.lifetimes.items():
            t = prog.problem.tensors[tid]
            if t.size == 0:
                continue
            if t.kind is TensorKind.INPUT:
                off = prog.offsets[tid]
                self.live[tid] = (off, off + t.size)
            if hi < len(prog.order):
                self.dies.setdefault(hi - 1, []).append(tid)

    def before_write(self, s: int, op_id: int) -> None:
        prog = self.prog
        for tid in prog.problem.op(op_id).outputs:
            t = prog.problem.tensors[tid]
            if t.size == 0:
                continue
            a = prog.offsets[tid]
            b = a + t.size
            for other, (la, lb) in self.live.items():
                prog.stats.guard_checks += 1
                if a < lb and la < b:
                    raise AssertionError(f"step {s}: op {op_id} writes tensor {tid} at [{a}, {b}) over live tensor "
                                         f"{other} at [{la}, {lb})")
            self.live[tid] = (a, b)

    def after_step(self, s: int) -> None:
        arena = self.prog._arena
        for tid in self.dies.get(s, []):
            a, b = self.live.pop(tid, (None, None))
            if a is not None:
                arena[a:b].fill_(0xFF)


def compare_arena_step(graph: Graph, problem: MemProblem, mapping: GraphMemory, plan, initial_state,
                       batch: tuple, rtol: float, atol: float) -> dict:
    """One step in the planned arena (``ArenaProgram``, debug checks on) against the plain single-device
    program (``StepProgram``) on the same seed, each from a fresh ``initial_state()``: whether the loss and
    every state tensor agree (``allclose`` at ``rtol``/``atol``, and bitwise), the largest difference, and the
    arena's statistics (``arena_equals_plan``: it used exactly the planned height)."""
    arena = ArenaProgram(graph, problem, mapping, plan.order, plan.offsets, plan.height, debug=True)
    ref = StepProgram(graph)
    s_ref, s_arena = initial_state(), initial_state()
    torch.manual_seed(0)
    loss_ref = ref.step(s_ref, batch)
    torch.manual_seed(0)
    loss_arena = arena.step(s_arena, batch)
    pairs = [(loss_ref, loss_arena)] + [(s_ref[k], s_arena[k]) for k in s_ref]
    max_diff, equal, bitwise = compare_pairs(pairs, rtol, atol)
    st = arena.stats
    return {"equal": equal, "bitwise": bitwise, "max_abs_diff": max_diff, "arena_bytes": st.arena_bytes,
            "arena_equals_plan": st.arena_bytes == plan.height, "out_variant_ops": st.out_variant,
            "copied_ops": st.copied, "view_ops": st.views, "view_copies": st.view_copies,
            "inplace_state": st.inplace_state, "loss": float(loss_arena)}


def compare_pairs(pairs, rtol: float, atol: float) -> tuple[float, bool, bool]:
    """(largest absolute difference, all close at rtol/atol, all bitwise equal) over (reference, result) tensor
    pairs, compared in float64; empty tensors are skipped."""
    max_diff, equal, bitwise = 0.0, True, True
    for a, b in pairs:
        if a.numel() == 0:
            continue
        a64, b64 = a.double(), b.double()
        max_diff = max(max_diff, float((a64 - b64).abs().max()))
        equal = equal and bool(torch.allclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True))
        bitwise = bitwise and bool(torch.equal(a, b))
    return max_diff, equal, bitwise
