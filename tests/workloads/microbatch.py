"""The examples at a batch of 8 (16 where a preset splits the batch over both axes), in the default dtype, so that 4 micro-batches of 2 rows split over dp=2 (gradient accumulation
tests and the docs/benchmarks.md table: ``rhino run tests/workloads/microbatch.py:gpt --nproc 2 --strategy
dp=2,microbatches=4 --dtype float64``)."""
import importlib.util
from pathlib import Path

import torch

_EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"_mb_example_{name}", _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp():
    return _example("mlp").workload(batch=8)


def gpt():
    return _example("gpt").workload(batch=8, dtype=torch.get_default_dtype())


def llama():
    return _example("llama").workload(batch=8, dtype=torch.get_default_dtype())


def bert():  # 16: its dp=2,tp=2 preset splits attention's batch over both axes
    return _example("bert").workload(batch=16)


def bert_one_layer():  # batch 8, one encoder layer (the one-row micro-batch test)
    return _example("bert").workload(layers=1)


def resnet():
    return _example("resnet").workload(batch=8)


def unet():
    return _example("unet").workload(batch=8)


def unet_batchnorm():
    return _example("unet").batchnorm(batch=8)


def moe():  # 16: its dp=2,tp=2 preset splits the routed tokens over both axes
    return _example("moe").workload(batch=16)
