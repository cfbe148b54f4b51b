"""A ResNet as timm builds it (``timm.create_model("resnet18", layers=[1, 1, 1, 1])``), in a LightningModule as its
users write one: no ``example_input_array``, the data handed to ``trainer.fit``.

timm is not a test dependency (and torchvision does not import with the CPU build of torch used here): the classes
below follow ``timm/models/resnet.py`` and ``timm/layers/adaptive_avgmax_pool.py`` (module names, registration order,
forward, ``zero_init_last``), so that what works on them works on timm's. What sets timm's layout apart from
torchvision's: ``act1`` for the stem's activation, ``global_pool`` (a module that pools and flattens) for
``avgpool`` + ``torch.flatten``, a forward split into ``forward_features`` and ``forward_head``, and the last batch
norm of each block starting at zero. With one block per stage (``layers=[1, 1, 1, 1]``) no container holds more than
one block: the blocks to pipeline are the chain of the model's children.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader

from helpers.stock_models import images


class BasicBlock(nn.Module):
    """timm's ``BasicBlock`` without its optional parts (drop block, anti-aliasing, attention, drop path: off by
    default, each an ``nn.Identity`` or ``None`` there)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.drop_block = nn.Identity()
        self.act1 = nn.ReLU(inplace=True)
        self.aa = nn.Identity()
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.se = None
        self.act2 = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path = None

    def zero_init_last(self) -> None:
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.drop_block(x)
        x = self.act1(x)
        x = self.aa(x)
        x = self.conv2(x)
        x = self.bn2(x)
        if self.downsample is not None:
            shortcut = self.downsample(shortcut)
        x += shortcut
        return self.act2(x)


class SelectAdaptivePool2d(nn.Module):
    """timm's global pool: average over the feature map, then flattened."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.flatten(self.pool(x))


class ResNet(nn.Module):
    """timm's ``ResNet`` with ``BasicBlock`` (``resnet18`` is ``layers=[2, 2, 2, 2]``); ``width`` is its 64."""

    def __init__(self, layers: list[int], num_classes: int = 10, width: int = 64, drop_rate: float = 0.0) -> None:
        super().__init__()
        self.drop_rate = drop_rate
        self.grad_checkpointing = False
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.act1 = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        inplanes = width
        for index, (blocks, planes) in enumerate(zip(layers, [width, 2 * width, 4 * width, 8 * width])):
            stride = 1 if index == 0 else 2
            downsample = None
            if stride != 1 or inplanes != planes:  # timm's downsample_conv: a 1x1 convolution and a norm
                downsample = nn.Sequential(
                    nn.Conv2d(inplanes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes)
                )
            stage = [BasicBlock(inplanes, planes, stride, downsample)]
            stage += [BasicBlock(planes, planes) for _ in range(1, blocks)]
            self.add_module(f"layer{index + 1}", nn.Sequential(*stage))
            inplanes = planes
        self.num_features = inplanes
        self.global_pool = SelectAdaptivePool2d()
        self.fc = nn.Linear(self.num_features, num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        for module in self.modules():
            if hasattr(module, "zero_init_last"):
                module.zero_init_last()

    def forward_features(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.act1(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        return x

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.global_pool(x)
        if self.drop_rate:
            x = F.dropout(x, p=float(self.drop_rate), training=self.training)
        return x if pre_logits else self.fc(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))


def timm_resnet(layers: list[int] | None = None, width: int = 8, num_classes: int = 10) -> ResNet:
    """``timm.create_model("resnet18", layers=[1, 1, 1, 1], num_classes=10)`` at ``width`` channels instead of 64."""
    return ResNet(layers or [1, 1, 1, 1], num_classes=num_classes, width=width)


class TimmResNetClassifier(LightningModule):
    """A timm ResNet fine-tuned as its users write it: no ``example_input_array``, SGD, cross entropy; its data
    (:func:`timm_resnet_loader`) given to ``trainer.fit``, not defined on the module."""

    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.model = timm_resnet(width=width)
        self.lr = lr

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def timm_resnet_loader(samples: int = 32, batch_size: int = 8) -> DataLoader:
    return DataLoader(images(samples, seed=0), batch_size=batch_size)
