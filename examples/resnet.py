"""Small ResNet-style image classifier.

Conv stem with BatchNorm and max-pool, residual basic blocks (one of them
downsampling with stride 2 and a 1x1 projection shortcut), a depthwise-
separable residual block (depthwise conv with ``groups=channels``), adaptive
average pooling and a linear classifier. BatchNorm runs in training mode, so
its running statistics are updated by every step.

Default size: widths 16/32, 10 classes, 3x32x32 images, batch 8
(~21K parameters). Optimizer: SGD, momentum 0.9, Nesterov, weight decay 5e-4.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def conv_bn(cin, cout, kernel=3, stride=1, groups=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    )


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = conv_bn(cin, cout, stride=stride)
        self.conv2 = conv_bn(cout, cout)
        self.shortcut = conv_bn(cin, cout, kernel=1, stride=stride) if stride != 1 or cin != cout else nn.Identity()

    def forward(self, x):
        return F.relu(self.conv2(F.relu(self.conv1(x))) + self.shortcut(x))


class DepthwiseSeparableBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.depthwise = conv_bn(channels, channels, groups=channels)
        self.pointwise = conv_bn(channels, channels, kernel=1)

    def forward(self, x):
        return F.relu(self.pointwise(F.relu(self.depthwise(x))) + x)


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32), classes=10):
        super().__init__()
        w1, w2 = widths
        self.stem = nn.Sequential(conv_bn(3, w1), nn.ReLU(), nn.MaxPool2d(2))
        self.layer1 = BasicBlock(w1, w1)
        self.layer2 = BasicBlock(w1, w2, stride=2)
        self.layer3 = DepthwiseSeparableBlock(w2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w2, classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(self.pool(x).flatten(1))


def loss_fn(model, images, labels):
    return F.cross_entropy(model(images), labels)


def workload(width=16, classes=10, image=32, batch=8, lr=0.1, device="cpu"):
    torch.manual_seed(0)
    with torch.device(device):
        model = ResNet((width, 2 * width), classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)

    if device == "meta":
        images = torch.empty(batch, 3, image, image, device="meta")
        labels = torch.empty(batch, dtype=torch.long, device="meta")
    else:
        g = torch.Generator().manual_seed(0)
        images = torch.randn(batch, 3, image, image, generator=g).to(device)
        labels = torch.randint(classes, (batch,), generator=g).to(device)
    return model, optimizer, loss_fn, (images, labels)
