"""Blocks whose code cannot run on the meta device (a mixture of experts' routing): the stage holding one computes its
output's shapes on a stand-in input and touches nothing doing so; what cannot work is refused, naming the fix.

The stages that wait for those shapes, and training equal to one device, are in tests/test_stock_pipelines.py
(Mixtral, Qwen2-MoE and a torch.nonzero block at 2 stages under gpipe and 1f1b).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.moe_models import MixtralModule, TopKMoE
from lightning_pipe.execution.block_calls import BlockCalls
from lightning_pipe.execution.call_order import PipelineOrderError
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.region import container_region

pytest.importorskip("transformers")


class Experts(nn.Module):
    """An embedding-free stack of top-k mixture-of-experts blocks (their routing calls torch.nonzero)."""

    def __init__(self, block: type[nn.Module] = TopKMoE, layers: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def one_stage(model: nn.Module, container: str = "blocks", **stage_options) -> tuple[StageBlocks, BlockCalls]:
    """The model as a stage holding every block: each chunk runs for real on the whole batch at its last block."""
    region = container_region(model, container)
    options = {"local": range(len(region)), "stage_index": 0, "num_stages": 1} | stage_options
    stage = StageBlocks(model, region, **options)
    stage.install()

    def run_chunk(chunk):
        call = calls.chunk_call(chunk, detach_side_arguments=False)
        return stage.run_micro_batch(call, 0, 1, False, (), call.stage_input)[0]

    calls = BlockCalls(stage, run_chunk)
    calls.begin_step(in_step=True)
    return stage, calls


def test_a_block_that_cannot_run_on_the_meta_device_gets_its_shapes_from_its_own_stage_touching_nothing():
    """The placeholders of the first blocks come from a run on a stand-in input: the output equals the model's, the
    random state is the one before, the user's hook fires only when the block really runs, once per signature."""
    torch.manual_seed(0)
    model = Experts()
    x = torch.randn(4, 5, 32)
    expected = model(x)
    seen = []
    model.blocks[0].register_forward_hook(lambda module, args, output: seen.append(args[0].shape))
    stage, calls = one_stage(model)
    state = torch.get_rng_state()
    output = model(x)
    assert torch.equal(output, expected)
    assert torch.equal(torch.get_rng_state(), state)
    assert seen == [(4, 5, 32)]  # the chunk's real run only, not the stand-in's
    learned = calls.placeholders.learned
    assert set(learned.not_on_meta) == {0, 1}  # the last block runs for real: no placeholder needed
    assert learned.not_on_meta[0].startswith("NotImplementedError: The register_meta function for torch.nonzero()")
    calls.begin_step(in_step=True)
    model(x)  # the same signature: the shapes are reused, the block is not run again for them
    assert seen == [(4, 5, 32)] * 2


def test_a_call_that_collects_router_logits_is_refused_at_the_first_block():
    """Mixtral's load-balancing loss asked for in the call (not in the config, which set-up refuses): every stage
    refuses at its first block call, before any block runs, naming the flag."""
    module = MixtralModule(layers=2)
    stage, calls = one_stage(module, "model.model.layers")
    tokens = torch.randint(1, 64, (2, 6))
    with pytest.raises(ValueError) as error:
        module.model(input_ids=tokens, labels=tokens, output_router_logits=True)
    assert str(error.value).startswith(
        "The model's call collects every block's router logits with hooks on each module inside the pipelined blocks"
        " (output_router_logits=True), for its load-balancing loss, added to its loss."
    )
    assert "Set output_router_logits=False" in str(error.value)
    calls.begin_step(in_step=True)
    assert module.model(input_ids=tokens, labels=tokens).loss.isfinite()  # without the flag, it runs


def test_virtual_stages_refuse_a_block_that_cannot_run_on_the_meta_device_naming_the_fix():
    """With several chunks per stage the stages that call a block are not the ones after its stage: refused in the
    first step, naming the block, why it cannot run on the meta device and the schedules that work."""
    model = Experts(layers=4)
    with pytest.raises(PipelineOrderError) as error:
        one_stage(model, local={0: range(0, 1), 2: range(2, 3)}, stage_index=0, num_stages=2, num_chunks=4,
                  block_stages={0: 0, 1: 1, 2: 0, 3: 1})[0].model(torch.randn(2, 3, 32))
    assert str(error.value) == (
        "blocks.0 (TopKMoE) cannot run on the meta device (NotImplementedError: The register_meta function for"
        " torch.nonzero() raises unimplemented by default, as a correct data-independent implementation does not"
        " exist. This implementation returns a fake value, assuming all elements of the tensor are non-zero. To"
        " enable this registration, please set 'torch.fx.experimental._config.meta_nonzero_assume_all_nonzero' to"
        " True.), and with several chunks per stage (an interleaved or V-shaped schedule) the stages that call it"
        " cannot learn its output's shapes from the stage holding it. Use a schedule with one chunk per stage"
        " (schedule='gpipe', '1f1b' or 'zero_bubble'), or make the block runnable on the meta device (Hugging Face"
        " mixtures of experts: experts_implementation='batched_mm')."
    )


class Picky(nn.Module):
    """A block that reads its values and refuses negative ones: neither the meta device nor random values do."""

    def forward(self, x):
        if len(torch.nonzero(x < 0)):
            raise ValueError("negative values")
        return x


def test_a_block_that_fails_on_a_stand_in_input_names_both_failures():
    """The first block runs on the model's own input (real: passed as it is), the second on random values."""
    model = Experts(Picky, layers=3)
    with pytest.raises(RuntimeError) as error:
        one_stage(model)[0].model(torch.rand(2, 3))
    assert str(error.value).startswith(
        "blocks.1 (Picky) cannot run on the meta device (NotImplementedError: The register_meta function for"
        " torch.nonzero() raises unimplemented by default"
    )
    assert str(error.value).endswith(
        "nor on a stand-in input of its call's shapes on its own stage, which the pipeline runs to learn the shapes"
        " of its output: ValueError: negative values"
    )
