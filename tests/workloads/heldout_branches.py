"""Small multi-branch models the examples do not have (``FILE:FUNC``, e.g.
``tests/workloads/heldout_branches.py:siamese``), to try pipelines (#12) and per-rank memory plans (#14) on
shapes nobody tuned for. Batch 8 (pp=2 with 4 micro-batches: 2 rows per micro-batch, 1 per rank under dp=2),
small widths (a step well under a second on CPU), every loss a mean over rows so a micro-batched step is the
mean of its micro-batches.

- ``siamese``: one encoder applied to two inputs (weights used twice), pairwise contrastive loss; Adam.
- ``t5``: tiny encoder-decoder transformer with cross-attention, decoder embedding tied with the head; AdamW.
- ``densenet``: a conv dense block, each layer on the concat of all earlier outputs; SGD momentum.
- ``inception``: parallel conv branches of depth 1, 2 and 3 and a pooled branch, merged by concat and add; Adam.
- ``multitask``: a trunk with two heads and an auxiliary loss from an intermediate layer, summed; AdamW.
- ``longskip``: the input embedding added to the last layer's output, LayerNorm / GELU / softmax gate; SGD.
- ``sandwich``: one weight matrix used by the first layer and (transposed) by the last; Adam.
- ``gnresnet``: conv net with GroupNorm and a strided residual downsample path; SGD momentum.
- ``towers``: an image and a token tower, a frozen layer, a position buffer, a logit scale used only in the loss; AdamW.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 8


def _gen():
    return torch.Generator().manual_seed(0)


# ---------------------------------------------------------------- siamese
class Encoder(nn.Module):
    def __init__(self, d_in, hidden, d_out):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(self.ln(F.gelu(self.fc1(x))))


class Siamese(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=8):
        super().__init__()
        self.enc = Encoder(d_in, hidden, d_out)

    def forward(self, a, b):
        return self.enc(a), self.enc(b)


def _siamese_loss(model, a, b, same, margin=1.0):
    za, zb = model(a, b)
    d = ((za - zb) ** 2).sum(-1).add(1e-6).sqrt()
    return (same * d ** 2 + (1 - same) * F.relu(margin - d) ** 2).mean()


def siamese():
    torch.manual_seed(0)
    model = Siamese()
    g = _gen()
    a = torch.randn(BATCH, 16, generator=g)
    b = torch.randn(BATCH, 16, generator=g)
    same = (torch.rand(BATCH, generator=g) < 0.5).to(a.dtype)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), _siamese_loss, (a, b, same)


# ---------------------------------------------------------------- t5-like encoder-decoder
class Attention(nn.Module):
    """Multi-head attention written out (q, k, v projections, softmax), self or cross."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, mem, causal=False):
        b, s, h = x.shape
        t = mem.shape[1]
        q = self.q(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)
        k, v = self.kv(mem).view(b, t, 2, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        att = q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5
        if causal:
            att = att.masked_fill(torch.ones(s, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = att.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, h))


class T5Block(nn.Module):
    def __init__(self, hidden, heads, cross):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.self_attn = Attention(hidden, heads)
        self.cross = Attention(hidden, heads) if cross else None
        self.ln2 = nn.LayerNorm(hidden) if cross else None
        self.ln3 = nn.LayerNorm(hidden)
        self.ff = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, mem=None):
        h = self.ln1(x)
        x = x + self.self_attn(h, h, causal=self.cross is not None)
        if self.cross is not None:
            x = x + self.cross(self.ln2(x), mem)
        return x + self.ff(self.ln3(x))


class TinyT5(nn.Module):
    def __init__(self, vocab=48, hidden=32, heads=4, layers=1):
        super().__init__()
        self.src_emb = nn.Embedding(vocab, hidden)
        self.tgt_emb = nn.Embedding(vocab, hidden)
        self.enc = nn.ModuleList(T5Block(hidden, heads, cross=False) for _ in range(layers))
        self.enc_ln = nn.LayerNorm(hidden)
        self.dec = nn.ModuleList(T5Block(hidden, heads, cross=True) for _ in range(layers))
        self.dec_ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tgt_emb.weight
        nn.init.normal_(self.tgt_emb.weight, std=0.1)

    def forward(self, src, tgt):
        m = self.src_emb(src)
        for blk in self.enc:
            m = blk(m)
        m = self.enc_ln(m)
        x = self.tgt_emb(tgt)
        for blk in self.dec:
            x = blk(x, m)
        return self.head(self.dec_ln(x))


