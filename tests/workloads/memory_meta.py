"""A workload on the meta device for ``rhino memory``: ~1 GiB of parameters (3 GiB with Adam state) that
planning must never allocate. Few ops, so planning is quick."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


def workload():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(8192, 16384), nn.GELU(), nn.Linear(16384, 8192), nn.LayerNorm(8192),
                          nn.Linear(8192, 10))
    x = torch.empty(64, 8192, device="meta")
    y = torch.empty(64, dtype=torch.long, device="meta")
    return m, torch.optim.Adam(m.parameters(), lr=1e-3), _loss, (x, y)
