"""Small LightningModules shaped like real projects, shared by the tests and their worker scripts."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch._dynamo import register_backend
from torch._dynamo.backends.registry import lookup_backend
from torch.utils.data import DataLoader, TensorDataset

from helpers import stock_models


class Component(nn.Module):
    """A model component holding the layers to pipeline in ``self.model``, with a reshape before the call."""

    def __init__(self, in_features: int = 12, hidden: int = 16, depth: int = 8) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth // 2):
            layers += [nn.Linear(in_features if i == 0 else hidden, hidden), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        return self.model(x.view(batch, -1))


class PipeClassifier(LightningModule):
    """Nested pipelined Sequential (``net.model``), a replicated parameter before it and a replicated head after."""

    def __init__(self, lr: float = 0.5, depth: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.lr = lr
        self.input_scale = nn.Parameter(torch.ones(3, 4))
        self.net = Component(depth=depth)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x * self.input_scale))

    sync_dist = False  # whether the logged values are averaged over data-parallel replicas

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=not self.sync_dist, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=self.sync_dist)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def classification_data(samples: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, 4, generator=generator)
    y = (x.sum(dim=(1, 2)) > 0).long() + (x[:, 0, 0] > 1).long()
    return TensorDataset(x, y)


def loaders(
    train_samples: int, val_samples: int, batch_size: int, shuffle: bool = False
) -> tuple[DataLoader, DataLoader]:
    return (
        DataLoader(classification_data(train_samples, seed=0), batch_size=batch_size, shuffle=shuffle),
        DataLoader(classification_data(val_samples, seed=1), batch_size=batch_size),
    )


class PairBlock(nn.Module):
    """A layer that takes and returns a tuple (features, mask), as stages passing several tensors do."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, mask = pair
        return torch.tanh(self.linear(x)) * mask, mask


class AddMask(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, (x[:, :1] > -0.5).float()


class TupleClassifier(PipeClassifier):
    """Stages exchange a tuple of a float tensor and a mask that needs no gradient."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net.model = nn.Sequential(nn.Linear(12, 16), AddMask(), *[PairBlock(16) for _ in range(6)])

    def forward(self, x):
        features, _ = self.net(x * self.input_scale)
        return self.head(features)


class SkipsSomeSteps(PipeClassifier):
    """``training_step`` returns None on batch 2: no backward and no update, as on one device."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 2 else {"loss": loss}


class SkipsBeforeTheModel(PipeClassifier):
    """``training_step`` returns None on batch 2 before calling the model: no stage runs its layers, no update."""

    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            return None
        return super().training_step(batch, batch_idx)


class SkipsSomeMicroBatches(PipeClassifier):
    """``training_step`` returns None before calling the model when its batch's first value is above 1.5: with the
    classifier's data in batches (or micro-batches) of 4, batches 2, 9 and 18 of 20."""

    def training_step(self, batch, batch_idx):
        if batch[0][0, 0, 0] > 1.5:
            return None
        return super().training_step(batch, batch_idx)


class PoisonedGradient(PipeClassifier):
    """At batch 2, an inf lands in the gradient of layer 0 (on the first stage only, in a pipeline)."""

    def on_after_backward(self):
        first_layer = self.net.model[0]  # on the other stages, the stand-in of a layer held elsewhere
        if self.trainer.fit_loop.epoch_loop.batch_idx == 2 and getattr(first_layer, "weight", None) is not None:
            first_layer.weight.grad[0, 0] = float("inf")


class BatchNormClassifier(PipeClassifier):
    """BatchNorm inside the pipelined Sequential, on the first and a later stage."""

    def __init__(self, lr: float = 0.5, layers_with_batch_norm: tuple[int, ...] = (1, 5)) -> None:
        super().__init__(lr=lr)
        layers: list[nn.Module] = []
        for i in range(8):
            if i in layers_with_batch_norm:
                layers.append(nn.BatchNorm1d(16))
            elif i % 2 == 0:
                layers.append(nn.Linear(12 if i == 0 else 16, 16))
            else:
                layers.append(nn.Tanh())
        self.net.model = nn.Sequential(*layers)


class OneBatchNormClassifier(BatchNormClassifier):
    """A single BatchNorm (layer 5: a later stage), whose input does not depend on how BatchNorm normalises."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr, layers_with_batch_norm=(5,))


class SyncedLogging(PipeClassifier):
    """Logs the loss averaged over data-parallel replicas, as a data-parallel project does."""

    sync_dist = True


class DropoutClassifier(PipeClassifier):
    """Dropout on some stages only: each stage draws a different amount of randomness per step."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net.model[1] = nn.Sequential(nn.Tanh(), nn.Dropout(0.3))


class TwoDropoutsClassifier(PipeClassifier):
    """``Linear, Dropout(0.5), Linear, Dropout(0.5)``: on 2 stages a dropout layer per stage, on 4 one on stages 1 and 3;
    the two layers see inputs of the same shape, so their masks can be compared element by element."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net.model = nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))


class ResettablePipeClassifier(PipeClassifier):
    """Can be created on the meta device (``init_module(empty_init=True)``): its own parameter has an initialiser."""

    def reset_parameters(self) -> None:
        nn.init.ones_(self.input_scale)


class DeferredPipeClassifier(PipeClassifier):
    """Builds its pipelined layers in ``configure_model`` (the memory-efficient way), seeded per layer."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr)
        self.net = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.net is None:  # Lightning calls it again for each trainer function
            import lightning_pipe  # here: loading a checkpoint of the other models must not need it

            self.net = Component()
            lightning_pipe.init_weights(self)  # seeded by each layer's name in the whole model


class TiedAcrossStages(PipeClassifier):
    """Layer 6 (the last stage) uses layer 2's weight (the first stage): one parameter on two stages."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net.model[6].weight = self.net.model[2].weight


class DeferredTiedAcrossStages(DeferredPipeClassifier):
    """Built in ``configure_model`` (on the meta device under the gpipe strategy), layer 6 using layer 2's weight."""

    def configure_model(self) -> None:
        if self.net is None:
            import lightning_pipe

            self.net = Component()
            self.net.model[6].weight = self.net.model[2].weight
            lightning_pipe.init_weights(self)  # on one device, layer 6 initialises the shared weight last


class TiedWithMomentum(TiedAcrossStages):
    """The shared weight has optimizer state (momentum) to checkpoint."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class TiedToOutside(PipeClassifier):
    """A module outside the pipelined one (run on every stage) shares layer 2's weight (the first stage)."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.project = nn.Linear(16, 16)
        self.project.weight = self.net.model[2].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.project(self.net(x * self.input_scale))))


