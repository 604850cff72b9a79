"""Learning-rate schedules (capture/schedule.py): the captured step reads each param group's rate from an
input that the runners set from the workload's scheduler before every step."""
import json
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import ROOT, eager_losses
from rhino.capture import capture, default_dtype, load_workload
from rhino.capture.schedule import planned_rates
from rhino.capture.trace import CaptureError
from rhino.capture.workload import WorkloadError
from rhino.check import check_captured
from rhino.lower import StepProgram
from rhino.runtime.exact import simulate_plan
from rhino.sharding.presets import parse_strategy, preset_plan

SCHEDULED = str(ROOT / "tests" / "workloads" / "scheduled.py")
EXACT = 1e-12

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5),
    "rmsprop_plain": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda p: torch.optim.RAdam(p, lr=1e-2),
    "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=0.5),
}


def _scheduled(optimizer=None, scheduler=None, func="workload"):
    """The test file's workload in float64, with another optimizer and scheduler where given, captured."""
    with default_dtype(torch.float64), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = load_workload(f"{SCHEDULED}:{func}")
        if optimizer is not None:
            w.optimizer = optimizer(w.model.parameters())
        if scheduler is not None:
            w.lr_scheduler = scheduler
        return capture(w)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_mirrored_optimizer_follows_the_schedule(name):
    """Five steps through the captured program against torch.optim with the scheduler stepped after each; the
    rates change at every step, and the program run at the first step's rates throughout differs."""
    cap = _scheduled(OPTIMIZERS[name])
    rates = [r["opt/group0/lr"] for r in planned_rates(cap, 5)]
    assert len(set(rates)) == 4 and list(cap.scheduled) == ["opt/group0/lr"]   # steps 2 and 3 share the peak
    with default_dtype(torch.float64):     # as built: torch makes NAdam's mu_product in the default dtype
        r = check_captured(cap, steps=5, rtol=EXACT, atol=EXACT)
    assert r.ok, r.first_mismatch
    # the control: without the rates written in, the same program drifts from PyTorch
    state, program = cap.initial_state(), StepProgram(cap.graph)
    state["opt/group0/lr"].fill_(rates[0])
    fixed = [float(program.step(state, cap.workload.batch)) for _ in range(5)]
    assert max(abs(a - b) for a, b in zip(fixed, r.eager_losses)) > 1e-6


def test_param_groups_keep_their_own_rates_under_a_sharded_plan():
    """SGD with two param groups (0.1 and 0.05, both scheduled), four steps of dp=2,tp=2 in lockstep: every
    rank's shards equal single-device training with the scheduler."""
    cap = _scheduled(func="sgd_groups")
    assert sorted(cap.scheduled) == ["opt/group0/lr", "opt/group1/lr"]
    first = planned_rates(cap, 1)[0]
    assert first == {"opt/group0/lr": 0.05, "opt/group1/lr": 0.025}
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,tp=2")), steps=4)
    assert r.ok and r.max_abs_diff <= EXACT, (r.first_mismatch, r.max_abs_diff)


CYCLED = {   # OneCycleLR's default cycle_momentum=True moves SGD's and RMSprop's momentum, the Adam family's beta1
    "sgd": (OPTIMIZERS["sgd"], "momentum"),
    "sgd_without_momentum": (lambda p: torch.optim.SGD(p, lr=0.1), "momentum"),   # built: momentum 0 -> 0.95
    "sgd_dampening": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "momentum"),
    "rmsprop": (OPTIMIZERS["rmsprop"], "momentum"),
    "adam": (OPTIMIZERS["adam"], "beta1"),
    "adamw": (OPTIMIZERS["adamw"], "beta1"),
    "nadam": (OPTIMIZERS["nadam"], "beta1"),
    "radam": (OPTIMIZERS["radam"], "beta1"),
    "adamax": (OPTIMIZERS["adamax"], "beta1"),
}


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)


@pytest.mark.parametrize("name", sorted(CYCLED))
def test_a_cycled_momentum_or_beta1_is_followed_too(name):
    """OneCycleLR with its defaults (cycle_momentum=True): the momentum or beta1 it moves becomes an input
    beside the rate; five steps equal torch.optim with the scheduler, and the program run with that input held
    at its first value differs."""
    optimizer, key = CYCLED[name]
    cap = _scheduled(optimizer, _one_cycle)
    assert sorted(cap.scheduled) == sorted(["opt/group0/lr", f"opt/group0/{key}"])
    planned = planned_rates(cap, 5)
    assert len({r[f"opt/group0/{key}"] for r in planned}) == 5
    with default_dtype(torch.float64):
        r = check_captured(cap, steps=5, rtol=EXACT, atol=EXACT)
    assert r.ok, r.first_mismatch
    state, program = cap.initial_state(), StepProgram(cap.graph)
    held = []
    for rates in planned:
        state["opt/group0/lr"].fill_(rates["opt/group0/lr"])
        state[f"opt/group0/{key}"].fill_(planned[0][f"opt/group0/{key}"])
        held.append(float(program.step(state, cap.workload.batch)))
    assert max(abs(a - b) for a, b in zip(held, r.eager_losses)) > 1e-9


def test_cycled_momenta_of_param_groups_under_a_sharded_plan():
    """CyclicLR (cycle_momentum defaults to True) over SGD's two param groups, four steps of dp=2,tp=2 in
    lockstep: every rank's shards equal single-device training."""
    cap = _scheduled(scheduler=lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, 0.01, 0.1, step_size_up=2),
                     func="sgd_groups")
    assert sorted(cap.scheduled) == ["opt/group0/lr", "opt/group0/momentum", "opt/group1/lr",
                                     "opt/group1/momentum"]
    r, _ = simulate_plan(cap, preset_plan(cap.graph, parse_strategy("dp=2,tp=2")), steps=4)
    assert r.ok and r.max_abs_diff <= EXACT, (r.first_mismatch, r.max_abs_diff)


