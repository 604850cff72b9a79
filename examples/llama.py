"""LLaMA-style decoder-only language model.

Hand-written RMSNorm, rotary position embeddings (RoPE) from precomputed
cos/sin buffers, separate q/k/v projections with optional grouped-query
attention (``n_kv_heads``), a SwiGLU MLP, no biases anywhere and an untied
output head.

Default size: 2 layers, hidden 64, 4 heads (4 KV heads), MLP 172, vocab 256,
sequence 32, batch 8 (~0.13M parameters). Optimizer: Adam.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, hidden, heads, n_kv_heads):
        super().__init__()
        assert heads % n_kv_heads == 0
        self.heads, self.n_kv_heads, self.head_dim = heads, n_kv_heads, hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)  # gate
        self.w3 = nn.Linear(hidden, inner, bias=False)  # up
        self.w2 = nn.Linear(inner, hidden, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, hidden, heads, n_kv_heads, inner):
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.attn = Attention(hidden, heads, n_kv_heads)
        self.mlp_norm = RMSNorm(hidden)
        self.mlp = SwiGLU(hidden, inner)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab, seq, hidden, heads, n_kv_heads, layers, inner, rope_theta=10000.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, n_kv_heads, inner) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [seq, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def autocast_loss_fn(model, x, y):
    """The forward under bf16 autocast (fp32 master weights), the loss in fp32."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def workload(layers=2, hidden=64, heads=4, n_kv_heads=None, seq=32, batch=8, vocab=256,
             inner=None, lr=3e-4, device="cpu", dtype=None, autocast=False):
    torch.manual_seed(0)
    n_kv_heads = n_kv_heads or heads
    inner = inner or int(8 * hidden / 3)  # the usual 2/3 * 4h SwiGLU width
    with torch.device(device):
        model = Llama(vocab, seq, hidden, heads, n_kv_heads, layers, inner)
        if dtype is not None:  # default: the default dtype (float64 under --dtype float64)
            model = model.to(dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8)

    if device == "meta":
        tokens = torch.empty(batch, seq + 1, dtype=torch.long, device="meta")
    else:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(vocab, (batch, seq + 1), generator=g).to(device)
    loss = autocast_loss_fn if autocast else loss_fn
    return model, optimizer, loss, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def llama_autocast(**kwargs):
    """The default LLaMA trained with bf16 autocast around the forward (fp32 parameters and AdamW state)."""
    return workload(autocast=True, **kwargs)


def llama_bf16(**kwargs):
    """The default LLaMA with bf16 parameters and optimizer state (``model.to(torch.bfloat16)``)."""
    return workload(dtype=torch.bfloat16, **kwargs)


def llama_7b(device="meta", batch=64):
    """LLaMA-7B shape (Touvron et al. 2023, arXiv 2302.13971: 32 layers, hidden 4096, 32 heads, SwiGLU
    width 11008, vocabulary 32000, sequence 2048), bf16, on the meta device."""
    return workload(layers=32, hidden=4096, heads=32, seq=2048, batch=batch, vocab=32000, inner=11008,
                    device=device, dtype=torch.bfloat16)
