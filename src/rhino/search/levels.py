"""The two optimization levels on one mesh's problem.

- **O1** (``segments.solve_o1``): critical-node segments chained by dynamic programming over the
  boundary state, each solve a greedy propagation plus local search; data parallel first. Small
  graphs (``O1_DESCENT_NODES``) also get up to ``O1_ROUNDS`` short rounds of axis-wise descent
  (``refine_o1``): by default the outer search runs it later, a round at a time, on the mesh whose
  plan prices best at the time (rule ``o1_refine_best_first``); with the rule off, here, on every mesh.
- **O2**: O1's plan, then rounds of axis-wise descent (``descent``: CP-SAT on one axis at a time)
  until a round changes nothing, then the joint ILP over all axes at once (``ilp.solve_ilp``), hinted
  with the descent's plan and given what is left of the budget; a solution is kept only if better.
- Both also return the data-parallel split followed through the graph (``segments``,
  rule ``dp_follow``) unless the model scores it worse than the answer; the outer search prices it
  exactly beside the answer.

Both return the model's view of the result, with what produced it (``Status``: a ``Source`` and its
detail); the caller prices the plan exactly (``cost.estimate``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from .descent import Descent, descend, score
from .ilp import solve_ilp
from .segments import followed_data_parallel, solve_o1
from .options import Level, SearchOptions
from .problem import Problem

__all__ = ["LevelResult", "Source", "Status", "solve_problem", "refine_o1", "JOINT_CANDIDATES", "O1_DESCENT_NODES"]

#: The joint ILP over all axes is tried only up to this many candidates (measured: with 1.7k it finds
#: no solution in 10 s on two cores; with a few hundred it closes the gap in seconds).
JOINT_CANDIDATES = 800
#: O1 adds up to ``O1_ROUNDS`` rounds of axis-wise descent (a CP-SAT step per axis, at most
#: ``O1_STEP_SECONDS`` each) on graphs of at most this many nodes, where building and pricing a mesh
#: take well under a second (larger graphs keep O1 solver-free).
O1_DESCENT_NODES = 4000
O1_STEP_SECONDS = 3.0
O1_ROUNDS = 2


class Source(StrEnum):
    """What produced a plan: a solver step here, or a choice of the outer search (``outer``)."""
    O1 = "O1"                                   # O1's segments and local search (detail: the start that won)
    O2_DESCENT = "O2 descent"                   # O2's axis-wise descent
    O2_JOINT = "O2 joint"                       # O2's joint ILP over all axes
    O1_KEPT = "O1 kept"                         # O2 ran, but O1's plan priced faster exactly
    DP_FOLLOWED = "data parallel, followed"     # rule dp_follow's plan priced faster than the solver's


#: The text of a source where it is not just its value (``Status.text``).
_SOURCE_TEXT = {Source.O1_KEPT: "O1 (kept: priced faster than the O2 refinement)",
                Source.DP_FOLLOWED: "data parallel, followed (priced faster than the solver's plan)"}


@dataclass(frozen=True)
class Status:
    """What produced a plan (``source``), O1's winning start (``start``: replicated, previous, data
    parallel, boundary ...) and whether O1's axis-wise descent improved it (``descent``)."""
    source: Source
    start: str = ""
    descent: bool = False

    def text(self) -> str:
        """The human text (``rhino plan --json``'s candidate status), e.g. ``O1 (data parallel) + descent``."""
        base = f"O1 ({self.start})" if self.source is Source.O1 else _SOURCE_TEXT.get(self.source, self.source.value)
        return base + (" + descent" if self.descent else "")

    __str__ = text


@dataclass
class LevelResult:
    choice: list[int]
    objective: float
    over: int
    status: Status
    steps: list[dict] = field(default_factory=list)
    o1_choice: list[int] = field(default_factory=list)   # O1's answer (O2 starts from it)
    followed: list[int] | None = None   # data parallel, followed (``segments``): priced beside the answer


def refine_o1(p: Problem, choice: list[int], options: SearchOptions, *, deadline: float,
              rounds: int = O1_ROUNDS) -> Descent:
    """O1's short axis-wise descent from ``choice`` (module docstring): ``choice`` itself unless the
    model scores the descent's plan better."""
    ndim = len(p.axis_keys[0][0]) if p.axis_keys and p.axis_keys[0] else 1
    d = descend(p, start=choice, rounds=rounds, step_time_limit=O1_STEP_SECONDS,
                deadline=min(deadline, time.perf_counter() + rounds * ndim * O1_STEP_SECONDS),
                workers=options.workers)
    d.steps = [dict(s, level="O1") for s in d.steps]
    if not score(p, d.choice) < score(p, choice):
        d.choice = list(choice)
    return d


def solve_problem(p: Problem, options: SearchOptions, *, deadline: float, start: list[int] | None = None,
                  critical: list[int] = ()) -> LevelResult:
    """Solve ``p`` at ``options.level`` before ``deadline`` (``time.perf_counter`` seconds)."""
    ndim = len(p.axis_keys[0][0]) if p.axis_keys and p.axis_keys[0] else 1
    now = time.perf_counter()
    budget = max(0.2, deadline - now)
    choice, sc, name = solve_o1(p, options, list(critical), start)
    status = Status(Source.O1, name)
    steps = [{"axis": "all", "status": status.text(), "objective": sc[1], "seconds": time.perf_counter() - now,
              "level": "O1"}]
    if options.level is Level.O1 and p.nodes <= O1_DESCENT_NODES and not options.o1_refine_best_first:
        d1 = refine_o1(p, choice, options, deadline=deadline)
        steps += d1.steps
        if d1.choice != choice:
            choice, status = d1.choice, Status(Source.O1, name, descent=True)
    o1_choice = list(choice)
    if options.level is Level.O2:
        d2 = descend(p, start=choice, rounds=3, step_time_limit=max(0.5, budget * 0.4 / ndim),
                     deadline=now + budget * 0.7, workers=options.workers)
        steps += [dict(s, level="O2") for s in d2.steps]
        if score(p, d2.choice) < score(p, choice):
            choice, status = d2.choice, Status(Source.O2_DESCENT)
        left = deadline - time.perf_counter()
        if ndim > 1 and left > 0.5 and sum(p.n_cands) <= JOINT_CANDIDATES:
            j = solve_ilp(p, time_limit=left, workers=options.workers, hint=choice, soft_memory=True)
            steps.append({"axis": "all", "status": j.status, "objective": j.objective, "seconds": j.seconds,
                          "level": "O2"})
            if j.choice and score(p, j.choice) < score(p, choice):
                choice, status = j.choice, Status(Source.O2_JOINT)
    over, obj = score(p, choice)
    followed = followed_data_parallel(p, options)
    if followed is not None and score(p, followed)[0] > over:
        # over memory where the answer is not: not worth an exact pricing. A slower model score is no
        # reason to skip it: the model prices each gradient reduction alone, the exact pricing (and the
        # runtime) buckets them, which favours data parallelism (BatchNorm U-Net on 8xA100: 3.32 vs 3.49 ms)
        followed = None
    return LevelResult(choice, obj, int(over), status, steps, o1_choice, followed)
