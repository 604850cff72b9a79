"""Learning-rate schedules beside a captured step.

A workload may define ``lr_scheduler(optimizer)`` returning a ``torch.optim.lr_scheduler`` scheduler over its
optimizer. The captured step then reads each param group's learning rate from a float64 0-dim input
(``capture.optim.scheduled_name``), and its momentum (SGD, RMSprop) or beta1 (the Adam family) from another
where the scheduler moves it (OneCycleLR's and CyclicLR's ``cycle_momentum``, found by ``probe``: the scheduler
built over a copy of the optimizer and stepped twice); before each step the runner writes the scheduler's
current values into those inputs (``set_rates``), and after it steps the scheduler (``LrSchedule.advance``), as a
PyTorch loop calls ``scheduler.step()`` after ``optimizer.step()``. A scheduler that moves any other
hyper-parameter, or a momentum the probe did not see move, is refused when it does, since the captured update
holds those as constants.
"""
from __future__ import annotations

import copy
import warnings
from typing import TYPE_CHECKING, Callable

import torch

from .optim import (SCHEDULABLE, changed_hyperparameter, group_value, hyperparameters, scheduled_values,
                    set_group_value)
from .workload import Workload, WorkloadError

if TYPE_CHECKING:
    from .trace import Captured

__all__ = ["LrSchedule", "planned_rates", "set_rates", "probe"]

# the scheduler steps a probe takes to see which momenta it moves (OneCycleLR and CyclicLR move them at once)
_PROBE_STEPS = 2

# torch warns when a scheduler steps before optimizer.step() (never called here: the step is captured)
_NOT_STEPPED = r"(Detected call of `lr_scheduler\.step\(\)` before|Seems like `optimizer\.step\(\)` has been)"


class LrSchedule:
    """The scheduler ``make(optimizer)`` over ``optimizer`` (the workload's or a copy of it), and the values it
    gives the scheduled inputs ``scheduled`` (input name -> (param group, key))."""

    def __init__(self, optimizer: torch.optim.Optimizer, make: Callable, scheduled: dict[str, tuple[int, str]],
                 spec: str = "the workload") -> None:
        self.optimizer, self.scheduled, self.spec, self.steps = optimizer, scheduled, spec, 0
        self._fixed = hyperparameters(optimizer, scheduled)
        self.scheduler = _build(optimizer, make, spec)
        self._check()
        self._start = (copy.deepcopy(self.scheduler.state_dict()), [g["lr"] for g in optimizer.param_groups],
                       {(g, key): group_value(optimizer.param_groups[g], key) for g, key in scheduled.values()})

    def rates(self) -> dict[str, float]:
        """The value of each scheduled input (learning rates, momenta) for the next step."""
        return scheduled_values(self.optimizer, self.scheduled)

    def advance(self) -> None:
        """``scheduler.step()``, after a training step."""
        _step(self.scheduler)
        self.steps += 1
        self._check()

    def rewind(self, steps: int) -> None:
        """The scheduler as after ``steps`` steps from its start (a resumed run), replayed from its start."""
        state, lrs, values = self._start
        self.scheduler.load_state_dict(copy.deepcopy(state))
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        for (g, key), value in values.items():       # a cycled momentum as the scheduler set it when built
            set_group_value(self.optimizer.param_groups[g], key, value)
        self.steps = 0
        for _ in range(steps):
            self.advance()

    def _check(self) -> None:
        changed = changed_hyperparameter(self._fixed, self.optimizer, self.scheduled)
        if changed:
            raise WorkloadError(f"{self.spec}: with the learning-rate scheduler, the optimizer's {changed}; only "
                                f"the learning rate, and a momentum or beta1 that it moves from its first steps, "
                                f"may follow a schedule (the captured update holds the rest as constants)")
        _momenta_on(self.optimizer, {g for g, key in self.scheduled.values() if key == "momentum"}, self.steps,
                    self.spec)


