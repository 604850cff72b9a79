"""Sharded checkpoints of a ``Trainer`` with ``torch.distributed.checkpoint`` (DCP), resumable under any plan.

Layout on disk (``DIR`` is the checkpoint root)::

    DIR/latest                  {"checkpoint": "step-00000004", "step": 4}, replaced atomically (os.replace)
    DIR/step-00000004/          one DCP checkpoint: .metadata, __<rank>_0.distcp, and rhino.json
    DIR/step-00000006.tmp-1f3a  a save in progress (or one that crashed): never read, removed by the next save

**Save** (``save_checkpoint``, collective): every state tensor (parameters, buffers, optimizer state: each
non-batch graph input) becomes a ``DTensor`` over a ``DeviceMesh`` with rhino's mesh shape (both are row-major:
rank r has the same coordinates in both), so each rank writes only its own shards and DCP's planner writes a
replicated piece once. Placements DTensor cannot express are turned into ones it can for that one tensor before
the write (rhino's redistribution planner, ``_dcp_sharding``): a strided ``Shard(dim, blocks > 1)`` (e.g. a
fused QKV weight under tensor parallelism) is gathered over its axis (``Replicate``) and a ``Partial`` is
reduced (``Replicate``). Memory cost: DCP writes the whole state dict in one call, so during a save each rank
also holds these tensors whole along those axes, all of them at once (GPT under ``tp=2``: each block's QKV
weight and bias and their two AdamW moments, i.e. (n - 1) / n of their bytes extra per rank); plans without
strided or partial state cost nothing extra. Loading such a tensor reads the expressible layout into a temporary
of the same size and slices it. ``Shard(dim)`` on several axes maps to DTensor's ``Shard(dim)`` on each, which
splits in the same axis order. The files go to ``step-N.tmp-<random>``; rank 0 then writes ``rhino.json`` (step,
data position, the saver's plan, world size, graph fingerprint, each input's shape and dtype, and the
state_dict-key -> graph-input map that ``export`` needs), and after a barrier renames the directory to
``step-N`` and replaces ``latest``. A crash at any point before the rename leaves only a ``.tmp-`` directory, so
the previous checkpoint and ``latest`` are untouched; a crash between the rename and the replacement of
``latest`` leaves ``latest`` on the previous good checkpoint.

**Load** (``load_checkpoint``, collective): each rank asks DCP for its shards under ITS plan (the target
DTensors carry the loader's placements, made expressible as above), so DCP's load planner reads only the
overlapping regions of the saved shards (a reshard when the plans or world sizes differ). A tensor whose loader
placement was made expressible is then sliced locally to its real layout (``Replicate`` -> ``Shard(dim,
blocks)`` is a local slice; ``Partial(sum)``: coordinate 0 keeps the value, the others zero). The step counter
and the data position (global batches consumed from ``batches()``) are restored: the batch stream is made again
and the consumed batches skipped (read again: a cost linear in the position). RNG states (torch's CPU generator,
and the CUDA one on a CUDA device) are saved per rank and restored only when the world size is unchanged: rank
r's generator has no counterpart in a job of another size, so after a resize the generators keep the state they
have (the captured training steps draw no random numbers unless the model does, e.g. dropout).

**Pipelines** (``plan.stages > 1``, stage-major ranks as in ``runtime.pipeline``): each rank saves and loads
only the state its stage holds, as DTensors over its stage's ``DeviceMesh`` (ranks ``stage * W ..``), so the
checkpoint's keys and global offsets are the same as an SPMD plan's; a weight held by two stages (a tied
embedding/head) is written once (DCP drops the duplicate pieces of a save). A pipelined checkpoint therefore
loads under any plan, pipelined or not, and the other way round.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..ir.graph import Role
from ..sharding.mesh import Mesh
from ..sharding.placement import Partial, Replicate, Shard, Sharding, local_shape
from ..sharding.redistribute import plan_redistribution
from .collectives import apply_step

__all__ = ["CheckpointInfo", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "read_meta",
           "checkpoint_dir", "META_FILE", "LATEST_FILE", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = 1
META_FILE = "rhino.json"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_STATE, _RNG = "state", "rng"


@dataclass
class CheckpointInfo:
    """What a checkpoint holds besides the tensors (read from its ``rhino.json``)."""

    path: Path
    step: int
    world_size: int
    strategy: str                  # the saver's plan (strategy string, "" for a searched plan)
    mesh: str                      # the saver's mesh, e.g. "dp4"
    data_position: int             # global batches consumed from batches() when it was saved
    fingerprint: str               # the saver's graph fingerprint

    def to_dict(self) -> dict:
        return {"path": str(self.path), "step": self.step, "world_size": self.world_size,
                "strategy": self.strategy, "mesh": self.mesh, "data_position": self.data_position}


# ----------------------------------------------------------------------------- directories

def checkpoint_dir(directory: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint of ``step`` under the root ``directory``."""
    return Path(directory) / f"step-{step:08d}"


