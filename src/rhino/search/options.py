"""Search options: the optimization level and every heuristic or pruning rule, each a named field
with a safe default (design.md, house rule 3). Tests turn rules off and check that the optimum does
not get worse and that the rule saves work."""
from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum, StrEnum

__all__ = ["Level", "RecomputeWhen", "PipelineWhen", "FitMemory", "SearchOptions"]


class Level(str, Enum):
    O1 = "O1"   # critical-node segments solved one by one and chained by dynamic programming
    O2 = "O2"   # one ILP over all cone strategies


class RecomputeWhen(StrEnum):
    """When the outer search tries activation recomputation (``outer``, step 3)."""
    AUTO = "auto"       # only when no plan fits without it
    NEVER = "never"
    ALWAYS = "always"   # beside every plan without it


class PipelineWhen(StrEnum):
    """When the outer search tries pipeline stages (``pipelines``)."""
    AUTO = "auto"       # no single-stage plan fits
    MEMORY = "memory"   # as auto, or (several nodes) the fastest fitting single-stage plan recomputes
    GAIN = "gain"       # as memory, or (several nodes) the best single-stage plan's exposed share is large
    NEVER = "never"
    ALWAYS = "always"


class FitMemory(StrEnum):
    """Which peak the fit check compares with device memory (``outer``, ``rank_memory.planned_fit``)."""
    PROGRAM = "program"   # the cost model's: program order, live bytes, replaced state freed at its last read
    PLANNED = "planned"   # as program; a candidate over capacity (within ``fit_memory_margin``) fits when its
    #                       rank program's memory plan (order + layout, ``memory.plan_memory``) + state does


