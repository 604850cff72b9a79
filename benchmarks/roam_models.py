"""The models of the ROAM paper's evaluation, written by hand (no torchvision) as Rhino workloads.

ROAM (arXiv 2310.19295; github HuiyaoShu/ROAM, ``roam/tools/load_models.py``) traces torchvision
``alexnet``, ``vgg11``, ``mnasnet0_5``, ``mobilenet_v2``, ``efficientnet_b0``, ``vit_b_16`` on
3x224x224 inputs, the torchtext RoBERTa-base encoder, and Hugging Face GPT-2 XL, each trained with
``Adam(lr=0.1, weight_decay=1e-4)`` and ``CrossEntropyLoss``. The definitions below follow the
torchvision 0.x architectures layer for layer (same parameter counts); only the weights' values differ
(none are needed: everything is built on the meta device unless ``device`` says otherwise).

Choices where ROAM's setup is not a standard classification step (said again in docs/benchmarks.md):

- The CNNs and ViT get integer class labels (1000 classes), as a normal training step; ROAM used
  ``CrossEntropyLoss(out, zeros_like(out))`` (probability targets), which has the same tensor sizes.
- "bert": RoBERTa-base encoder (vocabulary 50265, 12 layers, hidden 768, 514 positions) from
  ``transformers.RobertaConfig``, plus a linear classification head on the first token (2 classes).
  Sequence length 4: ROAM feeds the sentence "Hello world" through the torchtext RoBERTa transform,
  which gives ``<s> Hello world </s>``. Dropout 0.1 as in the torchtext encoder (training mode).
- "gpt2-XL": ``transformers.GPT2Model`` (no LM head, as ROAM's wrapper returns the last hidden state),
  48 layers, hidden 1600, 25 heads, sequence 1024; the loss is the cross-entropy of the hidden states
  over their 1600 features (ROAM: cross-entropy against ``zeros_like`` of the hidden states). ROAM
  loads it with ``from_pretrained``, which puts the model in eval mode, so dropout is 0 here.
- The torchvision models are fresh modules, i.e. in training mode: dropout and (EfficientNet)
  stochastic depth are active, BatchNorm uses batch statistics and updates its running buffers.
- Attention is computed as ROAM's torch 1.13 computed it: the attention matrix is materialised (ViT:
  a hand-written ``nn.MultiheadAttention`` equivalent; RoBERTa and GPT-2: ``attn_implementation="eager"``),
  not a fused scaled-dot-product kernel that would keep it out of memory.

Workload functions: ``<model>_<batch>`` for every (model, batch) of ROAM's tables, e.g.
``rhino memory benchmarks/roam_models.py:vit_32``; ``build(name, batch, device)`` is the general form.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "BATCHES", "build"]

MODELS = ("alexnet", "vgg", "mnasnet", "mobilenet", "efficientnet", "vit", "bert", "gpt2-XL")
BATCHES = {name: (1, 32) for name in MODELS}
BATCHES["gpt2-XL"] = (1, 2, 4)


# ---------------------------------------------------------------------------------------------
# AlexNet and VGG11 (torchvision.models.alexnet / vgg11)

class AlexNet(nn.Module):
    def __init__(self, classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class VGG11(nn.Module):
    CFG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")

    def __init__(self, classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(cin, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
            nn.Linear(4096, classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


# ---------------------------------------------------------------------------------------------
# MobileNetV2 (torchvision.models.mobilenet_v2)

def _make_divisible(v: float, divisor: int = 8, min_value: int | None = None) -> int:
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def _conv_bn_act(cin, cout, k=3, stride=1, groups=1, act=nn.ReLU6, eps=1e-5, momentum=0.1):
    layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
              nn.BatchNorm2d(cout, eps=eps, momentum=momentum)]
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


class _InvertedResidualV2(nn.Module):
    def __init__(self, cin, cout, stride, expand):
        super().__init__()
        hidden = int(round(cin * expand))
        self.use_res = stride == 1 and cin == cout
        layers = [] if expand == 1 else [_conv_bn_act(cin, hidden, k=1)]
        layers += [_conv_bn_act(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, 1, 0, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        cin, last = _make_divisible(32), _make_divisible(1280)
        features: list[nn.Module] = [_conv_bn_act(3, cin, stride=2)]
        for t, c, n, s in self.SETTINGS:
            cout = _make_divisible(c)
            for i in range(n):
                features.append(_InvertedResidualV2(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(_conv_bn_act(cin, last, k=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(last, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


# ---------------------------------------------------------------------------------------------
# MNASNet 0.5 (torchvision.models.mnasnet0_5)

_MNAS_BN_MOMENTUM = 1 - 0.9997


def _round_to_multiple_of(val: float, divisor: int, round_up_bias: float = 0.9) -> int:
    new_val = max(divisor, int(val + divisor / 2) // divisor * divisor)
    return new_val if new_val >= round_up_bias * val else new_val + divisor


class _MnasResidual(nn.Module):
    def __init__(self, cin, cout, k, stride, expand):
        super().__init__()
        mid = cin * expand
        self.apply_residual = cin == cout and stride == 1
        m = _MNAS_BN_MOMENTUM
        self.layers = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid, momentum=m), nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, k, padding=k // 2, stride=stride, groups=mid, bias=False),
            nn.BatchNorm2d(mid, momentum=m), nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout, momentum=m))

    def forward(self, x):
        return self.layers(x) + x if self.apply_residual else self.layers(x)


def _mnas_stack(cin, cout, k, stride, expand, repeats):
    return nn.Sequential(_MnasResidual(cin, cout, k, stride, expand),
                         *[_MnasResidual(cout, cout, k, 1, expand) for _ in range(repeats - 1)])


class MNASNet(nn.Module):
    def __init__(self, alpha: float = 0.5, classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        d = [_round_to_multiple_of(v * alpha, 8) for v in (32, 16, 24, 40, 80, 96, 192, 320)]
        m = _MNAS_BN_MOMENTUM
        self.layers = nn.Sequential(
            nn.Conv2d(3, d[0], 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(d[0], momentum=m),
            nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[0], 3, padding=1, stride=1, groups=d[0], bias=False),
            nn.BatchNorm2d(d[0], momentum=m), nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[1], 1, padding=0, stride=1, bias=False), nn.BatchNorm2d(d[1], momentum=m),
            _mnas_stack(d[1], d[2], 3, 2, 3, 3), _mnas_stack(d[2], d[3], 5, 2, 3, 3),
            _mnas_stack(d[3], d[4], 5, 2, 6, 3), _mnas_stack(d[4], d[5], 3, 1, 6, 2),
            _mnas_stack(d[5], d[6], 5, 2, 6, 4), _mnas_stack(d[6], d[7], 3, 1, 6, 1),
            nn.Conv2d(d[7], 1280, 1, padding=0, stride=1, bias=False), nn.BatchNorm2d(1280, momentum=m),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(1280, classes))

    def forward(self, x):
        return self.classifier(self.layers(x).mean([2, 3]))


# ---------------------------------------------------------------------------------------------
# EfficientNet-B0 (torchvision.models.efficientnet_b0)

def _stochastic_depth(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """torchvision.ops.stochastic_depth, mode "row"."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    noise = torch.empty([x.shape[0]] + [1] * (x.ndim - 1), dtype=x.dtype, device=x.device).bernoulli_(survival)
    return x * noise.div_(survival)


