"""BERT-style bidirectional encoder trained with masked language modelling.

Token + position + segment embeddings, post-LayerNorm encoder layers built on
``nn.MultiheadAttention(batch_first=True)`` with a key padding mask taken from
the batch, a GELU MLP, and a masked-LM head (dense + GELU + LayerNorm, decoder
tied to the token embedding, with its own output bias). The loss is cross
entropy over masked positions only (labels are -100 elsewhere).

Default size: 2 layers, hidden 64, 4 heads, vocab 256, sequence 32, batch 8
(~0.12M parameters). Optimizer: AdamW.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, MASK = 0, 1


class EncoderLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.attn = nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)
        self.ln1 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.ln2 = nn.LayerNorm(hidden)

    def forward(self, x, pad_mask):
        a, _ = self.attn(x, x, x, key_padding_mask=pad_mask, need_weights=False)
        x = self.ln1(x + a)
        return self.ln2(x + self.mlp(x))


class Bert(nn.Module):
    def __init__(self, vocab, seq, hidden, heads, layers, segments=2):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.seg = nn.Embedding(segments, hidden)
        self.emb_ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads) for _ in range(layers))
        self.mlm_dense = nn.Linear(hidden, hidden)
        self.mlm_ln = nn.LayerNorm(hidden)
        self.decoder = nn.Linear(hidden, vocab, bias=False)
        self.decoder.weight = self.tok.weight
        self.mlm_bias = nn.Parameter(torch.zeros(vocab))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids, segment_ids, pad_mask):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.emb_ln(self.tok(ids) + self.pos(pos) + self.seg(segment_ids))
        for layer in self.layers:
            x = layer(x, pad_mask)
        x = self.mlm_ln(F.gelu(self.mlm_dense(x)))
        return self.decoder(x) + self.mlm_bias


def loss_fn(model, ids, segment_ids, pad_mask, labels):
    logits = model(ids, segment_ids, pad_mask)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def make_batch(batch, seq, vocab, mask_prob=0.15):
    """Random sentence pairs of varying length, right-padded, 15% of real tokens masked."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    pos = torch.arange(seq)
    pad_mask = pos[None, :] >= lengths[:, None]  # True = padding, ignored by attention
    segment_ids = (pos[None, :] >= (lengths[:, None] // 2)).long() * (~pad_mask)
    masked = (torch.rand(batch, seq, generator=g) < mask_prob) & ~pad_mask
    masked[:, 0] = True  # guarantee at least one prediction target per row
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    ids = torch.where(masked, torch.full_like(ids, MASK), ids).masked_fill(pad_mask, PAD)
    return ids, segment_ids, pad_mask, labels


def workload(layers=2, hidden=64, heads=4, seq=32, batch=8, vocab=256, lr=1e-4, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = Bert(vocab, seq, hidden, heads, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01)

    if device == "meta":
        ids, segment_ids, labels = (torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(3))
        pad_mask = torch.empty(batch, seq, dtype=torch.bool, device="meta")
        data = (ids, segment_ids, pad_mask, labels)
    else:
        data = tuple(t.to(device) for t in make_batch(batch, seq, vocab))
    return model, optimizer, loss_fn, data
