"""Mixture-of-experts transformer language model.

Pre-LayerNorm decoder blocks whose feed-forward layer is a mixture of experts
with top-2 routing: router logits -> softmax -> ``torch.topk(k=2)`` ->
renormalised gate weights scattered into a dense [tokens, experts] combine
matrix. Every expert runs on every token (batched expert weights, einsum), so
all shapes are static. A Switch-style load-balancing auxiliary loss is added
to the language-modelling loss.

Default size: 2 layers, hidden 64, 4 heads, 4 experts (inner 128), vocab 256,
sequence 32, batch 8 (~0.20M parameters). Optimizer: AdamW.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MoE(nn.Module):
    def __init__(self, hidden, inner, experts, top_k=2):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, inner) / math.sqrt(hidden))
        self.b1 = nn.Parameter(torch.zeros(experts, inner))
        self.w2 = nn.Parameter(torch.randn(experts, inner, hidden) / math.sqrt(inner))
        self.b2 = nn.Parameter(torch.zeros(experts, hidden))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                   # [N, D]
        probs = F.softmax(self.router(x), dim=-1)                      # [N, E]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)           # [N, k]
        top_w = top_w / top_w.sum(-1, keepdim=True)
        combine = torch.zeros_like(probs).scatter(1, top_i, top_w)     # [N, E], k non-zeros per row

        h = F.gelu(torch.einsum("nd,edf->enf", x, self.w1) + self.b1[:, None])
        out = torch.einsum("enf,efd->end", h, self.w2) + self.b2[:, None]  # [E, N, D]
        y = torch.einsum("ne,end->nd", combine, out)

        # Switch-Transformer load balancing: E * sum_e (fraction routed to e) * (mean prob of e)
        routed = torch.zeros_like(probs).scatter(1, top_i, 1.0).mean(0) / self.top_k
        aux = self.experts * (routed * probs.mean(0)).sum()
        return y.reshape(shape), aux


class Block(nn.Module):
    def __init__(self, hidden, heads, inner, experts):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.moe = MoE(hidden, inner, experts)

    def attn(self, x):
        b, t, h = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, -1).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        y, aux = self.moe(self.ln2(x))
        return x + y, aux


class MoETransformer(nn.Module):
    def __init__(self, vocab, seq, hidden, heads, layers, inner, experts):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, inner, experts) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        aux = 0.0
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        return self.head(self.ln_f(x)), aux / len(self.blocks)


def loss_fn(model, x, y, aux_weight=0.01):
    logits, aux = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + aux_weight * aux


def workload(layers=2, hidden=64, heads=4, experts=4, inner=128, seq=32, batch=8, vocab=256,
             lr=3e-4, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = MoETransformer(vocab, seq, hidden, heads, layers, inner, experts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.05)

    if device == "meta":
        tokens = torch.empty(batch, seq + 1, dtype=torch.long, device="meta")
    else:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(vocab, (batch, seq + 1), generator=g).to(device)
    return model, optimizer, loss_fn, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
