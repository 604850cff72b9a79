"""Runtime: launch, mesh process groups, every redistribution step and failure handling (gloo, CPU).

Process start is slow, so one 4-rank launch (and one 2-rank launch) runs every step check and the
per-category tests read its report. Expected local tensors come from an independent oracle: explicit
index lists built from the definition in ``sharding.placement`` applied to a global tensor that every
rank builds from the same seed. Values are integers stored as float64, so sums are exact.
"""
from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rhino.runtime import (RankFailedError, apply_step, build_groups, gather_tensor, init_from_env, launch,
                           run_from_env, shard_tensor)
from rhino.sharding.mesh import Mesh
from rhino.sharding.placement import Partial, ReduceOp, Replicate, Shard
from rhino.sharding.steps import (AllGather, AllReduce, AllToAll, LocalScale, LocalSlice, ReduceScatter,
                                  ZeroUnlessFirst)

SHAPE = (24, 12)
CATEGORIES = ("all_gather", "local_slice", "reduce_scatter", "all_to_all", "all_reduce", "local_scale",
              "zero_unless_first", "shard", "round_trip", "groups")


# ----------------------------------------------------------------------------- oracle (plain torch)

def contribution(k: int) -> torch.Tensor:
    """Global-shaped tensor number ``k`` (k = -1: the test's global tensor); same on every rank."""
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randint(-50, 50, SHAPE, generator=g).double()


def oracle_local(x: torch.Tensor, sharding: tuple, mesh: Mesh, rank: int) -> torch.Tensor:
    """The local tensor by definition (Partial axes ignored: the caller picks the contribution)."""
    coords = mesh.coords(rank)
    for axis, p in enumerate(sharding):
        if isinstance(p, Shard):
            n, c = mesh.sizes[axis], coords[axis]
            m = x.shape[p.dim] // (p.blocks * n)
            idx = [blk * n * m + c * m + i for blk in range(p.blocks) for i in range(m)]
            x = x.index_select(p.dim, torch.tensor(idx))
    return x


def reduce_all(parts: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    stacked = torch.stack(parts)
    if op is ReduceOp.SUM:
        return stacked.sum(0)
    if op is ReduceOp.AVG:
        return stacked.sum(0) / len(parts)
    return stacked.amax(0) if op is ReduceOp.MAX else stacked.amin(0)


def step_cases(mesh: Mesh, others: list) -> list[tuple]:
    """(category, sharding before, steps, sharding after, partial op on the step's axis or None).

    A step acts on the local tensor along one axis. When a *later* axis shards the same dim, the
    result is a different strided layout (the planner orders such steps inner axis first), so those
    contexts are left to ``nested_cases``, which states the layout they give.
    """
    cases = []
    for a in range(mesh.ndim):
        n = mesh.sizes[a]
        for o, other in enumerate(others if mesh.ndim > 1 else [Replicate()]):
            def sh(p, a=a, other=other):
                s = [other] * mesh.ndim
                s[a] = p
                return tuple(s)

            def ok(*dims, a=a, other=other):
                return not (isinstance(other, Shard) and other.dim in dims and a < mesh.ndim - 1)
            for b in (1, 3):
                for d in (0, 1):
                    if ok(d):
                        cases.append(("all_gather", sh(Shard(d, b)), [AllGather(a, d, b)], sh(Replicate()), None))
                        cases.append(("local_slice", sh(Replicate()), [LocalSlice(a, d, b)], sh(Shard(d, b)), None))
                        for op in ReduceOp:
                            cases.append(("reduce_scatter", sh(Partial(op)), [ReduceScatter(a, op, d, b)],
                                          sh(Shard(d, b)), op))
                    for d2, b2 in ((1 - d, 1), (1 - d, 3), (d, 4 - b)):
                        if ok(d, d2):
                            cases.append(("all_to_all", sh(Shard(d, b)), [AllToAll(a, d, b, d2, b2)],
                                          sh(Shard(d2, b2)), None))
            for op in ReduceOp:
                cases.append(("all_reduce", sh(Partial(op)), [AllReduce(a, op)], sh(Replicate()), op))
            cases.append(("local_scale", sh(Partial(ReduceOp.AVG)),
                          [LocalScale(a, 1 / n), AllReduce(a, ReduceOp.SUM)], sh(Replicate()), ReduceOp.AVG))
            cases.append(("zero_unless_first", sh(Replicate()),
                          [ZeroUnlessFirst(a), AllReduce(a, ReduceOp.SUM)], sh(Replicate()), None))
    return cases + nested_cases(mesh)


def nested_cases(mesh: Mesh) -> list[tuple]:
    """Axis 0 steps while axis 1 shards the same dim with blocks b1 (a multiple of the step's b0):
    gathering axis 0 leaves ``Shard(d, n0 * b1)`` on axis 1, and slicing is its inverse."""
    if mesh.ndim != 2:
        return []
    n0, cases = mesh.sizes[0], []
    for d in (0, 1):
        for b0, b1 in ((1, 1), (1, 3), (3, 3)):
            both, inner = (Shard(d, b0), Shard(d, b1)), (Replicate(), Shard(d, n0 * b1))
            cases.append(("all_gather", both, [AllGather(0, d, b0)], inner, None))
            cases.append(("local_slice", inner, [LocalSlice(0, d, b0)], both, None))
    return cases


def without_partial(sharding: tuple) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in sharding)