def _momenta_on(optimizer: torch.optim.Optimizer, groups, steps: int, spec: str) -> None:
    """Refuse a scheduled momentum (of param groups ``groups``) at 0: the captured update keeps its buffer."""
    for g in sorted(groups):
        if group_value(optimizer.param_groups[g], "momentum") == 0:
            raise WorkloadError(f"{spec}: the scheduler set param_groups[{g}]['momentum'] to 0 after {steps} steps; "
                                f"the captured update keeps its momentum buffer, which torch skips at 0: keep the "
                                f"scheduled momentum above 0")


def _build(optimizer: torch.optim.Optimizer, make: Callable, spec: str):
    """``make(optimizer)``, checked to be a scheduler of ``optimizer`` stepped once per step."""
    try:
        scheduler = make(optimizer)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
        raise WorkloadError(f"{spec}: lr_scheduler(optimizer) failed: {type(exc).__name__}: {exc}") from None
    on_metric = isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if on_metric or not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise WorkloadError(f"{spec}: lr_scheduler(optimizer) must return a torch.optim.lr_scheduler scheduler "
                            f"stepped once per step, got a {type(scheduler).__name__}"
                            f"{' (it steps on a metric)' if on_metric else ''}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise WorkloadError(f"{spec}: lr_scheduler(optimizer) must schedule the optimizer it is given")
    return scheduler


def _step(scheduler) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_STEPPED)
        scheduler.step()


def _copy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` over the same parameters (a schedule on it leaves the original's values)."""
    return copy.deepcopy(optimizer, {id(p): p for g in optimizer.param_groups for p in g["params"]})


def probe(workload: Workload) -> tuple[torch.optim.Optimizer, set[tuple[int, str]]]:
    """The workload's optimizer as its scheduler leaves it when built (a copy: OneCycleLR sets the first rate and
    momentum there, and the captured update's structure, such as SGD's momentum buffer, follows them), and the
    (param group, ``momentum`` | ``beta1``) entries the scheduler moves: those it sets when built or in its first
    ``_PROBE_STEPS`` steps, or every one when it cycles momentum (``cycle_momentum``)."""
    optimizer = _copy(workload.optimizer)
    before = [{k: group_value(g, k) for k in _MOMENTA if _has(g, k)} for g in optimizer.param_groups]
    scheduler = _build(optimizer, workload.lr_scheduler, workload.spec)
    built = _copy(optimizer)
    moved = set()
    cycling = bool(getattr(scheduler, "cycle_momentum", False))
    for step in range(_PROBE_STEPS + 1):
        if step:
            _step(scheduler)
        for i, g in enumerate(optimizer.param_groups):
            moved |= {(i, k) for k, v in before[i].items() if cycling or group_value(g, k) != v}
    _momenta_on(built, {g for g, k in moved if k == "momentum"}, 0, workload.spec)
    return built, moved


_MOMENTA = SCHEDULABLE[1:]     # momentum, beta1


def _has(group: dict, key: str) -> bool:
    return "betas" in group if key == "beta1" else key in group


def planned_rates(cap: "Captured", steps: int) -> list[dict[str, float]] | None:
    """The learning rates of ``steps`` steps from the start of ``cap``'s schedule (on a copy of its optimizer),
    one dict per step; None without a schedule."""
    w = cap.workload
    if not cap.scheduled:
        return None
    # a copy of the optimizer: the schedule must not move the workload's own rates
    optimizer = _copy(w.optimizer)
    schedule = LrSchedule(optimizer, w.lr_scheduler, cap.scheduled, w.spec)
    out = []
    for _ in range(steps):
        out.append(schedule.rates())
        schedule.advance()
    return out


def set_rates(state: dict[str, torch.Tensor], rates: dict[str, float] | None) -> None:
    """Write ``rates`` into the learning-rate inputs of ``state`` that it holds (in place)."""
    for name, value in (rates or {}).items():
        if name in state:
            state[name].fill_(value)
