"""A wide MLP whose fp32 parameters + Adam state are large (tests/test_large_model.py).

``workload()``: 24 square layers of width 4096 (403M parameters: 1.6 GB of fp32 parameters, 4.8 GB with
Adam's two moments), a 16-way classifier, batch 8. ``medium()``, ``small()``: the same at smaller widths.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def workload(width=4096, layers=24, classes=16, batch=8):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(width, classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width)
    y = torch.randint(classes, (batch,))
    return model, optimizer, loss_fn, (x, y)


def small():
    return workload(width=256, layers=3)


def medium():
    return workload(width=1024, layers=13)
