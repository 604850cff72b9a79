"""GPT-2 style decoder-only language model.

Token + learned position embeddings, pre-LayerNorm transformer blocks with a
fused QKV projection and causal scaled-dot-product attention, a 4x GELU MLP,
a final LayerNorm and an output head tied to the token embedding.

Default size: 2 layers, hidden 64, 4 heads, vocab 256, sequence 32, batch 8
(~0.12M parameters). Optimizer: AdamW with two parameter groups (weight decay
on >=2-D weights only, none on biases and norms).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden, heads, attention="sdpa"):
        super().__init__()
        self.heads = heads
        self.attention = attention
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # "math": the scores are materialised, as before fused attention kernels
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class Block(nn.Module):
    def __init__(self, hidden, heads, attention="sdpa"):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads, attention)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq, hidden, heads, layers, attention="sdpa"):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def autocast_loss_fn(model, x, y):
    """Mixed precision as usually written: the forward under bf16 autocast (fp32 master weights stay
    fp32, matmuls run in bf16), the loss in fp32."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def workload(layers=2, hidden=64, heads=4, seq=32, batch=8, vocab=256, lr=3e-4, device="cpu", dtype=None,
             attention="sdpa", autocast=False):
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(vocab, seq, hidden, heads, layers, attention)
        if dtype is not None:  # default: the default dtype (float64 under --dtype float64)
            model = model.to(dtype)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )

    if device == "meta":
        tokens = torch.empty(batch, seq + 1, dtype=torch.long, device="meta")
    else:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(vocab, (batch, seq + 1), generator=g).to(device)
    loss = autocast_loss_fn if autocast else loss_fn
    return model, optimizer, loss, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def batches(seq=32, batch=8, vocab=256, corpus=64, seed=1):
    """Training data for ``rhino train``: global batches shaped like ``workload()``'s, drawn by a seeded,
    shuffling ``DataLoader`` from a fixed random corpus of ``corpus`` sequences, epoch after epoch."""
    from torch.utils.data import DataLoader, TensorDataset
    tokens = torch.randint(vocab, (corpus, seq + 1), generator=torch.Generator().manual_seed(seed))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch, shuffle=True,
                        drop_last=True, generator=torch.Generator().manual_seed(seed))
    while True:
        for x, y in loader:
            yield x, y


def gpt_autocast(**kwargs):
    """The default GPT trained with bf16 autocast around the forward (fp32 parameters and AdamW state)."""
    return workload(autocast=True, **kwargs)


def gpt_bf16(**kwargs):
    """The default GPT with bf16 parameters and optimizer state (``model.to(torch.bfloat16)``)."""
    return workload(dtype=torch.bfloat16, **kwargs)


def gpt2_xl(device="meta", batch=1):
    """GPT-2 XL shape (48 layers, hidden 1600, 25 heads, seq 1024, vocab 50257) on the meta device."""
    return workload(layers=48, hidden=1600, heads=25, seq=1024, batch=batch, vocab=50257, device=device)


def gpt3_175b(device="meta", batch=1536):
    """GPT-3 175B shape (96 layers, hidden 12288, 96 heads) as trained by Megatron-LM (Narayanan et al.
    2021, arXiv 2104.04473: sequence 2048, vocabulary 51200, bf16 here), on the meta device."""
    return workload(layers=96, hidden=12288, heads=96, seq=2048, batch=batch, vocab=51200, device=device,
                    dtype=torch.bfloat16)


def megatron(layers, hidden, heads, batch, device="meta", attention="math", autocast=False):
    """A GPT of Megatron-LM's weak-scaling table (arXiv 2104.04473, Table 1): sequence 2048,
    vocabulary 51200, attention scores materialised (as in 2021, before fused attention kernels), on
    the meta device. bf16 parameters by default; ``autocast=True``: fp32 master parameters and AdamW
    state, the forward under bf16 autocast (how Megatron-LM trains: mixed precision)."""
    dtype = torch.float32 if autocast else torch.bfloat16
    return workload(layers=layers, hidden=hidden, heads=heads, seq=2048, batch=batch, vocab=51200, device=device,
                    dtype=dtype, attention=attention, autocast=autocast)
