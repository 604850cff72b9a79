"""Plan search quality and speed (docs/benchmarks.md, section "Plan search").

Quality: for every example (at a GPU-sized configuration, on the meta device) and the clusters
8xA100-80G, 2x8xA100-80G and 8x8xH100: the best expert preset of the grid (``search.experts``), the O2
plan and the O1 plan, each priced by ``cost.estimate`` (the searched plans as searched: no preset
fallback). Targets: O2 <= best preset; O1 <= 1.1 x O2.

Speed: the search time (capture excluded) of a LLaMA-7B-shaped model on 8x8xA100-80G at O1 and O2,
and of a GPT-3 175B-shaped model on 1024 A100s at O1.

    .venv/bin/python benchmarks/search_quality.py quality --out /tmp/quality.json
    .venv/bin/python benchmarks/search_quality.py speed --out /tmp/speed.json
    .venv/bin/python benchmarks/search_quality.py table /tmp/quality.json /tmp/speed.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "examples"))

#: GPU-sized configurations of the examples (workload keyword arguments; batch divisible by 64).
CONFIGS = {
    "mlp": dict(inputs=1024, hidden=4096, layers=4, batch=1024),
    "gpt": dict(layers=12, hidden=768, heads=12, seq=1024, batch=64, vocab=50304),
    "llama": dict(layers=16, hidden=2048, heads=16, seq=2048, batch=64, vocab=32000),
    "bert": dict(layers=12, hidden=768, heads=12, seq=512, batch=64, vocab=30522),
    "resnet": dict(width=64, image=64, batch=512),
    "unet": dict(width=64, image=128, batch=64),
    "moe": dict(layers=4, hidden=1024, heads=16, experts=8, inner=4096, seq=512, batch=64, vocab=32000),
}
CLUSTERS = ["8xA100-80G", "2x8xA100-80G", "8x8xH100"]


def _capture(name: str, kwargs: dict):
    import importlib

    from rhino.capture import Workload, capture
    mod = importlib.import_module(name)
    model, opt, loss_fn, batch = mod.workload(device="meta", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(Workload(model, opt, loss_fn, tuple(batch), f"examples/{name}.py", name)).graph


def _search(graph, cluster, level: str, limit: float) -> dict:
    from rhino.search import NoPlanFits, SearchOptions, search
    t0 = time.perf_counter()
    try:
        r = search(graph, cluster, SearchOptions(level=level, time_limit=limit))
    except NoPlanFits as exc:
        return {"fits": False, "error": str(exc), "seconds": time.perf_counter() - t0}
    return {"fits": True, "step_seconds": r.estimate.step_seconds, "seconds": r.search_seconds,
            "mesh": dict(zip(r.plan.mesh.names, r.plan.mesh.sizes)), "recompute": r.best.recompute,
            "peak_bytes": r.estimate.memory_bytes["peak"], "status": r.best.status.text()}


def quality(args) -> list[dict]:
    from rhino.cost.cluster import parse_cluster
    from rhino.search.experts import best_preset, score_presets
    rows = []
    for name in args.examples:
        graph = _capture(name, CONFIGS[name])
        params = sum(graph.types[i.value].numel for i in graph.inputs if i.role.value == "param")
        for text in args.clusters:
            cluster = parse_cluster(text)
            best = best_preset(score_presets(graph, cluster))
            o2 = _search(graph, cluster, "O2", args.time_limit)
            o1 = _search(graph, cluster, "O1", args.time_limit)
            row = {"example": name, "config": CONFIGS[name], "params": params, "nodes": len(graph.nodes),
                   "cluster": text, "preset": None if best is None else
                   {"strategy": best.strategy, "step_seconds": best.step_seconds, "fits": best.fits},
                   "O2": o2, "O1": o1}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def speed(args) -> list[dict]:
    from rhino.cost.cluster import parse_cluster
    from rhino.ir.graph import Graph
    cases = [("llama_7b", "examples/llama.py:llama_7b", "8x8xA100-80G", "O1"),
             ("llama_7b", "examples/llama.py:llama_7b", "8x8xA100-80G", "O2"),
             ("gpt3_175b", "examples/gpt.py:gpt3_175b", "128x8xA100-80G", "O1")]
    graphs: dict[str, Graph] = {}
    rows = []
    for label, spec, cluster, level in cases:
        if label not in graphs:
            from rhino.capture import capture, load_workload
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                graphs[label] = capture(load_workload(str(ROOT / spec))).graph
            print(f"captured {label}: {len(graphs[label].nodes)} nodes in {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
        load = os.getloadavg()[0]
        r = _search(graphs[label], parse_cluster(cluster), level, args.time_limit)
        row = {"model": label, "nodes": len(graphs[label].nodes), "cluster": cluster, "level": level,
               "load_before": load, "load_after": os.getloadavg()[0], **r}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:,.2f}"


def table(args) -> None:
    quality_rows = json.loads(Path(args.quality).read_text())
    print("| example | params | cluster | best preset | preset ms | O2 ms (mesh) | O2 / preset | O2 s "
          "| O1 ms | O1 / O2 | O1 s |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in quality_rows:
        p, o2, o1 = r["preset"], r["O2"], r["O1"]
        pre = p["step_seconds"] if p and p["fits"] else None
        s2 = o2.get("step_seconds")
        s1 = o1.get("step_seconds")
        mesh = "x".join(str(v) for v in o2.get("mesh", {}).values())
        ratio2 = f"**{s2 / pre:.3f}**" if s2 and pre else "-"
        ratio1 = f"**{s1 / s2:.3f}**" if s1 and s2 else "-"
        print(f"| {r['example']} | {r['params'] / 1e6:,.1f}M | {r['cluster']} | {p['strategy'] if p else '-'} | "
              f"{_ms(pre)} | {_ms(s2)} ({mesh}) | {ratio2} | {o2['seconds']:.1f} | {_ms(s1)} | {ratio1} | "
              f"{o1['seconds']:.1f} |")
    if args.speed:
        print()
        print("| model | nodes | cluster | level | search s | step ms | mesh | load avg (before/after) |")
        print("|---|---:|---|---|---:|---:|---|---|")
        for r in json.loads(Path(args.speed).read_text()):
            mesh = "x".join(str(v) for v in r.get("mesh", {}).values())
            print(f"| {r['model']} | {r['nodes']:,} | {r['cluster']} | {r['level']} | {r['seconds']:.1f} | "
                  f"{_ms(r.get('step_seconds'))} | {mesh} | {r['load_before']:.1f} / {r['load_after']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--examples", nargs="*", default=list(CONFIGS))
    q.add_argument("--clusters", nargs="*", default=CLUSTERS)
    q.add_argument("--time-limit", type=float, default=60.0)
    q.add_argument("--out", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--time-limit", type=float, default=60.0)
    s.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("quality")
    t.add_argument("speed", nargs="?")
    args = ap.parse_args()
    if args.what == "table":
        table(args)
        return
    rows = quality(args) if args.what == "quality" else speed(args)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