# ----------------------------------------------------------------------------- rank programs

def check_steps(mesh: Mesh, rank: int, groups, others: list, report: dict) -> None:
    x = contribution(-1)
    for category, before, steps, after, op in step_cases(mesh, others):
        axis = steps[0].axis
        if op is None:
            local, expected = oracle_local(x, before, mesh, rank), oracle_local(x, after, mesh, rank)
        else:
            parts = [contribution(k) for k in range(mesh.sizes[axis])]
            mine = parts[mesh.coords(rank)[axis]]
            local = oracle_local(mine, without_partial(before), mesh, rank)
            expected = oracle_local(reduce_all(parts, op), after, mesh, rank)
        for native in (True, False):
            out = local
            for step in steps:
                out = apply_step(out, step, mesh, rank, groups, native=native)
            report["counts"][category] = report["counts"].get(category, 0) + 1
            if out.shape != expected.shape or not torch.equal(out, expected):
                report["failures"].append((category, f"mesh {mesh} rank {rank} native={native}: {steps} "
                                           f"{before} -> {after} gave shape {tuple(out.shape)}, "
                                           f"expected {tuple(expected.shape)} or different values"))
            if not local.equal(oracle_local(mine if op else x, without_partial(before), mesh, rank)):
                report["failures"].append((category, f"{steps} modified its input"))


def check_round_trip(mesh: Mesh, rank: int, groups, report: dict) -> None:
    x = contribution(-1)
    choices = [Replicate(), Shard(0), Shard(1, 3), Shard(0, 3), Partial(ReduceOp.SUM), Partial(ReduceOp.AVG),
               Partial(ReduceOp.MAX), Partial(ReduceOp.MIN)]
    shardings = [(p,) for p in choices] if mesh.ndim == 1 else [(p, q) for p in choices for q in choices]
    for sharding in shardings:
        local = shard_tensor(x, sharding, mesh, rank)
        if not any(isinstance(p, Partial) for p in sharding):
            report["counts"]["shard"] = report["counts"].get("shard", 0) + 1
            if not torch.equal(local, oracle_local(x, sharding, mesh, rank)):
                report["failures"].append(("shard", f"mesh {mesh} rank {rank}: shard_tensor {sharding} wrong"))
        back = gather_tensor(local, sharding, mesh, rank, groups)
        report["counts"]["round_trip"] = report["counts"].get("round_trip", 0) + 1
        if not torch.equal(back, x):
            report["failures"].append(("round_trip", f"mesh {mesh} rank {rank}: {sharding} round trip wrong"))