class TiedOutsideOnly(PipeClassifier):
    """GPT-2's tie: an input projection and an output projection outside the pipelined module share a weight."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.embed = nn.Linear(12, 12, bias=False)
        self.unembed = nn.Linear(12, 12, bias=False)
        self.unembed.weight = self.embed.weight
        self.to_embedding = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.net(self.embed(x.view(len(x), 12) * self.input_scale.view(12)))
        return self.unembed(self.to_embedding(hidden))[:, :3]


class TiedEverywhere(TiedOutsideOnly):
    """Both ties at once, trained with Adam: GPT-2's head tied to the input embedding (replicated on every stage) and
    layer 6 using layer 2's weight (two stages). Every rank's copy of a shared tensor must get the same bits."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr=lr)
        self.net.model[6].weight = self.net.model[2].weight

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class SyncedTiedAcrossStages(TiedAcrossStages):
    """A weight shared by two stages' blocks, the loss logged as the average over the data-parallel replicas."""

    sync_dist = True


class SyncedTiedOutsideOnly(TiedOutsideOnly):
    """GPT-2's tie outside the blocks, the loss logged as the average over the data-parallel replicas."""

    sync_dist = True


class Branch(nn.Module):
    """Linear ``a`` or ``b``, chosen by the sign of the input's first value: some micro-batches (and so some replicas)
    use one, some the other; the meta device's shape-only runs take ``b``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if not x.is_meta and x[0, 0] > 0 else self.b(x)


class BranchingClassifier(PipeClassifier):
    """Layer 2 uses one of two linear layers per call, by its input's values: a replica may leave one without a
    gradient where another replica computed one."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net.model[2] = Branch(16)


COMPILE_BACKEND = "counted_aot_eager"
WRAPPER_BACKEND = "counted_aot_eager_wrapper"  # the same, counted apart: a block wrapped by torch.compile(block)
compiled_graphs = {COMPILE_BACKEND: 0, WRAPPER_BACKEND: 0}  # graphs compiled with each backend in this process


