"""Held-out workloads of session 34 that found bugs (tests/test_pipeline.py, tests/test_sharding.py)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class EMACodebook(nn.Module):
    """Vector quantisation with an EMA codebook: cluster sizes and sums renewed in the forward under no_grad,
    the codebook recomputed from them at its end."""

    def __init__(self, d_in=6, d=4, k=5, decay=0.9):
        super().__init__()
        self.enc, self.dec, self.decay = nn.Linear(d_in, d), nn.Linear(d, d_in), decay
        self.register_buffer("embed", torch.randn(k, d))
        self.register_buffer("size", torch.ones(k))
        self.register_buffer("esum", self.embed.clone())

    def forward(self, x):
        z = self.enc(x)
        dist = (z.unsqueeze(1) - self.embed.unsqueeze(0)).pow(2).sum(-1)
        onehot = F.one_hot(dist.argmin(1), self.embed.shape[0]).to(z.dtype)
        q = onehot @ self.embed
        with torch.no_grad():
            self.size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
            self.esum.mul_(self.decay).add_(onehot.t() @ z, alpha=1 - self.decay)
            self.embed.copy_(self.esum / (self.size.unsqueeze(1) + 1e-5))
        return self.dec(z + (q - z).detach()), z, q


def _vq_loss(m, x):
    r, z, q = m(x)
    return F.mse_loss(r, x) + 0.25 * F.mse_loss(z, q.detach())


def ema_codebook():
    torch.manual_seed(0)
    m = EMACodebook()
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(41))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), _vq_loss, (x,)


class Attention(nn.Module):
    """scaled_dot_product_attention without a mask (its math path: ``_safe_softmax``), then a per-sample diagonal
    matrix (``diag_embed``) and a ``vdot`` regulariser."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)        # one head, 3-d: the math path (4-d runs a fused CPU kernel)
        y = self.out(F.scaled_dot_product_attention(q, k, v))
        d = torch.diag_embed(y.mean(1)) @ y.transpose(1, 2)
        return d.pow(2).mean() + 1e-3 * torch.vdot(self.out.bias, self.out.bias)


def attention():
    torch.manual_seed(0)
    m = Attention()
    x = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(3))
    # SGD: the key bias gets an exactly-zero gradient (softmax ignores a constant), which Adam would blow up from
    # rounding noise (about 1e-12 here) and so hide a wrong rule
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), lambda m, x: m(x), (x,)


class _AutocastNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(3, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.ln(self.fc(x)).sum(-1)


def _autocast_loss(m, x, y):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = m(x)
    return F.mse_loss(out.to(x.dtype), y)


def autocast_layer_norm():
    """A float32 LayerNorm on a bf16 activation under CPU autocast (the CPU kernel keeps mean and rstd in float32,
    the fake kernel said bf16)."""
    torch.manual_seed(0)
    m = _AutocastNorm()
    g = torch.Generator().manual_seed(30)
    return m, torch.optim.SGD(m.parameters(), lr=1e-2), _autocast_loss, \
        (torch.randn(8, 3, generator=g), torch.randn(8, generator=g))
