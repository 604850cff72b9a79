"""Recurrent models (held out from the rules' design): an LSTM tagger and a two-layer bidirectional GRU
classifier. In float32 on the CPU, PyTorch runs RNNs through oneDNN, whose RNN op returns the workspace
its backward needs only under grad mode; capture traces them to their aten cells instead."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Tagger(nn.Module):
    def __init__(self, vocab=30, d=8, tags=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, d, batch_first=True)
        self.out = nn.Linear(d, tags)

    def forward(self, ids):
        return self.out(self.rnn(self.emb(ids))[0])


class GruClassifier(nn.Module):
    def __init__(self, d=8, classes=3):
        super().__init__()
        self.rnn = nn.GRU(d, d, num_layers=2, bidirectional=True)
        self.out = nn.Linear(2 * d, classes)

    def forward(self, x):
        return self.out(self.rnn(x)[0].mean(0))


def _tag_loss(model, ids, tags):
    return F.cross_entropy(model(ids).flatten(0, 1), tags.flatten())


def _cls_loss(model, x, y):
    return F.cross_entropy(model(x), y)


def lstm(batch=4, seq=6, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = Tagger()
    g = torch.Generator().manual_seed(1)
    batch_ = (torch.randint(0, 30, (batch, seq), generator=g), torch.randint(0, 5, (batch, seq), generator=g))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _tag_loss, batch_


def gru(batch=4, seq=5, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = GruClassifier()
    g = torch.Generator().manual_seed(2)
    batch_ = (torch.randn(seq, batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g))
    return model, torch.optim.Adam(model.parameters(), lr=0.01), _cls_loss, batch_