@dataclass(frozen=True)
class SearchOptions:
    level: Level = Level.O2
    #: Wall-clock budget of the whole search (all mesh shapes), seconds. Each ILP gets a share.
    time_limit: float = 60.0
    #: CP-SAT worker threads (the machine the tests run on has 2 cores).
    workers: int = 2

    # -- strategy space ------------------------------------------------------------------------
    #: Strided splits ``x/k`` for the chunk counts ``k`` of fused tensors found in the graph
    #: (a fused QKV split into 3) and for dims a view merges or takes apart (``ir.analysis.merged_blocks``:
    #: a batch split seen through BERT's ``(seq batch, d)`` rows). Off: only contiguous splits.
    strided_splits: bool = True
    #: Partial passthrough (``~``) for linear ops: a Partial input stays Partial through them.
    partial_passthrough: bool = True
    #: Parameters, gradients' optimizer state and buffers may be sharded (ZeRO emerges from this).
    shard_state: bool = True

    #: Price redistributions with the exact planner on multi-axis meshes too (several times slower to
    #: build). Off: ``problem.quick_steps``, one collective per axis in a good order; plans are priced
    #: exactly at the end anyway.
    exact_redistribution: bool = False
    #: Reuse the steps the exact planner (``plan_redistribution``) found for one tensor to price
    #: another of the same rank with the same shardings (re-planned when they do not fit its shape).
    #: Off: every shape is planned (several times slower on two-axis meshes; same costs in practice).
    reuse_redistribution_plans: bool = True

    # -- coarsening and reuse ------------------------------------------------------------------
    #: Cones: a node whose one big input comes from inside a cone joins that cone and takes the
    #: strategy that consumes the input as it is (views, element-wise ops, norms on activations).
    #: Off: every node is its own cone (much larger ILPs, same optimum or better).
    cones: bool = True
    #: An optimizer update (all optimizer nodes of one parameter) is one cone whose choice is the
    #: sharding of that parameter's optimizer state.
    optimizer_cones: bool = True
    #: Identical layers (structural hashing) share one set of ILP variables.
    tie_layers: bool = True
    #: Rounds of neighbourhood refinement in the structural hash (larger: fewer, safer ties).
    tie_radius: int = 1

    # -- memory --------------------------------------------------------------------------------
    #: Nodes where the ILP checks per-device memory, besides the forward/backward boundary and the
    #: end of the step: the highest local peaks of the unsharded liveness timeline.
    memory_checkpoints: int = 6
    #: Rounds of "solve, estimate memory, add the violated peak as a constraint, solve again".
    memory_rounds: int = 4
    #: Fraction of device memory the search may plan for.
    memory_fraction: float = 1.0
    #: The fit check's peak (``FitMemory``): "program" (the cost model's) or "planned" (a candidate over
    #: capacity gets its rank program planned by ``memory``, O1, and fits when the arena + state does).
    fit_memory: FitMemory = FitMemory.PROGRAM
    #: planned: only candidates whose program-order peak is at most this fraction over capacity are planned.
    #: On the examples the cost model's peak was at most 1.35x the planned arena + state (mlp dp=2,tp=2,
    #: before session 26, when the cost model held the old and the new state), so 0.5 covers them.
    fit_memory_margin: float = 0.5
    #: planned: seconds for one rank program's memory plan (``memory.plan_memory``, O1).
    fit_memory_time_limit: float = 5.0
    #: planned: fraction of device memory kept free for what the torch-free rank program leaves out (the
    #: temporaries inside custom lowerings: the lowered programs' O1 arenas were 0 to 256 B larger on the
    #: examples, at most 0.02%; tests/test_planned_fit.py).
    fit_memory_headroom: float = 0.001

    # -- O1 --------------------------------------------------------------------------------------
    #: Strategies kept per critical node as dynamic-programming states (the cheapest by a lower bound).
    boundary_states: int = 2
    #: Data parallel first: when the data-parallel plan fits on a mesh axis that spans nodes, that axis
    #: stays data parallel (batch splits, optionally sharded optimizer state) and only the others are searched.
    dp_first: bool = True
    #: Data parallel, followed: the batch split propagated taking every value as it arrives where a
    #: candidate can (redistribution first, then time), improved, and priced beside the solver's plan
    #: on every mesh that is priced; the faster is kept (``segments``, ``outer``).
    dp_follow: bool = True

    # -- outer search ----------------------------------------------------------------------------
    #: O1 prices (with the cost model) only the meshes its model ranks best, this many.
    o1_priced_meshes: int = 2
    #: O1 on small graphs: every mesh is solved and priced first, then the descent refines, a round at a
    #: time, the plan that prices fastest now, while O1's budget lasts (the likely winner gets it first).
    #: Off: each mesh descends as it is solved, in mesh order, with an even share of the budget.
    o1_refine_best_first: bool = True
    #: Largest number of mesh axes tried.
    max_mesh_axes: int = 2
    #: Consider activation recomputation: "auto" only when no plan fits without it, "never", "always".
    recompute: RecomputeWhen = RecomputeWhen.AUTO

    # -- pipelines (``pipelines``, ``stages``) ---------------------------------------------------------
    #: Try pipeline stages: "auto" when no single-stage plan fits; "memory" (default) also when, on several
    #: nodes, the fastest fitting one needs activation recomputation (memory-bound: stages hold 1/pp of the
    #: state, Megatron-LM's reason for pp, arXiv 2104.04473 section 3.3); "gain" also when the fastest
    #: one's step exceeds its compute by more than ``pipeline_min_gain`` (opt-in: it prices pipelines for
    #: most multi-node searches, e.g. LLaMA-7B's O1 search on 8x8xA100-80G, 8 s without); "never", "always".
    pipeline: PipelineWhen = PipelineWhen.MEMORY
    pipeline_min_gain: float = 0.05
    #: Largest pipeline degree tried (Megatron-LM's largest in arXiv 2104.04473 Table 1 is 64).
    max_pp: int = 64
    #: Single-stage candidates whose plans are tried as stage plans (the best first).
    pipeline_plans: int = 1
    #: Stop raising the pipeline degree of a stage plan at the first degree that fits and prices slower
    #: than the fastest fitting plan so far (fewer stages, another stage plan, or single-stage). Off: every
    #: degree up to ``max_pp`` is priced.
    pipeline_stop_early: bool = True
    #: Also try the expert tensor-parallel preset (tp = devices per node, dp across nodes) as a stage plan
    #: (Megatron-LM's 3D layout). Off: only the searched single-stage plans.
    pipeline_megatron_start: bool = True
    #: Price the Megatron start's degrees before the searched stage plans' (``pipelines``), so that rule
    #: ``pipeline_stop_early`` stops a searched stage plan at its first fitting degree slower than the
    #: Megatron start's best (GPT-3 175B-shaped on 1024 A100s: its searched stage plan priced 46.7-73.8 s
    #: per step at pp = 2..32 against 19.76 s for the Megatron start). Off: the best searched stage plan first.
    pipeline_megatron_first: bool = True
    #: When no single-stage plan fits without recomputation and rule ``pipeline`` will price pipelines anyway
    #: (``memory`` or ``gain`` on several nodes, or ``always``; with ``recompute="auto"``), price the
    #: pipelines (from the plans without recomputation) before searching the single-stage plans with
    #: recomputation, and search those only when no pipelined plan fits without recomputation
    #: (``outer``, step 3; Megatron-LM's reason for pp: stages hold 1/pp of the state, arXiv 2104.04473
    #: section 3.3). A heuristic: a recomputing single-stage plan pays a second forward, a pipelined one a
    #: bubble; GPT-3 175B-shaped on 1024 A100s: 115.9 s per step single-stage with recomputation against
    #: 19.76 s pipelined without it (the same plan as with the rule off, found in 58 s instead of 236 s).
    #: Its searched stage plan is the best plan solved without recomputation, not the one solved with it:
    #: on a 4-layer GPT on 2x2 and 4x1 3 GiB A100s the plan prices 0-3% slower than with the rule off
    #: (tests/test_pipeline_search.py). Off: the single-stage plans with recomputation are searched first
    #: and compete (and the best of them is the searched stage plan).
    pipeline_before_recompute: bool = True
    #: Micro-batch counts priced per pipeline degree (the largest that divide the rank's batch).
    pipeline_microbatch_counts: int = 3
    #: Stage cut: CP-SAT on the unit DAG up to this many unit x stage variables, else the contiguous DP.
    stage_ilp_limit: int = 4000
    #: Skip (unpriced) a pipeline degree whose stage plan's parameters and optimizer state per rank, over
    #: ``pp``, exceed device memory: some stage holds at least that, whatever the cut. Off: every degree priced.
    pipeline_state_floor: bool = True
    #: Price a pipelined stage plan without activation recomputation first when its single-stage plan
    #: recomputes, with it only when that does not fit (``pipelines``). Off: the single-stage plan's mode.
    pipeline_drop_recompute: bool = True
    #: Stage cut units: the search's cones (coarser). Off: each forward node is a unit, as ``rhino
    #: estimate`` cuts (the contiguous DP is linear in units; measured on the Megatron 175B-shaped GPT at 24
    #: layers, pp=8, m=96: 7.81 s per step with node units, 7.93 s with cones, whose merged cycles unbalance
    #: the first stage).
    stage_cut_cones: bool = False
    #: Stage cut: CP-SAT's time per solve (each of its two phases gets half), seconds.
    stage_ilp_seconds: float = 2.0
    #: Stage cut: keep the cut solved for a plan and degree at a larger micro-batch count for a smaller one
    #: when it still fits the smaller count's memory rows (``stages.stage_cut``). Off: solved per count.
    pipeline_reuse_cut: bool = True
    #: Stage cut: stage loads within this fraction of the least bottleneck (TePDist's 8%).
    stage_tolerance: float = 0.08

    def with_(self, **kw) -> "SearchOptions":
        return replace(self, **kw)

    def __post_init__(self) -> None:
        if self.time_limit <= 0:
            raise ValueError(f"time limit must be positive, got {self.time_limit}")
        if self.recompute not in tuple(RecomputeWhen):
            raise ValueError(f"recompute must be auto, never or always, got {self.recompute!r}")
        object.__setattr__(self, "recompute", RecomputeWhen(self.recompute))
        if self.pipeline not in tuple(PipelineWhen):
            raise ValueError(f"pipeline must be auto, memory, gain, never or always, got {self.pipeline!r}")
        object.__setattr__(self, "pipeline", PipelineWhen(self.pipeline))
        if self.max_pp < 1 or self.pipeline_plans < 1 or self.pipeline_microbatch_counts < 1 \
                or not 0 <= self.stage_tolerance < 1 or self.pipeline_min_gain < 0:
            raise ValueError("max_pp, pipeline_plans and pipeline_microbatch_counts must be >= 1, "
                             "stage_tolerance in [0, 1), pipeline_min_gain >= 0")
        if not isinstance(self.level, Level):
            object.__setattr__(self, "level", Level(self.level))
        if self.workers < 1 or self.tie_radius < 0 or self.boundary_states < 1 or self.max_mesh_axes < 1 \
                or self.o1_priced_meshes < 1:
            raise ValueError("workers, boundary_states, max_mesh_axes and o1_priced_meshes must be >= 1, "
                             "tie_radius >= 0")
        if self.fit_memory not in tuple(FitMemory):
            raise ValueError(f"fit_memory must be program or planned, got {self.fit_memory!r}")
        object.__setattr__(self, "fit_memory", FitMemory(self.fit_memory))
        if self.fit_memory_margin < 0 or self.fit_memory_time_limit <= 0 or not 0 <= self.fit_memory_headroom < 1:
            raise ValueError("fit_memory_margin must be >= 0, fit_memory_time_limit positive and "
                             "fit_memory_headroom in [0, 1)")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