def _counted(name: str):
    @register_backend(name=name)
    def counted_aot_eager(graph: torch.fx.GraphModule, example_inputs: list, **kwargs):
        """``aot_eager`` (which traces forward and backward as inductor does, without its C++ compilation), counted."""
        compiled_graphs[name] += 1
        return lookup_backend("aot_eager")(graph, example_inputs, **kwargs)


_counted(COMPILE_BACKEND)
_counted(WRAPPER_BACKEND)


class CompiledPipelined(PipeClassifier):
    """The pipelined module wrapped by ``torch.compile``."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net.model = torch.compile(self.net.model, backend=COMPILE_BACKEND)


class DenseTanh(nn.Module):
    """A block of the model's own (``nn.Module.compile`` leaves a bare ``nn.Linear`` uncompiled)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class CompiledLayers(PipeClassifier):
    """Layers compiled one by one: wrapped by ``torch.compile`` (layer 0, with ``WRAPPER_BACKEND``) and compiled in
    place (``block.compile()``: the ``DenseTanh`` blocks 2 to 5, with ``COMPILE_BACKEND``)."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        blocks = [DenseTanh(16) for _ in range(4)]
        for block in blocks:
            block.compile(backend=COMPILE_BACKEND)
        self.net.model = nn.Sequential(torch.compile(nn.Linear(12, 16), backend=WRAPPER_BACKEND), nn.Tanh(), *blocks)


class CompiledInPlace(PipeClassifier):
    """The pipelined module compiled in place: refused under the gpipe strategy."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net.model.compile(backend=COMPILE_BACKEND)


class CompiledAroundThePipeline(PipeClassifier):
    """A compiled module holding the pipelined one: refused under the gpipe strategy."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.net = torch.compile(self.net, backend=COMPILE_BACKEND)


class Counted(nn.Module):
    """``tanh`` that counts its calls in training mode (forwards and their re-computations)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += int(self.training and not x.is_meta)  # not the shape-only calls of stages without it
        return torch.tanh(x)


class CountsForwards(PipeClassifier):
    """Every activation of the pipelined module counts how often it runs in training."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        for index in range(1, 8, 2):
            self.net.model[index] = Counted()
        self.training_steps = 0  # calls of training_step on real batches (not the start-up's meta-device probe)

    def training_step(self, batch, batch_idx):
        self.training_steps += int(not batch[0].is_meta)
        return super().training_step(batch, batch_idx)

    def forward_counts(self) -> dict[str, int]:
        """Training calls per counted layer that this process holds, and of ``training_step`` (``"training_step"``)."""
        counts = {name: module.calls for name, module in self.named_modules() if isinstance(module, Counted)}
        return {**counts, "training_step": self.training_steps}


class SequenceClassifier(PipeClassifier):
    """Per-position layers over a sequence (batch, length, 4) whose length changes from batch to batch."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.input_scale = nn.Parameter(torch.ones(4))
        self.net.model[0] = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net.model(x * self.input_scale).mean(dim=1))


class EmulatedClassifier(PipeClassifier):
    """A Linear, then seven emulated blocks (``lightning_pipe.testing.emulate``) of 1 ms per forward, input and weight
    gradient, the last twice as heavy: what the schedules-at-scale benchmark trains, small enough for a test."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        from lightning_pipe.testing.emulate import BlockTimes, emulated_blocks

        times = BlockTimes(forward=1e-3, input_gradient=1e-3, weight_gradient=1e-3)
        self.net.model = nn.Sequential(nn.Linear(12, 16), *emulated_blocks(16, [times] * 6 + [times.scaled(2)]))


class AutoEmulatedClassifier(EmulatedClassifier):
    """The emulated classifier with an example input, which ``schedule="auto"`` profiles its blocks on."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.example_input_array = torch.zeros(4, 3, 4)


class BatchNormBeforeTheBlocks(PipeClassifier):
    """BatchNorm outside the pipelined Sequential, on the input: what ``schedule="auto"`` refuses."""

    def __init__(self, lr: float = 0.5) -> None:
        super().__init__(lr=lr)
        self.norm = nn.BatchNorm1d(3)
        self.example_input_array = torch.zeros(4, 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(self.norm(x * self.input_scale)))


