"""Exact layout at a capacity with CP-SAT (OR-Tools): the second engine of ``solve_layout``'s portfolio.

Formulation
  Variables: ``k_i`` in ``[0, (C - z_i) / a_i]`` with offset ``o_i = a_i k_i``, in units of the gcd
  of all sizes and alignments (canonical offsets are multiples of it, so nothing is lost).
  Constraints: ``no_overlap_2d`` over rectangles ``[l_i, u_i) x [o_i, o_i + z_i)`` (time intervals fixed);
  ``fits`` is the domain of ``k_i``.
  Objective: none (feasibility under ``C``).

Strategies (``CpStrategy``):
  CANONICAL  a fixed search that takes the buffer with the lowest possible offset first (ties by a
             preorder, as in ``layout_bnb``) and tries that lowest offset first: MiniMalloc's canonical
             order, with CP-SAT's disjunctive propagation and clause learning on every section.
  DEFAULT    CP-SAT's own search.
One worker each, so that it can run beside the branch and bound on a two-core machine.
"""
from __future__ import annotations

import threading
from enum import Enum
from typing import Sequence

import numpy as np

from .layout_bnb import SearchStatus

__all__ = ["CpStrategy", "CpsatRun"]


class CpStrategy(str, Enum):
    CANONICAL = "canonical"
    DEFAULT = "default"


class CpsatRun:
    """One CP-SAT solve that another thread can stop (``stop``)."""

    def __init__(self) -> None:
        self._solver = None
        self._lock = threading.Lock()
        self._stopped = False

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._solver is not None:
                self._solver.stop_search()

    def solve(self, lower: Sequence[int], upper: Sequence[int], size: Sequence[int], alignment: Sequence[int],
              capacity: int, strategy: CpStrategy, order: Sequence[int] | None,
              time_limit: float, floor: Sequence[int] | None = None) -> tuple[SearchStatus, list[int] | None]:
        """FOUND with offsets, INFEASIBLE, or LIMIT; ``order`` ranks buffers for CANONICAL ties;
        ``floor``: a lowest offset per buffer (the domain of ``k_i`` starts there)."""
        from ortools.sat.python import cp_model
        sizes = np.asarray(size, dtype=np.int64)
        aligns = np.asarray(alignment, dtype=np.int64)
        nz = np.flatnonzero(sizes > 0)
        unit = int(np.gcd.reduce(np.concatenate([sizes[nz], aligns[nz]]))) if nz.size else 1
        cap = int(capacity) // unit
        model = cp_model.CpModel()
        ks, xs, ys = {}, [], []
        for j, i in enumerate(nz.tolist()):
            if j % 1024 == 0 and self._stopped:  # building a large model takes a while: stop between
                return SearchStatus.LIMIT, None
            z, a = int(sizes[i]) // unit, int(aligns[i]) // unit
            k_min = 0 if floor is None else -(-int(floor[i]) // (unit * a))
            if z > cap or k_min > (cap - z) // a:
                return SearchStatus.INFEASIBLE, None
            k = model.new_int_var(k_min, (cap - z) // a, f"k{i}")
            ks[i] = k
            start = k * a if a > 1 else k
            xs.append(model.new_fixed_size_interval_var(int(lower[i]), int(upper[i]) - int(lower[i]), f"t{i}"))
            ys.append(model.new_interval_var(start, z, start + z, f"o{i}"))
        model.add_no_overlap_2d(xs, ys)
        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(0.01, time_limit)
        solver.parameters.num_workers = 1
        if strategy is CpStrategy.CANONICAL:
            ranked = [i for i in (order if order is not None else range(len(sizes))) if i in ks]
            model.add_decision_strategy([ks[i] for i in ranked], cp_model.CHOOSE_LOWEST_MIN,
                                        cp_model.SELECT_MIN_VALUE)
            solver.parameters.search_branching = cp_model.FIXED_SEARCH
        with self._lock:
            if self._stopped:
                return SearchStatus.LIMIT, None
            self._solver = solver
        status = solver.solve(model)
        with self._lock:
            self._solver = None
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            offsets = [0] * len(sizes)
            for i, k in ks.items():
                offsets[i] = solver.value(k) * int(aligns[i])
            return SearchStatus.FOUND, offsets
        if status == cp_model.INFEASIBLE:
            return SearchStatus.INFEASIBLE, None
        return SearchStatus.LIMIT, None
