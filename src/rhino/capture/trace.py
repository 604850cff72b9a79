"""Capture a whole training step (forward, backward, optimizer update) as an IR graph.

The step is traced with ``make_fx`` on fake tensors (meta tensors become fake
CPU tensors, so nothing is allocated): ``torch.func.functional_call`` runs the
model with parameters, buffers and batch as inputs, ``torch.autograd.grad``
gives the gradients (the same aten backward ops eager autograd runs), and the
functional optimizer of ``optim.py`` computes the new state. If the trace has
in-place ops (BatchNorm running statistics, ``relu_``, ...), a second trace
under ``FunctionalTensorMode`` (AOTAutograd's functionalization) replaces them by pure ops; not
``torch.func.functionalize``, whose functorch layer swaps BCE-with-logits for an out-of-place copy of its kernel
that computes in the logits' dtype where the kernel rounds to the target's. Ops whose fake kernel refuses
inputs the real kernel accepts trace through the fallbacks of ``fallbacks.py``.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.nn.modules.transformer as transformer_module
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensorMode)
from torch._subclasses.functional_tensor import FunctionalTensorMode, dispatch_functionalize
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.nn.parameter import UninitializedParameter

from ..ir.graph import Graph, Role
from ..ir.verify import verify
from .amp import autocast_on
from .fallbacks import fake_fallbacks
from .module_state import attributes_kept, changed_numbers, python_draws
from .optim import (ParamUpdate, apply_update, initial_state, mirrored_kind, mirrored_names, plan_updates,
                    scheduled_name, scheduled_values, state_meta, state_name)
from .optim_traced import plan_traced, traced_update
from .schedule import probe
from .to_ir import fx_to_ir
from .workload import Workload, WorkloadError

__all__ = ["Captured", "capture", "CaptureError"]

_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


class CaptureError(WorkloadError):
    """The training step cannot be captured; the message says why and where. ``reason``: the message
    without its advice to the user (for callers that give their own)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


@dataclass
class Captured:
    """A captured training step and how its inputs map to the workload's tensors."""

    graph: Graph
    workload: Workload
    updates: list[ParamUpdate]
    param_names: list[str]                 # trainable, in graph-input order
    frozen_names: list[str]
    buffer_names: list[str]
    opaque_ops: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # a schedule's inputs (learning rates, cycled momenta) -> (param group, key)
    scheduled: dict[str, tuple[int, str]] = field(default_factory=dict)
    # the step captured again on fewer rows of the batch tensors (their rows -> graph; runtime.microbatch),
    # kept with the whole-batch step they must match
    row_captures: dict[tuple[int, ...], Graph] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def schedule_values(self) -> dict[str, float]:
        """The optimizer's scheduled hyper-parameters now, by input (``scheduled``)."""
        return scheduled_values(self.workload.optimizer, self.scheduled)

    def initial_state(self) -> dict[str, torch.Tensor]:
        """Current values of every state input, by graph-input name (copies)."""
        model, opt = self.workload.model, self.workload.optimizer
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        state = {n: params[n].detach().clone() for n in self.param_names + self.frozen_names}
        state.update({n: buffers[n].detach().clone() for n in self.buffer_names})
        state.update(initial_state(opt, self.updates, params))
        state.update({n: torch.tensor(v, dtype=torch.float64) for n, v in self.schedule_values.items()})
        return state


