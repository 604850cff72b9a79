"""The examples at batch 8 (``FILE:FUNC``, e.g. ``tests/workloads/pipelines.py:bert``), which is also their
default batch since session 11 (it was 4 for bert, gpt, llama, moe and unet): pp=2 with 4 micro-batches and
dp=2 inside a stage splits a batch of 8 into micro-batches of 2 rows, one per rank; at a batch of 4 a
micro-batch would have one row (which dp=2 cannot split, and which sends nn.MultiheadAttention down another
code path, so the step at 1/4 of the batch differs). Kept so that the tests and benchmarks name the batch
they were written for."""
import importlib.util
from pathlib import Path

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"pipelines_example_{name}", _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp():
    return _example("mlp").workload(batch=8)


def gpt():
    return _example("gpt").workload(batch=8)


def bert():
    return _example("bert").workload(batch=8)


def llama():
    return _example("llama").workload(batch=8)


def moe():
    return _example("moe").workload(batch=8)


def resnet():
    return _example("resnet").workload(batch=8)


def unet():
    return _example("unet").workload(batch=8)
