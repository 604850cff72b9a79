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


def _penalised(model, x):
    """The output's mean plus a penalty on its gradient with respect to the input (WGAN-GP, R1, PINN residuals)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + g.pow(2).sum(1).mean()


def gradient_penalty():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), _penalised, (torch.randn(8, 6, generator=g),)
