"""Which blocks the strategy pipelines when nothing names them, and what it says when they cannot be split.

A ResNet as timm builds it with one block per stage (``layer1``..``layer4``, each an ``nn.Sequential`` of one
``BasicBlock``) has no container of two blocks: its largest, ``layer4``, leaves a quarter of the model outside, so
the chain its training step calls (``conv1 .. fc``) is looked for, on the first training batch, before anything is
refused: before launch on the loader given to ``trainer.fit``, at set-up on a DataModule's. Where no chain can be
observed, the refusal names the container it chose, why, and the fixes: the chain as ``module_name=[...]``,
``example_input_array``, fewer stages.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from helpers.compare import merged_state_dict, rank_results, relative_weight_error
from helpers.launch import launch
from helpers.recording import StepLossRecording
from helpers.timm_models import TimmResNetClassifier, timm_resnet_loader
from lightning_pipe import GPipeStrategy
from lightning_pipe.partition.region import TooFewBlocks, chosen_region, find_region
from lightning_pipe.partition.step_probe import training_step_on

STEPS = 4
# BatchNorm normalises by the batch's statistics: one micro-batch gives the pipeline the batch one device sees.
RUNS = [
    {"name": "loader", "data": "loader", "strategy": {"num_micro_batches": 1}},
    {"name": "datamodule", "data": "datamodule", "strategy": {"num_micro_batches": 1}},
]
CHAIN = [f"model.{name}" for name in
         ("conv1", "bn1", "act1", "maxpool", "layer1", "layer2", "layer3", "layer4", "global_pool", "fc")]


class StepLosses(StepLossRecording, Callback):
    pass


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("region_choice")
    launch("region_choice_worker.py", {"devices": 2, "out": str(tmp), "steps": STEPS, "runs": RUNS}, tmp)
    return tmp


@pytest.fixture(scope="module")
def one_device():
    seed_everything(0)
    model = TimmResNetClassifier()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    losses = StepLosses()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[losses])
    trainer.fit(model, timm_resnet_loader())
    return initial, model.state_dict(), losses.losses


@pytest.mark.parametrize("name", [run["name"] for run in RUNS])
def test_a_timm_resnet_trains_as_on_one_device_with_nothing_naming_its_blocks(fitted, one_device, name):
    """Its data given to ``trainer.fit`` as a loader (the check before launch reads it) or as a DataModule (read
    once set up, at set-up)."""
    initial, expected, expected_losses = one_device
    results = rank_results(fitted / name)
    assert [result["region"] for result in results] == [CHAIN, CHAIN]
    losses = next(result["losses"] for result in results if result["losses"])
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert relative_weight_error(initial, expected, merged_state_dict(fitted / name)) < 1e-5
    # Negative control: the comparison sees a change of the weights the size of a tenth of training's.
    moved = {k: v + 0.1 * (expected[k] - initial[k]) if v.is_floating_point() else v for k, v in expected.items()}
    assert relative_weight_error(initial, expected, moved) > 1e-5


def test_where_no_chain_can_be_observed_the_refusal_names_the_container_why_and_the_fixes():
    """Outside a fit no training step shows the chain: refused before launch, naming ``layer4``, its one block, the
    share it leaves outside, the chain to name, ``example_input_array`` and the stage count that would work."""
    trainer = Trainer(strategy=GPipeStrategy(), accelerator="cpu", devices=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError) as refused:
        trainer.validate(TimmResNetClassifier(), timm_resnet_loader())
    assert str(refused.value) == (
        "num_stages=2 needs at least 2 blocks to pipeline, but the pipelined blocks are 'model.layer4' (an"
        " nn.Sequential of 1 block), the container holding the most parameters (73% of the model's; the other 27%"
        " would run whole on every stage). The chains of modules the model calls could not be observed: it has no"
        " example_input_array (nor GPipeStrategy(sample=...)), and this is not a fit, whose training step could show"
        " them; name the chain of modules around it, if the model calls them one after another in this order:"
        f" module_name={CHAIN}, or set `self.example_input_array = <an input of forward>` in the module's __init__,"
        " so that the strategy observes the chain the forward calls, or use at most 1 stage."
    )


def test_each_fix_the_refusal_names_gives_the_chain_the_training_step_calls():
    model = TimmResNetClassifier()
    with pytest.raises(TooFewBlocks) as refused:
        chosen_region(model, None, None, lambda: None, num_stages=2)  # a fit whose first batch cannot be read
    assert refused.value.step_unread and "the first training batch could not be read here" in str(refused.value)
    named = ast.literal_eval(re.search(r"module_name=(\[.*?\])", str(refused.value)).group(1))
    batch = [t.to("meta") for t in next(iter(timm_resnet_loader()))]
    step_chain = chosen_region(model, None, None, lambda: training_step_on(batch), num_stages=2)
    assert list(step_chain.names) == named == CHAIN
    assert list(chosen_region(model, named, None, None, num_stages=2).names) == CHAIN
    assert list(find_region(model, None, torch.zeros(2, 3, 32, 32), num_stages=2).names) == CHAIN  # example input


def test_a_named_container_of_too_few_blocks_is_refused_naming_the_chain_around_it():
    with pytest.raises(TooFewBlocks, match=re.escape(
        "num_stages=2 needs at least 2 blocks to pipeline, but module_name='model.layer4' names 'model.layer4' (an"
        f" nn.Sequential of 1 block); name the chain of modules around it, if the model calls them one after another"
        f" in this order: module_name={CHAIN}, or use at most 1 stage."
    )):
        chosen_region(TimmResNetClassifier(), "model.layer4", None, None, num_stages=2)
    with pytest.raises(TooFewBlocks, match=r"^num_stages=6 with virtual_stages=2 needs at least 12 blocks to pipeline,"
                                           r" .*use at most 5 stages\.$"):
        chosen_region(TimmResNetClassifier(), CHAIN, None, None, num_stages=6, virtual_stages=2)
