"""``RankStep``: one rank's training step, the executor every runner uses (``rhino run``'s check, the
Trainer, the lockstep simulation, benchmarks).

``RankStep(graph, plan, rank, device)`` lowers once; ``run(local_state, local_batch)`` runs one step and
replaces ``local_state``'s tensors with the new ones. ``local_state``: this rank's shard of every
non-batch graph input, by input name; ``local_batch``: this rank's share of the global batch
(``runtime.data.rank_batch``: with ``m`` micro-batches, this rank's shard of each micro-batch,
concatenated in micro-batch order along dim 0).

**Micro-batches** (``plan.microbatches = m > 1``; the semantics of design11.md interface 3): the global
batch is cut into m contiguous micro-batches along dim 0, each split over the mesh as the plan splits
the batch. The step runs as two programs (``cost.accumulate.split_step``): the gradient program once per
micro-batch, the update program once. Gradients stay in their produced sharding (a data-parallel
gradient stays ``Partial``): micro-batch 1's are kept, the later ones are added into them in place as
soon as each is computed, the sum is divided by m, and the update program reduces them once (as DDP's
``no_sync``) and steps the optimizer. Buffers updated in the forward (BatchNorm running statistics) are
carried from micro-batch to micro-batch. The loss reported is ``sum_k loss_k / m``. This equals
PyTorch's loop ``for mb: (loss_fn(model, *mb) / m).backward(); opt.step()``.

The micro-batch program needs the step's constants at batch B/m (a mean's 1/N, a loss's total weight
are numbers in the captured graph), so it is lowered from the step **captured again at batch B/m**
(``microbatch_graph``, ``runtime.microbatch``: derived from captures at larger micro-batches where PyTorch
takes other code paths at one row), with the plan applied by node name; ``same_structure`` checks that the
two graphs differ only in the batch dim and in numbers (a clear error otherwise).

**Recomputation**: a ``plan.recompute`` other than ``Recompute.NONE`` rewrites the step with ``cost.remat.remat``
(``with_recompute``) before anything is lowered (with micro-batches, the step at batch B/m).

**Overlap**: ``overlap=True`` lowers every program with asynchronous bucketed collectives
(``lower.overlap``; results identical to the blocking programs); with micro-batches the gradient
reductions are in the update program, where they all start at once (DDP's ``no_sync`` then one
reduction per bucket).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Generator

import torch

from ..capture import Captured
from ..ir.graph import Graph, Ref, Role
from ..lower.overlap import release_inputs
from ..lower.spmd import Part, SpmdProgram, lower_rank
from ..cost.accumulate import split_step
from ..cost.remat import remat, remat_plan
from ..sharding.placement import Partial, ReduceOp, replicated
from ..sharding.plan import PlanError, ResolvedPlan, ShardingPlan, resolve
from ..sharding.rebatch import rebatch_plan
from ..sharding.vocab import Recompute
from .microbatch import microbatch_graph

__all__ = ["RankStep", "microbatch_graph", "same_structure", "with_recompute", "Executor", "rank_program_sources"]

#: runs one program on its arguments and returns its outputs (``RankStep.run`` calls the module; the
#: lockstep simulation runs every rank's program together)
Executor = Callable[[SpmdProgram, list], list]


def with_recompute(graph: Graph, plan: ShardingPlan) -> tuple[Graph, ShardingPlan]:
    """The graph and plan the runtime executes for ``plan.recompute`` (identity for ``"none"``): the
    recomputing program of ``cost.remat.remat`` (the one the cost model prices), each copied node with
    its original's strategy (``remat_plan``)."""
    if Recompute(plan.recompute) is Recompute.NONE:
        return graph, plan
    new, origin = remat(graph, plan.recompute)
    return new, remat_plan(plan, origin)


