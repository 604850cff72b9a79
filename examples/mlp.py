"""Plain multi-layer perceptron on a synthetic classification task.

A stack of Linear + ReLU layers and a linear classifier, trained on random
Gaussian features whose labels come from a fixed random linear "teacher".

Default size: 32 inputs, 3 hidden layers of 64, 10 classes, batch 32
(~11K parameters). Optimizer: SGD, momentum 0.9 (dampening 0), weight decay 1e-4.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def make_mlp(inputs, hidden, layers, classes):
    dims = [inputs] + [hidden] * layers
    blocks = []
    for cin, cout in zip(dims[:-1], dims[1:]):
        blocks += [nn.Linear(cin, cout), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(dims[-1], classes))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def workload(inputs=32, hidden=64, layers=3, classes=10, batch=32, lr=0.05, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = make_mlp(inputs, hidden, layers, classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, dampening=0, weight_decay=1e-4)

    if device == "meta":
        x = torch.empty(batch, inputs, device="meta")
        y = torch.empty(batch, dtype=torch.long, device="meta")
    else:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, inputs, generator=g)
        teacher = torch.randn(inputs, classes, generator=g)
        x, y = x.to(device), (x @ teacher).argmax(-1).to(device)
    return model, optimizer, loss_fn, (x, y)
