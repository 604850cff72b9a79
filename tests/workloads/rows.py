"""Batches whose rows along dim 0 are not independent samples, for ``runtime.microbatch.microbatch_note``.

- ``time_major``: ``nn.MultiheadAttention`` in PyTorch's default (L, N, E) layout, token ids (L, N): dim 0 is time,
  so a micro-batch of rows is a part of every sequence, and attention mixes the parts.
- ``token_mean``: cross entropy with ``ignore_index``, whose mean is over the tokens that count, more of them
  padded in the first micro-batch than in the second: a loss that is not a mean over rows.
- ``batch_first``: the same model as ``time_major`` with ``batch_first=True`` (independent rows).
- ``summed`` and ``zero_valued_term`` (a helper's held-out cases, session 40): a loss summed over the rows, and a
  term across the rows whose value is zero but whose gradient is not.
"""
import torch
import torch.nn as nn


class Encoder(nn.Module):
    def __init__(self, batch_first: bool, d: int = 16, heads: int = 4, vocab: int = 50):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=batch_first)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x)
        a, _ = self.attn(h, h, h)
        return self.head(self.norm(h + a))


def _ce(model, x, y):
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=-100)


def _encoder(batch_first: bool):
    torch.manual_seed(0)
    model = Encoder(batch_first)
    x, y = torch.randint(0, 50, (8, 6)), torch.randint(0, 50, (8, 6))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), _ce, (x, y)


def time_major():
    return _encoder(batch_first=False)


def batch_first():
    return _encoder(batch_first=True)


def token_mean():
    model, opt, loss, (x, y) = _encoder(batch_first=True)
    y[:3, 2:] = -100
    return model, opt, loss, (x, y)


def _regression():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(8, 6, generator=g), \
        torch.randint(0, 3, (8,), generator=g)


def summed():
    """Cross entropy summed over the rows: the accumulation loop's ``(loss_k / m).backward()`` takes 1/m of the
    whole batch's gradient."""
    model, opt, x, y = _regression()
    return model, opt, lambda model, x, y: nn.functional.cross_entropy(model(x), y, reduction="sum"), (x, y)


def zero_valued_term():
    """A mean cross entropy plus ``v - v.detach()`` with ``v`` the variance over the rows: the value is the cross
    entropy's, the gradient also has the variance's (the losses agree, the gradients do not)."""
    model, opt, x, y = _regression()

    def loss(model, x, y):
        out = model(x)
        v = out.var(0).sum()
        return nn.functional.cross_entropy(out, y) + (v - v.detach())
    return model, opt, loss, (x, y)