def _same_args(a, b) -> bool:
    if isinstance(a, Ref) or isinstance(b, Ref):
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_args(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return True  # sizes and batch-size constants differ
    return a == b


def _differ(a, b) -> str:
    """How argument ``a`` of the whole-batch step became ``b``: lists of other lengths by their lengths."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) != len(b):
        return f"a list of {len(b)} values instead of {len(a)}"
    return f"{b!r} instead of {a!r}"


def same_structure(full: Graph, micro: Graph, microbatches: int) -> None:
    """ValueError unless ``micro`` is ``full`` at batch B/m: same inputs, nodes, ops and wiring; batch
    inputs with dim 0 divided by m; state inputs alike."""
    def fail(what: str):
        raise ValueError(f"the step captured at 1/{microbatches} of the batch differs from the whole-batch "
                         f"step ({what}): its graph depends on the batch size beyond the batch dim, so "
                         f"microbatches={microbatches} cannot run it (micro-batches take rows along dim 0 of every "
                         f"batch tensor: a sequence-first tensor, nn.LSTM's, nn.GRU's and nn.MultiheadAttention's "
                         f"default layout, holds time steps there; put its samples first or use microbatches=1)")
    if [(i.name, i.role, i.value) for i in full.inputs] != [(i.name, i.role, i.value) for i in micro.inputs]:
        fail("other inputs")
    for i in full.inputs:
        a, b = full.types[i.value], micro.types[i.value]
        want = (a.shape[0] // microbatches,) + tuple(a.shape[1:]) if i.role is Role.BATCH else tuple(a.shape)
        if a.dtype != b.dtype or tuple(b.shape) != want:
            fail(f"input {i.name} is {b.dtype.value}{list(b.shape)}, expected {a.dtype.value}{list(want)}")
    if len(full.nodes) != len(micro.nodes):
        fail(f"{len(micro.nodes)} nodes instead of {len(full.nodes)}")
    for x, y in zip(full.nodes, micro.nodes):
        if (x.name, x.op, x.outputs) != (y.name, y.op, y.outputs):
            fail(f"node {x.name} ({x.op}) became {y.name} ({y.op})")
        if len(x.args) != len(y.args):
            fail(f"node {x.name} ({x.op}) has {len(y.args)} arguments instead of {len(x.args)}")
        keys = sorted(x.kwargs.keys() | y.kwargs.keys())
        for what, a, b in [*zip(range(len(x.args)), x.args, y.args),
                           *((k, x.kwargs.get(k), y.kwargs.get(k)) for k in keys)]:
            if not _same_args(a, b):
                fail(f"node {x.name} ({x.op}): its argument {what} is {_differ(a, b)}")
    if [(o.name, o.value) for o in full.outputs] != [(o.name, o.value) for o in micro.outputs]:
        fail("other outputs")


def _take(local_state: dict, names: list[str], replaced) -> list:
    """The state a program reads, in ``names`` order; entries the program replaces leave ``local_state``
    (they come back from its outputs), so the caller holds no second reference to the old values."""
    replaced = set(replaced)
    return [local_state.pop(n) if n in replaced else local_state[n] for n in names]


class RankStep:
    """One rank's training step (module docstring)."""

    def __init__(self, graph: Graph | Captured, plan: ShardingPlan, rank: int, device: torch.device | str = "cpu",
                 overlap: bool = True, micro_graph: Graph | None = None) -> None:
        cap = graph if isinstance(graph, Captured) else None
        graph = cap.graph if cap is not None else graph
        if plan.stages > 1:
            raise ValueError(f"the plan has {plan.stages} pipeline stages; RankStep runs one stage's step, "
                             f"runtime.pipeline runs pipelines")
        full_rp = resolve(graph, plan)  # the plan is for this workload (fingerprint), every sharding checks
        self.plan, self.rank, self.device, self.overlap = plan, rank, torch.device(device), overlap
        self.microbatches = m = plan.microbatches
        self._released: dict[int, object] = {}   # id(program) -> its release_inputs form (``run``)
        if m == 1:
            g, p = with_recompute(graph, plan)
            self.rp = resolve(g, dataclasses.replace(p, fingerprint=""))
            self.programs = [lower_rank(self.rp, rank, self.device, overlap=overlap)]
            self.state_names = [i.name for i in g.inputs if i.role is not Role.BATCH]
            return
        if micro_graph is None:
            if cap is None:
                raise ValueError(f"the plan has microbatches={m}: give RankStep the Captured step (or "
                                 f"micro_graph=microbatch_graph(cap, {m}))")
            micro_graph = microbatch_graph(cap, m)
        same_structure(graph, micro_graph, m)
        g, p = with_recompute(micro_graph, rebatch_plan(full_rp, micro_graph))
        try:
            self.rp = rp = resolve(g, dataclasses.replace(p, fingerprint=""))
        except PlanError as exc:
            raise ValueError(f"microbatches={m}: a micro-batch of the batch cannot be split as the plan splits "
                             f"the batch ({exc}); choose microbatches so that it divides the batch size divided "
                             f"by the plan's batch split") from None
        self._lower_parts(rp)

    def _lower_parts(self, rp: ResolvedPlan) -> None:
        g, mesh = rp.graph, rp.plan.mesh
        split = split_step(g)
        self.split = split
        for vid in split.boundary:
            if any(isinstance(pl, Partial) and pl.op is not ReduceOp.SUM for pl in rp.value[vid]):
                raise ValueError(f"a gradient is Partial({rp.value[vid]}) under this plan; only sums can be "
                                 f"accumulated over micro-batches")
        state_in = {i.name: i.value for i in g.inputs}
        out_value = {o.name: o.value for o in g.outputs}
        loss = next(o.value for o in g.outputs if o.role is Role.LOSS)
        batch = [(i.name, i.value) for i in g.inputs if i.role is Role.BATCH]
        grad_nodes, upd_nodes = set(split.grad_nodes), set(split.update_nodes)
        grads = [(f"grad/{v}", v) for v in split.boundary]

        def reads(nodes: set[str]) -> set[int]:
            return {r.id for n in g.nodes if n.name in nodes for r in n.input_refs()}

        g_reads = reads(grad_nodes) | {out_value[n] for n in split.grad_state_outputs}
        self.grad_state = [i.name for i in g.inputs if i.role is not Role.BATCH and i.value in g_reads]
        buffers = [(n, out_value[n], rp.value[state_in[n]]) for n in split.grad_state_outputs]
        g_inputs = [(n, state_in[n]) for n in self.grad_state] + batch
        loss_out = [("loss", loss, replicated(mesh))]
        first = Part(grad_nodes, g_inputs, loss_out + buffers + [(n, v, None) for n, v in grads])
        later = Part(grad_nodes, g_inputs, loss_out + buffers, accumulate=grads)
        u_reads = reads(upd_nodes) | {out_value[n] for n in split.update_state_outputs}
        self.update_state = [i.name for i in g.inputs if i.role is not Role.BATCH and i.value in u_reads]
        update = Part(upd_nodes, [(n, state_in[n]) for n in self.update_state] + grads,
                      [(n, out_value[n], rp.value[state_in[n]]) for n in split.update_state_outputs])
        self.programs = [lower_rank(rp, self.rank, self.device, part, overlap=self.overlap)
                         for part in (first, later, update)]
        self.state_names = [i.name for i in g.inputs if i.role is not Role.BATCH]

    def step_communication(self) -> tuple[int, dict[str, int]]:
        """(bytes this rank sends, collectives by kind) in one training step: with micro-batches, the first
        micro-batch's program, the later ones' m - 1 times, and the update's."""
        runs = [1] if self.microbatches == 1 else [1, self.microbatches - 1, 1]
        sent, kinds = 0, {}
        for prog, times in zip(self.programs, runs):
            sent += prog.comm_bytes * times
            for kind, count in prog.collectives.items():
                kinds[kind] = kinds.get(kind, 0) + count * times
        return sent, kinds

    def local_batch(self, batch: tuple) -> tuple:
        """This rank's share of a global batch: its shard (as the plan shards each batch input) of every
        micro-batch, concatenated in micro-batch order along dim 0 (``runtime.data.rank_batch``)."""
        from .data import rank_batch
        return rank_batch(tuple(batch), self.rp, self.rank, self.microbatches, self.device)

    # -- running ---------------------------------------------------------------------------------------
    def schedule(self, local_state: dict, local_batch: tuple, release: bool = False) -> Generator[tuple, list, float]:
        """The step as (program, arguments) pairs; send each program's outputs back in. Returns the loss.
        ``run`` executes it on this rank; the lockstep simulation drives every rank's schedule together."""
        local_batch = tuple(local_batch)
        if self.microbatches == 1:
            prog = self.programs[0]
            outs = yield prog, _take(local_state, self.state_names, prog.output_names[1:] if release else ()) + list(local_batch)
            local_state.update(zip(prog.output_names[1:], outs[1:]))
            return float(outs[0])
        m = self.microbatches
        for i, b in enumerate(local_batch):
            if b.dim() == 0 or b.shape[0] % m:
                raise ValueError(f"local batch tensor {i} has {b.shape[0] if b.dim() else 'no'} rows, which do not "
                                 f"split into {m} micro-batches; pass runtime.data.rank_batch's share")
        first, later, update = self.programs
        n_buf = len(self.split.grad_state_outputs)
        grads: list = []
        loss = 0.0
        for k in range(m):
            mb = [b.narrow(0, k * (b.shape[0] // m), b.shape[0] // m) for b in local_batch]
            args = [local_state[n] for n in self.grad_state] + mb
            prog = first if k == 0 else later
            outs = yield prog, args + (grads if k else [])
            del args
            loss += float(outs[0])
            local_state.update(zip(self.split.grad_state_outputs, outs[1:1 + n_buf]))
            if k == 0:
                grads = list(outs[1 + n_buf:])
            del outs
        for t in grads:
            t.div_(m)
        outs = yield update, _take(local_state, self.update_state, update.output_names if release else ()) + grads
        del grads
        local_state.update(zip(update.output_names, outs))
        return loss / m

    def run_with(self, local_state: dict, local_batch: tuple, execute: Executor, release: bool = False) -> float:
        """One step, each program run by ``execute(program, args) -> outputs``. ``release``: the state a
        program replaces leaves ``local_state`` while it runs (``execute`` must then free its inputs)."""
        gen = self.schedule(local_state, local_batch, release)
        outs = None
        with torch.no_grad():
            while True:
                try:
                    prog, args = gen.send(outs)
                except StopIteration as stop:
                    return stop.value
                outs = execute(prog, args)
                del args

    def run(self, local_state: dict, local_batch: tuple) -> float:
        """One training step; ``local_state``'s entries are replaced by the new state. Returns the loss.
        Each program frees its inputs as it consumes them (``lower.overlap.release_inputs``): an old
        parameter or moment dies at its last use in the update, as with PyTorch's in-place optimizers."""
        return self.run_with(local_state, local_batch, self._execute_releasing, release=True)

    def _execute_releasing(self, prog, args: list) -> list:
        key = id(prog)
        if key not in self._released:
            self._released[key] = release_inputs(prog)
        return self._released[key].module(args)

    def held(self, prog, args: list, local_state: dict, local_batch: tuple) -> list:
        """The tensors held outside ``prog`` while it runs under ``schedule(..., release=True)``: the state left
        in ``local_state`` (not the state handed to the program that replaces it); with micro-batches also the
        batch and the gradient accumulators the schedule keeps."""
        held = list(local_state.values())
        if self.microbatches > 1:
            handed = len(self.update_state) if prog is self.programs[2] else 0
            held += list(local_batch) + list(args[handed:])
        return held

    def run_measured(self, local_state: dict, local_batch: tuple) -> tuple[float, int]:
        """``run``, node by node, also returning this rank's peak of live tensor bytes (``LiveBytesMeter``:
        the state, the local batch and the gradient accumulators held outside the programs count too). As in
        ``run``, the state a program replaces is handed to it (``release``): it dies at its last use there."""
        from .measure import LiveBytesMeter
        peak = [0]

        def execute(prog, args):
            meter = LiveBytesMeter(prog.module, self.held(prog, args, local_state, local_batch))
            outs = meter.run(*args)
            peak[0] = max(peak[0], meter.peak)
            return outs
        loss = self.run_with(local_state, local_batch, execute, release=True)
        return loss, peak[0]


def rank_program_sources(cap: Captured, plan: ShardingPlan) -> dict[str, str]:
    """Each rank's programs as Python source, by file name: ``rank{r}.py``; with micro-batches
    ``rank{r}_grad_first.py`` (the first micro-batch), ``rank{r}_grad.py`` (the later ones, accumulating) and
    ``rank{r}_update.py``. Each starts with a comment naming the rank, its mesh coordinates and its
    communication per run."""
    m = plan.microbatches
    micro = microbatch_graph(cap, m) if m > 1 else None
    names = [""] if m == 1 else ["_grad_first", "_grad", "_update"]
    out = {}
    for rank in range(plan.mesh.world):
        progs = RankStep(cap.graph, plan, rank, micro_graph=micro).programs
        for suffix, prog in zip(names, progs):
            header = (f"# Rhino per-rank program: rank {rank} of mesh {plan.mesh} "
                      f"(coordinates {plan.mesh.coords(rank)})\n"
                      f"# strategy: {plan.strategy_string or 'plan file'}; communication per run: "
                      f"{prog.comm_bytes} bytes, collectives {prog.collectives}\n"
                      f"# redistribute(x, kind, mesh_axis, ...) is rhino.lower.spmd_ops.redistribute.\n")
            out[f"rank{rank}{suffix}.py"] = header + prog.module.code
    return out
