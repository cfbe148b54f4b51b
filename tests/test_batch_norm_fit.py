"""A micro-batch too small for a BatchNorm fails before training, with the batch size, the micro-batch count and
the fix; and the rule checked is torch's own (the same micro-batch raises in torch, deferred or not)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pipe.execution import batchnorm
from lightning_pipe.execution.batchnorm import (
    check_micro_batches_fit_batch_norm,
    epoch_last_batch_size,
    observed_batch_norm_inputs,
)
from lightning_pipe.partition.microbatch import split

from helpers.stock_models import resnet18


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def shapes_of(layers: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Values per channel per sample of each BatchNorm, seen in a forward of ``x``."""
    with observed_batch_norm_inputs(layers, batch_size=len(x)) as values:
        layers(x)
    return values


def runs_in_torch(layers: nn.Module, x: torch.Tensor, num_micro_batches: int) -> bool:
    """Whether every micro-batch of ``x`` passes through ``layers`` in training (torch's own verdict)."""
    try:
        for micro_batch in split(x, num_micro_batches):
            layers(micro_batch)
    except ValueError as error:
        assert "Expected more than 1 value per channel when training" in str(error)
        return False
    return True


def test_one_sample_per_micro_batch_in_batch_norm_1d_is_refused_with_the_fix():
    layers, x = mlp(), torch.randn(8, 6)
    shapes = shapes_of(layers, x)
    with pytest.raises(ValueError) as error:
        check_micro_batches_fit_batch_norm(layers, shapes, batch_size=8, num_micro_batches=8)
    message = str(error.value)
    assert "BatchNorm1d layer '1' would get 1 value per channel" in message
    assert "a batch of 8 samples in num_micro_batches=8 gives micro-batches of 1 sample," in message
    assert "each sample brings it 1 value per channel" in message
    assert "Use num_micro_batches=4 or fewer, or batches of at least 16 samples" in message
    assert "deferred_batch_norm=True does not help" in message
    assert not runs_in_torch(layers, x, 8)


def test_the_fix_the_message_names_passes_the_check_and_runs():
    layers, x = mlp(), torch.randn(8, 6)
    shapes = shapes_of(layers, x)
    check_micro_batches_fit_batch_norm(layers, shapes, batch_size=8, num_micro_batches=4)
    assert runs_in_torch(layers, x, 4)
    check_micro_batches_fit_batch_norm(layers, shapes, batch_size=16, num_micro_batches=8)
    assert runs_in_torch(layers, torch.randn(16, 6), 8)


def test_deferred_batch_norm_fails_the_same_way_on_one_value_per_channel():
    layers, x = mlp(), torch.randn(8, 6)
    batchnorm.defer(layers)
    assert not runs_in_torch(layers, x, 8)
    with pytest.raises(ValueError, match="deferred_batch_norm=True does not help"):
        check_micro_batches_fit_batch_norm(layers, shapes_of(layers, x), batch_size=8, num_micro_batches=8)


def test_a_resnet_observed_on_the_meta_device_is_refused_where_its_feature_maps_are_1x1():
    """32x32 images shrink to 1x1 in layer4 of a ResNet-18 layout: one sample per micro-batch is one value there,
    while layer3's 2x2 maps still give 4 values per channel."""
    with torch.device("meta"):
        meta_model = resnet18(width=8)
        shapes = shapes_of(meta_model, torch.empty(8, 3, 32, 32))
    with pytest.raises(ValueError) as error:
        check_micro_batches_fit_batch_norm(meta_model, shapes, batch_size=8, num_micro_batches=8)
    assert "BatchNorm2d layer 'layer4.0.bn1' would get 1 value per channel" in str(error.value)
    assert "each sample brings it 1 value per channel" in str(error.value)
    assert "layer3" not in str(error.value)
    check_micro_batches_fit_batch_norm(meta_model, shapes, batch_size=8, num_micro_batches=4)

    torch.manual_seed(0)
    model, x = resnet18(width=8), torch.randn(8, 3, 32, 32)
    assert not runs_in_torch(model, x, 8)
    assert runs_in_torch(model, x, 4)
    assert runs_in_torch(model.layer3, torch.randn(8, 16, 4, 4), 8)  # 2x2 maps after layer3's stride: 4 values


