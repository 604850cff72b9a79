"""Snapshot of Rhino's deterministic outputs, to check that a refactor changes no number.

    python benchmarks/snapshot.py --out FILE    write the snapshot (run from the repository root)
    python benchmarks/snapshot.py --compare FILE    recompute and list every value that differs

Runs the CLI in-process with --json: `rhino estimate` (every example x strategy on two clusters),
`rhino memory --level O1` (every example), `rhino plan --level O1` (every example on 8xA100-80G).
`rhino plan` entries depend on the search's time budgets (descent rounds are cut by wall-clock deadlines,
so machine load changes them): they are reported separately, under "plan (time-dependent)"; the estimate
and memory entries are exact (two runs of unchanged main agree on all of them). A full run takes ~5-10 min
under load; use --only EXAMPLE... to check a subset.
Timings (keys containing 'seconds', '_s', 'time' of the solver, 'elapsed') are dropped.
"""
import argparse, contextlib, io, json, math, sys

EXAMPLES = ["mlp", "gpt", "llama", "bert", "resnet", "unet", "moe"]
CLUSTERS = {"cpu:4": ["dp=4", "dp=4,zero=3", "tp=4", "dp=2,tp=2", "dp=2,tp=2,sp=on", "dp=4,microbatches=4",
                       "dp=4,recompute=full", "dp=4,zero=2", "dp=2,tp=2,microbatches=4,recompute=full"],
            "8xA100-80G": ["dp=8", "dp=8,zero=3", "tp=8", "dp=2,tp=4", "dp=4,tp=2,sp=on", "dp=8,microbatches=4",
                           "dp=8,recompute=selective", "dp=8,zero=1"]}
DROP = ("elapsed", "wall", "solve_time", "time_s", "search_s", "_ms_taken", "took", "progress", "capture_seconds")
DROP_SECONDS = ("memory ", "plan ")  # there "seconds" are measured (solver time); in estimates they are predictions


def _cli(argv):
    from rhino.cli.main import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    text = buf.getvalue()
    try:
        return {"rc": rc, "json": json.loads(text)}
    except json.JSONDecodeError:
        return {"rc": rc, "text": text[-2000:]}


def _clean(x, seconds=False):
    if isinstance(x, dict):
        return {k: _clean(v, seconds) for k, v in x.items()
                if not any(d in k.lower() for d in DROP) and not (seconds and "seconds" in k.lower())}
    if isinstance(x, list):
        return [_clean(v, seconds) for v in x]
    return x


def snapshot(only=None):
    out = {}
    for ex in EXAMPLES:
        if only and ex not in only:
            continue
        f = f"examples/{ex}.py"
        for cl, strats in CLUSTERS.items():
            for s in strats:
                out[f"estimate {ex} {cl} {s}"] = _cli(["estimate", f, "--cluster", cl, "--strategy", s, "--json"])
        out[f"memory {ex}"] = _cli(["memory", f, "--level", "O1", "--time-limit", "30", "--json"])
        out[f"plan {ex}"] = _cli(["plan", f, "--cluster", "8xA100-80G", "--level", "O1", "--time-limit", "60", "--json"])
        print(ex, file=sys.stderr, flush=True)
    return {k: _clean(v, k.startswith(DROP_SECONDS)) for k, v in out.items()}


def diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                yield f"{path}/{k}: only in {'new' if k in b else 'old'}"
            else:
                yield from diff(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from diff(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        if not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12):
            yield f"{path}: {a!r} -> {b!r}"
    elif a != b:
        yield f"{path}: {str(a)[:200]} -> {str(b)[:200]}"


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--compare")
    p.add_argument("--only", nargs="*", help="examples to include")
    a = p.parse_args()
    snap = snapshot(a.only)
    if a.out:
        json.dump(snap, open(a.out, "w"), indent=1, sort_keys=True)
    if a.compare:
        old = json.load(open(a.compare))
        if a.only:
            old = {k: v for k, v in old.items() if k.split()[1] in a.only}
        lines = list(diff(old, snap))
        exact = [l for l in lines if not l.startswith("/plan ")]
        timed = [l for l in lines if l.startswith("/plan ")]
        print("\n".join(exact) if exact else "estimate/memory: no differences")
        if timed:
            print("plan (time-dependent, load changes these):\n  " + "\n  ".join(timed))
        sys.exit(1 if exact else 0)
