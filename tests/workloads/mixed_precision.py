"""Small mixed-precision workloads: a bf16-autocast forward over fp32 master weights, and bf16 models
(``model.to(torch.bfloat16)``) with each functional optimizer."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=8):
        super().__init__()
        self.up = nn.Linear(d_in, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.down(F.gelu(self.norm(self.up(x))))


def _data(batch=8, d_in=16, d_out=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    return torch.randn(batch, d_in, generator=g).to(dtype), torch.randint(0, d_out, (batch,), generator=g)


def _autocast_loss(m, x, y):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        logits = m(x)
    return F.cross_entropy(logits.float(), y)


def _loss(m, x, y):
    return F.cross_entropy(m(x).float(), y)


def mlp_autocast():
    """fp32 parameters and Adam state, the forward in bf16 autocast (the matmuls run in bf16)."""
    torch.manual_seed(0)
    m = MLP()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1), _autocast_loss, _data()


def mlp_autocast_sgd():
    torch.manual_seed(0)
    m = MLP()
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), _autocast_loss, _data()


def _bf16(opt):
    torch.manual_seed(0)
    m = MLP().to(torch.bfloat16)
    return m, opt(m.parameters()), _loss, _data(dtype=torch.bfloat16)


def mlp_bf16_adam():
    return _bf16(lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True))


def mlp_bf16_adamw():
    return _bf16(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1))


def mlp_bf16_sgd():
    return _bf16(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))


def mlp_bf16_rmsprop():
    return _bf16(lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True))


def mlp_bf16_rmsprop_plain():
    return _bf16(lambda p: torch.optim.RMSprop(p, lr=1e-2))


def mlp_bf16_adagrad():
    return _bf16(lambda p: torch.optim.Adagrad(p, lr=1e-2, lr_decay=0.01))


def cast_chain():
    """A weight reaching its matmul through a chain of explicit conversions (fp32 -> fp16 -> bf16)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 32) * 0.1)
            self.v = nn.Parameter(torch.randn(32, 8) * 0.1)

        def forward(self, x):
            h = torch.relu(x.to(torch.bfloat16) @ self.w.to(torch.float16).to(torch.bfloat16))
            return (h @ self.v.to(torch.bfloat16)).float()

    m = Net()
    return m, torch.optim.Adam(m.parameters(), lr=1e-2), _loss, _data()


def big_autocast(layers=2, hidden=8192, batch=8, seq=512):
    """A GPT-like stack on the meta device that does not fit one 40 GB device in fp32 with Adam
    (2 layers of hidden 8192: 1.6B parameters, 26 GB of parameters and Adam state), bf16 autocast."""
    with torch.device("meta"):
        blocks = []
        for _ in range(layers):
            blocks += [nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)]
        m = nn.Sequential(*blocks, nn.Linear(hidden, 1024))
    x = torch.empty(batch, seq, hidden, device="meta")
    y = torch.empty(batch, seq, dtype=torch.long, device="meta")

    def loss(model, x, y):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    return m, torch.optim.AdamW(m.parameters(), lr=1e-4), loss, (x, y)


def mlp_autocast_cuda():
    """Autocast written for a GPU (``torch.autocast("cuda")``, dtype left to CUDA's default float16 for the
    first layer, bf16 for the second); capture and the check's eager reference run it on the CPU."""
    torch.manual_seed(0)
    m = MLP()

    def loss(model, x, y):
        with torch.autocast("cuda"):
            h = model.norm(model.up(x))
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model.down(F.gelu(h))
        return F.cross_entropy(logits.float(), y)

    return m, torch.optim.AdamW(m.parameters(), lr=1e-2), loss, _data()


class BNNet(nn.Module):
    """Linear (no bias: a bias before batch norm has no gradient but noise) -> BatchNorm1d -> GELU -> Linear."""

    def __init__(self, d_in=16, hidden=32, d_out=8):
        super().__init__()
        self.up = nn.Linear(d_in, hidden, bias=False)
        self.bn = nn.BatchNorm1d(hidden)
        self.down = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.down(F.gelu(self.bn(self.up(x))))


def bn_autocast():
    """Batch norm under bf16 autocast: a bf16 input with fp32 parameters (the CPU kernel's mixed dtype)."""
    torch.manual_seed(0)
    m = BNNet()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2), _autocast_loss, _data()