def test_shapes_seen_with_another_batch_size_count_per_sample():
    layers = mlp()
    shapes = shapes_of(layers, torch.randn(2, 6))  # an example input of 2 samples
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert shapes_of(conv, torch.randn(2, 3, 5, 5)) == {"1": 9.0}  # 3x3 maps: 9 values per sample
    with pytest.raises(ValueError, match="micro-batches of 1 sample"):
        check_micro_batches_fit_batch_norm(layers, shapes, batch_size=8, num_micro_batches=8)
    check_micro_batches_fit_batch_norm(layers, shapes, batch_size=8, num_micro_batches=4)


def test_a_batch_smaller_than_the_micro_batch_count_asks_for_the_batch_that_fits_it():
    layers = mlp()
    shapes = shapes_of(layers, torch.randn(3, 6))
    with pytest.raises(ValueError) as error:
        check_micro_batches_fit_batch_norm(layers, shapes, batch_size=3, num_micro_batches=8)
    assert "Use num_micro_batches=1 or fewer, or batches of at least 16 samples" in str(error.value)


def test_a_batch_of_one_sample_is_refused_as_on_one_device():
    layers = mlp()
    with pytest.raises(ValueError) as error:
        check_micro_batches_fit_batch_norm(layers, shapes_of(layers, torch.randn(4, 6)), batch_size=1,
                                           num_micro_batches=4)
    assert "gets 1 value per channel in training: the batch holds 1 sample and each sample brings" in str(error.value)
    assert "on one device either. Use batches of at least 2 samples (or drop_last=True" in str(error.value)


def test_batch_norm_in_evaluation_accepts_any_micro_batch_unless_it_keeps_no_running_statistics():
    layers = mlp().eval()
    shapes = shapes_of(layers, torch.randn(8, 6))
    check_micro_batches_fit_batch_norm(layers, shapes, batch_size=8, num_micro_batches=8)
    assert runs_in_torch(layers, torch.randn(8, 6), 8)
    layers[1] = nn.BatchNorm1d(8, track_running_stats=False).eval()
    with pytest.raises(ValueError, match="would get 1 value per channel"):
        check_micro_batches_fit_batch_norm(layers, shapes, batch_size=8, num_micro_batches=8)
    assert not runs_in_torch(layers, torch.randn(8, 6), 8)


def test_a_pipeline_stage_refuses_a_too_small_micro_batch_before_its_blocks_run():
    """The strategy's check, as the last stage of a ResNet-18 chain (layer2 .. avgpool) makes it in its first
    training step: on the shapes of that step's calls, before any block runs, naming the layer as the model does."""
    from lightning_pipe.partition.region import find_region
    from lightning_pipe.execution.block_calls import BlockCalls
    from lightning_pipe.execution.stage import StageBlocks

    torch.manual_seed(0)
    model, x = resnet18(width=8), torch.randn(8, 3, 32, 32)
    region = find_region(model, None, x[:2])
    assert region.label == "conv1 .. avgpool"
    stage = StageBlocks(model, region, range(5, 9), stage_index=1, num_stages=2)
    stage.install()
    calls = BlockCalls(stage, lambda chunk: calls.check_micro_batches_fit_batch_norm(calls.chunk_call(chunk, False), 8))
    calls.begin_step(in_step=True)
    with pytest.raises(ValueError) as error:
        model(x)
    message = str(error.value)
    assert message.startswith(
        "BatchNorm2d layer 'layer4.0.bn1' would get 1 value per channel in training: a batch of 8 samples in"
        " num_micro_batches=8 gives micro-batches of 1 sample, and each sample brings it 1 value per channel."
        " Use num_micro_batches=4 or fewer, or batches of at least 16 samples."
    )

    def fixed(chunk: int) -> torch.Tensor:  # the fix the message names passes; the pipeline's output stands in after it
        fixed_calls.check_micro_batches_fit_batch_norm(fixed_calls.chunk_call(chunk, False), 4)
        return torch.zeros(8, 64, 1, 1)

    fixed_calls = BlockCalls(stage, fixed)  # the model's calls answered anew, with the fixed count
    fixed_calls.begin_step(in_step=True)
    assert model(x).shape == (8, 10)


