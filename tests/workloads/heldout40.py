"""Held-out workloads of session 40 (a helper's thirteenth batch: time-major layouts, loss normalisations,
optimizer set-ups), reduced to what failed."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class TwoHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 24), nn.Tanh())
        self.cls = nn.Linear(24, 4)
        self.reg = nn.Linear(24, 2)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        h = self.trunk(x)
        return self.cls(h), self.reg(h)


def uncertainty_weights():
    """Kendall et al.'s learned task uncertainty, sum_i exp(-s_i) L_i + s_i, over a cross entropy and an MSE."""
    torch.manual_seed(0)
    model = TwoHead()
    g = torch.Generator().manual_seed(10)
    x, y, t = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g), torch.randn(8, 2, generator=g)

    def loss(model, x, y, t):
        lc, lr = model(x)
        ls = torch.stack([F.cross_entropy(lc, y), F.mse_loss(lr, t)])
        return (torch.exp(-model.log_vars) * ls + model.log_vars).sum()
    return model, torch.optim.Adam(model.parameters(), lr=5e-2), loss, (x, y, t)


class EncoderWithPadding(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 4, 32, dropout=0.0), 1,
                                         enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, x, pad):
        return self.out(self.enc(self.emb(x), src_key_padding_mask=pad))


def time_major_padding_mask():
    """Time-major token ids (L, N) beside a batch-major (N, L) key padding mask: dim 0 means time in one and
    samples in the other, so a micro-batch of rows of each does not fit together (PyTorch asserts)."""
    torch.manual_seed(0)
    model = EncoderWithPadding()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 20, (8, 4), generator=g), torch.randint(0, 20, (8, 4), generator=g)
    pad = torch.zeros(4, 8, dtype=torch.bool)
    pad[1, 6:] = True

    def loss(model, x, pad, y):
        return F.cross_entropy(model(x, pad).reshape(-1, 20), y.reshape(-1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), loss, (x, pad, y)


class TimeMajorLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 12)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def time_major_lstm():
    """nn.LSTM's default (L, N, F) input: dim 0 is time, so the step at half the rows unrolls half the steps."""
    torch.manual_seed(0)
    model = TimeMajorLSTM()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 4, 6, generator=g), torch.randint(0, 3, (8, 4), generator=g)

    def loss(model, x, y):
        return F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss, (x, y)


def ctc_time_major():
    """CTC on time-major (T, N, C) log-probs with the lengths as lists: a micro-batch of rows along dim 0 is half
    the time steps, shorter than the input lengths the lists give."""
    torch.manual_seed(0)
    model = nn.Linear(6, 5)
    g = torch.Generator().manual_seed(12)
    x, tgt = torch.randn(12, 4, 6, generator=g), torch.randint(1, 5, (4, 4), generator=g)

    def loss(model, x, tgt):
        return F.ctc_loss(model(x).log_softmax(-1), tgt, [12, 12, 12, 12], [4, 3, 2, 4])
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), loss, (x, tgt)


def adafactor():
    """torch.optim.Adafactor (factored second moments for matrices, a full one for vectors) in two param groups,
    one with weight decay: its kernel reads ``.item()`` of the step and of two norms in every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.Adafactor([{"params": matrices, "weight_decay": 0.01}, {"params": vectors, "lr": 5e-3}],
                                lr=1e-2)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    return model, opt, lambda model, x, y: F.cross_entropy(model(x), y), (x, y)


def asgd():
    """torch.optim.ASGD averaging from its first step (t0=1), with weight decay: its default kernel branches on
    ``mu.item() != 1`` and takes Python's ``max`` of its step counter in every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    opt = torch.optim.ASGD(model.parameters(), lr=0.05, t0=1, lambd=1e-3, weight_decay=0.01)
    return model, opt, lambda model, x, y: F.cross_entropy(model(x), y), (x, y)


class ScriptedBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.jit.script(nn.Sequential(nn.Linear(8, 16), nn.Tanh()))
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.body(x))


def scripted_submodule():
    """A torch.jit.script submodule: a deep copy of it holds parameters that are not leaves, made outside the copy's
    memo, so the single-device reference's optimizer stepped orphan tensors and never moved the scripted layer."""
    torch.manual_seed(0)
    model = ScriptedBody()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda model, x, y: F.mse_loss(model(x), y), (x, y)


@torch.compile(backend="eager")
def _compiled_gate(a, b):
    return torch.tanh(a) * torch.sigmoid(b)


class CompiledParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(8, 16)
        self.body = torch.compile(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), backend="eager")
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.body(_compiled_gate(self.a(x), self.b(x))))


def compiled_parts():
    """A torch.compile'd submodule and a torch.compile'd function inside the model (the model itself uncompiled):
    tracing stopped at dynamo's "Detected that you are using FX to symbolically trace a dynamo-optimized function"."""
    torch.manual_seed(0)
    model = CompiledParts()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), lambda model, x, y: F.mse_loss(model(x), y), (x, y)


def loss_all_reduces():
    """A loss written for DDP that all-reduces itself (no process group exists while Rhino captures the step)."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)

    def loss(model, x, y):
        value = F.cross_entropy(model(x), y)
        dist.all_reduce(value)
        return value / dist.get_world_size()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), loss, (x, y)