def check_groups(mesh: Mesh, rank: int, groups, report: dict) -> None:
    for axis in range(mesh.ndim):
        expected = next(g for g in mesh.groups(axis) if rank in g)
        got = dist.get_process_group_ranks(groups.group(rank, axis))
        report["counts"]["groups"] = report["counts"].get("groups", 0) + 1
        if tuple(got) != tuple(expected) or groups.ranks(rank, mesh.names[axis]) != tuple(expected):
            report["failures"].append(("groups", f"mesh {mesh} rank {rank} axis {axis}: {got} != {expected}"))


def run_checks(ctx, meshes: list[tuple[Mesh, list]]) -> dict:
    report = {"rank": ctx.rank, "world": ctx.world_size, "device": str(ctx.device), "failures": [],
              "counts": {}}
    for mesh, others in meshes:
        groups = build_groups(mesh)
        check_groups(mesh, ctx.rank, groups, report)
        check_steps(mesh, ctx.rank, groups, others, report)
        check_round_trip(mesh, ctx.rank, groups, report)
    return report


# ----------------------------------------------------------------------------- tests: steps

@pytest.fixture(scope="module")
def four_ranks():
    meshes = [(Mesh(("x",), (4,)), []),
              (Mesh(("dp", "tp"), (2, 2)), [Replicate(), Shard(0), Shard(1, 3), Shard(0, 3)]),
              (Mesh(("a", "b"), (1, 4)), [Replicate(), Shard(0, 3)])]
    start = time.monotonic()
    reports = launch(run_checks, 4, meshes, timeout_s=60)
    return reports, time.monotonic() - start


@pytest.fixture(scope="module")
def two_ranks():
    meshes = [(Mesh(("x",), (2,)), []), (Mesh(("dp", "tp"), (2, 1)), [Replicate(), Shard(1, 3)])]
    return launch(run_checks, 2, meshes, timeout_s=60)


@pytest.mark.parametrize("category", CATEGORIES)
@pytest.mark.multiprocess
def test_four_ranks(four_ranks, category):
    reports, _ = four_ranks
    failures = [msg for rep in reports for cat, msg in rep["failures"] if cat == category]
    assert all(rep["counts"].get(category, 0) > 0 for rep in reports)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("category", CATEGORIES)
@pytest.mark.multiprocess
def test_two_ranks(two_ranks, category):
    failures = [msg for rep in two_ranks for cat, msg in rep["failures"] if cat == category]
    assert all(rep["counts"].get(category, 0) > 0 for rep in two_ranks)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.multiprocess     # its fixtures start the 4- and 2-rank jobs: read here from the multiprocess run's
def test_results_come_back_in_rank_order(four_ranks, two_ranks):
    reports, _ = four_ranks
    assert [(r["rank"], r["world"], r["device"]) for r in reports] == [(i, 4, "cpu") for i in range(4)]
    assert [(r["rank"], r["world"]) for r in two_ranks] == [(0, 2), (1, 2)]


# ----------------------------------------------------------------------------- tests: failures

def raise_on_rank_one(ctx):
    dist.barrier()                          # everyone is up: the timestamp measures detection only
    if ctx.rank == 1:
        raise ValueError(f"boom at {time.time()!r}\nsecond line")
    dist.barrier()                          # the others wait in a collective for rank 1
    return ctx.rank


def raise_everywhere(ctx):
    raise ValueError("the workload is refused\nsecond line")


def exit_on_rank_one(ctx, stamp: str):
    dist.barrier()
    if ctx.rank == 1:
        Path(stamp).write_text(repr(time.time()))
        os._exit(3)
    t = torch.ones(1)
    dist.all_reduce(t)                      # waits for rank 1, which is gone
    return ctx.rank


