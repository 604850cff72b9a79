"""The training step at batch B/m (``microbatch_graph``): what the micro-batch programs are lowered from.

The step is captured again on the first B/m rows of every batch tensor. Its structure (nodes, ops, wiring)
must be the whole-batch step's, as the plan is applied by node name (``rank_step.same_structure``). PyTorch
does not always give that: a tensor with a dimension of size 1 counts as contiguous after a transpose, so at
one row per micro-batch ``reshape`` becomes a ``view`` where it copies at two rows or more (``clone`` +
``_unsafe_view``), and ``linear`` folds into ``addmm`` (BERT's attention, a T5 decoder).

**Derived step** (used only when the direct capture's structure differs). The step is captured at k = 3 and
4 units of B/m rows (rows past B repeat the batch: only shapes matter), where PyTorch takes the whole-batch
code paths. Every number that differs between the two captures (a shape, a size argument, a constant like a
mean's 1/N) is taken as a function of k, linear in k or, failing that, with a linear reciprocal; each such
fit is checked exactly at k = 2 (a third capture) and at k = m (the whole-batch step), and the step at k = 1
is the whole-batch structure with every number evaluated at k = 1. Any number that fits neither form, and any
difference of structure between the captures, keeps the direct capture, which ``same_structure`` then
refuses with its message.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings

import torch

from ..capture import Captured, CaptureError, capture, default_dtype
from ..capture.optim import copy_model
from ..ir.graph import Graph, Ref
from ..ir.registry import draws_rng
from ..ir.types import TensorType
from .compare import least_precise_dtype
from .data import check_microbatch_rows

__all__ = ["check_microbatch_loss", "checked_microbatch_graph", "explain_microbatch_errors", "microbatch_error",
           "microbatch_graph", "microbatch_note"]

_FIT_UNITS = (3, 4)        # k of the two captures every number is fitted on
_CHECK_UNIT = 2            # k of a third capture each fit must reproduce exactly (as must the whole batch, k = m)


class _NotAFunctionOfK(Exception):
    """A number of the captures is not linear (nor reciprocal-linear) in the micro-batch size."""


def microbatch_graph(cap: Captured, microbatches: int) -> Graph:
    """The training step at batch B/m (module docstring)."""
    from .rank_step import same_structure
    hooked = [n for n, p in cap.workload.model.named_parameters() if p._backward_hooks and n in cap.param_names]
    if hooked and microbatches > 1:
        raise ValueError(f"parameter {hooked[0]} has a gradient hook (register_hook), which PyTorch's accumulation "
                         f"loop runs on each micro-batch's gradient and the captured step on the whole batch's; "
                         f"use microbatches=1")
    direct = _capture_units(cap, microbatches, 1)
    try:
        same_structure(cap.graph, direct, microbatches)
        return direct
    except ValueError:
        pass
    derived = _derived(cap, microbatches, direct)
    return direct if derived is None else derived


def checked_microbatch_graph(cap: Captured, microbatches: int) -> Graph | None:
    """For a run with processes: ``microbatch_graph`` (None for one micro-batch), after
    ``check_microbatch_loss``'s check."""
    if microbatches == 1:
        return None
    micro = microbatch_graph(cap, microbatches)
    check_microbatch_loss(cap, microbatches)
    return micro


def check_microbatch_loss(cap: Captured, microbatches: int) -> None:
    """The workload's loss on each of its micro-batches (rows ``k B/m`` to ``(k+1) B/m`` of every batch
    tensor), in plain PyTorch on a copy of the model, before any process starts: a batch whose rows are not
    independent samples (a graph's edge list indexing its node rows; ``embedding_bag`` offsets, whose second
    micro-batch does not start at 0) fails here with a sentence instead of inside every rank. The capture
    cannot see this: it runs on fake tensors, which do not check index values."""
    try:
        _losses(cap, microbatches)
    except (AssertionError, IndexError, RuntimeError, ValueError) as exc:
        raise microbatch_error(exc, microbatches) from None


