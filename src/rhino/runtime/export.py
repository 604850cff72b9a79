"""Export a sharded checkpoint (``runtime/checkpoint.py``) as plain single-device ``state_dict``s.

``export_checkpoint(path)`` reads every state tensor whole in this one process (DCP without a process
group assembles each tensor from all ranks' shards) and returns what eager PyTorch loads:

- the model's ``state_dict``: every key ``model.state_dict()`` has, in its order; tied parameters (GPT's
  tied head) appear under each of their keys and share one tensor, as in eager PyTorch, so
  ``model.load_state_dict(sd, strict=True)`` accepts it;
- with ``optimizer=True``, ``{"model": ..., "optimizer": ...}`` where the optimizer part has
  ``torch.optim.Optimizer.state_dict()``'s layout: ``{"state": {index: {slot: tensor}}, "param_groups":
  [{hyper-parameters..., "params": [index, ...]}]}`` (indices count the parameters group by group, as torch
  does), for ``optimizer.load_state_dict``. rhino's internal ``started`` slot (whether SGD's momentum buffer
  exists yet) is dropped: a buffer that does not exist yet is left out, as torch leaves it out.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from ..atomic import atomic_path, check_file_target
from .checkpoint import read_meta

__all__ = ["load_full", "export_checkpoint", "write_export"]

_INTERNAL_SLOTS = ("started",)


def load_full(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Every state tensor (or those in ``names``) of checkpoint ``path`` whole, by graph-input name."""
    import torch.distributed.checkpoint as dcp
    meta = read_meta(path)
    inputs = meta["inputs"]
    unknown = [n for n in (names or []) if n not in inputs]
    if unknown:
        raise ValueError(f"checkpoint {meta['path']!r} holds no tensor {unknown[0]!r}")
    wanted = {n: torch.empty(inputs[n]["shape"], dtype=getattr(torch, inputs[n]["dtype"]))
              for n in (names if names is not None else inputs)}
    state = {"state": wanted}
    with warnings.catch_warnings():           # DCP warns that it loads in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=meta["path"], no_dist=True)
    return state["state"]


def export_checkpoint(path: str | os.PathLike, optimizer: bool = False) -> tuple[dict, dict]:
    """(the export, the checkpoint's meta): a model ``state_dict``, or ``{"model", "optimizer"}`` with
    ``optimizer`` (see the module docstring)."""
    meta = read_meta(path)
    full = load_full(meta["path"])
    missing = [k for k, n in meta["model_keys"].items() if n not in full]
    if missing:
        raise ValueError(f"checkpoint {meta['path']!r} lacks the model's {missing[0]!r} (not an input of the "
                         f"captured step), so no strict state_dict can be written")
    model = {key: full[name] for key, name in meta["model_keys"].items()}
    if not optimizer:
        return model, meta
    return {"model": model, "optimizer": _optimizer_state(meta, full)}, meta


def _optimizer_state(meta: dict, full: dict[str, torch.Tensor]) -> dict:
    state, groups, index = {}, [], 0
    for group in meta["param_groups"]:
        hp = {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}
        ids = []
        for name in group["params"]:
            slots = {key.rsplit("/", 1)[1]: t for key, t in full.items() if key.startswith(f"opt/{name}/")}
            started = slots.pop("started", None)
            if started is not None and float(started) == 0.0:
                slots = {}       # torch holds no state for a parameter before its first step
            for slot in _INTERNAL_SLOTS:
                slots.pop(slot, None)
            if slots:
                state[index] = slots
            ids.append(index)
            index += 1
        hp["params"] = ids
        groups.append(hp)
    return {"state": state, "param_groups": groups}


def write_export(path: str | os.PathLike, out: str | os.PathLike, optimizer: bool = False) -> dict:
    """Export checkpoint ``path`` to the file ``out`` (``torch.save``); returns a summary for reports."""
    out = Path(out)
    check_file_target(out)          # before the checkpoint is read: its directory exists, it is not one
    exported, meta = export_checkpoint(path, optimizer)
    with atomic_path(out) as tmp:   # an interrupted export leaves no half-written file (nor loses an old one)
        torch.save(exported, tmp)
    model = exported["model"] if optimizer else exported
    unique = {id(t): t for t in model.values()}
    return {"checkpoint": meta["path"], "step": meta["step"], "out": str(out), "keys": len(model),
            "parameters_numel": sum(t.numel() for t in unique.values()), "optimizer": optimizer,
            "bytes": out.stat().st_size}
