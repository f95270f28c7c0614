"""Convnets and a vision transformer, the shapes real training code has (random weights, small)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout (4 stages x 2 BasicBlocks), narrower."""

    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width, 2 * width, 4 * width, 8 * width]
        cin, stages = width, []
        for i, w in enumerate(widths):
            stages.append(nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)))
            cin = w
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_residual = stride == 1 and cin == cout
        self.conv = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        return x + self.conv(x) if self.use_residual else self.conv(x)


class MobileNetV2(nn.Module):
    """Depthwise-separable inverted residuals with in-place ReLU6, as in torchvision's MobileNetV2."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        config = [(16, 1, 1, 1), (24, 2, 2, 6), (32, 3, 2, 6), (64, 2, 2, 6)]  # (channels, repeats, stride, expand)
        layers = [nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(inplace=True))]
        cin = 16
        for cout, repeats, stride, expand in config:
            for i in range(repeats):
                layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(cin, classes))

    def forward(self, x):
        x = F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)
        return self.classifier(x)


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(self.ln_1(x)).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class ViT(nn.Module):
    """Patch embedding, a class token, learned positions, SDPA encoder blocks with dropout."""

    def __init__(self, image: int = 32, patch: int = 4, width: int = 96, depth: int = 6, heads: int = 4,
                 classes: int = 10, dropout: float = 0.1) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, width, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(width, heads, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor, as timm's and torchvision's ConvNeXt write it."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x):
        y = self.conv_dw(x).permute(0, 2, 3, 1)
        y = self.fc2(self.act(self.fc1(self.norm(y))))
        return x + y.mul(self.gamma).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """timm's and torchvision's ConvNeXt layout (patchify stem, depthwise 7x7 convolutions, channels-last LayerNorm,
    inverted MLPs with layer scale), smaller: its convolutions run through oneDNN on a CPU, which allocates reorders
    inside each op."""

    def __init__(self, depths=(1, 1, 2, 1), dims=(32, 64, 128, 256), classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))
        stages, cin = [], dims[0]
        for i, (depth, dim) in enumerate(zip(depths, dims)):
            down = nn.Identity() if i == 0 else nn.Sequential(LayerNorm2d(cin, eps=1e-6), nn.Conv2d(cin, dim, 2, 2))
            stages.append(nn.Sequential(down, *[ConvNeXtBlock(dim) for _ in range(depth)]))
            cin = dim
        self.stages = nn.Sequential(*stages)
        self.norm, self.head = nn.LayerNorm(cin, eps=1e-6), nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.norm(self.stages(self.stem(x)).mean((2, 3))))


def images(batch: int, size: int = 32) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)),)


def labels_loss(batch: int, classes: int = 10):
    labels = torch.randint(0, classes, (batch,), generator=torch.Generator().manual_seed(1))
    return lambda logits: F.cross_entropy(logits, labels)


class GatedBlock(nn.Module):
    """A residual MLP block with data-dependent control flow: neither fx nor torch.export trace it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(self.ln(x))))
        if h.abs().mean() > 10.0:  # a value-dependent branch, as in gating or overflow guards
            h = h / h.abs().mean()
        return x + self.drop(h)


class GatedTower(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.layers = nn.ModuleList(GatedBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