def _micro_batches(batch: tuple, microbatches: int) -> list[tuple]:
    """Micro-batch ``k``: rows ``k B/m`` to ``(k+1) B/m`` of every batch tensor."""
    return [tuple(b[k * (b.shape[0] // microbatches):(k + 1) * (b.shape[0] // microbatches)] for b in batch)
            for k in range(microbatches)]


def _losses(cap: Captured, microbatches: int) -> list[torch.Tensor]:
    """The loss of each micro-batch (``_micro_batches``) in plain PyTorch on one copy of the model (buffers a forward
    updates carried from one to the next, as in the accumulation loop)."""
    w = cap.workload
    model = copy_model(w.model)
    parts = _micro_batches(w.batch, microbatches)
    # the caller's random stream stays where it was (dropout would draw from it); gradients on, as in training:
    # a loss may take gradients itself (a WGAN-GP or R1 penalty calls torch.autograd.grad)
    with torch.enable_grad(), torch.random.fork_rng():
        return [w.loss_fn(model, *part).detach() for part in parts]


def microbatch_note(cap: Captured, microbatches: int) -> str | None:
    """A sentence when ``microbatches`` micro-batches change what a step computes: PyTorch's accumulation loop over
    them (``(loss_k / m).backward()`` for each, ``_accumulated``) gives other parameter gradients than one backward
    of the whole batch's loss, in plain PyTorch on copies of the model. Rows along dim 0 that are not independent
    samples do that (time-major input, whose dim 0 is time: ``nn.MultiheadAttention``'s and ``nn.LSTM``'s default
    layout; batch norm; terms across the batch, even ones whose value is zero), as does a loss that is not a mean
    over the rows (divided by a count taken from the batch; a sum, whose accumulation takes 1/m of its gradient).
    Such a run still equals the accumulation loop (its reference); the note says that this is not one step on the
    whole batch. None where the gradients agree (norm-wise, within 1,000 units of the epsilon of the least precise
    dtype the step computes in, at most 5%), with one micro-batch, where the step draws random numbers (each pass
    draws other masks), or where the step does not trace or the loss fails on a micro-batch (the run says why:
    ``microbatch_graph``, ``check_microbatch_loss``)."""
    if microbatches == 1 or any(draws_rng(n.op) for n in cap.graph.nodes):
        return None
    from .rank_step import same_structure
    try:   # the run checks these first too: a plain PyTorch loss is only tried on micro-batches that trace
        same_structure(cap.graph, microbatch_graph(cap, microbatches), microbatches)
        got = _accumulated(cap, microbatches)
    except (AssertionError, IndexError, RuntimeError, ValueError):
        return None     # the run says why
    if got is None:
        return None
    (whole, whole_grad), (mean, acc_grad) = got
    scale = float(whole_grad.norm())
    rel = min(0.05, 1e3 * torch.finfo(least_precise_dtype(cap)).eps)
    off = float((acc_grad - whole_grad).norm())
    if off <= rel * scale or not math.isfinite(off):
        return None
    why = ("the loss sums over the rows, so each micro-batch's share (loss_k / m) takes 1/m of its gradient: make it a "
           "mean over the rows" if float((acc_grad * microbatches - whole_grad).norm()) <= rel * scale else
           "the rows along dim 0 are not independent samples (time-major input such as nn.MultiheadAttention's "
           "default (L, N, E) layout, batch norm, terms across the batch such as a load-balancing loss) or the loss "
           "is not a mean over them: put the samples first where dim 0 is not the batch dimension")
    return (f"microbatches={microbatches} changes the step: PyTorch's accumulation loop over {microbatches} "
            f"micro-batches (1/{microbatches} of the rows along dim 0 of every batch tensor each) gives gradients "
            f"{off / max(scale, 1e-300):.3g} (norm-wise, relative) away from one backward of the whole batch (losses: "
            f"{mean:.6g} on average over the micro-batches, {whole:.6g} on the whole batch), and the run equals that "
            f"loop: {why}, or use microbatches=1 for one step on the whole batch")


def _accumulated(cap: Captured, microbatches: int):
    """((the whole batch's loss, its gradients), (the micro-batches' mean loss, the accumulation loop's gradients))
    in plain PyTorch, gradients flattened over the trainable parameters (float64 sums); None where the loss is not
    a floating-point scalar or no parameter gets a gradient."""
    w = cap.workload
    parts = _micro_batches(w.batch, microbatches)

    def grads(model, batches):
        params = [p for p in model.parameters() if p.requires_grad]
        total, losses = 0.0, []
        for batch in batches:   # buffers a forward updates carry from one micro-batch to the next, as in the loop
            loss = w.loss_fn(model, *batch)
            if not params or loss.numel() != 1 or not loss.is_floating_point() or not loss.requires_grad:
                return None
            got = torch.autograd.grad(loss / len(batches), params, allow_unused=True)
            got = [g if g is not None else torch.zeros_like(p) for g, p in zip(got, params)]
            total = total + torch.cat([(torch.view_as_real(g) if g.is_complex() else g).reshape(-1).double()
                                       for g in got])
            losses.append(float(loss.detach()))
        return sum(losses) / len(losses), total

    # the caller's random stream stays where it was; gradients on, as in training
    with torch.enable_grad(), torch.random.fork_rng():
        acc = grads(copy_model(w.model), parts)
        whole = grads(copy_model(w.model), [tuple(w.batch)])
    return None if acc is None or whole is None else (whole, acc)


@contextlib.contextmanager
def explain_microbatch_errors(microbatches: int):
    """An IndexError inside (an index into rows another micro-batch holds) becomes ``microbatch_error``'s
    sentence where there are micro-batches (``rhino train``, whose deferred model cannot try the loss first)."""
    try:
        yield
    except IndexError as exc:
        if microbatches == 1:
            raise
        raise microbatch_error(exc, microbatches) from None


def microbatch_error(exc: Exception, microbatches: int) -> ValueError:
    """The sentence for a step that fails on a micro-batch's rows (``exc``)."""
    first = (str(exc).strip().splitlines() or [""])[0]   # the fx interpreter appends the node's lines
    return ValueError(f"the loss fails on a micro-batch ({type(exc).__name__}: {first}); microbatches={microbatches} "
                      f"takes 1/{microbatches} of the rows along dim 0 of every batch tensor, so each must hold "
                      f"independent samples along dim 0; use microbatches=1 for this workload")


def _capture_units(cap: Captured, microbatches: int, units: int) -> Graph:
    """The step captured on ``units`` x B/m rows of every batch tensor (rows past B repeat the batch), once per
    number of rows of a capture (``Captured.row_captures``)."""
    check_microbatch_rows(cap.workload.batch, microbatches)
    key = tuple(b.shape[0] // microbatches * units for b in cap.workload.batch)
    if key not in cap.row_captures:
        cap.row_captures[key] = _capture_rows(cap, microbatches, units)
    return cap.row_captures[key]


def _capture_rows(cap: Captured, microbatches: int, units: int) -> Graph:
    micro = []
    for b in cap.workload.batch:
        rows = b.shape[0] // microbatches * units
        if rows > b.shape[0]:
            b = torch.cat([b] * math.ceil(rows / b.shape[0]))
        micro.append(b[:rows])
    dtypes = {p.dtype for p in cap.workload.model.parameters() if p.is_floating_point()}
    with warnings.catch_warnings(), default_dtype(torch.float64 if dtypes == {torch.float64} else None):
        warnings.simplefilter("ignore")
        try:
            return capture(dataclasses.replace(cap.workload, batch=tuple(micro))).graph
        except CaptureError as exc:   # e.g. a sequence-first tensor: its rows are time steps, not samples
            raise ValueError(f"the step does not trace on a micro-batch (1/{microbatches} of the rows along dim 0 of "
                             f"every batch tensor): {exc.reason}; micro-batches need independent samples along dim 0 of "
                             f"each batch tensor (a sequence-first tensor holds time steps there); use "
                             f"microbatches=1 for this workload") from None


def _derived(cap: Captured, m: int, direct: Graph) -> Graph | None:
    """The whole-batch structure with every number at one unit of B/m rows, or None (module docstring)."""
    at = {k: cap.graph if k == m else _capture_units(cap, m, k) for k in (_CHECK_UNIT, *_FIT_UNITS)}
    at[m] = cap.graph              # the whole batch: captured already, never again
    a, b = (at[k] for k in _FIT_UNITS)
    checks = {k: at[k] for k in (_CHECK_UNIT, m)}
    try:
        for g in [b, *checks.values()]:
            _same_frame(a, g)
        types = {v: TensorType(tuple(_at_one(a.types[v].shape, b.types[v].shape,
                                            {k: g.types[v].shape for k, g in checks.items()})), a.types[v].dtype)
                 for v in a.types}
        nodes = [dataclasses.replace(
            n, args=_at_one(n.args, b.nodes[i].args, {k: g.nodes[i].args for k, g in checks.items()}),
            kwargs=_at_one(n.kwargs, b.nodes[i].kwargs, {k: g.nodes[i].kwargs for k, g in checks.items()}))
            for i, n in enumerate(a.nodes)]
    except _NotAFunctionOfK:
        return None
    if any(d1 <= 0 < d3 for v in types for d1, d3 in zip(types[v].shape, a.types[v].shape)):
        return None                # a dimension that vanishes at one unit: not this kind of step
    return dataclasses.replace(a, types=types, nodes=nodes, meta=dict(direct.meta))


def _same_frame(a: Graph, g: Graph) -> None:
    """Everything but the numbers is the same in ``a`` and ``g``: inputs, outputs, constants, node names,
    ops and outputs, and the set of values."""
    same = ([(i.name, i.role, i.value) for i in a.inputs] == [(i.name, i.role, i.value) for i in g.inputs]
            and [(o.name, o.role, o.value) for o in a.outputs] == [(o.name, o.role, o.value) for o in g.outputs]
            and a.constants == g.constants and a.types.keys() == g.types.keys()
            and all(a.types[v].dtype == g.types[v].dtype and len(a.types[v].shape) == len(g.types[v].shape)
                    for v in a.types)
            and len(a.nodes) == len(g.nodes)
            and all((x.name, x.op, x.outputs, x.multi) == (y.name, y.op, y.outputs, y.multi)
                    for x, y in zip(a.nodes, g.nodes)))
    if not same:
        raise _NotAFunctionOfK("structure")


def _identical(v, x) -> bool:
    return type(v) is type(x) and (v == x or (isinstance(x, float) and math.isnan(x) and math.isnan(v)))


def _at_one(x, y, checks: dict[int, object]):
    """``x`` (at k = 3) and ``y`` (at k = 4) evaluated at k = 1, every number checked at ``checks`` (k -> value)."""
    kx, ky = _FIT_UNITS
    if isinstance(x, bool) or x is None or isinstance(x, (str, Ref, torch.dtype)) or not isinstance(
            x, (int, float, list, tuple, dict)):
        if any(v != x for v in (y, *checks.values())):
            raise _NotAFunctionOfK(repr(x))
        return x
    if isinstance(x, (list, tuple)):
        if not isinstance(y, (list, tuple)) or len(y) != len(x) or any(
                not isinstance(v, (list, tuple)) or len(v) != len(x) for v in checks.values()):
            raise _NotAFunctionOfK("length")
        return type(x)(_at_one(xi, y[i], {k: v[i] for k, v in checks.items()}) for i, xi in enumerate(x))
    if isinstance(x, dict):
        if not isinstance(y, dict) or y.keys() != x.keys() or any(v.keys() != x.keys() for v in checks.values()):
            raise _NotAFunctionOfK("keys")
        return {key: _at_one(x[key], y[key], {k: v[key] for k, v in checks.items()}) for key in x}
    if all(_identical(v, x) for v in (y, *checks.values())):
        return x                   # the same at every k (infinities and NaNs included)
    if isinstance(x, int) and isinstance(y, int) and not isinstance(y, bool):
        slope = y - x
        if all(isinstance(v, int) and v == x + slope * (k - kx) for k, v in checks.items()):
            return x + slope * (1 - kx)
        raise _NotAFunctionOfK(f"int {x}, {y}")
    if isinstance(x, float) and isinstance(y, float):
        for f, inv in ((lambda v: v, lambda v: v), (lambda v: 1.0 / v, lambda v: 1.0 / v)):
            try:
                fx, fy = f(x), f(y)
                slope = (fy - fx) / (ky - kx)
                if all(isinstance(v, float) and math.isclose(inv(fx + slope * (k - kx)), v, rel_tol=1e-12)
                       for k, v in checks.items()):
                    return inv(fx + slope * (1 - kx))
            except ZeroDivisionError:
                continue
        raise _NotAFunctionOfK(f"float {x}, {y}")
    raise _NotAFunctionOfK(f"{x!r}, {y!r}")
