"""Small U-Net for per-pixel segmentation.

Two-level encoder (conv + GroupNorm + SiLU, max-pool downsampling), a
bottleneck containing a grouped conv (``groups=2``), a decoder that upsamples
with ``ConvTranspose2d`` and concatenates the encoder skip connections
(``torch.cat``), and a 1x1 conv producing per-pixel class logits. The loss is
per-pixel cross entropy.

``unet.py:batchnorm`` is the same network with BatchNorm (training mode) in place of GroupNorm.

Default size: base width 16, 4 classes, 3x32x32 images, batch 8
(~0.10M parameters). Optimizer: SGD with momentum and weight decay. (Not Adam: Adam's first
steps scale every gradient element to about +-lr, so the float32 rounding noise of the few
near-zero gradient elements of a conv net, which changes with how the batch is split, would show
up at the 1e-5 level in data-parallel comparisons with one device.)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def norm_layer(kind, channels):
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(4, channels)


class ConvBlock(nn.Sequential):
    """Two 3x3 conv -> GroupNorm (or BatchNorm) -> SiLU stages."""

    def __init__(self, cin, cout, groups=1, norm="group"):
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1), norm_layer(norm, cout), nn.SiLU(),
            nn.Conv2d(cout, cout, 3, padding=1, groups=groups), norm_layer(norm, cout), nn.SiLU(),
        )


class UNet(nn.Module):
    def __init__(self, in_ch=3, classes=4, width=16, norm="group"):
        super().__init__()
        w1, w2, w3 = width, 2 * width, 4 * width
        self.enc1 = ConvBlock(in_ch, w1, norm=norm)
        self.enc2 = ConvBlock(w1, w2, norm=norm)
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = ConvBlock(w2, w3, groups=2, norm=norm)
        self.up2 = nn.ConvTranspose2d(w3, w2, kernel_size=2, stride=2)
        self.dec2 = ConvBlock(2 * w2, w2, norm=norm)
        self.up1 = nn.ConvTranspose2d(w2, w1, kernel_size=2, stride=2)
        self.dec1 = ConvBlock(2 * w1, w1, norm=norm)
        self.out = nn.Conv2d(w1, classes, kernel_size=1)

    def forward(self, x):
        s1 = self.enc1(x)                      # [B, w1, H, W]
        s2 = self.enc2(self.pool(s1))          # [B, w2, H/2, W/2]
        x = self.bottleneck(self.pool(s2))     # [B, w3, H/4, W/4]
        x = self.dec2(torch.cat([self.up2(x), s2], dim=1))
        x = self.dec1(torch.cat([self.up1(x), s1], dim=1))
        return self.out(x)                     # [B, classes, H, W]


def loss_fn(model, images, masks):
    return F.cross_entropy(model(images), masks)


def workload(width=16, classes=4, image=32, batch=8, lr=0.05, device="cpu", norm="group"):
    torch.manual_seed(0)
    with torch.device(device):
        model = UNet(3, classes, width, norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)

    if device == "meta":
        images = torch.empty(batch, 3, image, image, device="meta")
        masks = torch.empty(batch, image, image, dtype=torch.long, device="meta")
    else:
        g = torch.Generator().manual_seed(0)
        images = torch.randn(batch, 3, image, image, generator=g).to(device)
        masks = torch.randint(classes, (batch, image, image), generator=g).to(device)
    return model, optimizer, loss_fn, (images, masks)


def batchnorm(width=16, classes=4, image=32, batch=4, lr=0.05, device="cpu"):
    """The U-Net with BatchNorm: every norm's statistics span the whole (global) batch."""
    return workload(width, classes, image, batch, lr, device, norm="batch")
