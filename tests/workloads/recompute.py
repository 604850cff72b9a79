"""Workloads for the recomputation tests: the examples built in float64 (GPT and LLaMA pin their dtype),
activation-heavy sizes (where the step's peak sits at the forward/backward crossover), and a model with
dropout (random outputs are never recomputed)."""
import importlib.util
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name):
    spec = importlib.util.spec_from_file_location(f"rhino_recompute_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt():
    return _example("gpt").workload(dtype=torch.float64)


def llama():
    return _example("llama").workload(dtype=torch.float64)


def gpt_activations():
    """GPT with a batch large enough that activations dominate the step's memory."""
    return _example("gpt").workload(layers=2, batch=32, dtype=torch.float64)


def resnet_activations():
    """The ResNet example at batch 16: activations dominate the step's memory."""
    return _example("resnet").workload(batch=16)


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for layer in self.layers:
            x = x + F.dropout(torch.tanh(layer(x)), p=0.25, training=True)
        return self.head(x)


def dropout_mlp():
    torch.manual_seed(0)
    model = DropoutMLP()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x, y: F.cross_entropy(m(x), y), batch


class Im2colNet(nn.Module):
    """A linear layer over ``F.unfold`` columns: its weight's transpose is made before the (opaque) im2col, so
    a recomputation cut can fall between the transpose and the matmul reading it (held-out, session 21)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(3 * 9, 8)
        self.dec = nn.Conv2d(8, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        b, _, h, w = x.shape
        cols = F.unfold(x, 3, padding=1).transpose(1, 2)
        y = self.w(cols).transpose(1, 2).reshape(b, 8, h, w)
        y = F.interpolate(F.avg_pool2d(F.relu(self.bn(y)), 2), scale_factor=2, mode="bilinear", align_corners=False)
        return self.dec(y)


def im2col_net():
    torch.manual_seed(0)
    model = Im2colNet()
    x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), lambda m, x: F.l1_loss(m(x), x), (x,)


class ChunkGRU(nn.Module):
    """A projection chunked into three, a bidirectional GRU (its cells split their gates) and attention pooling:
    full recomputation rewrites a split of which only some chunks are used again."""

    def __init__(self, d=8, h=12, classes=3):
        super().__init__()
        self.proj = nn.Linear(d, 3 * h)
        self.gru = nn.GRU(h, h, batch_first=True, bidirectional=True)
        self.query = nn.Parameter(torch.randn(1, 1, 2 * h) * 0.1)
        self.out = nn.Linear(2 * h, classes)

    def forward(self, x):
        a, b, c = self.proj(x).chunk(3, dim=-1)
        o, _ = self.gru(a + torch.nn.functional.silu(b) * torch.sigmoid(c))
        att = (self.query * o).sum(-1).softmax(-1)
        return self.out((att.unsqueeze(-1) * o).sum(1))


def chunk_gru():
    torch.manual_seed(0)
    model = ChunkGRU()
    x, y = torch.randn(8, 4, 8), torch.randint(0, 3, (8,))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.8), \
        lambda m, a, t: torch.nn.functional.cross_entropy(m(a), t), (x, y)