def test_the_epochs_last_batch_size_is_read_from_the_loader():
    from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

    data = TensorDataset(torch.randn(19, 6))
    assert epoch_last_batch_size(DataLoader(data, batch_size=8)) == 3
    assert epoch_last_batch_size(DataLoader(data, batch_size=8, drop_last=True)) is None
    assert epoch_last_batch_size(DataLoader(data, batch_size=19)) is None  # every batch is whole
    assert epoch_last_batch_size(DataLoader(data, batch_size=None)) is None  # the dataset gives batches itself
    # A replica's share, as Lightning's DistributedSampler gives it: 10 of 19 samples (padded), in batches of 4.
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    assert epoch_last_batch_size(DataLoader(data, batch_size=4, sampler=sampler)) == 2

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.randn(5, 6))

    assert epoch_last_batch_size(DataLoader(Stream(), batch_size=4)) is None  # its length is unknown


def test_a_pipeline_stage_refuses_an_epochs_last_batch_too_small_for_its_micro_batches():
    """Batches of 8 in 2 micro-batches fit ResNet-18's layer4; the epoch's last batch of 2 samples would give it
    micro-batches of one sample. The check in the first step names that batch and drop_last."""
    from lightning_pipe.partition.region import find_region
    from lightning_pipe.execution.block_calls import BlockCalls
    from lightning_pipe.execution.stage import StageBlocks

    torch.manual_seed(0)
    model, x = resnet18(width=8), torch.randn(8, 3, 32, 32)
    stage = StageBlocks(model, find_region(model, None, x[:2]), range(5, 9), stage_index=1, num_stages=2)
    stage.install()
    calls = BlockCalls(stage, lambda chunk: calls.check_micro_batches_fit_batch_norm(
        calls.chunk_call(chunk, False), 2, epoch_last_batch=2
    ))
    calls.begin_step(in_step=True)
    with pytest.raises(ValueError) as error:
        model(x)
    assert "the epoch's last batch of 2 samples in num_micro_batches=2 gives micro-batches of 1 sample" in str(
        error.value)
    assert "Pass drop_last=True to the training DataLoader to leave that batch out" in str(error.value)
    with pytest.raises(ValueError, match="the epoch's last batch holds 1 sample and .* on one device either. Pass"):
        check_micro_batches_fit_batch_norm(mlp(), {"1": 1.0}, 1, 4, last_of_epoch=True)

    def fits(chunk: int) -> torch.Tensor:  # a last batch of 4 gives micro-batches of 2: 2 values per channel in layer4
        fitting_calls.check_micro_batches_fit_batch_norm(fitting_calls.chunk_call(chunk, False), 2, epoch_last_batch=4)
        return torch.zeros(8, 64, 1, 1)

    fitting_calls = BlockCalls(stage, fits)  # the model's calls answered anew, with the larger last batch
    fitting_calls.begin_step(in_step=True)
    assert model(x).shape == (8, 10)


def test_the_epochs_last_batch_counts_only_if_the_fit_reaches_it():
    """``limit_train_batches`` and ``max_steps`` may end the epoch before its last batch: then it is not checked."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pipe.execution.batchnorm import epoch_last_batch_reached

    loader = DataLoader(TensorDataset(torch.randn(34, 6)), batch_size=8)  # 5 batches, the last of 2 samples

    def fit(num_training_batches=5, max_steps=-1, accumulate_grad_batches=1):
        return SimpleNamespace(train_dataloader=loader, num_training_batches=num_training_batches,
                               max_steps=max_steps, accumulate_grad_batches=accumulate_grad_batches)

    assert epoch_last_batch_reached(fit()) == 2
    assert epoch_last_batch_reached(fit(max_steps=5)) == 2
    assert epoch_last_batch_reached(fit(max_steps=3, accumulate_grad_batches=2)) == 2
    assert epoch_last_batch_reached(fit(num_training_batches=4)) is None  # limit_train_batches=4
    assert epoch_last_batch_reached(fit(max_steps=4)) is None
