"""cProfile of the search's pipeline phase (``search.pipelines.pipeline_candidates``) on a Megatron GPT, the
tp=8 preset (full recomputation) as its only stage plan; prints each priced degree, the phase's seconds, the
best plan, its re-estimate from scratch, and the top functions.

    python benchmarks/pipeline_phase.py LAYERS HIDDEN HEADS GPUS BATCH [PUBLISHED_STRATEGY]
    python benchmarks/pipeline_phase.py 24 12288 96 1024 1536      # 175B-shaped, 24 layers
"""
import sys, time, warnings, cProfile, pstats
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from rhino.capture import capture
from rhino.capture.workload import Workload
from rhino.cost.cluster import parse_cluster
from rhino.cost.estimate import estimate, estimate_strategy
from rhino.search import SearchOptions
from rhino.search.outer import Candidate
from rhino.search.coarsen import build_cones
from rhino.search.space import Space
from rhino.search.outer import candidate_meshes
from rhino.search.pipelines import pipeline_candidates
from rhino.search.stages import stage_cut
from rhino.sharding.presets import StrategySpec, preset_plan
from rhino.sharding.vocab import Recompute
import gpt
layers, hidden, heads, gpus, batch = [int(x) for x in sys.argv[1:6]]
pub = sys.argv[6] if len(sys.argv) > 6 else None
t0 = time.perf_counter()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    graph = capture(Workload(*gpt.megatron(layers, hidden, heads, batch, autocast=True), "examples/gpt.py", "megatron")).graph
print("capture", time.perf_counter() - t0, len(graph.nodes), flush=True)
cluster = parse_cluster(f"{gpus // 8}x8xA100-80G")
opts = SearchOptions(level="O1")
t0 = time.perf_counter()
meshes = candidate_meshes(cluster, opts)
cones = build_cones(graph, Space(graph, meshes[0], opts), opts)
print("cones", time.perf_counter() - t0, len(cones.cones), flush=True)
if pub:
    t0 = time.perf_counter()
    e = estimate_strategy(graph, cluster, pub, stages=stage_cut(capacity=cluster.device.memory_bytes))
    print("published", pub, e.step_seconds, e.fits, time.perf_counter() - t0, flush=True)
plan = preset_plan(graph, StrategySpec(dp=gpus // 8, tp=8)); plan.recompute = "full"
c = Candidate(plan.mesh, Recompute.FULL, plan, None, 0.0)
pr = cProfile.Profile()
t0 = time.perf_counter()
out = []
def say(ev, info): print(round(time.perf_counter() - t0, 1), ev, info, flush=True)
pr.enable()
out = pipeline_candidates(graph, cluster, [c], opts.with_(pipeline_megatron_start=False), cones, time.perf_counter() + 1e9, say)
pr.disable()
print("pipeline phase", time.perf_counter() - t0, flush=True)
best = min(out, key=lambda c: (not c.fits, c.step_seconds))
print("best", best.estimate.mesh, best.estimate.microbatches, best.estimate.step_seconds, flush=True)
t0 = time.perf_counter()
again = estimate(graph, cluster, best.plan)
print("re-estimate", again.step_seconds, again.step_seconds / best.estimate.step_seconds - 1, time.perf_counter() - t0)
pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