class _SqueezeExcitation(nn.Module):
    def __init__(self, channels, squeeze):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        s = F.adaptive_avg_pool2d(x, 1)
        return x * torch.sigmoid(self.fc2(F.silu(self.fc1(s))))


class _MBConv(nn.Module):
    def __init__(self, expand, k, stride, cin, cout, sd_prob):
        super().__init__()
        self.use_res = stride == 1 and cin == cout
        bn = dict(eps=1e-3, momentum=0.1)  # torchvision efficientnet_b0: BatchNorm2d(eps=1e-3)
        mid = _make_divisible(cin * expand)
        layers: list[nn.Module] = []
        if mid != cin:
            layers.append(_conv_bn_act(cin, mid, k=1, act=nn.SiLU, **bn))
        layers += [_conv_bn_act(mid, mid, k=k, stride=stride, groups=mid, act=nn.SiLU, **bn),
                   _SqueezeExcitation(mid, max(1, cin // 4)),
                   _conv_bn_act(mid, cout, k=1, act=None, **bn)]
        self.block = nn.Sequential(*layers)
        self.sd_prob = sd_prob

    def forward(self, x):
        y = self.block(x)
        return _stochastic_depth(y, self.sd_prob, self.training) + x if self.use_res else y


class EfficientNetB0(nn.Module):
    # expand, kernel, stride, in, out, layers
    SETTINGS = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
                (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1))

    def __init__(self, classes: int = 1000, dropout: float = 0.2, stochastic_depth: float = 0.2) -> None:
        super().__init__()
        bn = dict(eps=1e-3, momentum=0.1)
        layers: list[nn.Module] = [_conv_bn_act(3, 32, stride=2, act=nn.SiLU, **bn)]
        total = sum(s[5] for s in self.SETTINGS)
        block_id = 0
        for expand, k, stride, cin, cout, n in self.SETTINGS:
            stage = []
            for i in range(n):
                stage.append(_MBConv(expand, k, stride if i == 0 else 1, cin if i == 0 else cout, cout,
                                     stochastic_depth * block_id / total))
                block_id += 1
            layers.append(nn.Sequential(*stage))
        layers.append(_conv_bn_act(320, 1280, k=1, act=nn.SiLU, **bn))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout, inplace=True), nn.Linear(1280, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


# ---------------------------------------------------------------------------------------------
# ViT-B/16 (torchvision.models.vit_b_16)

class _SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` as torch 1.13 ran it (ROAM's version): the attention matrix is materialised
    (``softmax(q k^T / sqrt(d)) v``), no fused SDPA kernel. Same parameters (packed in-projection)."""

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(hidden, 3 * hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        d = h // self.heads
        q, k, v = self.in_proj(x).view(b, t, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        a = torch.softmax((q * d ** -0.5) @ k.transpose(-2, -1), dim=-1)
        return self.out_proj((a @ v).transpose(1, 2).reshape(b, t, h))


class _EncoderBlock(nn.Module):
    def __init__(self, heads, hidden, mlp):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = _SelfAttention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, hidden),
                                 nn.Dropout(0.0))

    def forward(self, x):
        x = x + self.self_attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    def __init__(self, image=224, patch=16, layers=12, heads=12, hidden=768, mlp=3072, classes=1000):
        super().__init__()
        self.patch, self.hidden = patch, hidden
        self.conv_proj = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        seq = (image // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, hidden).normal_(std=0.02))
        self.layers = nn.Sequential(*[_EncoderBlock(heads, hidden, mlp) for _ in range(layers)])
        self.ln = nn.LayerNorm(hidden, eps=1e-6)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        n = x.shape[0]
        x = self.conv_proj(x).reshape(n, self.hidden, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1) + self.pos_embedding
        x = self.ln(self.layers(x))
        return self.head(x[:, 0])


# ---------------------------------------------------------------------------------------------
# RoBERTa-base encoder + classification head, GPT-2 XL body (transformers configs, random weights)

class RobertaClassifier(nn.Module):
    def __init__(self, classes: int = 2) -> None:
        super().__init__()
        from transformers import RobertaConfig, RobertaModel
        config = RobertaConfig(vocab_size=50265, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                               intermediate_size=3072, max_position_embeddings=514, type_vocab_size=1,
                               layer_norm_eps=1e-5, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                               pad_token_id=1, attn_implementation="eager")
        self.encoder = RobertaModel(config, add_pooling_layer=False)
        self.head = nn.Linear(768, classes)

    def forward(self, ids):
        return self.head(self.encoder(input_ids=ids).last_hidden_state[:, 0])


class GPT2Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model
        config = GPT2Config(n_layer=48, n_embd=1600, n_head=25, n_positions=1024, vocab_size=50257,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                            attn_implementation="eager")
        self.model = GPT2Model(config)

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


# ---------------------------------------------------------------------------------------------

def _ce(model, x, y):
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


_IMAGE = {"alexnet": AlexNet, "vgg": VGG11, "mnasnet": MNASNet, "mobilenet": MobileNetV2,
          "efficientnet": EfficientNetB0, "vit": ViT}
BERT_SEQ = 4     # "<s> Hello world </s>" (ROAM's input sentence through the torchtext RoBERTa transform)
GPT2_SEQ = 1024


def build(name: str, batch: int, device: str = "meta"):
    """``(model, optimizer, loss_fn, batch)`` for ROAM model ``name`` (see ``MODELS``) at ``batch``."""
    if name not in MODELS:
        raise ValueError(f"unknown ROAM model {name!r}; choose one of {', '.join(MODELS)}")
    torch.manual_seed(0)
    with torch.device(device):
        if name in _IMAGE:
            model = _IMAGE[name]()
            x = torch.randn(batch, 3, 224, 224)
            y = torch.randint(0, 1000, (batch,))
        elif name == "bert":
            model = RobertaClassifier()
            x = torch.randint(3, 50265, (batch, BERT_SEQ))
            y = torch.randint(0, 2, (batch,))
        else:
            model = GPT2Body()
            x = torch.randint(0, 50257, (batch, GPT2_SEQ))
            y = torch.zeros(batch * GPT2_SEQ, dtype=torch.long)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, weight_decay=1e-4)
    return model, optimizer, _ce, (x, y)


def _register() -> None:
    for name in MODELS:
        for b in BATCHES[name]:
            fn = functools.partial(build, name, b)
            fn.__doc__ = f"ROAM {name}, batch {b}, meta device."
            globals()[f"{name.replace('-', '_').lower()}_{b}"] = fn


_register()
