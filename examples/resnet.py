"""A small ResNet (BasicBlocks with BatchNorm, in-place ReLU and residual ``+=``) for ckplan.

Exercises the traps a convnet brings: BatchNorm running statistics must be
updated once per step even when a block is recomputed, and in-place ops must
not be recomputed from modified inputs. ``ckplan examples/resnet.py --budget 60%``.
"""

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
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, widths=(32, 64, 128), blocks_per_stage: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU(inplace=True))
        layers, cin = [], widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                layers.append(BasicBlock(cin, width, stride=2 if i > 0 and j == 0 else 1))
                cin = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


torch.manual_seed(0)
model = ResNet()
_images = torch.randn(16, 3, 32, 32)
_labels = torch.randint(0, 10, (16,))
inputs = (_images,)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, _labels)
