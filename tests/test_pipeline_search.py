"""The default search's pipeline dimension (search/pipelines.py): chosen where faster, priced as
``cost.estimate`` prices the plan from scratch."""
from __future__ import annotations

import importlib.util
import warnings
from dataclasses import replace

from conftest import ROOT
from rhino.capture import capture
from rhino.capture.workload import Workload
from rhino.cost.cluster import make_cluster
from rhino.cost.devices import get_device
from rhino.cost.estimate import estimate
from rhino.search import SearchOptions, search
from rhino.search.pipelines import worth_pipelining


def _megatron_gpt(layers, hidden, heads, batch):
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(Workload(*gpt.megatron(layers, hidden, heads, batch, autocast=True),
                                str(ROOT / "examples" / "gpt.py"), "megatron")).graph


def test_default_search_pipelines_a_memory_bound_multi_node_step_and_prices_it_exactly():
    """A mixed-precision GPT (4 layers, hidden 1024, sequence 2048, batch 8) on 4 nodes of one A100 cut to
    3 GiB, over 10 Gb/s Ethernet: without pipelines only recomputing plans fit; the default rule
    (``pipeline="memory"``) prices pipelines and picks one that is faster than every single-stage plan.
    The search's price equals ``estimate`` of the returned plan re-priced from scratch (1e-9)."""
    g = _megatron_gpt(4, 1024, 16, 8)
    cluster = make_cluster(4, 1, replace(get_device("A100-80G"), memory_bytes=3 * 2**30), "ethernet-10G")
    r = search(g, cluster, SearchOptions(level="O1", time_limit=10))
    single = [c for c in r.candidates if c.estimate is not None and c.estimate.pp == 1 and c.fits]
    assert single and all(c.estimate.recompute != "none" for c in single)
    assert not worth_pipelining(single, SearchOptions(pipeline="auto"), cluster)   # the old default: no pipelines
    e = r.estimate
    assert e.pp > 1 and e.fits and e.step_seconds < min(c.step_seconds for c in single)
    assert r.plan.stages == e.pp and r.plan.microbatches == e.microbatches and r.plan.recompute == e.recompute
    again = estimate(g, cluster, r.plan)
    assert abs(again.step_seconds / e.step_seconds - 1) <= 1e-9
    assert again.memory_bytes == e.memory_bytes and again.node_stage == e.node_stage
