"""Small workloads that exercise capture corners: optimizers, state, and op families."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.unused = nn.Linear(3, 3)         # in the optimizer, never gets a gradient
        self.frozen = nn.Linear(16, 16)       # requires_grad=False
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(16))  # not in the optimizer

    def forward(self, x):
        h = torch.relu_(self.a(x))            # an in-place op in user code
        h = self.frozen(h) * self.scale
        return self.b(h)


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _net_groups(net):
    return [{"params": [net.a.weight, net.b.weight], "weight_decay": 0.05},
            {"params": [net.a.bias, net.b.bias, *net.unused.parameters()], "lr": 0.02, "weight_decay": 0.0}]


def _loss(m, x, y):
    return F.cross_entropy(m(x), y)


def sgd_dampening():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(_net_groups(net), lr=0.05, momentum=0.9, dampening=0.3, maximize=False)
    return net, opt, _loss, _data()


def sgd_nesterov_maximize():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(_net_groups(net), lr=0.05, momentum=0.8, nesterov=True, maximize=True)
    return net, opt, lambda m, x, y: -_loss(m, x, y), _data()


def sgd_plain():
    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.SGD(_net_groups(net), lr=0.1), _loss, _data()


def adam_amsgrad():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(_net_groups(net), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, amsgrad=True)
    return net, opt, _loss, _data()


def adamw_stepped():
    """The optimizer has state already (one eager step before capture)."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(_net_groups(net), lr=1e-2, weight_decay=0.1)
    x, y = _data()
    _loss(net, x, y).backward()
    opt.step()
    opt.zero_grad()
    return net, opt, _loss, (x, y)


def sgd_stepped():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(_net_groups(net), lr=0.05, momentum=0.9, dampening=0.5)
    x, y = _data()
    _loss(net, x, y).backward()
    opt.step()
    opt.zero_grad()
    return net, opt, _loss, (x, y)


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, padding=1, stride=2)
        self.dw = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8)
        self.g = nn.Conv2d(8, 8, 1, groups=2, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.gn = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 4, 2, stride=2, output_padding=0)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.c1d = nn.Conv1d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        h = self.gn(self.g(self.dw(h)))
        h = F.max_pool2d(h, 3, stride=1, padding=1, ceil_mode=True) + F.avg_pool2d(h, 3, 1, 1)
        h = self.inorm(self.up(h))
        h = self.c1d(h.flatten(2)).mean(-1)
        return self.head(F.adaptive_avg_pool2d(h[:, :, None, None], 1).flatten(1))


def convs():
    torch.manual_seed(0)
    m = Convs()
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(4, 4, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
    return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3), _loss, batch


class InplaceClamps(nn.Module):
    """In-place ReLU6 after batch norm (MobileNetV2's block) and a hardtanh with other bounds; inputs are
    scaled so that many values sit outside the bounds."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU6(inplace=True)
        self.head = nn.Linear(8 * 8 * 8, 3)

    def forward(self, x):
        h = self.act(self.bn(self.conv(x)) * 4)
        h = nn.functional.hardtanh(h - 3, -1.5, 2.0, inplace=True)
        return self.head(h.flatten(1))


def inplace_clamps():
    torch.manual_seed(0)
    m = InplaceClamps()
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(4, 4, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
    return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), _loss, batch


class Routing(nn.Module):
    """MultiheadAttention, top-k, scatter, gather, index_select, boolean masks, dropout, erfcx (opaque)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16, padding_idx=0)
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.1)
        self.router = nn.Linear(16, 4)
        self.experts = nn.Parameter(torch.randn(4, 16, 16) * 0.1)
        self.out = nn.Linear(16, 20)
        self.drop = nn.Dropout(0.2)

    def forward(self, tokens, pad):
        x = self.emb(tokens)
        a, _ = self.mha(x, x, x, key_padding_mask=pad)
        x = self.drop(x + a)
        w = self.router(x).softmax(-1)
        top, idx = w.topk(2, dim=-1)
        dense = torch.zeros_like(w).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        y = torch.einsum("bse,eij,bsj->bsi", dense, self.experts, x)
        y = y + torch.gather(x, 1, idx[..., :1].expand(-1, -1, 16) % x.shape[1])
        y = y.masked_fill(pad[..., None], 0.0)
        y = y + torch.special.erfcx(torch.tanh(y) * 0.5)
        y = y.index_select(-1, torch.arange(15, -1, -1))
        return self.out(y)


def routing():
    torch.manual_seed(0)
    m = Routing()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 20, (3, 7), generator=g)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:] = True
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return m, opt, lambda m, t, p: F.cross_entropy(m(t, p).flatten(0, 1), t.flatten()), (tokens, pad)


