"""Hugging Face coverage (docs/benchmarks.md, section "Hugging Face coverage").

For every architecture of tests/hf_workloads.py (tiny configs, random weights, AdamW, no download):

- check: the workload built in float64 is captured and ``rhino check`` runs 2 steps against eager
  PyTorch (tolerance 1e-9);
- ``dp=2,tp=2`` and ``dp=4,zero=3``: 2 sharded training steps in float64, every rank's program run
  in one process in lockstep (collectives simulated), every rank's loss and every rank's shard of
  every parameter and optimizer-state tensor compared with eager PyTorch at 1e-9 (tests/hf_exact.py);
- plan: ``rhino plan`` (search level O1, 60 s limit, presets compared) on ``8xA100-80G`` for the float32
  workload: the mesh, where the plan came from and the predicted step time.

    .venv/bin/python benchmarks/hf_coverage.py --out /tmp/hf.json [--models gpt2,t5]
    .venv/bin/python benchmarks/hf_coverage.py --table /tmp/hf.json      # writes docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

PRESETS = ("dp=2,tp=2", "dp=4,zero=3")
CLUSTER = "8xA100-80G"
COMMAND = ("python benchmarks/hf_coverage.py --time-limit 20 --out /tmp/hf.json && "
           "python benchmarks/hf_coverage.py --table /tmp/hf.json")


def _plan(name: str, level: str, limit: float) -> dict:
    import hf_workloads as hf

    from rhino.capture import Workload, capture
    from rhino.search.planning import plan_workload
    from rhino.cost.cluster import parse_cluster
    m, opt, loss_fn, batch = getattr(hf, name)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Workload(m, opt, loss_fn, tuple(batch), f"tests/hf_workloads.py:{name}", name))
    t0 = time.perf_counter()
    plan, report = plan_workload(cap.graph, parse_cluster(CLUSTER), level=level, time_limit=limit,
                                 workload=f"tests/hf_workloads.py:{name}")
    d = report.to_dict()
    return {"found": True, "mesh": d["mesh"], "source": d["source"], "fits": d["fits"],
            "seconds": round(time.perf_counter() - t0, 1), "step_ms": d["step_seconds"] * 1e3,
            "opaque": cap.opaque_ops}


def measure(name: str, level: str, limit: float) -> dict:
    from hf_exact import capture64, check64, exact_under
    row: dict = {"model": name}
    t0 = time.perf_counter()
    cap = capture64(name)
    c = check64(cap, steps=2)
    row["params"] = sum(p.numel() for p in cap.workload.model.parameters())
    row["check"] = {"ok": c.ok, "max_abs_diff": c.max_abs_diff, "first_mismatch": c.first_mismatch}
    for preset in PRESETS:
        r = exact_under(cap, preset, steps=2)
        row[preset] = {"ok": r.ok, "max_abs_diff": r.max_abs_diff,
                       "first_mismatch": r.first_mismatch, "seconds": round(r.seconds, 1)}
    row["plan"] = _plan(name, level, limit)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def _cell(r: dict) -> str:
    return f"OK {r['max_abs_diff']:.1e}" if r["ok"] else f"**FAIL** {r['max_abs_diff']:.1e}"


def table(rows: list[dict]) -> str:
    import hf_workloads as hf
    out = ["Every architecture of `tests/hf_workloads.py` (tiny configs: hidden 16-64, 2 layers, sequence 16-32,",
           "batch 4, random weights, AdamW, every dropout 0). *check*: `rhino check` of the workload built in",
           "float64, 2 steps, vs eager PyTorch. *dp=2,tp=2* / *dp=4,zero=3*: 2 sharded steps in float64, every",
           "rank's program run in one process in lockstep, every rank's loss and every rank's shard of every",
           "parameter and optimizer-state tensor compared with eager PyTorch (tolerance 1e-9; the cell gives",
           f"the largest absolute difference). *plan*: `rhino plan` on `{CLUSTER}` (O1, 20 s limit, presets",
           "compared) for the float32 workload: mesh, predicted step time.",
           "",
           f"    {COMMAND}",
           "",
           "| model | family | params | check | dp=2,tp=2 | dp=4,zero=3 | plan on 8xA100-80G | predicted step |",
           "|---|---|---:|---|---|---|---|---:|"]
    for r in rows:
        p = r["plan"]
        mesh = "x".join(f"{k}{v}" for k, v in p["mesh"].items()) if p.get("found") else "**none**"
        out.append(f"| {r['model']} | {hf.FAMILIES.get(r['model'], '')} | {r['params']:,} | {_cell(r['check'])} | "
                   f"{_cell(r['dp=2,tp=2'])} | {_cell(r['dp=4,zero=3'])} | {mesh} | {p.get('step_ms', 0):.3f} ms |")
    ok = sum(all(r[k]["ok"] for k in ("check", *PRESETS)) and r["plan"].get("found") for r in rows)
    out += ["", f"{ok} of {len(rows)} models pass every column."]
    fails = [f"- {r['model']} {k}: {r[k]['first_mismatch']}" for r in rows for k in ("check", *PRESETS)
             if not r[k]["ok"]]
    if fails:
        out += ["", "Failures (first mismatch):", *fails]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the measured rows as JSON")
    ap.add_argument("--models", help="comma-separated subset (default: all)")
    ap.add_argument("--level", default="O1")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--table", help="JSON from --out: write the table into docs/benchmarks.md")
    args = ap.parse_args()
    if args.table:
        from rhino.benchmarks_doc import replace_section
        rows = json.loads(Path(args.table).read_text())
        replace_section(ROOT / "docs" / "benchmarks.md", "Hugging Face coverage", table(rows))
        print(table(rows))
        return
    import hf_workloads as hf
    names = args.models.split(",") if args.models else hf.MODELS
    rows = []
    for name in names:
        row = measure(name, args.level, args.time_limit)
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