@pytest.mark.multiprocess
def test_rank_that_raises_is_named():
    with pytest.raises(RankFailedError) as info:
        launch(raise_on_rank_one, 2, timeout_s=15)
    err = info.value
    raised_at = float(re.search(r"boom at ([0-9.]+)", str(err)).group(1))
    assert time.time() - raised_at < 5
    assert err.rank == 1
    assert str(err).startswith("rank 1 failed: ValueError: boom at")
    assert "second line" not in str(err)
    assert "raise_on_rank_one" in err.remote_traceback


@pytest.mark.multiprocess
def test_the_same_error_on_every_rank_is_said_once():
    """A workload every rank refuses alike (a capture refusal in ``rhino train``) is one sentence, not "rank 0
    failed ... (then rank(s) 1 failed too)"."""
    with pytest.raises(RankFailedError) as info:
        launch(raise_everywhere, 2, timeout_s=15)
    assert str(info.value) == "every rank failed with ValueError: the workload is refused"
    assert "raise_everywhere" in info.value.remote_traceback


@pytest.mark.multiprocess
def test_rank_that_dies_is_named(tmp_path):
    stamp = tmp_path / "died_at"
    with pytest.raises(RankFailedError) as info:
        launch(exit_on_rank_one, 2, str(stamp), timeout_s=15)
    assert time.time() - float(stamp.read_text()) < 15
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 exited with code 3")


def stall_rank_zero(ctx):
    if ctx.rank == 0:
        time.sleep(60)                      # alive but never joins: the others must time out
    dist.barrier()
    return ctx.rank


def unpicklable_result(ctx):
    return (lambda: None) if ctx.rank == 1 else ctx.rank


@pytest.mark.multiprocess
def test_collective_timeout_ends_a_stalled_job():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch(stall_rank_zero, 2, timeout_s=3)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and "Timed out" in str(info.value)


@pytest.mark.multiprocess
def test_unpicklable_result_names_the_rank():
    with pytest.raises(RankFailedError, match=r"^rank 1 failed: .*pickle") as info:
        launch(unpicklable_result, 2, timeout_s=15)
    assert info.value.rank == 1


def sum_of_tensors(ctx, tensors):
    return float(sum(t.sum() for t in tensors))


@pytest.mark.multiprocess
def test_arguments_of_hundreds_of_tensors_reach_every_rank():
    """A fork server takes at most ~250 file descriptors per process; tensors shared as descriptors (the
    start method's own pickler) failed with 'too many fds' for a 274-tensor model."""
    tensors = [torch.full((3,), float(i)) for i in range(600)]
    assert launch(sum_of_tensors, 2, tensors, timeout_s=30) == [3.0 * sum(range(600))] * 2


def test_unpicklable_function_is_rejected_before_starting():
    with pytest.raises(ValueError, match="picklable"):
        launch(lambda ctx: None, 2)


# ----------------------------------------------------------------------------- tests: torchrun path

def test_init_from_env_names_missing_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError, match="RANK"):
        init_from_env()


def single_rank_job(ctx):
    mesh = Mesh(("x",), (1,))
    groups = build_groups(mesh)
    x = contribution(-1)
    out = apply_step(x, AllGather(0, 1, 3), mesh, ctx.rank, groups)
    back = gather_tensor(shard_tensor(x, (Shard(0, 3),), mesh, 0), (Shard(0, 3),), mesh, 0, groups)
    return ctx.rank, ctx.world_size, ctx.backend.value, torch.equal(out, x), torch.equal(back, x)


