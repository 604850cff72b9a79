"""Held-out models of session 23's bug hunt (each named where it is used)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class SeqFirstDecoder(nn.Module):
    """A sequence-first nn.MultiheadAttention with kdim/vdim (its (time batch) rows split strided by the
    time steps), then a pre-norm nn.TransformerDecoderLayer whose cross-attention reads the first tokens:
    the dp=2,tp=2 preset splits its ``(batch heads)`` dims strided by the batch size (``x/8``), a block count
    that a micro-batch of B/m rows must scale (``sharding.rebatch``)."""

    def __init__(self, d=8, mem_d=6, vocab=12):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mem = nn.Linear(4, mem_d)
        self.cross = nn.MultiheadAttention(d, 4, kdim=mem_d, vdim=mem_d)
        self.dec = nn.TransformerDecoderLayer(d, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids, memory):
        x = self.emb(ids)
        m = self.mem(memory).transpose(0, 1)
        a, _ = self.cross(x.transpose(0, 1), m, m)
        x = x + a.transpose(0, 1)
        x = self.dec(x, torch.tanh(x[:, :3]))
        return self.out(x)


def seq_first_decoder(batch=8):
    torch.manual_seed(0)
    model = SeqFirstDecoder()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (batch, 6), generator=g)
    memory = torch.randn(batch, 5, 4, generator=g)

    def loss(m, ids, memory, tgt):
        return F.cross_entropy(m(ids, memory).flatten(0, 1), tgt.flatten())
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss, (ids, memory, ids.roll(-1, 1))


def constants_in_batch(classes=5):
    """Per-step constants passed in the batch beside the samples: class weights ``[classes]`` and a 0-dim
    temperature. Data parallelism replicates them; micro-batches, which cut every batch tensor along dim 0,
    refuse them by name (``classes=4``: the weights split evenly, so the 0-dim temperature is named)."""
    torch.manual_seed(0)
    model = nn.Linear(6, classes)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, classes, (8,), generator=g)

    def loss(m, x, y, weight, temperature):
        return F.cross_entropy(m(x) / temperature, y, weight=weight, label_smoothing=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss, \
        (x, y, torch.linspace(0.5, 2.0, classes), torch.tensor(0.7))


def constants_in_batch_even():
    return constants_in_batch(classes=4)


class TiedAutoencoder(nn.Module):
    """A tied autoencoder (W and W.t()) whose reconstruction is warped by a spatial transformer (affine_grid +
    grid_sample, opaque ops), trained with a mean-reduced ``F.mse_loss``: ``mse_loss.out`` resizes its scalar
    out tensor to the unreduced ``[B, 16]`` shape before reducing into it (PyTorch's "An output with one or
    more elements was resized" warning), which in the arena claims the bytes after the loss's slot."""

    def __init__(self):
        super().__init__()
        self.W = nn.Parameter(torch.randn(12, 16) * 0.2)      # code x input
        self.b_enc = nn.Parameter(torch.zeros(12))
        self.b_dec = nn.Parameter(torch.zeros(16))
        self.loc = nn.Linear(16, 6)
        nn.init.zeros_(self.loc.weight)
        with torch.no_grad():
            self.loc.bias.copy_(torch.tensor([1.0, 0.1, 0.0, -0.1, 1.0, 0.0]))
        self.pix = nn.Linear(4, 4)

    def forward(self, x):                       # x [B, 16]
        h = torch.sigmoid(x @ self.W.t() + self.b_enc)
        rec = h @ self.W + self.b_dec
        img = rec.reshape(-1, 1, 4, 4)
        theta = self.loc(x).reshape(-1, 2, 3)
        grid = F.affine_grid(theta, img.shape, align_corners=False)
        warped = F.grid_sample(img, grid, align_corners=False)
        return self.pix(warped).reshape(x.shape[0], 16), h


def tied_autoencoder(batch=8):
    torch.manual_seed(0)
    model = TiedAutoencoder()
    g = torch.Generator().manual_seed(0)

    def loss(m, x):
        out, h = m(x)
        return F.mse_loss(out, x) + 1e-2 * h.abs().mean()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss, \
        (torch.randn(batch, 16, generator=g),)