def _t5_loss(model, src, tgt_in, tgt_out):
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten())


def t5():
    torch.manual_seed(0)
    model = TinyT5()
    g = _gen()
    src = torch.randint(0, 48, (BATCH, 10), generator=g)
    tgt = torch.randint(0, 48, (BATCH, 9), generator=g)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), _t5_loss, (src, tgt[:, :-1], tgt[:, 1:])


# ---------------------------------------------------------------- densenet block
class DenseNet(nn.Module):
    def __init__(self, c0=4, growth=4, layers=3, classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, c0, 3, padding=1)
        self.layers = nn.ModuleList(nn.Conv2d(c0 + i * growth, growth, 3, padding=1) for i in range(layers))
        self.head = nn.Linear(c0 + layers * growth, classes)

    def forward(self, x):
        feats = [F.relu(self.stem(x))]
        for conv in self.layers:
            feats.append(F.relu(conv(torch.cat(feats, 1))))
        return self.head(torch.cat(feats, 1).mean((2, 3)))


def _cls_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def densenet():
    torch.manual_seed(0)
    model = DenseNet()
    g = _gen()
    x = torch.randn(BATCH, 3, 8, 8, generator=g)
    y = torch.randint(0, 5, (BATCH,), generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), _cls_loss, (x, y)


# ---------------------------------------------------------------- inception
class InceptionBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.b1 = nn.Conv2d(c, c, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                                nn.Conv2d(c, c, 3, padding=1))
        self.pool = nn.Conv2d(c, c, 1)
        self.merge = nn.Conv2d(3 * c, c, 1)

    def forward(self, x):
        cat = torch.cat([self.b1(x), self.b2(x), self.b3(x)], 1)
        pooled = self.pool(F.avg_pool2d(x, 3, stride=1, padding=1))
        return F.relu(x + self.merge(F.relu(cat)) + pooled)


class Inception(nn.Module):
    def __init__(self, c=6, classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(InceptionBlock(c), InceptionBlock(c))
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.blocks(F.relu(self.stem(x))).amax((2, 3)))


def inception():
    torch.manual_seed(0)
    model = Inception()
    g = _gen()
    x = torch.randn(BATCH, 3, 8, 8, generator=g)
    y = torch.randint(0, 5, (BATCH,), generator=g)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), _cls_loss, (x, y)


# ---------------------------------------------------------------- multi-task
class MultiTask(nn.Module):
    def __init__(self, d_in=16, hidden=32, classes=4):
        super().__init__()
        self.l1 = nn.Linear(d_in, hidden)
        self.l2 = nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, hidden)
        self.aux = nn.Linear(hidden, classes)
        self.cls = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, classes))
        self.reg = nn.Linear(hidden, 1)

    def forward(self, x):
        h1 = F.relu(self.l1(x))
        h2 = F.relu(self.l2(h1))
        h3 = F.relu(self.l3(h2))
        return self.cls(h3), self.reg(h3).squeeze(-1), self.aux(h1)


def _multitask_loss(model, x, y, t):
    logits, value, aux = model(x)
    return F.cross_entropy(logits, y) + 0.5 * F.mse_loss(value, t) + 0.3 * F.cross_entropy(aux, y)


def multitask():
    torch.manual_seed(0)
    model = MultiTask()
    g = _gen()
    x = torch.randn(BATCH, 16, generator=g)
    y = torch.randint(0, 4, (BATCH,), generator=g)
    t = torch.randn(BATCH, generator=g)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05), _multitask_loss, (x, y, t)


