"""The seed tutorial's model, fixed: the smallest example.

The tutorial (shared/seeds) wrapped every layer in its own ``checkpoint`` call and
flattened a 64x32x32 feature map with ``view(-1, 64*4*4)``, which silently turned
a batch of 4 into 256 rows and then crashed in the loss. Here the feature map is
pooled down to 4x4 and flattened per sample, and no checkpoint is placed by hand:
ckplan decides (try ``ckplan examples/seed_cnn.py --budget 70%``).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class SeedCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, kernel_size=3, stride=1, padding=1)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, stride=1, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(64 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))   # 32x32 -> 16x16
        x = self.pool(F.relu(self.conv2(x)))   # 16x16 -> 8x8
        x = self.pool(x)                       # 8x8 -> 4x4
        x = x.flatten(1)                       # per sample: (batch, 64*4*4), not view(-1, ...)
        return self.fc(x)


torch.manual_seed(0)
model = SeedCNN()
_images = torch.randn(32, 3, 32, 32)
_labels = torch.randint(0, 10, (32,))
inputs = (_images,)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, _labels)
