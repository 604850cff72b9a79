"""Loading workload files: ``FILE[:FUNC]`` -> (model, optimizer, loss_fn, batch)."""
from __future__ import annotations

import importlib.util
import sys
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Workload", "WorkloadError", "load_workload", "validate_workload", "parse_spec", "default_dtype", "DTYPES"]

# ``--dtype`` names: the default dtype a workload is built under (float64 makes exactness checks sharp).
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@contextmanager
def default_dtype(dtype: torch.dtype | None):
    """``torch.set_default_dtype(dtype)`` inside the block (nothing for None), restored after."""
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class WorkloadError(ValueError):
    """A user mistake in a workload file; the message says what to change."""


@dataclass
class Workload:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    batch: tuple
    path: str
    func: str
    batches: Callable | None = None   # the file's ``batches()``: an iterator of global batches (training data)
    # the file's ``lr_scheduler(optimizer)``: a torch.optim.lr_scheduler over the optimizer, stepped after each step
    lr_scheduler: Callable | None = None

    @property
    def spec(self) -> str:
        return f"{self.path}:{self.func}"

    @property
    def on_meta(self) -> bool:
        tensors = list(self.model.parameters()) + list(self.model.buffers()) + \
            [b for b in self.batch if isinstance(b, torch.Tensor)]
        return any(t.device.type == "meta" for t in tensors)


def parse_spec(spec: str) -> tuple[Path, str]:
    path, sep, func = spec.rpartition(":")
    if not sep or not func.isidentifier() or not path:
        path, func = spec, "workload"
    return Path(path), func


def load_workload(spec: str, dtype: torch.dtype | None = None, call: Callable | None = None) -> Workload:
    """Import ``FILE`` and call ``FUNC`` (default ``workload``); validate what it returns. ``dtype``: the
    default dtype while the file is imported and the function runs (floating tensors it creates without
    an explicit dtype, parameters included, get it). ``call(fn)``, if given, runs the function in place
    of ``fn()`` (deferred initialisation records it, ``capture/deferred.py``)."""
    with default_dtype(dtype):
        return _load(spec, call)


def _load(spec: str, call: Callable | None = None) -> Workload:
    path, func = parse_spec(spec)
    if path.is_dir():
        raise WorkloadError(f"workload {str(path)!r} is a directory; pass FILE[:FUNC] with a .py file")
    if not path.is_file():
        raise WorkloadError(f"workload file {str(path)!r} does not exist; pass FILE[:FUNC] with an existing .py file")
    module_name = f"rhino_workload_{abs(hash(str(path.resolve())))}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    if loader is None or loader.loader is None:
        raise WorkloadError(f"cannot import {str(path)!r}: it is not a Python file")
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:      # as `python FILE` has it: the file may import the modules beside it
        sys.path.append(folder)
    try:
        loader.loader.exec_module(module)
    except SyntaxError as exc:
        raise WorkloadError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 -- user code: report where it failed, then stop
        raise WorkloadError(f"importing {path} failed: {_where(exc, path)}") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise WorkloadError(f"{path} has no function {func!r}; define it or pass FILE:FUNC")
    try:
        result = call(fn) if call is not None else fn()
    except Exception as exc:  # noqa: BLE001 -- user code: report where it failed, then stop
        raise WorkloadError(f"{path}:{func}() failed: {_where(exc, path)}") from None
    w = validate_workload(result, path, func)
    data = getattr(module, "batches", None)
    if data is not None and not callable(data):
        raise WorkloadError(f"{path}: batches must be a function returning an iterator of batches, "
                            f"got a {type(data).__name__}")
    w.batches = data
    schedule = getattr(module, "lr_scheduler", None)
    if schedule is not None and not callable(schedule):
        raise WorkloadError(f"{path}: lr_scheduler must be a function taking the optimizer and returning a "
                            f"torch.optim.lr_scheduler scheduler, got a {type(schedule).__name__}")
    w.lr_scheduler = schedule
    return w


def _where(exc: BaseException, path: Path) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename).resolve() == path.resolve()]
    loc = f" (at {path}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{loc}"


def _uncompiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(module)`` wraps (the same parameters): its program is what capture traces
    (a compiled wrapper cannot be traced), and the eager reference runs it without compiling."""
    if "torch._dynamo.eval_frame" in sys.modules:   # loaded by torch.compile: no compiled module without it
        from torch._dynamo.eval_frame import OptimizedModule
        while isinstance(model, OptimizedModule):
            model = model._orig_mod
    return model


def validate_workload(result, path: Path, func: str) -> Workload:
    """What a workload function returned -> ``Workload``; a ``WorkloadError`` sentence for each mistake."""
    where = f"{path}:{func}()"
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        got = f"a {type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else "")
        raise WorkloadError(f"{where} must return (model, optimizer, loss_fn, batch), got {got}")
    model, optimizer, loss_fn, batch = result
    if not isinstance(model, torch.nn.Module):
        raise WorkloadError(f"{where} returned a {type(model).__name__} as model; it must be a torch.nn.Module")
    model = _uncompiled(model)
    sparse = next((name for name, m in model.named_modules()
                   if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse), None)
    if sparse is not None:
        what = f"the embedding {sparse!r}" if sparse else "the model, an embedding,"   # '' names the root module
        raise WorkloadError(f"{where}: {what} has sparse=True, whose gradient is a sparse tensor "
                            f"(its shape depends on the indices' values), which a training-step graph cannot hold; "
                            f"use sparse=False (a dense gradient, zero in the rows the batch does not index)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise WorkloadError(f"{where} returned a {type(optimizer).__name__} as optimizer; it must be a "
                            f"torch.optim optimizer over the model's parameters")
    if not callable(loss_fn):
        raise WorkloadError(f"{where} returned a {type(loss_fn).__name__} as loss_fn; it must be callable as "
                            f"loss_fn(model, *batch)")
    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if not isinstance(batch, (tuple, list)) or not all(isinstance(b, torch.Tensor) for b in batch):
        raise WorkloadError(f"{where} must return the batch as a tuple of tensors")
    model_params = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in model_params:
                raise WorkloadError(f"{where}: the optimizer holds a tensor of shape {list(p.shape)} that is not a "
                                    f"parameter of the model (a learned loss weight kept beside it?); make it one "
                                    f"(model.log_vars = nn.Parameter(...)), read it in loss_fn as model.log_vars, "
                                    f"and build the optimizer over model.parameters()")
    return Workload(model, optimizer, loss_fn, tuple(batch), str(path), func)