def huge_meta():
    """~43 GB of parameters (more than this machine's RAM) on the meta device: capture must not allocate them."""
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(60000, 60000), nn.GELU(), nn.Linear(60000, 60000),
                          nn.LayerNorm(60000), nn.Linear(60000, 8))
    x = torch.empty(16, 60000, device="meta")
    y = torch.empty(16, dtype=torch.long, device="meta")
    return m, torch.optim.Adam(m.parameters()), _loss, (x, y)


def rmsprop_centered():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.RMSprop(_net_groups(net), lr=1e-2, alpha=0.9, momentum=0.5, centered=True)
    return net, opt, _loss, _data()


def rmsprop_plain():
    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.RMSprop(_net_groups(net), lr=1e-2, weight_decay=0.01), _loss, _data()


def adagrad():
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adagrad(_net_groups(net), lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)
    return net, opt, _loss, _data()


def dropout():
    """Dropout at p = 0.2: each rank of a data-parallel run draws its own masks."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
    return net, torch.optim.SGD(net.parameters(), lr=0.1), _loss, _data()


class _Checkpointed(nn.Module):
    """Blocks under ``torch.utils.checkpoint`` (non-reentrant): their backward reruns the blocks' forward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def user_checkpoint():
    """A user's own activation checkpointing: captured, the rerun must read the step's parameters (it read the
    initial ones as constants, so steps after the first went wrong)."""
    torch.manual_seed(0)
    net = _Checkpointed()
    return net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), _loss, _data()


class _GaussianHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ELU(), nn.Linear(16, 4))

    def forward(self, x):
        mu, log_std = self.net(x).chunk(2, dim=-1)
        return mu, log_std.clamp(-5, 2)


def distribution_nll():
    """``torch.distributions.Normal(...).log_prob``: the distribution checks its arguments by default, which
    stopped tracing at a ``bool`` of a tensor; the capture runs without the checks."""
    torch.manual_seed(0)
    net = _GaussianHead()
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)

    def loss(m, x, t):
        mu, log_std = m(x)
        return -torch.distributions.Normal(mu, log_std.exp()).log_prob(t).mean()
    return net, torch.optim.RMSprop(net.parameters(), lr=1e-3), loss, (x, t)


def huber_head():
    """``F.huber_loss`` (opaque) with its default mean: aten's ``huber_loss.out`` resizes its out tensor to the
    unreduced shape and writes the elementwise loss there before reducing, so in an arena it wrote past its
    8-byte slot over other tensors (``lower.arena.ArenaProgram._out_safe``)."""
    torch.manual_seed(0)
    net = _GaussianHead()
    g = torch.Generator().manual_seed(4)
    x, t = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
    return net, torch.optim.RMSprop(net.parameters(), lr=1e-3), lambda m, x, t: F.huber_loss(m(x)[0], t, delta=0.5), \
        (x, t)


class _MaxNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, 16, max_norm=1.0)
        self.out = nn.Linear(16, 40)

    def forward(self, t):
        return self.out(self.emb(t).mean(1))


def maxnorm_embedding():
    """``nn.Embedding(max_norm=...)`` renormalises the rows it looks up in place, in the forward: the update reads
    that batch-dependent value. One step is exact; micro-batches cannot carry it (``cost.accumulate``)."""
    torch.manual_seed(0)
    net = _MaxNorm()
    with torch.no_grad():
        net.emb.weight.mul_(3.0)
    g = torch.Generator().manual_seed(3)
    t, y = torch.randint(0, 40, (8, 5), generator=g), torch.randint(0, 40, (8,), generator=g)
    return net, torch.optim.SGD(net.parameters(), lr=0.1), lambda m, t, y: F.cross_entropy(m(t), y), (t, y)


class _Rotation(nn.Module):
    """A complex buffer (unit rotations) applied to pairs of a linear layer's outputs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("rot", torch.polar(torch.ones(2), torch.tensor([0.3, 0.7])))

    def forward(self, x):
        z = torch.view_as_complex(self.lin(x).reshape(-1, 2, 2))
        return torch.view_as_real(z * self.rot).flatten(1)


def complex_buffer():
    """Complex state: the comparisons read both its parts."""
    torch.manual_seed(0)
    model = _Rotation()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x, y: F.mse_loss(m(x), y), (x, y)


class _PackedUnbind(nn.Module):
    """A packed projection viewed as ``(B, 3, D)``, the 3 moved to the front and unbound (no dim given)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 3, 4).transpose(0, 1).unbind()
        return (q * k + v).sum(-1)


def packed_unbind():
    torch.manual_seed(0)
    model = _PackedUnbind()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x: m(x).pow(2).mean(), (x,)