# ---------------------------------------------------------------- long skip
class LongSkip(nn.Module):
    def __init__(self, vocab=40, hidden=24, layers=3, classes=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
                                    for _ in range(layers))
        self.gate = nn.Linear(hidden, hidden)
        self.out_ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids):
        e = self.emb(ids)
        x = e
        for layer in self.layers:
            x = x + layer(x)
        x = x * self.gate(x).softmax(-1) + e  # the long skip: the embedding meets the last layer
        return self.head(self.out_ln(x).mean(1))


def longskip():
    torch.manual_seed(0)
    model = LongSkip()
    g = _gen()
    ids = torch.randint(0, 40, (BATCH, 6), generator=g)
    y = torch.randint(0, 6, (BATCH,), generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), _cls_loss, (ids, y)


# ---------------------------------------------------------------- first and last layer share a weight
class Sandwich(nn.Module):
    def __init__(self, d=16, hidden=24):
        super().__init__()
        self.w = nn.Parameter(torch.randn(hidden, d) / d ** 0.5)
        self.b_in = nn.Parameter(torch.zeros(hidden))
        self.mid = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.b_out = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = torch.tanh(x @ self.w.t() + self.b_in)
        return self.mid(h) @ self.w + self.b_out


def _recon_loss(model, x, target):
    return F.mse_loss(model(x), target)


def sandwich():
    torch.manual_seed(0)
    model = Sandwich()
    g = _gen()
    x = torch.randn(BATCH, 16, generator=g)
    target = torch.tanh(x.flip(-1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), _recon_loss, (x, target)


# ---------------------------------------------------------------- GroupNorm resnet with a downsample path
class GNBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.n1 = nn.GroupNorm(2, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.n2 = nn.GroupNorm(2, cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.GroupNorm(2, cout))

    def forward(self, x):
        y = F.relu(self.n1(self.c1(x)))
        return F.relu(self.n2(self.c2(y)) + self.down(x))


class GNResNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.b1 = GNBlock(4, 8, 2)
        self.b2 = GNBlock(8, 8, 1)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.b2(self.b1(F.relu(self.stem(x)))).mean((2, 3)))


def gnresnet():
    torch.manual_seed(0)
    model = GNResNet()
    g = _gen()
    x = torch.randn(BATCH, 3, 8, 8, generator=g)
    y = torch.randint(0, 5, (BATCH,), generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4), _cls_loss, (x, y)


# ---------------------------------------------------------------- two different towers, frozen layer, buffer
class Towers(nn.Module):
    """An image tower (conv) and a token tower (embedding + a registered position buffer), a frozen
    projection, a learnable logit scale used only in the loss (CLIP-like, but a per-pair loss)."""

    def __init__(self, vocab=30, seq=5, hidden=16):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.img_fc = nn.Linear(4, hidden)
        self.tok = nn.Embedding(vocab, hidden)
        pos = torch.arange(seq, dtype=torch.get_default_dtype())[:, None] / 10 ** (torch.arange(hidden) / hidden)
        self.register_buffer("pos", torch.sin(pos))
        self.txt_fc = nn.Linear(hidden, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, img, ids):
        zi = self.img_fc(F.relu(self.conv(img)).mean((2, 3)))
        zt = self.txt_fc(torch.tanh(self.tok(ids) + self.pos).mean(1))
        zi, zt = F.normalize(self.frozen(zi), dim=-1), F.normalize(zt, dim=-1)
        return (zi * zt).sum(-1)


def _towers_loss(model, img, ids, match):
    return F.binary_cross_entropy_with_logits(model.logit_scale * model(img, ids), match)


def towers():
    torch.manual_seed(0)
    model = Towers()
    g = _gen()
    img = torch.randn(BATCH, 3, 6, 6, generator=g)
    ids = torch.randint(0, 30, (BATCH, 5), generator=g)
    match = (torch.rand(BATCH, generator=g) < 0.5).to(img.dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2), _towers_loss, (img, ids, match)


WORKLOADS = ["siamese", "t5", "densenet", "inception", "multitask", "longskip", "sandwich", "gnresnet", "towers"]
