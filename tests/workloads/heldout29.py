"""Held-out models of session 29's bug hunt (each named where it is used)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _gen():
    return torch.Generator().manual_seed(0)


class SoftplusTransposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)

    def forward(self, x, w):                       # x [B, 6, 4], w [B, 8, 6]
        return (F.softplus(self.lin(x)) * w.transpose(1, 2)).sum()


def softplus_transposed():
    """softplus_backward's real CPU kernel keeps the transposed incoming gradient's layout, its fake kernel
    is contiguous: the Linear backward's traced ``view`` failed on the real tensor in ``rhino check``."""
    torch.manual_seed(0)
    g = _gen()
    x, w = torch.randn(8, 6, 4, generator=g), torch.randn(8, 8, 6, generator=g)
    m = SoftplusTransposed()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), lambda m, x, w: m(x, w), (x, w)


def focal_gather():
    """A focal loss written with ``gather``, whose backward is ``new_zeros(grad, [B, C])`` + ``scatter_add``:
    data parallelism all-gathered the gradient for ``new_zeros`` to read its dtype."""
    torch.manual_seed(0)
    g = _gen()
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    m = nn.Linear(6, 3)

    def loss(m, x, y):
        logp = F.log_softmax(m(x), -1).gather(1, y[:, None])
        return (-(1 - logp.exp()) ** 2 * logp).mean()
    return m, torch.optim.SGD(m.parameters(), lr=0.1), loss, (x, y)


def bce_sum_and_kl():
    """``binary_cross_entropy_with_logits(reduction="sum")`` with a pos_weight and ``kl_div`` (``xlogy``):
    both ran opaque, so data parallelism gathered the batch before them."""
    torch.manual_seed(0)
    g = _gen()
    x = torch.randn(8, 6, generator=g)
    t = (torch.rand(8, 5, generator=g) > 0.5).to(torch.get_default_dtype())
    m = nn.Linear(6, 5)
    pos_weight = torch.linspace(0.5, 2.0, 5)

    def loss(m, x, t):
        z = m(x)
        bce = F.binary_cross_entropy_with_logits(z, t, reduction="sum", pos_weight=pos_weight) / x.shape[0]
        kl = F.kl_div(F.log_softmax(z, -1), t.softmax(-1), reduction="batchmean")
        return bce + kl + torch.clamp_min(z, torch.zeros(5)).norm(2, dim=1).mean()
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), loss, (x, t)


class SpectralConv2d(nn.Module):
    def __init__(self, cin, cout, modes):
        super().__init__()
        self.modes = modes
        self.w = nn.Parameter(torch.randn(cin, cout, modes, modes, 2) / (cin * cout))

    def forward(self, x):
        b, _, h, w = x.shape
        xf = torch.fft.rfft2(x)
        wc = torch.view_as_complex(self.w)
        out = torch.zeros(b, wc.shape[1], h, w // 2 + 1, dtype=xf.dtype, device=x.device)
        out[:, :, :self.modes, :self.modes] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :self.modes, :self.modes], wc)
        return torch.fft.irfft2(out, s=(h, w))


class FNO(nn.Module):
    def __init__(self):
        super().__init__()
        self.lift = nn.Conv2d(1, 4, 1)
        self.spec = SpectralConv2d(4, 4, 3)
        self.pw = nn.Conv2d(4, 4, 1)
        self.proj = nn.Conv2d(4, 1, 1)

    def forward(self, x):
        h = self.lift(x)
        return self.proj(F.gelu(self.spec(h) + self.pw(h)))


def fno():
    """A Fourier neural operator (rfft2 / irfft2, complex weights viewed from real ones): the FFTs and the
    backward's ``new_empty_strided`` ran opaque (data parallelism gathered the batch, ~6x the bytes)."""
    torch.manual_seed(0)
    model = FNO()
    g = _gen()
    x, y = torch.randn(8, 1, 8, 8, generator=g), torch.randn(8, 1, 8, 8, generator=g)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), lambda m, x, y: F.mse_loss(m(x), y), (x, y)


class GatedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Conv1d(8, 8, 1)
        self.filt = nn.Conv1d(8, 8, 1)
        self.gate = nn.Conv1d(8, 8, 1)
        self.out = nn.Conv1d(8, 8, 1)

    def forward(self, x):
        h = F.relu(self.l0(x))
        return self.out(torch.tanh(self.filt(h)) * torch.sigmoid(self.gate(h)))


def gated_conv():
    """WaveNet's gate: one activation read by a filter and a gate convolution. Cut between the two, the
    activation is sent on to the gate's stage too, and the filter's ``convolution_backward`` (which reads
    its weight) ran there: the filter weight and its momentum were held and updated on both stages."""
    torch.manual_seed(0)
    g = _gen()
    x, y = torch.randn(8, 8, 5, generator=g), torch.randn(8, 8, 5, generator=g)
    m = GatedConv()
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), lambda m, x, y: F.mse_loss(m(x), y), (x, y)


class SqueezedBack(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x).unsqueeze(1).squeeze(1)


def squeezed_back():
    """``squeeze(dim)``: its SPMD lowering calls ``squeeze.dims`` with the dim rewritten as a list; the
    single-device lowering must keep the traced op."""
    torch.manual_seed(0)
    m = SqueezedBack()
    x = torch.randn(8, 16, generator=_gen())
    return m, torch.optim.SGD(m.parameters(), lr=0.05), lambda m, x: m(x).square().mean(), (x,)


class BatchedInverse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        a = self.lin(x).view(-1, 4, 4)
        return torch.linalg.inv(a.transpose(1, 2) @ a + torch.eye(4))


def batched_inverse():
    """``torch.linalg.inv`` traces an ``_linalg_check_errors`` node that returns nothing: the SPMD lowering
    bound its (absent) output and failed with KeyError: None."""
    torch.manual_seed(0)
    m = BatchedInverse()
    x = torch.randn(8, 16, generator=_gen())
    return m, torch.optim.SGD(m.parameters(), lr=0.05), lambda m, x: m(x).square().mean(), (x,)


class ShuffleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.act = nn.PReLU(8)
        self.up = nn.PixelShuffle(2)
        self.head = nn.Conv2d(1, 2, 1)

    def forward(self, x):                                       # x [B, 2, 4, 4]
        u = self.up(self.act(self.conv(x)))                     # [B, 2, 8, 8]
        g = F.logsigmoid(F.pixel_unshuffle(u, 2))               # [B, 8, 4, 4]
        return self.head(F.glu(self.up(g), 1))                  # [B, 2, 8, 8]


def prelu_shuffle():
    """nn.PReLU, PixelShuffle / pixel_unshuffle, logsigmoid and glu: opaque before session 29's probes, so
    data parallelism gathered the batch before each."""
    torch.manual_seed(0)
    m = ShuffleNet()
    g = _gen()
    x, y = torch.randn(8, 2, 4, 4, generator=g), torch.randn(8, 2, 8, 8, generator=g)
    return m, torch.optim.SGD(m.parameters(), lr=0.05), lambda m, x, y: F.mse_loss(m(x), y), (x, y)


def float32_target():
    """A target made with ``.float()`` beside a float64 model: capture's fake kernel of binary_cross_entropy
    accepts the mix, the real one does not (nor does eager PyTorch)."""
    torch.manual_seed(0)
    m = nn.Linear(16, 16)
    g = _gen()
    x, t = torch.randn(8, 16, generator=g), torch.randint(0, 2, (8, 16), generator=g).float()
    return m, torch.optim.SGD(m.parameters(), lr=0.05), \
        lambda m, x, t: F.binary_cross_entropy(torch.sigmoid(m(x)), t), (x, t)
