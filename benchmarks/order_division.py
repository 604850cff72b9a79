"""Operator ordering with flat windows vs ROAM's tree-based task division, side by side in one run.

For every (model, batch) row (``benchmarks/roam_models.py``: the ROAM models at batch 1 and 32 and
GPT-2 XL at batch 1, 2 and 4, ROAM's tables), capture the training step on the meta device and convert it as
``benchmarks/roam.py`` does, then order its ops with ``order_ops(level="O2")`` twice under the same time
limit (by default a fifth of ROAM's published solve time, as in ``benchmarks/roam.py``, but at least
``--min-time-limit`` seconds):
``OrderOptions(division="flat")`` (windows around the peak step) and ``division="tree"``
(``memory/order_tree.py``). Reported per row: the peak of live bytes and the seconds of each, why each
stopped, the order lower bound (``IndexedProblem.lower_bound``) and, as evidence about the gap to it, a
second bound at the loss step (:func:`loss_pair_bound`).

    .venv/bin/python benchmarks/order_division.py [--models efficientnet] [--batches 32] [--time-limit 20]
        [--min-time-limit 10] [--cache DIR] [--out results.json] [--resume results.json]
        [--docs docs/benchmarks.md] [--notes notes.md]
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import roam  # noqa: E402
import roam_models  # noqa: E402

SECTION = "## Memory planning: tree vs flat task division"
ROWS = [(m, b) for m in roam_models.MODELS for b in roam_models.BATCHES[m]]


def load_problem(name: str, batch: int, cache: Path | None):
    """The row's ``MemProblem`` (captured, or read from ``cache`` when it holds it) and the capture seconds."""
    from rhino.memory.problem import MemProblem

    path = cache / f"{name}_{batch}.json" if cache else None
    if path is not None and path.exists():
        return MemProblem.from_dict(json.loads(path.read_text())), 0.0
    from rhino.capture import capture
    from rhino.capture.workload import Workload
    from rhino.memory.from_graph import problem_from_graph

    t0 = time.perf_counter()
    model, opt, loss_fn, data = roam_models.build(name, batch, "meta")
    func = f"{name.replace('-', '_').lower()}_{batch}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Workload(model, opt, loss_fn, data, "benchmarks/roam_models.py", func))
    problem, _ = problem_from_graph(cap.graph, name=f"{name} b{batch}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(problem.to_dict()))
    return problem, time.perf_counter() - t0


def loss_pair_bound(g) -> int:
    """Bytes live at the LOSS op's step in every order (a bound for this report, not the planner's).

    ``must_live`` at the loss counts the tensors made by its ancestors and read by its descendants. Add,
    for each op ``u`` that is neither (e.g. a forward ``clone`` kept for the backward) whose outputs are
    all read, and only by descendants of the loss, and which reads exactly one tensor ``X`` made by an
    ancestor (or a graph input) that no descendant of the loss reads and that is not kept:
    ``min(bytes of u's outputs, size of X)``. If ``u`` runs before the loss its outputs are live at the
    loss step (their readers come later); if after, ``X`` is (``u`` reads it later). Each ``X`` is used
    once, so the added tensors are distinct and not counted by ``must_live``.
    """
    if g.loss < 0:
        return 0
    anc = g.ancestors(g.loss)
    desc = [False] * g.n
    stack = [g.loss]
    while stack:
        for s in g.succs[stack.pop()]:
            if not desc[s]:
                desc[s] = True
                stack.append(s)
    total = g.must_live([g.loss])[0]
    used: set[int] = set()
    for u in range(g.n):
        if u == g.loss or anc[u] or desc[u] or not g.op_out[u]:
            continue
        if any(not g.cons[j] or g.keep[j] or not all(desc[c] for c in g.cons[j]) for j in g.op_out[u]):
            continue
        early = [j for j in g.op_in[u] if g.prod[j] < 0 or anc[g.prod[j]]]
        if len(early) != 1 or len(g.op_in[u]) != 1:
            continue
        x = early[0]
        if x in used or g.keep[x] or any(desc[c] for c in g.cons[x]):
            continue
        used.add(x)
        total += min(g.out_bytes[u], g.size[x])
    return total


def run_row(name: str, batch: int, time_limit: float, cache: Path | None) -> dict:
    from rhino.memory.order import OrderOptions, order_ops
    from rhino.memory.order_graph import IndexedProblem
    from rhino.memory.simulate import check_order, replay

    problem, capture_s = load_problem(name, batch, cache)
    g = IndexedProblem(problem)
    row = {"model": name, "batch": batch, "ops": len(problem.ops), "capture_seconds": capture_s,
           "program": replay(problem, problem.op_ids()).peak, "lower_bound": g.lower_bound(),
           "loss_pair_bound": loss_pair_bound(g), "time_limit": time_limit}
    for div in ("flat", "tree"):
        r = order_ops(problem, "O2", OrderOptions(division=div), time_limit=time_limit)
        check_order(problem, r.order)
        peak = replay(problem, r.order).peak
        assert peak == r.peak, f"{div}: the order's replayed peak {peak} differs from the reported {r.peak}"
        row[div] = {"peak": r.peak, "seconds": r.seconds, "stopped": r.stopped, "solves": r.windows,
                    "improved": r.improved, "source": r.source, "heuristic": min(r.candidates.values())}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | ops | limit s | program order | best heuristic | **flat** peak | flat s | flat stop | "
             "**tree** peak | tree s | tree stop | tree / flat | order lower bound | loss-step bound |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        f, t = r["flat"], r["tree"]
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['ops']:,} | {r['time_limit']:.1f} | {r['program']:,} | "
            f"{f['heuristic']:,} | "
            f"**{f['peak']:,}** | {f['seconds']:.1f} | {f['stopped']} ({f['solves']}) | **{t['peak']:,}** | "
            f"{t['seconds']:.1f} | {t['stopped']} ({t['solves']}) | {t['peak'] / f['peak']:.4f} | "
            f"{r['lower_bound']:,} | {max(r['lower_bound'], r['loss_pair_bound']):,} |")
    return "\n".join(lines)