SEQUENCE_LENGTHS = (5, 2, 9, 3, 7)


def sequence_loaders(train_samples: int, val_samples: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Batches of sequences whose length cycles through ``SEQUENCE_LENGTHS`` (a loader of ready-made batches)."""

    def batches(samples: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        made = []
        for number, start in enumerate(range(0, samples, batch_size)):
            size, length = min(batch_size, samples - start), SEQUENCE_LENGTHS[number % len(SEQUENCE_LENGTHS)]
            x = torch.randn(size, length, 4, generator=generator)
            made.append((x, (x.mean(dim=(1, 2)) > 0).long() + (x[:, 0, 0] > 1).long()))
        return made

    return (DataLoader(batches(train_samples, 0), batch_size=None),
            DataLoader(batches(val_samples, 1), batch_size=None))


MODELS = {"auto_emulated": AutoEmulatedClassifier, "batchnorm_before": BatchNormBeforeTheBlocks, "dropout": DropoutClassifier, "two_dropouts": TwoDropoutsClassifier, "synced": SyncedLogging, "batchnorm": BatchNormClassifier, "one_batchnorm": OneBatchNormClassifier, "classifier": PipeClassifier, "tuple": TupleClassifier, "skips": SkipsSomeSteps, "skips_before": SkipsBeforeTheModel, "skips_some": SkipsSomeMicroBatches, "poisoned": PoisonedGradient, "deferred": DeferredPipeClassifier, "resettable": ResettablePipeClassifier,
          "tied": TiedAcrossStages, "tied_momentum": TiedWithMomentum,
          "tied_deferred": DeferredTiedAcrossStages, "tied_outside": TiedToOutside, "tied_outside_only": TiedOutsideOnly,
          "tied_everywhere": TiedEverywhere, "synced_tied": SyncedTiedAcrossStages,
          "synced_tied_outside": SyncedTiedOutsideOnly, "branching": BranchingClassifier,
          "compiled": CompiledPipelined, "compiled_layers": CompiledLayers, "counts": CountsForwards,
          "sequences": SequenceClassifier, "llama": stock_models.LlamaModule, "token_mean_llama": stock_models.TokenMeanLlama,
          "sample_weighted_llama": partial(stock_models.LlamaModule, weight_by_samples=True),
          "emulated": EmulatedClassifier}


class ProjectModule(LightningModule):
    """Shaped like a real project: torchmetrics for each split, dict outputs, schedulers, an example input."""

    def __init__(self, lr: float = 0.3, scheduler: str | None = None) -> None:
        super().__init__()
        from torchmetrics import MaxMetric, MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        self.lr, self.scheduler = lr, scheduler
        self.net = Component()
        self.head = nn.Linear(16, 3)
        self.criterion = nn.CrossEntropyLoss()
        self.train_acc, self.val_acc, self.test_acc = (MulticlassAccuracy(num_classes=3) for _ in range(3))
        self.train_loss = MeanMetric()
        self.val_loss_max = MaxMetric()
        self.example_input_array = torch.zeros(4, 3, 4)

    def forward(self, x):
        return self.head(self.net(x))

    def _shared(self, batch):
        x, y = batch
        logits = self(x)
        return self.criterion(logits, y), logits.argmax(dim=1), y

    def training_step(self, batch, batch_idx):
        loss, preds, targets = self._shared(batch)
        self.train_acc(preds, targets)
        self.train_loss(loss)
        self.log("train/loss", self.train_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True, prog_bar=True)
        return {"loss": loss, "preds": preds, "targets": targets}

    def validation_step(self, batch, batch_idx):
        loss, preds, targets = self._shared(batch)
        self.val_acc(preds, targets)
        self.val_loss_max(loss)
        self.log("val_loss", loss, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_epoch=True)
        self.log("val/loss_max", self.val_loss_max, on_epoch=True)

    def test_step(self, batch, batch_idx):
        loss, preds, targets = self._shared(batch)
        self.test_acc(preds, targets)
        self.log("test/loss", loss)
        self.log("test/acc", self.test_acc)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(dim=-1)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.scheduler == "step":
            return {"optimizer": optimizer,
                    "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5), "interval": "step"}}
        if self.scheduler == "epoch":
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}
        if self.scheduler == "plateau":
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}
        return optimizer
