"""Small models whose exactness depends on rules the exhaustive op check covers one op at a time:
shifted-window attention (roll, window partition views and permutes, a relative position bias
gathered by index), relative position buckets computed from ``arange`` positions (T5), and a conv net
trained with a mean-reduced ``F.mse_loss``. Used by tests/test_rule_exhaustive.py under random plans."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class WindowBlock(nn.Module):
    """A Swin block: shifted windows, window attention with a relative position bias table."""

    def __init__(self, dim=8, heads=2, ws=2, shift=1, res=4):
        super().__init__()
        self.heads, self.ws, self.shift, self.res = heads, ws, shift, res
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.table = nn.Parameter(torch.randn((2 * ws - 1) ** 2, heads) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(ws), torch.arange(ws), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (ws - 1)
        self.register_buffer("rel_index", rel[..., 0] * (2 * ws - 1) + rel[..., 1], persistent=False)

    def mask(self):
        ws, s, n = self.ws, self.shift, self.res
        img = torch.zeros(1, n, n, 1)
        cnt = 0
        for h in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
            for w in (slice(0, -ws), slice(-ws, -s), slice(-s, None)):
                img[:, h, w, :] = cnt
                cnt += 1
        win = img.view(1, n // ws, ws, n // ws, ws, 1).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws)
        m = win.unsqueeze(1) - win.unsqueeze(2)
        return m.masked_fill(m != 0, -100.0)

    def forward(self, x):
        b, hh, ww, c = x.shape
        ws, nh = self.ws, self.heads
        h = torch.roll(self.norm1(x), shifts=(-self.shift, -self.shift), dims=(1, 2))
        win = h.view(b, hh // ws, ws, ww // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        bw, n, _ = win.shape
        q, k, v = self.qkv(win).reshape(bw, n, 3, nh, c // nh).permute(2, 0, 3, 1, 4)
        attn = (q * (c // nh) ** -0.5) @ k.transpose(-2, -1)
        attn = attn + self.table[self.rel_index.view(-1)].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        nw = (hh // ws) * (ww // ws)
        attn = attn.view(bw // nw, nw, nh, n, n) + self.mask().unsqueeze(1).unsqueeze(0)
        out = (attn.view(-1, nh, n, n).softmax(-1) @ v).transpose(1, 2).reshape(bw, n, c)
        out = self.proj(out).view(b, hh // ws, ww // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, c)
        x = x + torch.roll(out, shifts=(self.shift, self.shift), dims=(1, 2))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def windows():
    torch.manual_seed(0)
    model = WindowBlock()
    x, y = torch.randn(4, 4, 4, 8), torch.randn(4, 4, 4, 8)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, a, t: F.mse_loss(m(a), t), (x, y)


def _bucket(rel, buckets=8, max_distance=16):
    """T5's relative position bucket (bidirectional)."""
    n = buckets // 2
    out = (rel > 0).to(torch.long) * n
    rel = torch.abs(rel)
    exact = n // 2
    large = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (n - exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, n - 1))
    return out + torch.where(rel < exact, rel, large)


class BucketAttention(nn.Module):
    def __init__(self, d=8, heads=2, vocab=16):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.rel = nn.Embedding(8, heads)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(s, dtype=torch.long)
        bias = self.rel(_bucket(pos[None, :] - pos[:, None])).permute(2, 0, 1).unsqueeze(0)
        out = ((q @ k.transpose(-1, -2) + bias).softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        return self.head(out)


def buckets():
    torch.manual_seed(0)
    model = BucketAttention()
    ids, tgt = torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))
    loss = lambda m, a, t: F.cross_entropy(m(a).flatten(0, 1), t.flatten())  # noqa: E731
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss, (ids, tgt)


def conv_mse():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.SiLU(),
                          nn.ConvTranspose2d(4, 4, 2, stride=2), nn.Conv2d(4, 2, 1))
    x, y = torch.randn(4, 2, 4, 4), torch.randn(4, 2, 8, 8)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, a, t: F.mse_loss(m(a), t), (x, y)


class WeightNormed(nn.Module):
    """Weight-normed Linears (``parametrizations.weight_norm``: the opaque ``_weight_norm_interface`` and its
    backward) and a LayerNorm, whose backward kernels read their inputs as contiguous."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.utils.parametrizations.weight_norm(nn.Linear(8, 16))
        self.norm = nn.LayerNorm(16)
        self.l2 = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16), dim=None)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = self.norm(F.elu(self.l1(x)))
        return self.out(h + F.elu(self.l2(h))).squeeze(-1)


def weight_norm():
    torch.manual_seed(0)
    model = WeightNormed()
    x, y = torch.randn(8, 8), torch.randn(8)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), \
        lambda m, a, t: F.huber_loss(m(a), t, delta=0.5), (x, y)