def _complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / META_FILE).is_file()


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``directory`` (named by ``latest``, else the highest complete
    ``step-*`` directory); ``directory`` may also be one checkpoint. None when there is none."""
    root = Path(directory)
    if not root.is_dir():
        return None
    if _complete(root) and _STEP_DIR.match(root.name):
        return root
    latest = root / LATEST_FILE
    if latest.is_file():
        try:
            named = root / json.loads(latest.read_text())["checkpoint"]
        except (ValueError, KeyError, TypeError):
            named = None
        if named is not None and _complete(named):
            return named
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and _complete(p))
    return steps[-1][1] if steps else None


def read_meta(path: str | os.PathLike) -> dict:
    """The ``rhino.json`` of checkpoint ``path`` (a checkpoint root resolves to its latest checkpoint)."""
    found = latest_checkpoint(path)
    if found is None:
        raise ValueError(f"{str(path)!r} holds no complete checkpoint; save one with rhino train ... --checkpoint DIR")
    meta = json.loads((found / META_FILE).read_text())
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"checkpoint {str(found)!r} has format {meta.get('format')!r}, this rhino reads "
                         f"{CHECKPOINT_FORMAT}")
    meta["path"] = str(found)
    return meta


def _info(meta: dict) -> CheckpointInfo:
    return CheckpointInfo(Path(meta["path"]), meta["step"], meta["world_size"], meta["strategy"], meta["mesh"],
                          meta["data_position"], meta["fingerprint"])


# ----------------------------------------------------------------------------- layouts

def _dcp_sharding(sharding: Sharding, mesh: Mesh) -> Sharding:
    """``sharding`` with every placement DTensor cannot express (strided Shard, Partial) made Replicate."""
    return tuple(p if isinstance(p, Shard) and p.blocks == 1 and n > 1 else Replicate()
                 for p, n in zip(sharding, mesh.sizes))


def _redistribute(t: torch.Tensor, shape, src: Sharding, dst: Sharding, trainer) -> torch.Tensor:
    """``t`` (this rank's piece under ``src``) as its piece under ``dst`` (collective when communicating)."""
    for step in plan_redistribution(shape, src, dst, trainer.plan.mesh):
        t = apply_step(t, step, trainer.plan.mesh, _mesh_rank(trainer), trainer.groups)
    return t


def _mesh_rank(trainer) -> int:
    """This rank's rank within its stage's mesh (the global rank without pipeline stages)."""
    return trainer.rank % trainer.plan.mesh.world


def _device_mesh(trainer):
    """The ``DeviceMesh`` of this rank's stage (the whole job without pipeline stages; stage-major ranks)."""
    from torch.distributed.device_mesh import DeviceMesh
    mesh = trainer.plan.mesh
    first = trainer.rank - _mesh_rank(trainer)
    return DeviceMesh(trainer.device.type, torch.arange(first, first + mesh.world).reshape(mesh.sizes),
                      _init_backend=False)


def _dtensor(local: torch.Tensor, sharding: Sharding, device_mesh):
    from torch.distributed.tensor import DTensor, Replicate as DReplicate, Shard as DShard
    placements = [DShard(p.dim) if isinstance(p, Shard) else DReplicate() for p in sharding]
    return DTensor.from_local(local, device_mesh, placements, run_check=False)


def _state_inputs(trainer) -> list:
    """The state a checkpoint holds: every non-batch input but scheduled learning rates (the scheduler,
    replayed to the checkpoint's step on resume, gives them)."""
    return [inp for inp in trainer.cap.graph.inputs
            if inp.role is not Role.BATCH and inp.name not in trainer.cap.scheduled]


def _held_inputs(trainer) -> list:
    """The state inputs this rank holds: all of them, or its pipeline stage's (``runtime.pipeline``)."""
    return [inp for inp in _state_inputs(trainer) if inp.name in trainer.state]


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


# ----------------------------------------------------------------------------- save

def save_checkpoint(trainer, directory: str | os.PathLike, step: int | None = None) -> Path:
    """Save ``trainer``'s state as checkpoint ``step`` (default: steps done) under ``directory``; collective.
    Returns the checkpoint's path (see the module docstring for the layout and the atomic commit)."""
    import torch.distributed.checkpoint as dcp
    step = trainer.steps_done if step is None else int(step)
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, got {step}")
    root = Path(directory)
    box = [None]
    if trainer.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        box[0] = str(root / f"step-{step:08d}.tmp-{secrets.token_hex(4)}")
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    device_mesh = _device_mesh(trainer)
    tensors = {}
    for inp in _held_inputs(trainer):
        have = trainer.rp.value[inp.value]
        want = _dcp_sharding(have, trainer.plan.mesh)
        shape = trainer.cap.graph.types[inp.value].shape
        local = _redistribute(trainer.state[inp.name], shape, have, want, trainer)
        tensors[inp.name] = _dtensor(local, want, device_mesh)
    state = {_STATE: tensors, _RNG: {f"rank{trainer.rank}": _rng_state(trainer.device)}}
    dcp.save(state, checkpoint_id=tmp)
    if trainer.rank == 0:
        (tmp / META_FILE).write_text(json.dumps(_meta(trainer, step), indent=1))
    dist.barrier()
    final = checkpoint_dir(root, step)
    if trainer.rank == 0:
        _commit(tmp, final, step)
    dist.barrier()
    return final


def _meta(trainer, step: int) -> dict:
    graph, plan = trainer.cap.graph, trainer.plan
    return {"format": CHECKPOINT_FORMAT, "step": step, "data_position": trainer.data_position,
            "world_size": trainer.world, "mesh": str(plan.mesh), "strategy": plan.strategy_string,
            "plan": json.loads(plan.to_json()), "fingerprint": graph.fingerprint(),
            "inputs": {inp.name: {"role": inp.role.value, "shape": list(graph.types[inp.value].shape),
                                  "dtype": graph.types[inp.value].dtype.value} for inp in _state_inputs(trainer)},
            "model_keys": _model_keys(trainer), "param_groups": _param_groups(trainer)}


def _model_keys(trainer) -> dict[str, str]:
    """Every key of ``model.state_dict()`` -> the graph input holding it (tied parameters share one)."""
    model = trainer.workload.model
    names = {id(t): n for n, t in model.named_parameters()}
    names.update({id(t): n for n, t in model.named_buffers()})
    return {key: names.get(id(t), key) for key, t in model.state_dict(keep_vars=True).items()}


def _param_groups(trainer) -> list[dict]:
    """The optimizer's param groups (hyper-parameters; params by name) for export, JSON-safe values only."""
    model, opt = trainer.workload.model, trainer.workload.optimizer
    if opt is None:
        return []
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for g in opt.param_groups:
        hp = {k: v for k, v in g.items() if k != "params" and _json_safe(v)}
        hp["params"] = [names[id(p)] for p in g["params"]]
        groups.append(hp)
    return groups


def _json_safe(v) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def _commit(tmp: Path, final: Path, step: int) -> None:
    """Rank 0: make the written ``tmp`` checkpoint ``final``, point ``latest`` at it, drop stale temporaries."""
    root = final.parent
    old = None
    if final.exists():                      # the same step saved again: move the old one aside first
        old = root / f"{final.name}.old-{secrets.token_hex(4)}"
        os.replace(final, old)
    os.replace(tmp, final)
    pointer = root / f"{LATEST_FILE}.tmp-{secrets.token_hex(4)}"
    pointer.write_text(json.dumps({"checkpoint": final.name, "step": step}) + "\n")
    os.replace(pointer, root / LATEST_FILE)
    for stale in root.iterdir():
        if ".tmp-" in stale.name or ".old-" in stale.name:
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- load

def load_checkpoint(trainer, path: str | os.PathLike) -> CheckpointInfo:
    """Fill ``trainer.state`` with its shards under its own plan from checkpoint ``path`` (a checkpoint, or a
    root: its latest), reshard as needed, and restore the step, the data position and (same world size) the
    RNG states; collective. See the module docstring."""
    import torch.distributed.checkpoint as dcp
    meta = read_meta(path)
    info = _info(meta)
    _check_compatible(trainer, meta)
    device_mesh = _device_mesh(trainer)
    mesh = trainer.plan.mesh
    targets, fixups = {}, {}
    for inp in _held_inputs(trainer):
        have = trainer.rp.value[inp.value]
        want = _dcp_sharding(have, mesh)
        shape = trainer.cap.graph.types[inp.value].shape
        if want == tuple(p if n > 1 else Replicate() for p, n in zip(have, mesh.sizes)):
            local = trainer.state[inp.name]                    # loaded in place
        else:
            local = torch.empty(local_shape(shape, want, mesh), dtype=trainer.state[inp.name].dtype,
                                device=trainer.device)
            fixups[inp.name] = (shape, want, have)
        targets[inp.name] = _dtensor(local, want, device_mesh)
    state = {_STATE: targets}
    same_world = info.world_size == trainer.world
    if same_world:
        state[_RNG] = {f"rank{trainer.rank}": _rng_state(trainer.device)}
    dcp.load(state, checkpoint_id=info.path)
    for name, target in targets.items():
        if name in fixups:
            shape, want, have = fixups[name]
            trainer.state[name] = _local_fixup(target.to_local(), shape, want, have, trainer)
    if same_world:
        rng = state[_RNG][f"rank{trainer.rank}"]
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], trainer.device)
    trainer.steps_done = info.step
    if trainer.schedule is not None:
        trainer.schedule.rewind(info.step)
    trainer.set_data_position(info.data_position)
    return info


