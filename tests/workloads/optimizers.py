"""Small workloads for the optimizers mirrored after the first four: NAdam, RAdam, Adamax, Adadelta.

Each sets non-default options (weight decay, maximize, decoupled weight decay, NAdam's momentum decay) and
two param groups; widths divide by 4 so that tp=2 and dp=4,zero=3 shard every parameter evenly.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 4)
        if unused:                             # in the optimizer, never gets a gradient (its step stays 0)
            self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _groups(net, lr: float, weight_decay: float):
    """Weights with weight decay at the optimizer's lr; biases and norm without, at a third of it."""
    decayed = [net.a.weight, net.b.weight]
    rest = [p for p in net.parameters() if all(p is not q for q in decayed)]
    return [{"params": decayed, "weight_decay": weight_decay},
            {"params": rest, "lr": lr / 3, "weight_decay": 0.0}]


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


def _negated(m, x, y):                         # with maximize=True: ascend the negated loss
    return -F.cross_entropy(m(x), y)


def nadam():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.NAdam(_groups(net, 1e-2, 0.05), lr=1e-2, betas=(0.85, 0.99), momentum_decay=6e-3)
    return net, opt, _loss, _data()


def nadam_decoupled_maximize():
    """Decoupled weight decay, maximize, and an unused parameter (its step and mu_product stay put)."""
    torch.manual_seed(0)
    net = Net(unused=True)
    opt = torch.optim.NAdam(_groups(net, 2e-2, 0.1), lr=2e-2, decoupled_weight_decay=True, maximize=True)
    return net, opt, _negated, _data()


def nadam_stepped():
    """Two eager steps before capture: step and mu_product are read from the optimizer's state."""
    net, opt, loss_fn, batch = nadam()
    for _ in range(2):
        loss_fn(net, *batch).backward()
        opt.step()
        opt.zero_grad()
    return net, opt, loss_fn, batch


def radam():
    """Default betas (0.9, 0.999): steps 1-5 take the unrectified branch, later ones the rectified one."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.RAdam(_groups(net, 1e-2, 0.05), lr=1e-2, maximize=True)
    return net, opt, _negated, _data()


def radam_decoupled():
    torch.manual_seed(0)
    net = Net(unused=True)
    opt = torch.optim.RAdam(_groups(net, 1e-2, 0.1), lr=1e-2, betas=(0.8, 0.99), eps=1e-6,
                            decoupled_weight_decay=True)
    return net, opt, _loss, _data()


def adamax():
    torch.manual_seed(0)
    net = Net(unused=True)
    opt = torch.optim.Adamax(_groups(net, 2e-2, 0.05), lr=2e-2, betas=(0.8, 0.95), eps=1e-6, maximize=True)
    return net, opt, _negated, _data()


def adadelta():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adadelta(_groups(net, 0.5, 0.05), lr=0.5, rho=0.8, eps=1e-5)
    return net, opt, _loss, _data()


def adadelta_maximize():
    torch.manual_seed(0)
    net = Net(unused=True)
    opt = torch.optim.Adadelta(_groups(net, 1.0, 0.01), maximize=True)
    return net, opt, _negated, _data()