class _LossModule(torch.nn.Module):
    """Holds the model so ``functional_call`` can swap its tensors; forward is the user's loss."""

    def __init__(self, model: torch.nn.Module, loss_fn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch, grad_of: list | None = None, spec: str = ""):
        """The user's loss and its gradients with respect to ``grad_of``, taken inside ``functional_call``: a
        backward that reruns forward code (``torch.utils.checkpoint``) must see the swapped-in tensors, not
        the module's own (outside, it read them as constants: right at the first step only)."""
        loss = self.loss_fn(self.model, *batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            got = f"a tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CaptureError(f"{spec}: loss_fn must return a scalar floating-point tensor, got {got}")
        return loss, (torch.autograd.grad(loss, grad_of, allow_unused=True) if grad_of else [])


def capture(workload: Workload, verify_graph: bool = True) -> Captured:
    """Trace ``workload``'s training step into one pure IR graph."""
    start = time.perf_counter()
    model, optimizer = workload.model, workload.optimizer
    _materialize_lazy(workload)
    _refuse_post_accumulate_hooks(workload)
    names = {id(p): n for n, p in model.named_parameters()}
    traced = mirrored_kind(optimizer) is None
    _refuse_traced_schedule(workload, traced)
    # with a schedule, the update's structure follows the hyper-parameters as its scheduler leaves them when built
    built, moved = probe(workload) if workload.lr_scheduler is not None else (optimizer, set())
    updates = plan_traced(optimizer, names) if traced else plan_updates(built, names)
    trained = {u.name for u in updates}
    param_names = [u.name for u in updates]
    frozen_names = [n for n, _ in model.named_parameters() if n not in trained]
    buffer_names = [n for n, _ in model.named_buffers()]
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    opt_state = initial_state_meta(optimizer, updates, params)
    scheduled = _scheduled(workload, updates, moved)
    rates = scheduled_values(optimizer, scheduled)
    opt_state.update({n: torch.tensor(v, dtype=torch.float64) for n, v in rates.items()})
    opt_names = list(opt_state)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _Faker(fake_mode)
    flat = ([fake(params[n], grad=True) for n in param_names] + [fake(params[n]) for n in frozen_names] +
            [fake(buffers[n]) for n in buffer_names] + [fake(opt_state[n]) for n in opt_names] +
            [fake(b) for b in workload.batch])
    counts = (len(param_names), len(frozen_names), len(buffer_names), len(opt_names))
    wrapper = _LossModule(model, workload.loss_fn)
    # Parameters whose step counters are equal (and stay so: every parameter with a gradient steps)
    # share one counter in the graph, so bias corrections are computed once, not per parameter.
    share = not traced and _steps_equal(optimizer, updates, params)
    step = _make_step(wrapper, workload, updates, param_names, frozen_names, buffer_names, opt_names, counts,
                      share, traced, scheduled)

    with warnings.catch_warnings(), _quiet_logger("torch._subclasses.fake_tensor"), fake_fallbacks():
        warnings.simplefilter("ignore")
        with attributes_kept(model, workload.loss_fn) as before:
            gm = _trace(step, flat, workload)
            attributes, drawn, reached = changed_numbers(before), python_draws(before), before.reached.changed()
        if drawn:
            raise CaptureError(f"{workload.spec}: the model's forward draws from {drawn[0]}, so the captured step "
                               f"would take the branch drawn while tracing at every step; draw with torch "
                               f"(torch.rand(()) < p) and choose with torch.where, or pass the draw in the batch")
        changed = attributes + reached
        if changed:
            more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
            who = "the model's forward" if attributes else "the training step"
            raise CaptureError(f"{workload.spec}: {who} changes {changed[0]}{more}, a Python number, "
                               f"which the captured step would hold at the value seen while tracing; keep it in a "
                               f"buffer (self.register_buffer) updated with tensor ops, or pass it in the batch")
        _refuse_mutated_constants(gm, workload)
        gm = _functionalize(gm, flat)
    _simplify(gm)
    roles = ([(n, Role.PARAM) for n in param_names] + [(n, Role.FROZEN) for n in frozen_names] +
             [(n, Role.BUFFER) for n in buffer_names] + [(n, Role.OPT_STATE) for n in opt_names] +
             [(f"batch/{i}", Role.BATCH) for i in range(len(workload.batch))])
    out_roles = ([("loss", Role.LOSS)] + [(n, Role.PARAM) for n in param_names] +
                 [(n, Role.FROZEN) for n in frozen_names] + [(n, Role.BUFFER) for n in buffer_names] +
                 [(n, Role.OPT_STATE) for n in opt_names])
    graph, opaque = fx_to_ir(gm, roles, out_roles)
    graph.meta.update(workload=workload.spec, model=type(model).__name__,
                      optimizer=type(optimizer).__name__)
    if verify_graph:
        verify(graph)
    if opaque:
        warnings.warn(f"{len(set(opaque))} op(s) unknown to the registry run as opaque ops (never sharded): "
                      f"{', '.join(sorted(set(opaque)))}", stacklevel=2)
    return Captured(graph, workload, updates, param_names, frozen_names, buffer_names, sorted(set(opaque)),
                    time.perf_counter() - start, scheduled)


def _refuse_traced_schedule(workload: Workload, traced: bool) -> None:
    if workload.lr_scheduler is not None and traced:
        raise CaptureError(f"{workload.spec}: a learning-rate schedule needs one of the optimizers Rhino mirrors "
                           f"({', '.join(mirrored_names())}); {type(workload.optimizer).__name__} is traced with "
                           f"its learning rate as a constant: drop lr_scheduler, or build a new step per rate")


def _scheduled(workload: Workload, updates: list[ParamUpdate], moved: set[tuple[int, str]]
               ) -> dict[str, tuple[int, str]]:
    """With a learning-rate schedule (the workload's ``lr_scheduler``), each stepped param group's learning
    rate, and the momenta its scheduler moves (``moved``), as graph inputs, by input name; else none (they are
    constants of the step)."""
    if workload.lr_scheduler is None:
        return {}
    groups = sorted({u.group for u in updates})
    keys = [(g, "lr") for g in groups] + sorted((g, k) for g, k in moved if g in groups)
    return {scheduled_name(g, k): (g, k) for g, k in keys}


def initial_state_meta(optimizer, updates, params) -> dict[str, torch.Tensor]:
    """Initial optimizer state; for meta parameters, meta tensors (no memory)."""
    if any(p.device.type == "meta" for p in params.values()):
        out = {}
        for u in updates:
            p = params[u.name]
            for key in u.state_keys:
                out[state_name(u.name, key)] = state_meta(u, key, p)
        return out
    return initial_state(optimizer, updates, params)


class _Faker:
    """Real tensors -> fake tensors; meta tensors -> fake CPU tensors of the same shape."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode

    def __call__(self, t: torch.Tensor, grad: bool = False) -> torch.Tensor:
        if t.device.type == "meta":
            with self.mode:
                out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        else:
            out = self.mode.from_tensor(t.detach())
        return out.requires_grad_(True) if grad else out


def _gradient_hooks(model: torch.nn.Module, param_names: list[str], grads) -> list:
    """Each gradient through the hooks its parameter holds (``p.register_hook(fn)``: ``fn(grad)`` in order, a
    returned tensor replacing the gradient), as backward calls them on a leaf's summed gradient: the traced
    parameters are other tensors, so autograd does not."""
    params = dict(model.named_parameters())
    out = list(grads)
    for i, name in enumerate(param_names):
        hooks = params[name]._backward_hooks
        if hooks and out[i] is not None:
            for fn in hooks.values():
                g = fn(out[i])
                out[i] = out[i] if g is None else g
    return out


def _refuse_post_accumulate_hooks(workload: Workload) -> None:
    for name, p in workload.model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None):
            raise WorkloadError(f"{workload.spec}: parameter {name} has a hook registered with "
                                f"register_post_accumulate_grad_hook, which runs on .grad outside the traced step; "
                                f"change the gradient with p.register_hook(fn) or in the optimizer's step() instead")


def _shared_step(updates, grads, opt) -> torch.Tensor | None:
    """The step counter of the first stepped parameter: all counters are equal, so one stands for all."""
    for u, g in zip(updates, grads):
        if g is not None and "step" in u.state_keys:
            return opt[state_name(u.name, "step")]
    return None


def _steps_equal(optimizer, updates, params) -> bool:
    """Whether every parameter's step counter holds the same value (true before the first step)."""
    seen = set()
    for u in updates:
        if "step" not in u.state_keys:
            continue
        v = optimizer.state.get(params[u.name], {}).get("step", 0)
        if isinstance(v, torch.Tensor):
            if v.device.type == "meta":
                continue
            v = float(v)
        seen.add(float(v))
    return len(seen) <= 1


def _make_step(wrapper, workload, updates, param_names, frozen_names, buffer_names, opt_names, counts,
               share_steps: bool, traced: bool, scheduled: dict[str, tuple[int, str]]):
    n_p, n_f, n_b, n_o = counts
    prefixed = lambda names: ["model." + n for n in names]  # noqa: E731
    all_names = prefixed(param_names) + prefixed(frozen_names) + prefixed(buffer_names)

    def step(*flat):
        tensors = dict(zip(all_names, flat[:n_p + n_f + n_b]))
        opt = dict(zip(opt_names, flat[n_p + n_f + n_b:n_p + n_f + n_b + n_o]))
        batch = flat[n_p + n_f + n_b + n_o:]
        params = list(flat[:n_p])
        loss, grads = torch.func.functional_call(wrapper, tensors, tuple(batch), {"grad_of": params,
                                                 "spec": workload.spec}, tie_weights=True, strict=False)
        grads = _gradient_hooks(workload.model, param_names, grads)
        frozen = [t.detach() for t in flat[n_p:n_p + n_f]]
        buffers = [tensors[n] for n in prefixed(buffer_names)]
        if traced:
            held = dict(workload.model.named_parameters())
            others = {id(held[n]): t for n, t in zip(frozen_names, frozen)}
            new_params, new_opt = traced_update(workload.optimizer, updates, params, grads, opt, state_name, others)
            return [loss.detach().reshape(())] + new_params + frozen + buffers + [new_opt[n] for n in opt_names]
        new_params, new_opt = [], dict(opt)
        scalars: dict = {}
        shared = _shared_step(updates, grads, opt) if share_steps else None
        for u, p, g in zip(updates, params, grads):
            if g is None:  # unused parameter: torch skips it (no step, no state change)
                new_params.append(p.detach())
                continue
            st = {k: opt[state_name(u.name, k)] for k in u.state_keys}
            if shared is not None and "step" in st:
                st["step"] = shared
            hp = {k: opt[n] for n, (group, k) in scheduled.items() if group == u.group}
            new_p, new_st = apply_update(u, p.detach(), g, st, scalars, hp)
            new_params.append(new_p)
            new_opt.update({state_name(u.name, k): v for k, v in new_st.items()})
        return [loss.detach().reshape(())] + new_params + frozen + buffers + [new_opt[n] for n in opt_names]

    return step


@contextlib.contextmanager
def _quiet_logger(name: str):
    """Fake tensors log a traceback before raising; the error we raise says it in one sentence."""
    logger = logging.getLogger(name)
    old = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(old)


def _mask_as_given(mask, is_causal=None, size=None) -> bool:
    """``nn.modules.transformer._detect_is_causal_mask`` without reading the mask: the hint as given."""
    return is_causal is True


@contextlib.contextmanager
def _compiled_code_as_written():
    """A ``torch.compile``'d function or submodule inside the model runs its own Python code while the step is traced
    (dynamo's ``error_on_nested_fx_trace=False``: it steps aside under FX tracing instead of raising "Detected that
    you are using FX to symbolically trace a dynamo-optimized function"); the eager reference still runs it compiled.
    Only where dynamo is loaded (``torch.compile`` loads it; importing it costs about a second). TorchScript code
    (``torch.jit.script``/``trace``) runs unoptimised: its profiling executor specialises a function after its first
    calls, so a later capture (the step at 1/m of the batch) recorded other ops than the first."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.jit.optimized_execution(False))
        if "torch._dynamo" in sys.modules:
            from torch._dynamo import config as dynamo_config
            stack.enter_context(dynamo_config.patch(error_on_nested_fx_trace=False))
        yield


@contextlib.contextmanager
def _value_checks_off():
    """Checks inside torch that read a tensor's value (``bool`` of a comparison) stop tracing, and change no
    result; the capture runs without them (the workload's own eager run, the reference, keeps them):

    - ``torch.distributions`` validates its arguments by default, which only raises on invalid values;
    - ``nn.TransformerEncoder``/``TransformerDecoder``/``Transformer`` compare a given mask with the causal
      one to use a causal kernel instead; without the comparison the mask is applied as given, which is
      right for every mask (a causal hint passed by the user is kept);
    - ``F.gaussian_nll_loss`` (and ``nn.GaussianNLLLoss``) raises if ``torch.any(var < 0)``."""
    before = torch.distributions.Distribution._validate_args
    detect, gaussian = transformer_module._detect_is_causal_mask, F.gaussian_nll_loss
    torch.distributions.Distribution.set_default_validate_args(False)
    transformer_module._detect_is_causal_mask = _mask_as_given
    F.gaussian_nll_loss = _without_any(gaussian)
    try:
        yield
    finally:
        torch.distributions.Distribution.set_default_validate_args(before)
        transformer_module._detect_is_causal_mask, F.gaussian_nll_loss = detect, gaussian


def _without_any(fn):
    """``fn`` with ``torch.any`` answering False while it runs: its one use there is the value check."""
    def call(*args, **kwargs):
        any_ = torch.any
        torch.any = _false
        try:
            return fn(*args, **kwargs)
        finally:
            torch.any = any_
    return call


def _false(*args, **kwargs) -> bool:
    return False


# selecting elements by a mask (boolean indexing, one-argument torch.where, nonzero, masked_select)
_MASKED = ("keep every element and mask the result instead of selecting (x * mask, torch.where(mask, x, 0.0), a "
           "masked mean as (x * mask).sum() / mask.sum()): the selection's size depends on the mask's values")
# ops whose output shape depends on a tensor argument's values, and the form of the call that does not
_VALUE_SHAPE_FIXES = {
    torch.ops.aten._ctc_loss.Tensor: "pass input_lengths and target_lengths to F.ctc_loss as lists of ints "
                                     "(tensors of lengths make the shapes depend on values)",
    torch.ops.aten._pack_padded_sequence.default: "run the RNN on the padded batch and mask what it returns past "
                                                  "each length (a packed sequence's shapes depend on the lengths)",
    torch.ops.aten.nonzero.default: _MASKED,
    torch.ops.aten.masked_select.default: _MASKED,
    torch.ops.aten._unique2.default: "use a fixed set of values (torch.arange over the possible ones) instead of "
                                     "torch.unique, whose size depends on the values"}


def _materialize_lazy(workload: Workload) -> None:
    """Lazy modules (``nn.LazyLinear``) get their parameters from their first call, as in eager training: one
    forward and loss on the batch, without gradients (the parameter objects the optimizer holds become real)."""
    if not any(isinstance(p, UninitializedParameter) for p in workload.model.parameters()):
        return
    try:
        with torch.no_grad():
            workload.loss_fn(workload.model, *workload.batch)
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(f"{workload.spec}: the first call that makes the lazy modules' parameters failed "
                           f"({first}); check that loss_fn(model, *batch) runs in plain PyTorch") from None


def _trace(step, flat, workload: Workload) -> torch.fx.GraphModule:
    try:
        # tracing runs on fake CPU tensors: a CUDA autocast region acts on them. Without oneDNN, RNNs trace
        # to their aten cells (mm, sigmoid, ...): the oneDNN RNN op returns its backward's workspace only
        # under grad mode, which the lowered step (run under no_grad) does not have
        with autocast_on("cpu"), torch.backends.mkldnn.flags(enabled=False), _value_checks_off(), \
                _compiled_code_as_written():
            return make_fx(step, tracing_mode="fake")(*flat)
    except _DATA_DEPENDENT as exc:
        fix = _module_fix(exc) or _VALUE_SHAPE_FIXES.get(getattr(exc, "func", None)) or \
            "use tensor ops such as torch.where instead"
        raise CaptureError(f"tracing stopped at {_user_frame(exc, workload)}: Python control flow or a "
                           f"shape depends on a tensor's value (.item(), bool(tensor), boolean indexing), "
                           f"which a training-step graph cannot hold; {fix}") from None
    except CaptureError:
        raise
    except SyntaxError as exc:  # torch.fx writes each traced graph as Python source
        line = (exc.text or "").strip()
        fix = ("x.random_(low, high) traces to an op whose overload torch.fx writes as invalid Python (it is named "
               "`from`, a keyword): write x.random_(high - low).add_(low) instead") if ".from(" in line else \
            "rewrite the call on that line"
        raise CaptureError(f"torch.fx could not write the traced step as Python ({line.split(';')[0]}); "
                           f"{fix}") from None
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as exc:
        first = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else type(exc).__name__
        reason = f"tracing the training step failed at {_user_frame(exc, workload)}: {first}"
        advice = ("Write the step as for one device: the plan's collectives reduce across ranks (a loss that "
                  "calls torch.distributed itself has no process group to use while Rhino captures it)"
                  if "process group" in first.lower() else
                  "Check that the batch fits the model (shapes, dtypes) and that loss_fn(model, *batch) runs in "
                  "plain PyTorch")
        raise CaptureError(f"{reason}. {advice}", reason) from None


#: torch modules that read a tensor's value in their own forward, by the file of that frame: what to change
_MODULE_VALUE_FIXES = {
    ("nn", "modules", "batchnorm.py"): "give each BatchNorm a numeric momentum (momentum=None keeps a cumulative "
                                       "average whose factor 1 / num_batches_tracked is read as a Python number "
                                       "every step)",
    ("nn", "modules", "adaptive.py"): "nn.AdaptiveLogSoftmaxWithLoss's forward selects each cluster's rows by "
                                      "target, which the user cannot mask: compute the loss as "
                                      "F.nll_loss(asm.log_prob(input), target) instead"}


def _module_fix(exc: BaseException) -> str | None:
    """The fix for a torch module that reads a value in its forward (``_MODULE_VALUE_FIXES``), if the
    innermost such frame is one."""
    for f in reversed(traceback.extract_tb(exc.__traceback__)):
        parts = Path(f.filename).parts
        for tail, fix in _MODULE_VALUE_FIXES.items():
            if parts[-len(tail):] == tail:
                return fix
    return None


def _user_frame(exc: BaseException, workload: Workload) -> str:
    """The innermost traceback frame outside torch and rhino: where user code was running."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = str(Path(torch.__file__).parent)
    rhino_dir = str(Path(__file__).parents[1])
    # "<string>", "<eval_with_key>": code generated at run time (dataclass __init__, fx modules)
    user = [f for f in frames if not f.filename.startswith((torch_dir, rhino_dir, "<"))]
    if not user:
        return workload.spec
    f = user[-1]
    code = f" ({f.line.strip()})" if f.line else ""
    return f"{f.filename}:{f.lineno}{code}"


# aten ops that mutate arguments their schema does not mark as mutated.
def _fix_legacy_mutators(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.aten.native_batch_norm.default
                and node.args[5] and node.args[3] is not None):
            node.target = torch.ops.aten._native_batch_norm_legit.default
    gm.recompile()


def _is_mutating(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _written_bases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes whose storage a mutating ``node`` writes (its written arguments, followed back through views)."""
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        val = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        while isinstance(val, torch.fx.Node) and val.op == "call_function" and val.args and \
                getattr(val.target, "is_view", False):
            val = val.args[0]
        if isinstance(val, torch.fx.Node):
            out.append(val)
    return out


def _refuse_mutated_constants(gm: torch.fx.GraphModule, workload: Workload) -> None:
    """A tensor the step holds as a constant (a module's plain tensor attribute, a tensor in the loss function's
    closure) and updates in place has nowhere to keep its new value: refused in one sentence, naming it."""
    for node in gm.graph.nodes:
        if not _is_mutating(node):
            continue
        for base in _written_bases(node):
            if base.op == "get_attr":
                name = _tensor_name(getattr(gm, base.target), workload)
                raise CaptureError(f"{workload.spec}: the step updates {name} "
                                   f"in place ({node.target}), a tensor that is not a parameter, buffer or batch "
                                   f"tensor, so its new value would be lost after each step; register it as a buffer "
                                   f"of a module (self.register_buffer) or keep it out of the step")


def _tensor_name(t: torch.Tensor, workload: Workload) -> str:
    for name, m in workload.model.named_modules():
        for key, v in vars(m).items():
            if v is t:
                return f"model.{name + '.' if name else ''}{key}"
    fn = workload.loss_fn
    for var, cell in zip(getattr(getattr(fn, "__code__", None), "co_freevars", ()), fn.__closure__ or ()):
        if cell.cell_contents is t:
            return f"{var} (in the closure of {fn.__qualname__})"
    return "a tensor"


@contextlib.contextmanager
def _check_errors_without_effect_token():
    """torch marks ``_linalg_check_errors`` (``linalg.cholesky``'s, ``linalg.solve``'s check of the factorization) as
    an ordered side effect, which functionalization threads through an effect token that only export sets up:
    "Could not find a token for effect EffectType.ORDERED" for any step with an in-place op and a checked linalg
    call. Functionalized as a plain op; the mark is back for everything after (dead-code elimination keeps it)."""
    holder = torch._library.simple_registry.singleton.find("aten::_linalg_check_errors").effect
    before = holder.effect
    holder.register(None)
    try:
        yield
    finally:
        holder.register(before)


def _functionalize(gm: torch.fx.GraphModule, flat: list) -> torch.fx.GraphModule:
    _fix_legacy_mutators(gm)
    if not any(_is_mutating(n) for n in gm.graph.nodes):
        return gm
    with torch.no_grad(), _check_errors_without_effect_token():
        inputs = [t.detach() for t in flat]
        gm2 = make_fx(dispatch_functionalize(gm, FunctionalTensorMode()), tracing_mode="fake")(*inputs)
    # the mutated inputs' new values are outputs already: a write back into an input (copy_) is dropped
    for node in reversed(list(gm2.graph.nodes)):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and node.args[0].op == "placeholder" and not node.users:
            gm2.graph.erase_node(node)
    left = [str(n.target) for n in gm2.graph.nodes if _is_mutating(n)]
    if left:
        raise CaptureError(f"in-place ops remain after functionalization: {', '.join(sorted(set(left)))}")
    gm2.recompile()
    return gm2


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default}


def _simplify(gm: torch.fx.GraphModule) -> None:
    """Drop no-op aliases (detach), let clamp backwards read the clamp's output, drop dead code."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ALIASES:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    _hardtanh_backward_reads_output(gm.graph)
    _two_norms_as_sums(gm.graph)
    _det_solves_for_contiguous(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()


#: determinant ops -> the index of their pivots output (``(det, LU, pivots)``, ``(sign, logabsdet, LU, pivots)``)
_DETERMINANTS = {torch.ops.aten._linalg_det.default: 2, torch.ops.aten._linalg_slogdet.default: 3}


def _det_solves_for_contiguous(graph: torch.fx.Graph) -> None:
    """``det`` and ``slogdet`` factor ``A``, or ``A^T`` where ``A`` is C-contiguous (the same determinant, no copy),
    and their backward solves with that factorization, its ``adjoint`` flag fixed by ``A``'s strides while tracing.
    A rank's ``A`` may have other strides (an all-gathered parameter is C-contiguous, a QR-initialised one is not:
    wrong gradients under tensor parallelism and ZeRO-3). Ranks call both ops on a C-contiguous ``A``
    (``input_layout``, ``ir.ops_linalg``), so where the traced ``A`` was not, the solves reading their pivots
    (``linalg_lu_solve``) get the other ``adjoint``: with the factors of ``A^T``, solving with ``A`` is the adjoint
    solve and the other way round."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _DETERMINANTS]:
        val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
        if val is None or val.is_contiguous():
            continue
        index = _DETERMINANTS[node.target]
        for piv in [u for u in node.users if u.target is operator.getitem and u.args[1] == index]:
            for solve in [u for u in piv.users if u.target is torch.ops.aten.linalg_lu_solve.default]:
                if solve.args[1] is not piv:
                    continue
                solve.kwargs = {**solve.kwargs, "adjoint": not solve.kwargs.get("adjoint", False)}


_VECTOR_NORM = torch.ops.aten.linalg_vector_norm.default
_PRODUCTS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
                       torch.ops.aten.baddbmm.default, torch.ops.aten.mv.default, torch.ops.aten.addmv.default,
                       torch.ops.aten.dot.default, torch.ops.aten._linalg_eigh.default})


def _two_norms_as_sums(graph: torch.fx.Graph) -> None:
    """``linalg_vector_norm(x)`` (2-norm, real floats) as ``sqrt(sum(x * x))`` where no matrix product reads
    ``x``, or a value made from it, later in the step. The registry splits a sum (partial sums, then a scalar
    all-reduced) but not a norm, so the norm of a split gradient gathered it (LAMB's trust ratio, a clipping
    norm, Adafactor's RMS). Where a product follows (Muon's ``G / ||G||`` into Newton-Schulz), the norm is kept:
    gathering the gradient there keeps the products whole, which the greedy propagation, not looking ahead,
    would otherwise split (the Muon MLP under dp=2,tp=2: 18,848 -> 74,424 B). Equal up to the order of the
    additions."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is _VECTOR_NORM]:
        args = list(node.args) + [2, None, False][len(node.args) - 1:]
        x, ord_, dim, keepdim = args[0], args[1], args[2], args[3]
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if (ord_ not in (2, 2.0) or node.kwargs.get("dtype") is not None or val is None
                or not val.is_floating_point() or _product_follows(x, order[node], order)):
            continue
        with graph.inserting_before(node), val.fake_mode:
            sq = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
            sq.meta["val"] = val * val
            if dim is None:
                total = graph.call_function(torch.ops.aten.sum.default, (sq,))
                total.meta["val"] = sq.meta["val"].sum()
                if keepdim:
                    total = graph.call_function(torch.ops.aten.view.default, (total, [1] * val.dim()))
                    total.meta["val"] = sq.meta["val"].sum().view([1] * val.dim())
            else:
                dims = [dim] if isinstance(dim, int) else list(dim)
                total = graph.call_function(torch.ops.aten.sum.dim_IntList, (sq, dims, keepdim))
                total.meta["val"] = sq.meta["val"].sum(dims, keepdim)
            root = graph.call_function(torch.ops.aten.sqrt.default, (total,))
            root.meta["val"] = total.meta["val"].sqrt()
        node.replace_all_uses_with(root)
        graph.erase_node(node)


def _product_follows(x: torch.fx.Node, after: int, order: dict) -> bool:
    """Whether a matrix product after position ``after`` reads ``x`` or a value made from it."""
    seen, todo = set(), [x]
    while todo:
        n = todo.pop()
        for user in n.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target in _PRODUCTS and order.get(user, after + 1) > after:
                return True
            todo.append(user)
    return False


_HARDTANH = torch.ops.aten.hardtanh.default
_HARDTANH_BACKWARD = torch.ops.aten.hardtanh_backward.default


def _hardtanh_bounds(node: torch.fx.Node, first: int) -> tuple:
    """(min_val, max_val) of a hardtanh (``first`` = 1) or hardtanh_backward (``first`` = 2) call."""
    args = list(node.args[first:]) + [None, None]
    lo = node.kwargs.get("min_val", args[0] if args[0] is not None else -1.0)
    hi = node.kwargs.get("max_val", args[1] if args[1] is not None else 1.0)
    return lo, hi


def _hardtanh_backward_reads_output(graph: torch.fx.Graph) -> None:
    """``hardtanh_backward(g, x, lo, hi)`` masks ``g`` with ``lo < x < hi``; for ``y = hardtanh(x, lo, hi)``
    and ``lo < hi`` that is exactly ``lo < y < hi``, so it may read ``y`` (what eager autograd saves for
    an in-place ReLU6). The trace of ``ReLU6(inplace=True)`` instead saves a clone of ``x`` made
    before the in-place op: reading ``y`` lets that clone, a whole activation kept for the
    backward, disappear."""
    outputs: dict[tuple, torch.fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _HARDTANH:
            outputs[(node.args[0], *_hardtanh_bounds(node, 1))] = node
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not _HARDTANH_BACKWARD:
            continue
        source = node.args[1]
        while (isinstance(source, torch.fx.Node) and source.op == "call_function"
               and source.target is torch.ops.aten.clone.default and len(source.args) == 1):
            source = source.args[0]
        lo, hi = _hardtanh_bounds(node, 2)
        y = outputs.get((source, lo, hi))
        if y is not None and lo < hi:
            node.args = (node.args[0], y, *node.args[2:])
