"""batches() from a DataLoader with worker processes over a Dataset class defined in this file (the ranks'
children must unpickle it: tests/test_trainer.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Rows(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(6, generator=g), torch.randint(0, 3, (), generator=g)


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def workload():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = next(iter(DataLoader(Rows(), batch_size=4)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, (x, y)


def batches():
    return iter(DataLoader(Rows(), batch_size=4, num_workers=1))
