"""When a tensor-parallel redistribution starts: at its reader (before session 32) or when its input exists.

``cost.step.StepOptions.start_after_producer`` prices each redistribution of a computed value (other than
gradient buckets and stored state) as ``lower/overlap.py`` runs it: started right after its producer, waited
for at its first reader. For every example and strategy: the predicted step with the option off and on,
and the change.

    python benchmarks/overlap_start.py [--cluster 8xA100-80G] [--strategies tp=8,,dp=2,tp=4,,dp=4,tp=2,sp=on]
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from rhino.capture import capture, load_workload  # noqa: E402
from rhino.cost.cluster import axis_links, parse_cluster  # noqa: E402
from rhino.cost.step import StepOptions, step_time  # noqa: E402
from rhino.sharding.plan import resolve  # noqa: E402
from rhino.sharding.presets import parse_strategy, preset_plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="8xA100-80G")
    ap.add_argument("--strategies", default="tp=8,,dp=2,tp=4,,dp=4,tp=2,sp=on", help="separated by ',,'")
    args = ap.parse_args()
    cluster = parse_cluster(args.cluster)
    print("| example | strategy | step, start at reader (us) | step, start after producer (us) | change |"
          " exposed comm before -> after (us) |")
    print("|---|---|---:|---:|---:|---:|")
    for path in sorted((ROOT / "examples").glob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = capture(load_workload(str(path))).graph
        for strategy in args.strategies.split(",,"):
            rp = resolve(graph, preset_plan(graph, parse_strategy(strategy)))
            links = axis_links(cluster, rp.plan.mesh)
            old, new = (step_time(rp, cluster.device, links, StepOptions(start_after_producer=on))
                        for on in (False, True))
            print(f"| {path.stem} | {strategy} | {old.step_seconds * 1e6:,.1f} | {new.step_seconds * 1e6:,.1f} | "
                  f"{new.step_seconds / old.step_seconds - 1:+.2%} | {old.exposed_comm_seconds * 1e6:,.1f} -> "
                  f"{new.exposed_comm_seconds * 1e6:,.1f} |")


if __name__ == "__main__":
    main()
