"""The expert baseline: the grid of presets (``sharding.presets``) a person would try on a cluster,
each priced by ``cost.estimate.estimate_strategy`` -- what the searched plan is compared with.

Grid: tensor parallelism ``tp`` over the divisors of the devices per node (Megatron keeps it inside a
node), data parallelism over the rest; with ``tp = 1`` also ZeRO stages 1 and 3; with ``tp > 1`` also
sequence parallelism, and with it ZeRO-1 over ``dp`` (Megatron-LM's distributed optimizer beside tensor and
sequence parallelism). When none of these fits, the same grid with full recomputation.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.cluster import Cluster
from ..cost.estimate import Estimate, estimate_strategy
from ..ir.graph import Graph
from ..sharding.plan import PlanError
from ..sharding.vocab import Recompute

__all__ = ["PresetScore", "preset_grid", "score_presets", "best_preset"]


@dataclass
class PresetScore:
    strategy: str
    estimate: Estimate | None
    error: str = ""

    @property
    def fits(self) -> bool:
        return self.estimate is not None and self.estimate.fits

    @property
    def step_seconds(self) -> float:
        return self.estimate.step_seconds if self.estimate is not None else float("inf")


def preset_grid(cluster: Cluster, recompute: Recompute | str = Recompute.NONE) -> list[str]:
    """Strategy strings of the grid (module docstring)."""
    world, dpn = cluster.world, cluster.devices_per_node
    out = []
    suffix = f",recompute={Recompute(recompute)}" if recompute != Recompute.NONE else ""
    for tp in [t for t in range(1, dpn + 1) if dpn % t == 0 and world % t == 0]:
        dp = world // tp
        if tp == 1:
            out.append(f"dp={dp}{suffix}")
            if dp > 1:
                out += [f"dp={dp},zero=1{suffix}", f"dp={dp},zero=3{suffix}"]
        else:
            out += [f"dp={dp},tp={tp}{suffix}", f"dp={dp},tp={tp},sp=on{suffix}"]
            if dp > 1:
                out.append(f"dp={dp},tp={tp},sp=on,zero=1{suffix}")
    return out


def score_presets(graph: Graph, cluster: Cluster, progress=None) -> list[PresetScore]:
    """Every preset of the grid, priced; presets the graph cannot take keep the reason."""
    say = progress or (lambda event, info: None)
    scores = []
    for recompute in (Recompute.NONE, Recompute.FULL):
        for s in preset_grid(cluster, recompute):
            say("preset", {"strategy": s})
            try:
                scores.append(PresetScore(s, estimate_strategy(graph, cluster, s)))
            except (PlanError, ValueError) as exc:
                scores.append(PresetScore(s, None, str(exc)))
        if any(p.fits for p in scores):
            break
    return scores


def best_preset(scores: list[PresetScore]) -> PresetScore | None:
    """The fastest preset that fits, else the one with the smallest memory peak."""
    fitting = [p for p in scores if p.fits]
    if fitting:
        return min(fitting, key=lambda p: p.step_seconds)
    scored = [p for p in scores if p.estimate is not None]
    return min(scored, key=lambda p: p.estimate.memory_bytes["peak"]) if scored else None
