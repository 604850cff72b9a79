"""Memory layout of large traces (#14 item 5): ``rhino layout FILE.csv --time-limit 60`` on 60,000-buffer traces.

Traces (MiniMalloc CSV, written to ``--dir``):

- ``gptN``: the training step of a GPT-2 XL-wide GPT with N layers (hidden 1600, 25 heads, sequence 1024,
  AdamW) captured on the meta device, converted by ``memory.from_graph`` with its parameter and optimizer
  state included (live the whole step), buffers in program order (``memory.problem.buffers``).
- ``gpt2xl-xK``: K training steps of GPT-2 XL (``gpt48``) one after another (a longer step): its
  parameter and optimizer state is one buffer live over all K steps, every other buffer repeats per step.
- ``train-S``: a seeded synthetic training step (generator below): parameters and optimizer state live the
  whole step; per layer a forward chain of temporaries and saved activations (freed by the matching
  backward op, in reverse), gradients live from their backward op to the optimizer update, optimizer
  temporaries; sizes log-uniform in 64-byte multiples.
- ``random-S``: a seeded MiniMalloc-style random trace: lifetimes and sizes log-uniform (many short
  buffers, few long ones), starts uniform over the horizon.
- ``wide-S``: a second random shape (held out while the lowest-fit greedy was chosen): sizes uniform in
  64-byte multiples up to 256 KiB, lifetimes exponential (mean 800), starts uniform over 100,000.
- ``lognorm-S`` and ``mixed-S``: two shapes made after the squeaky-wheel search was chosen (held out):
  ``lognorm``: sizes log-normal (median 16 KiB, sigma 2, 64-byte multiples, at most 64 MiB), starts in
  bursts (a burst every ~400 steps, 60 buffers each, starts within 40 steps of it), lifetimes log-normal
  (median 50, sigma 1.5); ``mixed``: 59,900 tiny buffers (64 B to 4 KiB, lifetimes 1-200) and 100 huge
  ones (8-64 MiB, lifetimes 1,000-20,000), starts uniform over 200,000. ``mixed`` was run before
  ``big_first`` was written (it failed at 5.4%), so only ``lognorm`` stayed held out for the whole method;
  ``pow2-S`` was made after everything else (held out): power-of-two sizes from 64 B to 16 MiB (weight
  ``size ** -0.5``), 90% of lifetimes 1-10 and 10% 1,000-50,000, starts uniform over 300,000.
- ``bimodal-S`` (session 11): 85% of sizes 64 B-4 KiB and 15% 512 KiB-4 MiB (64-byte multiples), lifetimes
  heavy-tailed (``20 * Pareto(1.2)``, at most 50,000), starts uniform over 200,000. ``bimodal-1`` was held out
  from session 10's method and missed (1.471%); ``SplitOptions.revisit`` was then made from it, so only
  ``bimodal-2`` and ``wide-2`` (``wide``'s generator, another seed) are held out from that.
- ``nested-S``, ``lifo-S``, ``aligned-S`` (session 13, shapes that broke the planner's limits rather than its
  quality): fully nested lifetimes; a random stack of allocations (nested lifetimes of random depth);
  ``random-S`` with 4 KiB alignments on 30% of the buffers (alignments that do not divide the sizes).
- Session 14 (skyline passes): ``wide-1`` and ``wide-3`` chose the skyline search's settings and ``wide-2`` its
  ``focus_share``; ``wide-4``, ``wide-5``, ``random-13`` and ``random-14`` were made after every choice (held out).
- Session 15, four shapes made before the skyline start (held out from it; ``skyline_switch`` was chosen on
  ``wide-4`` and the public ``pangu_2.6B``): ``dense-S``: starts uniform over only 2,000 steps, lifetimes
  exponential (mean 50), sizes uniform 64 B-64 KiB (~1,500 live buffers: a long plateau of near-peak
  load); ``serving-S``: inference steps of 96 short activations (1-6 steps, up to 512 KiB) and 4 KV-cache
  buffers (64 KiB-4 MiB, 2,000-40,000 steps); ``pipeline-S``: 120 micro-batches of 40 layers, each layer
  saving 6 activations for ~4,000 steps beside 6 temporaries; ``hugebytes-S``: sizes uniform up to 10^11
  bytes (no 64-byte multiple), lifetimes up to 3,000 over 10^6 steps (~90-115 buffers live); ``sparse-S``:
  times in steps of 10^7, a third of the buffers empty or of 1-17 bytes, alignments 1 B-4 KiB per buffer.
- Session 16: big-first's heavy buffers were chosen on ``serving-1`` and ``serving-3`` (the squeaky wheel
  before the exact search) and window repair on ``hugebytes-1``; ``serving-2``, ``hugebytes-2`` and
  ``hugebytes-3`` were made after those choices (held out).
- Session 17, shapes with repeated sizes: ``onesize-S`` (every buffer 1 MiB, lifetimes exponential, mean
  800, over 100,000 steps: interval colouring, whose optimum is the bound), ``onesizeplus-S`` (the same with
  one buffer in 100 of 8-32 MiB living 2,000-20,000 steps), ``classes-S`` (sizes 4 KiB, 64 KiB, 1 MiB or
  4 MiB), ``paged-S`` (a paged KV cache: requests of 2-40 blocks of 2 MiB allocated as they grow and freed
  at their end, beside one- to three-step activations up to 2 MiB), ``nsaligned-S`` (nanosecond times
  from 10^15, sizes 1 B-1 MiB, 512-byte alignments that do not divide them). ``onesize`` chose the
  ``SIZE_START`` pass (``memory.layout``); the others were made before that change.
- Session 18: ``bursts-S`` (20 bursts of 3,000 ``wide``-like buffers, 20,000 steps apart: 20 independent
  mid-sized leaves), made after the peak split (``memory.layout_peak``) was chosen (held out).
- Session 19, 1,000,000 buffers: ``long-S``, ``densehuge-S``, ``randomhuge-S`` (generators below); ``long-5``
  and ``densehuge-7`` chose ``SplitOptions.fine_cuts_above`` and ``ImproveOptions.huge``, ``randomhuge-7``
  was made after them (held out).
- Session 42, seven shapes made after every choice (held out): ``realloc-S`` (arrays reallocated at twice their
  size), ``clique-S`` (every buffer live at one step), ``sawtooth-S`` (phases that free at their end),
  ``robson-S`` (rounds that free every other buffer, then allocate larger ones), ``dups-S`` (identical buffers in
  groups), ``steps-S`` (one-step buffers: 200 cliques), ``moe-S`` (a mixture-of-experts training step); their
  generators below.
- Session 43, three shapes made after the core window (``memory.layout_core``) was chosen on ``realloc-2`` and
  ``realloc-6`` (held out): ``grow15-S`` (lists growing by 1.5x, copies overlapping 1-3 steps), ``spikes-S``
  (workspace bursts of 256 KiB-8 MiB buffers over a steady background), ``kvcopy-S`` (serving with contiguous KV
  caches copied into twice their size as they grow); their generators below.

Each trace runs the CLI in a child process (``--json``); its peak RSS is the child's ``ru_maxrss``
(``os.wait4``). Writes the section "Memory layout: large traces" of docs/benchmarks.md.

    .venv/bin/python benchmarks/layout_scale.py [--traces random-1,random-2,wide-1,lognorm-1,mixed-1,train-1,train-2,gpt2xl-x11] [--time-limit 60]
    git show 892d58c:src/rhino/memory/layout_greedy.py > /tmp/old_greedy.py && \
        .venv/bin/python benchmarks/layout_scale.py --pass-speed random-1 --old-greedy /tmp/old_greedy.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import time
from typing import Callable
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TITLE = "Memory layout: large traces"


def write_csv(path: Path, rows: list[tuple[int, ...]]) -> None:
    """Rows ``(lower, upper, size)``, or ``(lower, upper, size, alignment)`` for every row."""
    with path.open("w") as f:
        f.write("id,lower,upper,size" + (",alignment" if rows and len(rows[0]) == 4 else "") + "\n")
        f.writelines(",".join(map(str, (i, *r))) + "\n" for i, r in enumerate(rows))


def _size(rng: random.Random, lo_exp: float, hi_exp: float) -> int:
    return 64 * max(1, int(2 ** rng.uniform(lo_exp, hi_exp)) // 64)


def synthetic_training(seed: int, layers: int = 900, width: int = 20) -> list[tuple[int, int, int]]:
    """Buffers of a synthetic training step (see the module docstring); ~68 buffers per layer."""
    rng = random.Random(seed)
    rows: list[list[int]] = []
    t = 0
    saved: list[list[int]] = []  # per layer: indices of its saved activations (upper set in backward)
    params = [[_size(rng, 12, 24) for _ in range(rng.randint(2, 6))] for _ in range(layers)]
    for layer in range(layers):
        keep = []
        for _ in range(width):
            t += 1
            if rng.random() < 0.4:
                keep.append(len(rows))
                rows.append([t, -1, _size(rng, 14, 24)])
            else:
                rows.append([t, t + rng.randint(1, 3), _size(rng, 12, 24)])
        saved.append(keep)
    grads = []
    for layer in reversed(range(layers)):
        for _ in range(width):
            t += 1
            rows.append([t, t + rng.randint(1, 4), _size(rng, 12, 24)])
        for i in saved[layer]:
            rows[i][1] = t + rng.randint(0, 2)
        for sz in params[layer]:
            grads.append(len(rows))
            rows.append([t, -1, sz])
    for g in grads:  # the optimizer: temporaries, then the gradient is freed
        for _ in range(3):
            t += 1
            rows.append([t, t + 2, rows[g][2]])
        rows[g][1] = t + 1
    end = t + 4
    rows += [[0, end, sz] for p in params for sz in p for _ in range(3)]  # weights, Adam's m and v
    return [(lo, up, sz) for lo, up, sz in rows]


def synthetic_random(seed: int, n: int = 60_000, horizon: int = 200_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        lo = rng.randrange(horizon)
        rows.append((lo, lo + max(1, int(2 ** rng.uniform(0, 14))), _size(rng, 6, 22)))
    return rows


def uniform_exponential(rng: random.Random, n: int, horizon: int, mean: float,
                        units: int) -> list[tuple[int, int, int]]:
    """``n`` buffers: starts uniform over ``horizon``, lifetimes ``1 +`` exponential (``mean``), sizes
    uniform in 64-byte multiples up to ``64 * units`` (the ``wide``, ``dense``, ``long`` shapes)."""
    rows = []
    for _ in range(n):
        lo = rng.randrange(horizon)
        rows.append((lo, lo + 1 + int(rng.expovariate(1 / mean)), 64 * rng.randint(1, units)))
    return rows


def synthetic_wide(seed: int, n: int = 60_000, horizon: int = 100_000) -> list[tuple[int, int, int]]:
    return uniform_exponential(random.Random(seed), n, horizon, 800, 4096)


def synthetic_lognorm(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    rows, t = [], 0
    while len(rows) < n:
        t += 1 + int(rng.expovariate(1 / 400))
        for _ in range(min(60, n - len(rows))):
            lo = t + rng.randrange(40)
            size = 64 * max(1, min(2 ** 20, int(rng.lognormvariate(math.log(16384), 2)) // 64))
            rows.append((lo, lo + 1 + int(rng.lognormvariate(math.log(50), 1.5)), size))
    return rows


def synthetic_mixed(seed: int, n: int = 60_000, huge: int = 100, horizon: int = 200_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        lo = rng.randrange(horizon)
        if k < huge:
            rows.append((lo, lo + rng.randint(1000, 20000), 2 ** 20 * rng.randint(8, 64)))
        else:
            rows.append((lo, lo + rng.randint(1, 200), 64 * rng.randint(1, 64)))
    return rows


def synthetic_pow2(seed: int, n: int = 60_000, horizon: int = 300_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    sizes = [2 ** k for k in range(6, 25)]
    weights = [z ** -0.5 for z in sizes]
    rows = []
    for z in rng.choices(sizes, weights, k=n):
        lo = rng.randrange(horizon)
        rows.append((lo, lo + (rng.randint(1, 10) if rng.random() < 0.9 else rng.randint(1000, 50000)), z))
    return rows


def synthetic_bimodal(seed: int, n: int = 60_000, horizon: int = 200_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        lo = rng.randrange(horizon)
        size = 64 * (rng.randint(1, 64) if rng.random() < 0.85 else rng.randint(8192, 65536))
        rows.append((lo, lo + min(50_000, int(20 * rng.paretovariate(1.2))), size))
    return rows


def synthetic_dense(seed: int, n: int = 60_000, horizon: int = 2_000) -> list[tuple[int, int, int]]:
    return uniform_exponential(random.Random(seed + 100), n, horizon, 50, 1024)


def synthetic_serving(seed: int, steps: int = 600) -> list[tuple[int, int, int]]:
    rng = random.Random(seed + 104)
    rows, t = [], 0
    for _ in range(steps):
        rows += [(t, t + rng.randint(2_000, 40_000), 1 << rng.randint(16, 22)) for _ in range(4)]
        for _ in range(96):
            rows.append((t, t + rng.randint(1, 6), 64 * rng.randint(1, 8192)))
            t += 1
    return rows


def synthetic_pipeline(seed: int, micro: int = 120, layers: int = 40) -> list[tuple[int, int, int]]:
    rng = random.Random(seed + 105)
    rows, t = [], 0
    for _ in range(micro):
        for _ in range(layers):
            for _ in range(6):
                rows.append((t, t + 4_000 + rng.randrange(800), 64 * rng.randint(512, 8192)))
                rows.append((t, t + rng.randint(1, 4), 64 * rng.randint(64, 8192)))
            t += 2
        t += 200
    return rows


def synthetic_hugebytes(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed + 102)
    rows = []
    for _ in range(n):
        lo = rng.randrange(10 ** 6)
        rows.append((lo, lo + 1 + rng.randrange(3_000), rng.randint(1, 10 ** 11)))
    return rows


def synthetic_sparse(seed: int, n: int = 60_000) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed + 103)
    rows = []
    for _ in range(n):
        lo, size = rng.randrange(200_000), rng.choice([0, 0, 1, 3, 17, 4096, 65536, 1 << 20, 3 << 20])
        rows.append((lo * 10 ** 7, (lo + 1 + int(rng.expovariate(1 / 600))) * 10 ** 7, size,
                     rng.choice([1, 8, 64, 256, 4096])))
    return rows


def synthetic_nested(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """Every buffer inside the one before (``[i, 2n - i)``): the deepest nesting a trace can have."""
    rng = random.Random(seed)
    return [(i, 2 * n - i, _size(rng, 6, 22)) for i in range(n)]


def synthetic_lifo(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """A stack of allocations: each step allocates one buffer after freeing the newest live one with
    probability 1/2 (nested lifetimes of random depth, as a caching allocator sees a program's temporaries)."""
    rng = random.Random(seed)
    rows, stack = [], []
    for t in range(1, n + 1):
        if stack and rng.random() < 0.5:
            rows[stack.pop()][1] = t
        stack.append(len(rows))
        rows.append([t, -1, _size(rng, 6, 22)])
    for i in stack:
        rows[i][1] = n + 1
    return [(lo, up, sz) for lo, up, sz in rows]


def synthetic_aligned(seed: int) -> list[tuple[int, int, int, int]]:
    """``random-SEED`` with an alignment per buffer: 4 KiB for 30% of them (not dividing most sizes), else 64."""
    rng = random.Random(seed + 1000)
    return [(lo, up, sz, 4096 if rng.random() < 0.3 else 64) for lo, up, sz in synthetic_random(seed)]


def captured_gpt(layers: int) -> list[tuple[int, int, int]]:
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt

    from rhino.capture import capture
    from rhino.capture.workload import Workload
    from rhino.memory.from_graph import problem_from_graph
    from rhino.memory.problem import buffers

    w = gpt.workload(layers=layers, hidden=1600, heads=25, seq=1024, batch=1, vocab=50257, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(Workload(*w, "examples/gpt.py", "workload"))
    prob, _ = problem_from_graph(cap.graph, include_state=True)
    return [(b.lower, b.upper, b.size) for b in buffers(prob, range(len(prob.ops)))]


def repeat_steps(rows: list[tuple[int, int, int]], k: int) -> list[tuple[int, int, int]]:
    """``k`` steps of a trace in a row; buffers live over the whole step (state) stay live over all."""
    end = max(up for _, up, _ in rows)
    state = [(0, k * end, sz) for lo, up, sz in rows if lo == 0 and up == end]
    step = [r for r in rows if not (r[0] == 0 and r[1] == end)]
    return state + [(lo + i * end, up + i * end, sz) for i in range(k) for lo, up, sz in step]


def synthetic_onesize(seed: int, n: int = 60_000, horizon: int = 100_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed + 300)
    rows = []
    for _ in range(n):
        lo = rng.randrange(horizon)
        rows.append((lo, lo + 1 + int(rng.expovariate(1 / 800)), 1 << 20))
    return rows


def synthetic_onesizeplus(seed: int, n: int = 60_000, horizon: int = 100_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed + 310)
    rows = []
    for k in range(n):
        lo = rng.randrange(horizon)
        if k % 100 == 0:
            rows.append((lo, lo + rng.randint(2_000, 20_000), rng.choice([8, 16, 32]) << 20))
        else:
            rows.append((lo, lo + 1 + int(rng.expovariate(1 / 600)), 1 << 20))
    return rows


def synthetic_classes(seed: int, n: int = 60_000, horizon: int = 100_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed + 320)
    rows = []
    for _ in range(n):
        lo = rng.randrange(horizon)
        rows.append((lo, lo + 1 + int(rng.expovariate(1 / 500)), rng.choice([4096, 65536, 1 << 20, 1 << 22])))
    return rows


def synthetic_paged(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    rng = random.Random(seed + 330)
    rows, t = [], 0
    while len(rows) < n:
        t += 1
        if rng.random() < 0.3:  # a request: its KV blocks of 2 MiB, allocated as it grows, freed at its end
            blocks, end = rng.randint(2, 40), t + rng.randint(200, 3_000)
            rows += [(t + (k * (end - t)) // (blocks + 1), end, 2 << 20) for k in range(blocks)]
        rows += [(t, t + rng.randint(1, 3), 64 * rng.randint(1, 32_768)) for _ in range(rng.randint(0, 2))]
    return rows[:n]


def synthetic_nsaligned(seed: int, n: int = 60_000) -> list[tuple[int, int, int, int]]:
    rng = random.Random(seed + 340)
    rows = []
    for _ in range(n):
        lo = 10 ** 15 + rng.randrange(10 ** 12)
        rows.append((lo, lo + rng.randint(1, 10 ** 10), rng.randint(1, 1 << 20), 512))
    return rows


def synthetic_bursts(seed: int, bursts: int = 20, per: int = 3_000) -> list[tuple[int, int, int]]:
    """``wide``'s buffers in separate bursts: ``per`` buffers with starts uniform over 5,000 steps, lifetimes
    exponential (mean 800, at most 15,000), sizes uniform in 64-byte multiples up to 256 KiB; bursts 20,000
    steps apart, so the trace splits into ``bursts`` independent mid-sized leaves."""
    rng = random.Random(seed + 108)
    rows = []
    for k in range(bursts):
        for _ in range(per):
            lo = 20_000 * k + rng.randrange(5_000)
            rows.append((lo, lo + 1 + min(14_999, int(rng.expovariate(1 / 800))), 64 * rng.randint(1, 4096)))
    return rows


def synthetic_long(seed: int, n: int = 1_000_000) -> list[tuple[int, int, int]]:
    """A long trace (session 19): starts uniform over 2,000,000 steps, lifetimes exponential (mean 300),
    sizes uniform in 64-byte multiples up to 256 KiB (~150 live buffers; the load dips to under half
    its peak)."""
    return uniform_exponential(random.Random(seed), n, 2_000_000, 300, 4096)


def synthetic_densehuge(seed: int, n: int = 1_000_000) -> list[tuple[int, int, int]]:
    """``dense`` at 1,000,000 buffers (session 19): starts uniform over 40,000 steps, lifetimes
    exponential (mean 50), sizes uniform in 64-byte multiples up to 64 KiB (~1,250 live: one leaf)."""
    return uniform_exponential(random.Random(seed), n, 40_000, 50, 1024)


def synthetic_randomhuge(seed: int, n: int = 1_000_000) -> list[tuple[int, int, int]]:
    """``random`` at 1,000,000 buffers (session 19): starts uniform over 3,000,000 steps, lifetimes
    log-uniform 1-16,384, sizes log-uniform 64 B-4 MiB (not 64-byte multiples)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        lo = rng.randrange(3_000_000)
        rows.append((lo, lo + max(1, int(2 ** rng.uniform(0, 14))), int(2 ** rng.uniform(6, 22))))
    return rows


def _growing(rng: random.Random, n: int, gap: int, unit: int, first: int, copies: tuple[int, int],
             life: tuple[int, int], grow: Callable[[int], int], overlap: Callable[[random.Random], int] = lambda r: 1,
             last: tuple[int, int] | None = None,
             extra: Callable[[random.Random, int], list] | None = None) -> list[tuple[int, int, int]]:
    """Arrays that grow by copying (``realloc``, ``grow15``, ``kvcopy``): one every 1-``gap`` steps, ``unit`` times
    1-``first`` bytes, copied ``copies`` times into ``grow(size)`` bytes after ``life`` steps each, the copies
    overlapping ``overlap`` steps; the last copy lives ``last`` steps (default: 1 to ``life``'s most);
    ``extra(rng, t)``: rows beside each array."""
    rows, t = [], 0
    while len(rows) < n:
        t += rng.randint(1, gap)
        size, at = unit * rng.randint(1, first), t
        for _ in range(rng.randint(*copies)):
            nxt = at + rng.randint(*life)
            rows.append((at, nxt + overlap(rng), size))
            at, size = nxt, grow(size)
        rows.append((at, at + rng.randint(*(last or (1, life[1]))), size))
        if extra is not None:
            rows += extra(rng, t)
    return rows[:n]


def synthetic_realloc(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """Growing arrays (session 42): each starts at 64 B-4 KiB and is reallocated 1-12 times at twice its size,
    the new buffer allocated one step before the old one is freed, each copy living 5-400 steps."""
    return _growing(random.Random(seed + 500), n, 20, 64, 64, (1, 12), (5, 400), lambda s: 2 * s)


def synthetic_clique(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """Every buffer live at one step (session 42): sizes uniform 1 B-1 MiB."""
    rng = random.Random(seed + 510)
    return [(0, 1, rng.randint(1, 1 << 20)) for _ in range(n)]


def synthetic_sawtooth(seed: int, n: int = 60_000, phases: int = 12) -> list[tuple[int, int, int]]:
    """Phases that allocate for 8,000 steps and free at their end (session 42): 70% of a phase's buffers live
    to 1-1,500 steps past its end (into the next phase), the rest 1-50 steps; sizes 64 B-512 KiB."""
    rng = random.Random(seed + 520)
    rows, per = [], n // phases
    for p in range(phases):
        for k in range(per):
            lo = 10_000 * p + (k * 8_000) // per
            up = 10_000 * p + 8_000 + rng.randint(1, 1_500) if rng.random() < 0.7 else lo + rng.randint(1, 50)
            rows.append((lo, up, 64 * rng.randint(1, 8192)))
    return rows


def synthetic_robson(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """A fragmenting pattern (session 42, after Robson's worst cases for allocators): rounds of 400 buffers of
    one size (64 B-4 KiB) where every other one lives 3,000-6,000 steps and the others 1-30, then 100 buffers
    four times that size living 50-2,000 steps."""
    rng = random.Random(seed + 530)
    rows, t = [], 0
    while len(rows) < n:
        size = 64 << rng.randint(0, 6)
        for k in range(400):
            rows.append((t, t + (rng.randint(3_000, 6_000) if k % 2 else rng.randint(1, 30)), size))
            t += 1
        t += 10
        for _ in range(100):
            rows.append((t, t + rng.randint(50, 2_000), 4 * size))
            t += 1
    return rows[:n]


def synthetic_dups(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """Identical buffers in groups of 1-30 (session 42): starts uniform over 100,000 steps, lifetimes
    exponential (mean 500), sizes 64 B-128 KiB."""
    rng = random.Random(seed + 540)
    rows = []
    while len(rows) < n:
        lo = rng.randrange(100_000)
        up = lo + 1 + int(rng.expovariate(1 / 500))
        rows += [(lo, up, 64 * rng.randint(1, 2048))] * rng.randint(1, 30)
    return rows[:n]


def synthetic_steps(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """Buffers of one step each over 200 steps (session 42: 200 cliques of ~300), sizes 1 B-4 MiB."""
    rng = random.Random(seed + 550)
    return [(lo, lo + 1, rng.randint(1, 1 << 22)) for lo in (rng.randrange(200) for _ in range(n))]


def synthetic_moe(seed: int, layers: int = 96, experts: int = 64) -> list[tuple[int, int, int]]:
    """A mixture-of-experts training step (session 42): per layer and expert a saved activation of a log-normal
    size (median ~70 KiB) freed in the backward pass, and three temporaries (median ~190 KiB) of 1-4 steps."""
    rng = random.Random(seed + 560)
    rows: list[list[int]] = []
    saved, t = [], 0
    lognormal = lambda mu, sigma: 64 * max(1, int(rng.lognormvariate(mu, sigma)))  # noqa: E731
    for _ in range(layers):
        keep = []
        for _ in range(experts):
            t += 1
            keep.append(len(rows))
            rows.append([t, -1, lognormal(7, 1.2)])
            rows += [[t, t + rng.randint(1, 3), lognormal(8, 1.0)] for _ in range(3)]
        saved.append(keep)
    for layer in reversed(range(layers)):
        for _ in range(experts):
            t += 1
            rows += [[t, t + rng.randint(1, 4), lognormal(8, 1.0)] for _ in range(3)]
        for i in saved[layer]:
            rows[i][1] = t + 1
    return [(lo, up, sz) for lo, up, sz in rows]


def synthetic_grow15(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """Lists growing by 1.5x (session 43): each starts at 64 B-16 KiB and is reallocated 1-15 times at 1.5 times
    its size (64-byte multiples), the copies overlapping for 1-3 steps, each living 20-600 steps."""
    return _growing(random.Random(seed + 570), n, 30, 64, 256, (1, 15), (20, 600), lambda s: 64 * max(1, 3 * s // 128),
                    overlap=lambda r: r.randint(1, 3))


def synthetic_spikes(seed: int, n: int = 60_000, spikes: int = 30) -> list[tuple[int, int, int]]:
    """Workspace bursts over a steady background (session 43): ``spikes`` times 20-60 buffers of 256 KiB-8 MiB
    living 1-30 steps from one step, beside buffers with starts uniform over 100,000 steps, lifetimes
    exponential (mean 300) and sizes 64 B-64 KiB."""
    rng = random.Random(seed + 580)
    rows = []
    for _ in range(spikes):
        t = rng.randrange(100_000)
        rows += [(t, t + rng.randint(1, 30), 64 * rng.randint(4096, 131072)) for _ in range(rng.randint(20, 60))]
    rows += uniform_exponential(rng, n - len(rows), 100_000, 300, 1024)
    return rows


def synthetic_kvcopy(seed: int, n: int = 60_000) -> list[tuple[int, int, int]]:
    """Serving with contiguous KV caches (session 43): a request every 1-40 steps whose cache starts at 64 KiB-1 MiB
    and is copied into one twice its size 0-5 times, every 50-500 steps (the copies overlapping one step), beside
    four activations per request of 16 KiB-2 MiB living 1-3 steps."""
    return _growing(random.Random(seed + 590), n, 40, 65536, 16, (0, 5), (50, 500), lambda s: 2 * s, last=(50, 500),
                    extra=lambda r, t: [(t + k, t + k + r.randint(1, 3), 16384 * r.randint(1, 128)) for k in range(4)])


_MORE = {"nested": synthetic_nested, "lifo": synthetic_lifo, "aligned": synthetic_aligned, "dense": synthetic_dense,
         "serving": synthetic_serving, "pipeline": synthetic_pipeline, "hugebytes": synthetic_hugebytes,
         "sparse": synthetic_sparse, "onesize": synthetic_onesize, "onesizeplus": synthetic_onesizeplus,
         "classes": synthetic_classes, "paged": synthetic_paged, "nsaligned": synthetic_nsaligned,
         "bursts": synthetic_bursts, "long": synthetic_long, "densehuge": synthetic_densehuge,
         "randomhuge": synthetic_randomhuge, "realloc": synthetic_realloc, "clique": synthetic_clique,
         "sawtooth": synthetic_sawtooth, "robson": synthetic_robson, "dups": synthetic_dups, "steps": synthetic_steps,
         "moe": synthetic_moe, "grow15": synthetic_grow15, "spikes": synthetic_spikes, "kvcopy": synthetic_kvcopy}


def make_trace(name: str, out: Path) -> Path:
    path = out / f"{name}.csv"
    if path.exists():
        return path
    kind, _, arg = name.partition("-")
    if kind == "gpt2xl":
        rows = repeat_steps(captured_gpt(48), int(arg.lstrip("x")))
    elif kind.startswith("gpt"):
        rows = captured_gpt(int(kind[3:]))
    elif kind == "train":
        rows = synthetic_training(int(arg))
    elif kind == "random":
        rows = synthetic_random(int(arg))
    elif kind == "wide":
        rows = synthetic_wide(int(arg))
    elif kind == "lognorm":
        rows = synthetic_lognorm(int(arg))
    elif kind == "mixed":
        rows = synthetic_mixed(int(arg))
    elif kind == "pow2":
        rows = synthetic_pow2(int(arg))
    elif kind == "bimodal":
        rows = synthetic_bimodal(int(arg))
    elif kind in _MORE:
        rows = _MORE[kind](int(arg))
    else:
        raise ValueError(f"unknown trace {name!r}: expected gptN, gpt2xl-xK, train-SEED, random-SEED, wide-SEED, "
                         f"lognorm-SEED, mixed-SEED, pow2-SEED, bimodal-SEED or "
                         f"{', '.join(k + '-SEED' for k in _MORE)}")
    write_csv(path, rows)
    return path


def run_cli(path: Path, time_limit: float) -> dict:
    cmd = [sys.executable, "-m", "rhino.cli.main", "layout", str(path), "--time-limit", str(time_limit), "--json"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.stdout.close()
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        raise RuntimeError(f"{' '.join(cmd)} exited {os.waitstatus_to_exitcode(status)}")
    row = json.loads(out)
    row.update(wall=time.perf_counter() - t0, rss_gb=usage.ru_maxrss / 1e6,
               load=Path("/proc/loadavg").read_text().split()[0])
    return row


def pass_speed(path: Path, old: str | None, repeats: int = 2) -> None:
    """One lowest-fit pass by size on a trace, timed (wall and CPU) in this process; with ``old`` (a
    ``layout_greedy.py`` of another commit, e.g. from ``git show``) that module's pass beside it."""
    import importlib.util

    import numpy as np

    from rhino.memory import layout_greedy
    from rhino.memory.layout_io import read_buffers
    bufs = read_buffers(path)
    lo, up, sz = (np.array([getattr(b, f) for b in bufs], np.int64) for f in ("lower", "upper", "size"))
    al, fl = np.ones(len(bufs), np.int64), np.zeros(len(bufs), np.int64)
    order = np.lexsort((lo, lo - up, -sz))
    impls = [("this tree", layout_greedy.place_in_order)]
    if old:
        spec = importlib.util.spec_from_file_location(Path(old).stem, old)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # numba's cache finds the module by name
        spec.loader.exec_module(mod)
        impls.insert(0, (old, mod.place_in_order))
    for _, f in impls:  # compile first
        f(lo[:64], up[:64], sz[:64], al[:64], fl[:64], np.arange(64), lowest=True)
    for _ in range(repeats):
        for name, f in impls:
            t, c = time.perf_counter(), time.process_time()
            off = f(lo, up, sz, al, fl, order, lowest=True)
            print(f"{name}: wall {time.perf_counter() - t:.2f} s, cpu {time.process_time() - c:.2f} s, height "
                  f"{int((off + sz).max())}, load {Path('/proc/loadavg').read_text().split()[0]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="random-1,random-2,wide-1,lognorm-1,mixed-1,train-1,train-2,gpt2xl-x11")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--dir", default="/tmp/rhino-layout-scale")
    ap.add_argument("--doc", default=str(ROOT / "docs/benchmarks.md"))
    ap.add_argument("--pass-speed", metavar="TRACE", help="only time one lowest-fit pass on TRACE (e.g. random-1)")
    ap.add_argument("--old-greedy", metavar="PATH", help="with --pass-speed: a layout_greedy.py to time beside")
    args = ap.parse_args(argv)
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.pass_speed:
        pass_speed(make_trace(args.pass_speed, out), args.old_greedy)
        return 0
    rows = []
    for name in args.traces.split(","):
        r = run_cli(make_trace(name, out), args.time_limit)
        r["gap"] = 100 * (r["height"] / r["lower_bound"] - 1) if r["lower_bound"] else 0.0
        rows.append((name, r))
        print(f"{name}: {r['buffers']} buffers, bound {r['lower_bound']}, height {r['height']} "
              f"(gap {r['gap']:.3f}%), {r['seconds']:.1f}s (wall {r['wall']:.1f}s), rss {r['rss_gb']:.2f} GB, "
              f"{r['solver']}, valid {r['valid']}, load {r['load']}", flush=True)
    from rhino.benchmarks_doc import replace_section
    body = [f"Command: `.venv/bin/python benchmarks/layout_scale.py --traces {args.traces} --time-limit "
            f"{args.time_limit:g}`, which runs `rhino layout TRACE.csv --time-limit {args.time_limit:g} --json` "
            f"per trace in a child process (traces: see the script's docstring; `gptN` is captured, the others "
            f"are seeded synthetic traces). Seconds: the solver's, as the CLI reports them (after start-up and "
            f"reading the CSV; `--time-limit` covers the whole run); wall: the "
            f"child process from start to exit; peak RSS: the child's `ru_maxrss`. Gap: height over the "
            f"max-load lower bound. Every layout is checked by `validate_layout`. Machine: {os.cpu_count()} "
            f"cores, shared (1-minute load average at each row). Date: {datetime.date.today().isoformat()}.", "",
            "| trace | buffers | lower bound (B) | height (B) | gap % | seconds | wall s | peak RSS GB | solver "
            "| valid | load |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for name, r in rows:
        body.append(f"| {name} | {r['buffers']:,} | {r['lower_bound']:,} | {r['height']:,} | {r['gap']:.3f} | "
                    f"{r['seconds']:.1f} | {r['wall']:.1f} | {r['rss_gb']:.2f} | {r['solver']} | {r['valid']} | "
                    f"{r['load']} |")
    replace_section(args.doc, TITLE, "\n".join(body))
    return 0 if all(r["valid"] for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
