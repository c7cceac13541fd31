"""A ResNet-18-shaped image classifier: the model with no repeating transformer block that the
benchmarks and tests hold the estimators to (built by factory: `hybrid.model.convnet:convnet`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a (projected when the shape changes) skip connection."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


@dataclass
class ClassifierOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class ConvNet(nn.Module):
    """A ResNet-18-shaped image classifier: the non-transformer model of the benchmarks (no
    sequence, activations set by image size and channels)."""

    def __init__(self, channels=(64, 128, 256, 512), per_stage: int = 2, classes: int = 1000, image: int = 224):
        super().__init__()
        self.image, self.classes = image, classes
        self.stem = nn.Sequential(nn.Conv2d(3, channels[0], 7, 2, 3, bias=False), nn.BatchNorm2d(channels[0]),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], channels[0]
        for i, cout in enumerate(channels):
            for j in range(per_stage):
                blocks.append(ResBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def example_inputs(self, micro_batch: int) -> dict:
        """A batch of the shape this model trains on (random images and labels)."""
        device = next(self.parameters()).device
        return {"x": torch.randn(micro_batch, 3, self.image, self.image, device=device),
                "labels": torch.randint(0, self.classes, (micro_batch,), device=device)}

    def forward(self, x, labels=None):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        loss = None if labels is None else F.cross_entropy(logits.float(), labels)
        return ClassifierOutput(loss=loss, logits=logits)


def convnet() -> ConvNet:
    """Factory for `hybrid ... hybrid.model.convnet:convnet` (11.7M params, 224x224 images)."""
    return ConvNet()


def small_convnet() -> ConvNet:
    """A CPU-sized ConvNet for measured runs and tests (64x64 images, 100 classes)."""
    return ConvNet(channels=(32, 64, 128, 256), classes=100, image=64)