def write_docs(path: Path, rows: list[dict], command: str, notes: str) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    body = f"{SECTION}\n\n```\n{command}\n```\n\n{notes}\n\n{table(rows)}\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    after = re.compile(rf"^{re.escape(roam.SECTION)}\n.*?(?=^## )", re.S | re.M)  # right after the ROAM table
    if pattern.search(text):
        text = pattern.sub(lambda _: body + "\n", text, count=1)
    elif after.search(text):
        text = after.sub(lambda mt: mt.group(0) + body + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=roam_models.MODELS)
    ap.add_argument("--batches", nargs="+", type=int)
    ap.add_argument("--time-limit", type=float,
                    help="seconds per order search, each division (default: ROAM's solve time / 5, as roam.py)")
    ap.add_argument("--min-time-limit", type=float, default=10.0,
                    help="floor of the default time limit (a fifth of ROAM's time leaves no search on small rows)")
    ap.add_argument("--resume", type=Path, help="keep the rows already in this JSON file (from --out)")
    ap.add_argument("--cache", type=Path, help="directory of captured problems (read, or written after capture)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON (updated as it runs)")
    ap.add_argument("--docs", type=Path, help="write the section into this markdown file")
    ap.add_argument("--notes", type=Path, help="markdown notes to put above the table")
    args = ap.parse_args(argv)
    rows = [(m, b) for m, b in ROWS
            if (not args.models or m in args.models) and (not args.batches or b in args.batches)]
    published = roam.roam_published()
    old = json.loads(args.resume.read_text()) if args.resume and args.resume.exists() else []
    kept = {(r["model"], r["batch"]): r for r in old}
    out: list[dict] = []
    for name, batch in rows:
        if (name, batch) in kept:
            out.append(kept[(name, batch)])
            continue
        roam_limit = published.get((name, batch), {}).get("roam_seconds", 300.0) / roam.TIME_FRACTION
        limit = args.time_limit or max(args.min_time_limit, roam_limit)
        print(f"{name} batch {batch}: time limit {limit:.1f} s ...", file=sys.stderr, flush=True)
        r = run_row(name, batch, limit, args.cache)
        print(f"{name} b{batch}: flat {r['flat']['peak']:,} B in {r['flat']['seconds']:.1f} s, tree "
              f"{r['tree']['peak']:,} B in {r['tree']['seconds']:.1f} s", flush=True)
        out.append(r)
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))
    print(table(out))
    if args.docs:
        shown = list(argv if argv is not None else sys.argv[1:])
        for flag in ("--notes", "--cache", "--out", "--resume"):  # local file names: not part of the command to rerun
            while flag in shown:
                i = shown.index(flag)
                del shown[i:i + 2]
        cmd = "\n".join(["# machine: " + platform.platform(),
                         ".venv/bin/python benchmarks/order_division.py " + " ".join(shown)])
        write_docs(args.docs, out, cmd, args.notes.read_text().strip() if args.notes else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