class _Late(torch.optim.lr_scheduler.LRScheduler):
    """A user-written scheduler: a constant rate, and a momentum it sets from step ``at`` on."""

    def __init__(self, optimizer, at, momentum):
        self.at, self.momentum = at, momentum
        super().__init__(optimizer)

    def get_lr(self):
        if self.last_epoch >= self.at:
            for g in self.optimizer.param_groups:
                g["momentum"] = self.momentum
        return [g["lr"] for g in self.optimizer.param_groups]


def test_momenta_a_schedule_cannot_be_followed_in_are_one_sentence():
    """A momentum moved only after the probe's steps is a constant of the step: refused when it moves; a
    scheduled momentum set to 0 (torch then skips the buffer the step keeps) is refused."""
    sgd = OPTIMIZERS["sgd"]
    cap = _scheduled(sgd, lambda opt: _Late(opt, 4, 0.5))
    assert list(cap.scheduled) == ["opt/group0/lr"]
    with pytest.raises(WorkloadError, match=r"the optimizer's param_groups\[0\]\['momentum'\] changed from "
                                            r"0.9 to 0.5; only the learning rate, and a momentum") as e:
        planned_rates(cap, 5)
    assert "\n" not in str(e.value)
    cap = _scheduled(sgd, lambda opt: _Late(opt, 1, 0.0))
    assert sorted(cap.scheduled) == ["opt/group0/lr", "opt/group0/momentum"]
    with pytest.raises(WorkloadError, match=r"set param_groups\[0\]\['momentum'\] to 0 after 1 steps.*"
                                            r"keep the scheduled momentum above 0"):
        planned_rates(cap, 3)
    with pytest.raises(WorkloadError, match=r"set param_groups\[0\]\['momentum'\] to 0 after 0 steps"):
        _scheduled(sgd, lambda opt: _Late(opt, 0, 0.0))    # 0 when built: the step would have no buffer
    cap = _scheduled(scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10,
                                                                               cycle_momentum=False))
    assert list(cap.scheduled) == ["opt/group0/lr"]
    with default_dtype(torch.float64):
        assert check_captured(cap, steps=3, rtol=EXACT, atol=EXACT).ok


def test_schedules_rhino_cannot_follow_are_one_sentence():
    with pytest.raises(WorkloadError, match="got a ReduceLROnPlateau \\(it steps on a metric\\)"):
        _scheduled(scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))

    class Signs(torch.optim.Optimizer):          # a user-written optimizer: its step() is traced
        def __init__(self, params, lr):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self):
            for g in self.param_groups:
                for p in g["params"]:
                    p.add_(p.grad.sign(), alpha=-g["lr"])
    with pytest.raises(CaptureError, match="a learning-rate schedule needs one of the optimizers Rhino mirrors"):
        _scheduled(lambda p: Signs(p, 0.1))


@pytest.mark.multiprocess
def test_rhino_train_follows_the_schedule_across_a_resume_under_another_plan(tmp_path):
    """``rhino train``: 4 steps under dp=2,zero=3 saved, resumed under tp=2 up to 8; the 8 losses equal the plain
    loop's with the scheduler (the resumed run replays the schedule to step 4: the checkpoint holds no rates)."""
    def train(*args):
        out = subprocess.run([sys.executable, "-m", "rhino.cli.main", "train", SCHEDULED, "--dtype", "float64",
                              "--checkpoint", str(tmp_path / "ck"), "--json", *args],
                             capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)
    first = train("--nproc", "2", "--strategy", "dp=2,zero=3", "--steps", "4", "--log", str(tmp_path / "log.jsonl"))
    second = train("--nproc", "2", "--strategy", "tp=2", "--steps", "8", "--resume")
    assert second["resumed_from_step"] == 4
    got, want = first["losses"] + second["losses"], eager_losses(SCHEDULED, 8)
    assert len(got) == 8
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), (step, a, b)
    # the schedule matters here: the constant-rate loop differs
    with default_dtype(torch.float64):
        w = load_workload(SCHEDULED)
        it, plain = w.batches(), []
        for _ in range(8):
            w.optimizer.zero_grad()
            loss = w.loss_fn(w.model, *next(it))
            loss.backward()
            w.optimizer.step()
            plain.append(loss.item())
    assert max(abs(a - b) for a, b in zip(got, plain)) > 1e-4
    # --log gives each step's rate (one per scheduled param group)
    logged = [json.loads(line)["lr"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    scheduler, rates = w.lr_scheduler(torch.optim.SGD([torch.zeros(1)], lr=1e-2)), []
    for _ in range(4):
        rates.append([scheduler.get_last_lr()[0]])
        with warnings.catch_warnings():       # (torch: the scheduler stepped before optimizer.step())
            warnings.simplefilter("ignore")
            scheduler.step()
    assert logged == rates and len({r[0] for r in rates}) == 3


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_rewound_schedule_gives_each_step_its_cycled_momentum_again(name):
    """A resumed run replays the schedule from its start (``LrSchedule.rewind``): the rate and the cycled
    momentum or beta1 of every step come back, step 0 included (the value the scheduler set when built)."""
    from rhino.capture.schedule import LrSchedule
    cap = _scheduled(CYCLED[name][0], _one_cycle)
    schedule = LrSchedule(cap.workload.optimizer, _one_cycle, cap.scheduled)
    seen = []
    for _ in range(4):
        seen.append(schedule.rates())
        schedule.advance()
    assert len({tuple(r.values()) for r in seen}) == 4
    for k in (3, 0, 2):
        schedule.rewind(k)
        assert schedule.rates() == seen[k]
