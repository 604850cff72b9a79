"""Models whose library calls needed care in tracing or planning (held out in session 22).

- ``causal_encoder``: ``nn.TransformerEncoder`` given a causal mask compares it with the causal mask
  (``_detect_is_causal_mask``), a ``bool`` of a tensor: tracing stopped there.
- ``ctc_lists``: ``F.ctc_loss`` with lengths as lists of ints and the mean reduction: torch's fake kernel
  of ``_ctc_loss`` calls every form dynamic, and the mean builds a tensor from the list in C++.
- ``gaussian_head``: ``nn.GaussianNLLLoss`` checks ``torch.any(var < 0)`` (a ``bool`` of a tensor).
- ``embedding_bag``: ``nn.EmbeddingBag(mode="mean")``, whose meta kernel gives ``max_indices`` no elements on
  the meta device and one per bag on CPU (rank graphs ran ops on meta: the arena's slot was empty).
- ``compiled``: a model wrapped by ``torch.compile`` (FX cannot trace the wrapper; its module is traced).
- ``channels_last``: a channels-last conv net; its graph reads the pooled gradient through ``as_strided`` with
  explicit strides and storage offsets, which the arena ran against the arena's storage (wrong gradients).
- ``packed_lstm`` (``pack_padded_sequence``: shapes from the lengths' values) and ``sparse_embedding``
  (``nn.Embedding(sparse=True)``: a sparse gradient): refused in one sentence each, saying what to use.
- ``ctc_tensor_lengths``: the lengths as tensors (their values give the shapes): refused, saying to pass
  lists.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalEncoder(nn.Module):
    def __init__(self, vocab=32, d=16, seq=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, t):
        mask = nn.Transformer.generate_square_subsequent_mask(t.shape[1], dtype=self.pos.dtype)
        return self.head(self.enc(self.emb(t) + self.pos[: t.shape[1]], mask=mask))


def causal_encoder():
    torch.manual_seed(0)
    model = CausalEncoder()
    t = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(1))
    return (model, torch.optim.Adam(model.parameters(), lr=1e-3),
            lambda m, x, y: F.cross_entropy(m(x).flatten(0, 1), y.flatten()), (t[:, :-1].clone(), t[:, 1:].clone()))


class GruCtc(nn.Module):
    def __init__(self, feats=6, hidden=12, classes=5):
        super().__init__()
        self.gru = nn.GRU(feats, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.gru(x)[0]).log_softmax(-1).transpose(0, 1)  # (time, batch, classes)


def _ctc_lists(m, x, targets):
    return F.ctc_loss(m(x), targets, [x.shape[1]] * x.shape[0], [3, 4, 2, 4], zero_infinity=True)


def _ctc_tensors(m, x, targets):
    n, t = x.shape[0], x.shape[1]
    return F.ctc_loss(m(x), targets, torch.full((n,), t), torch.full((n,), targets.shape[1]))


def ctc_lists():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = GruCtc()
    x, targets = torch.randn(4, 10, 6, generator=g), torch.randint(1, 5, (4, 4), generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _ctc_lists, (x, targets)


def ctc_tensor_lengths():
    model, opt, _, batch = ctc_lists()
    return model, opt, _ctc_tensors, batch


class GaussianHead(nn.Module):
    """Mean and variance heads (heteroscedastic regression)."""
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.mean, self.logvar = nn.Linear(16, 2), nn.Linear(16, 2)

    def forward(self, x):
        h = self.body(x)
        return self.mean(h), self.logvar(h).exp()


def _gaussian(m, x, y):
    mean, var = m(x)
    return nn.GaussianNLLLoss(full=True)(mean, y, var)


def gaussian_head():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = GaussianHead()
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), _gaussian, (x, y)


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(40, 8, mode="mean")
        self.fc = nn.Linear(8, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx))


def embedding_bag():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Bag()
    idx, y = torch.randint(0, 40, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), lambda m, i, y: F.cross_entropy(m(i), y), (idx, y)


def compiled():
    model, opt, loss_fn, batch = embedding_bag()
    return torch.compile(model), opt, loss_fn, batch


def channels_last():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4)).to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
    y = torch.randint(0, 4, (8,), generator=g)
    return (model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            lambda m, x, y: F.cross_entropy(m(x), y), (x, y))


class PackedLstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(6, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        packed = nn.utils.rnn.pack_padded_sequence(x, [5, 4, 4, 2], batch_first=True)
        out, _ = nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)
        return self.fc(out.mean(1))


def packed_lstm():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = PackedLstm()
    x, y = torch.randn(4, 5, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda m, x, y: F.cross_entropy(m(x), y), (x, y)


def sparse_embedding():
    model, _, loss_fn, batch = embedding_bag()
    model.emb = nn.EmbeddingBag(40, 8, mode="mean", sparse=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, batch
