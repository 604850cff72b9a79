"""Learning-rate schedules beside a captured step.

A workload may define ``lr_scheduler(optimizer)`` returning a ``torch.optim.lr_scheduler`` scheduler over its
optimizer. The captured step then reads each param group's learning rate from a float64 0-dim input
(``capture.optim.scheduled_name``); before each step the runner writes the scheduler's current rates into
those inputs (``set_rates``), and after it steps the scheduler (``LrSchedule.advance``), as a PyTorch loop calls
``scheduler.step()`` after ``optimizer.step()``. Only the learning rate may follow a schedule: a scheduler
that changes another hyper-parameter (``OneCycleLR``'s momentum cycling) is refused, since the captured
update holds those as constants.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable

import torch

from .optim import changed_hyperparameter, hyperparameters, scheduled_values
from .trace import Captured
from .workload import WorkloadError

__all__ = ["LrSchedule", "planned_rates", "set_rates"]

# torch warns when a scheduler steps before optimizer.step() (never called here: the step is captured)
_NOT_STEPPED = r"(Detected call of `lr_scheduler\.step\(\)` before|Seems like `optimizer\.step\(\)` has been)"


class LrSchedule:
    """The scheduler ``make(optimizer)`` over ``optimizer`` (the workload's or a copy of it), and the rates it
    gives the learning-rate inputs ``scheduled`` (input name -> param group)."""

    def __init__(self, optimizer: torch.optim.Optimizer, make: Callable, scheduled: dict[str, int],
                 spec: str = "the workload") -> None:
        self.optimizer, self.scheduled, self.spec = optimizer, scheduled, spec
        self._fixed = hyperparameters(optimizer, scheduled=True)
        try:
            self.scheduler = make(optimizer)
        except (TypeError, ValueError, KeyError, AttributeError, RuntimeError) as exc:
            raise WorkloadError(f"{spec}: lr_scheduler(optimizer) failed: {type(exc).__name__}: {exc}") from None
        on_metric = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if on_metric or not isinstance(self.scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise WorkloadError(f"{spec}: lr_scheduler(optimizer) must return a torch.optim.lr_scheduler scheduler "
                                f"stepped once per step, got a {type(self.scheduler).__name__}"
                                f"{' (it steps on a metric)' if on_metric else ''}")
        if getattr(self.scheduler, "optimizer", optimizer) is not optimizer:
            raise WorkloadError(f"{spec}: lr_scheduler(optimizer) must schedule the optimizer it is given")
        self._check()
        self._start = (copy.deepcopy(self.scheduler.state_dict()), [g["lr"] for g in optimizer.param_groups])
        self.steps = 0

    def rates(self) -> dict[str, float]:
        """The learning rate of each scheduled input for the next step."""
        return scheduled_values(self.optimizer, self.scheduled)

    def advance(self) -> None:
        """``scheduler.step()``, after a training step."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_STEPPED)
            self.scheduler.step()
        self.steps += 1
        self._check()

    def rewind(self, steps: int) -> None:
        """The scheduler as after ``steps`` steps from its start (a resumed run), replayed from its start."""
        state, lrs = self._start
        self.scheduler.load_state_dict(copy.deepcopy(state))
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        self.steps = 0
        for _ in range(steps):
            self.advance()

    def _check(self) -> None:
        changed = changed_hyperparameter(self._fixed, self.optimizer)
        if changed:
            raise WorkloadError(f"{self.spec}: the learning-rate scheduler changed the optimizer's {changed}; only "
                                f"the learning rate may follow a schedule (the captured update holds the rest "
                                f"as constants): schedule lr alone (OneCycleLR/CyclicLR: cycle_momentum=False)")


def planned_rates(cap: Captured, steps: int) -> list[dict[str, float]] | None:
    """The learning rates of ``steps`` steps from the start of ``cap``'s schedule (on a copy of its optimizer),
    one dict per step; None without a schedule."""
    w = cap.workload
    if not cap.scheduled:
        return None
    # a copy of the optimizer over the same parameters: the schedule must not move the workload's own rates
    optimizer = copy.deepcopy(w.optimizer, {id(p): p for g in w.optimizer.param_groups for p in g["params"]})
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