def _local_fixup(t: torch.Tensor, shape, want: Sharding, have: Sharding, trainer) -> torch.Tensor:
    """From an expressible layout (Replicate where ``have`` is strided or partial) to ``have``: local steps."""
    out = _redistribute(t, shape, want, have, trainer)
    return out.contiguous()


def _check_compatible(trainer, meta: dict) -> None:
    """The checkpoint must hold this workload's state: the same state inputs with the same roles, shapes and
    dtypes. The program may differ otherwise (another learning rate, loss or batch shape: a run resumed with a
    new setting), as ``load_state_dict`` asks only for matching keys and shapes."""
    graph = trainer.cap.graph
    mine = {inp.name: {"role": inp.role.value, "shape": list(graph.types[inp.value].shape),
                       "dtype": graph.types[inp.value].dtype.value} for inp in _state_inputs(trainer)}
    saved = meta["inputs"]
    missing = [n for n in mine if n not in saved]
    extra = [n for n in saved if n not in mine]
    differ = [n for n in mine if n in saved and saved[n] != mine[n]]
    if missing or extra or differ:
        if missing:
            what = f"it lacks {missing[0]!r}"
        elif extra:
            what = f"it holds {extra[0]!r}, which this workload does not have"
        else:
            what = f"{differ[0]!r} is {_described(saved[differ[0]])} there, {_described(mine[differ[0]])} here"
        raise ValueError(f"checkpoint {meta['path']!r} was saved from another workload ({what}); resume it with "
                         f"a workload of the same parameters and optimizer state, or start a new checkpoint directory")


def _described(entry: dict) -> str:
    return f"a {entry['role']} of shape {tuple(entry['shape'])} in {entry['dtype']}"