def test_run_from_env_joins_a_one_rank_job(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    expected_backend = "nccl" if torch.cuda.is_available() else "gloo"
    assert run_from_env(single_rank_job, timeout_s=20) == (0, 1, expected_backend, True, True)
    assert not dist.is_initialized()


def transposed_all_reduce(ctx):
    from rhino.runtime.collectives import all_reduce_tensor
    base = torch.arange(12.0).reshape(3, 4) * (ctx.rank + 1)
    grad = base.t()                                   # a transposed view, as a weight gradient often is
    out = all_reduce_tensor(grad, ReduceOp.AVG, dist.group.WORLD, ctx.world_size)
    return out, out.stride(), grad.stride(), out.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr()


@pytest.mark.multiprocess
def test_all_reduce_keeps_the_input_layout():
    """A transposed input comes back transposed (no in-memory transposition), with the right values."""
    for out, out_stride, in_stride, fresh in launch(transposed_all_reduce, 2, timeout_s=30):
        assert torch.equal(out, (torch.arange(12.0).reshape(3, 4) * 1.5).t())
        assert out_stride == in_stride and fresh


def test_alpha_beta_keeps_a_positive_latency_under_noise():
    """The alpha-beta fit of message times: exact on a clean line; where noise on the largest message pulls the
    fitted latency below zero (``rhino profile --nproc 2`` once reported 0.0 s beside another run), the smallest
    message's time less its bytes' share."""
    from rhino.runtime.profile import alpha_beta, fit_line
    sizes = [4096.0, 65536.0, 524288.0, 2097152.0, 8388608.0]
    clean = [20e-6 + s / 1e9 for s in sizes]
    slope, lat = alpha_beta(sizes, clean)
    assert slope == pytest.approx(1e-9) and lat == pytest.approx(20e-6)
    noisy = clean[:-1] + [clean[-1] * 1.2]
    assert fit_line(sizes, noisy)[1] <= 0
    slope, lat = alpha_beta(sizes, noisy)
    assert lat == pytest.approx(noisy[0] - slope * sizes[0]) and lat > 0
    slope, lat = alpha_beta(sizes, [1e-6, 1e-6, 1e-6, 1e-6, 3e-2])  # even the smallest time is all bytes: its time
    assert lat == 1e-6


@pytest.mark.multiprocess
def test_profile_measures_concurrent_ranks(tmp_path):
    """`rhino profile --nproc 2`: both ranks measure compute at once, then all-reduce; the file loads."""
    import json
    import subprocess
    import sys
    from rhino.cost.machine_profile import load_profile
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-m", "rhino.cli.main", "profile", "--nproc", "2", "--json", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["link_ranks"] == 2 and doc["threads"] == max(1, (os.cpu_count() or 1) // 2)
    for key in ("matmul_flops", "memory_bandwidth", "link_bandwidth", "link_latency_s", "launch_overhead_s",
                "p2p_bandwidth", "p2p_message_s"):
        assert doc[key] > 0, key
    assert doc["p2p_latency_s"] >= 0     # a fitted intercept, clamped at 0
    assert doc["thin_gemm_d0"] >= 0 and doc["k0"] >= 0   # least-squares fits, clamped at 0
    assert set(doc["kind_bandwidth"]) == {"elementwise", "norm", "reduction"}
    prof = load_profile(out)
    assert prof.link_ranks == 2 and prof.matmul_flops == doc["matmul_flops"]


def _gloo_threads_after_training(ctx):
    """Train one step (fake-tensor capture, dp groups, the per-rank programs' context), shut down, and
    name the gloo threads still running in this process."""
    from rhino.runtime import shutdown
    from rhino.runtime.trainer import Trainer
    trainer = Trainer(str(Path(__file__).resolve().parents[1] / "examples" / "mlp.py"), strategy="dp=2",
                      dtype=torch.float64)
    trainer.step()
    del trainer
    shutdown()
    names = [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)


@pytest.mark.multiprocess
def test_no_process_group_outlives_shutdown():
    """A group still alive at interpreter exit aborts the process at random (a gloo thread frees a finished
    collective's tensors after Python has finalized): after ``shutdown`` no gloo thread may be left."""
    assert launch(_gloo_threads_after_training, 2) == [[], []]
