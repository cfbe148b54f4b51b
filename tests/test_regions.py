"""What the strategy pipelines in a model, what it leaves whole on every stage, and what it refuses: a model whose
code does not pass each block's output straight to the next block is refused on its first step, before any block
runs, with the two blocks named and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.stock_models import STOCK_MODELS
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.execution.block_calls import BlockCalls
from lightning_pipe.execution.call_order import PipelineOrderError
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.balance import plan_partition
from lightning_pipe.partition.region import container_region, find_region, outside_parameters, outside_share, suggested_chain
from lightning_pipe.partition.step_probe import random_state_kept, training_step_on
from lightning_pipe.trace.stage_summary import build_stage_summary, outside_warning


def summary_of(name: str):
    torch.manual_seed(0)
    model = STOCK_MODELS[name]()
    region = find_region(model, None, getattr(model, "example_input_array", None))
    blocks = nn.Sequential(*region.blocks(model))
    plan = plan_partition(model, blocks, PipelineParallelConfig(2, 2), None)
    outside = [(name, n, "every stage") for name, n in outside_parameters(model, region)]
    replicated = sum(n for _, n, _ in outside)
    return build_stage_summary(plan, region.label, [1, 0], ["cpu", "cpu"], replicated, 2, "never", outside=outside)


def test_summary_says_what_runs_whole_on_every_stage_with_its_share():
    summary = summary_of("gpt2")
    text = str(summary)
    assert "GPipe: pipelining 'model.transformer.h' (4 blocks) over 2 stages" in text
    # the embeddings and the final norm; the head's weight is the embedding's (tied), counted once
    assert [line.split(" | ") for line in text.splitlines()[-5:]] == [
        ["Outside the blocks    ", "Params", "Held by"],
        ["model.transformer.wte ", "2.0 K ", "every stage"],
        ["model.transformer.wpe ", "1.0 K ", "every stage"],
        ["model.transformer.ln_f", "64    ", "every stage"],
        ["Held by every stage: 6% of the parameters"],
    ]
    assert summary.replicated_parameters == 2048 + 1024 + 64
    assert outside_warning(summary) is None


def test_more_than_a_fifth_of_the_parameters_outside_the_pipeline_warns_naming_the_largest():
    """Lightning's demo transformer: its decoder layers are pipelined, its encoder runs whole on every stage."""
    summary = summary_of("demo")
    assert summary.module_name == "model.transformer.decoder.layers"
    assert summary.outside_share == pytest.approx(21376 / (21376 + 25664))
    warning = outside_warning(summary)
    assert warning is not None
    assert warning.startswith(
        "45% of the model's parameters (21376) are outside the pipelined 'model.transformer.decoder.layers' and run"
        " whole on every stage (more than 20%; the largest is model.transformer.encoder)"
    )
    assert "GPipeStrategy(module_name=...)" in warning


def test_a_resnet_pipelines_its_chain_of_children_and_keeps_only_the_head_whole():
    summary = summary_of("resnet18")
    assert summary.module_name == "model.conv1 .. model.avgpool"
    assert summary.outside == (("model.fc", 650, "every stage"),)
    assert outside_warning(summary) is None


def meta_batch(model) -> list[torch.Tensor] | dict[str, torch.Tensor]:
    batch = next(iter(model.train_dataloader()))
    return {key: t.to("meta") for key, t in batch.items()} if isinstance(batch, dict) else [t.to("meta") for t in batch]


def test_a_chain_that_only_the_training_step_calls_is_found_and_leaves_nothing_outside():
    """Lightning's README autoencoder: forward calls the encoder, training_step the encoder then the decoder. From
    forward and the containers alone, the decoder (half the parameters) would be pipelined; the step's chain holds
    them all and splits them evenly over two stages. The step's run reads no value: a user's hook does not fire."""
    model = STOCK_MODELS["autoencoder"]()
    assert find_region(model, num_stages=2).label == "decoder"
    fired = []
    model.encoder.register_forward_hook(lambda module, args, output: fired.append(output.sum().item()))
    region = find_region(model, step=training_step_on(meta_batch(model)), num_stages=2)
    assert region.names == ("encoder", "decoder")
    assert outside_parameters(model, region) == [] and not fired
    # Four stages cannot split two blocks: the decoder's three layers are what a split can try (and refuse, naming
    # the stage count), as without the step.
    assert find_region(model, step=training_step_on(meta_batch(model)), num_stages=4).label == "decoder"


def test_the_step_search_leaves_the_model_as_it_was_and_finds_both_stacks_of_an_encoder_decoder():
    """Lightning's demo transformer builds its position encoding on its first forward, on the device of its input:
    the run on the meta device must not leave it there. Its step chains `transformer, decoder` (which would put the
    whole nn.Transformer on one stage) and, inside nn.Transformer, the encoder's layers and norm, then the decoder's
    layers, which take the encoder's output: that chain is the region, with less than 10% of the model outside.
    BART's two stacks alike (its masks are read on the way, which the meta device cannot answer)."""
    model = STOCK_MODELS["demo"]()
    region = find_region(model, step=training_step_on(meta_batch(model)), num_stages=2)
    stack = "model.transformer"
    assert region.names == (f"{stack}.encoder.layers.0", f"{stack}.encoder.layers.1", f"{stack}.encoder.norm",
                            f"{stack}.decoder.layers.0", f"{stack}.decoder.layers.1")
    assert outside_share(model, region) < 0.1
    assert model.model.pos_encoder.pe is None
    bart = STOCK_MODELS["bart"]()
    region = find_region(bart, step=training_step_on(meta_batch(bart)), num_stages=2)
    assert region.names == tuple(f"model.model.{stack}.layers.{i}" for stack in ("encoder", "decoder") for i in (0, 1))
    assert outside_share(bart, region) < 0.1


def test_the_warning_names_the_module_name_that_would_pipeline_the_most_parameters():
    model = STOCK_MODELS["autoencoder"]()
    region = find_region(model, num_stages=2)
    assert suggested_chain(model, region) == ["encoder", "decoder"]
    plan = plan_partition(model, nn.Sequential(*region.blocks(model)), PipelineParallelConfig(2, 2), None)
    outside = [(name, n, "every stage") for name, n in outside_parameters(model, region)]
    summary = build_stage_summary(plan, region.label, [1, 0], ["cpu", "cpu"], sum(n for _, n, _ in outside), 2,
                                  "never", outside=outside)
    warning = outside_warning(summary, suggested_chain(model, region))
    assert warning.startswith("50% of the model's parameters (100867) are outside the pipelined 'decoder'")
    assert "GPipeStrategy(module_name=['encoder', 'decoder']) pipelines the most parameters" in warning


def test_the_start_up_search_draws_no_random_number_the_run_would_draw():
    loader = torch.utils.data.DataLoader(torch.arange(10), shuffle=True)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with random_state_kept():
        next(iter(loader))
        torch.rand(5)
    assert torch.equal(torch.rand(3), expected)


# -- models whose blocks are not a chain ------------------------------------------------------------------------


class Scaled(nn.Module):
    """The model's loop changes each block's output before the next block receives it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) * 0.5
        return x


class UNetSkip(nn.Module):
    """A U-Net-style skip: the first block's output reaches the third block past the second."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Bilinear(4, 4, 4)])

    def forward(self, x):
        down = self.blocks[0](x)
        middle = self.blocks[1](down)
        return self.blocks[2](middle, down)


class EncoderDecoder(nn.Module):
    """Two encoder blocks, then two decoder blocks that start from the target and attend to ``memory``: the encoder's
    output (``memory="output"``), the first encoder block's (``"first"``), or the encoder's output changed by the
    model's code between the stacks (``"changed"``)."""

    def __init__(self, memory: str = "output") -> None:
        super().__init__()
        self.memory = memory
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Bilinear(4, 4, 4), nn.Bilinear(4, 4, 4)])

    def forward(self, x):
        first = self.blocks[0](x)
        memory = self.blocks[1](first)
        memory = {"output": memory, "first": first, "changed": memory * 2}[self.memory]
        target = x.flip(0)  # computed from the batch: the decoder's chain starts there
        return self.blocks[3](self.blocks[2](target, memory), memory)


def test_an_encoder_decoder_restarts_the_chain_and_carries_the_encoders_output_to_each_decoder_block():
    """The decoder's first block takes the target, not the encoder's output: the chain restarts there; both decoder
    blocks take the encoder's output, which travels on with the hidden state (its key in the chunk's message)."""
    model = EncoderDecoder()
    region = container_region(model, "blocks")
    stage = StageBlocks(model, region, range(2, 3), 1, 3)
    stage.install()
    received = torch.randn(2, 4)  # the encoder's output, as stage 0 sends it: the travelling value of blocks.1
    sent = {}

    def run_chunk(chunk):
        call = calls.chunk_call(chunk, detach_side_arguments=False)
        sent["carried"] = call.carried
        output, sent["values"] = stage.run_micro_batch(call, 0, 1, False, (), received)
        return output

    calls = BlockCalls(stage, run_chunk)
    calls.begin_step(in_step=True)
    model(torch.randn(2, 4))
    assert [call.restart for call in calls.chain.calls] == [False, False, True, False]
    assert sent["carried"] == ((1, None),)  # blocks.1's output goes on to the stage of blocks.3
    assert list(sent["values"]) == [(1, None)] and torch.equal(sent["values"][(1, None)], received)


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ("changed", "the argument 'input2' of blocks.2 is computed by the model's code from the output of a pipelined"
                    " block"),
        ("first", "blocks.2 takes the output of blocks.0, which does not reach pipeline stage 1"),
    ],
)
def test_an_encoder_output_that_cannot_reach_the_decoder_is_refused_naming_the_blocks(memory, message):
    model = EncoderDecoder(memory)
    stage = StageBlocks(model, container_region(model, "blocks"), range(2, 4), 1, 2)
    stage.install()
    received = torch.randn(2, 4)
    calls = BlockCalls(stage, lambda chunk: stage.run_micro_batch(calls.chunk_call(chunk, False), 0, 1, False, (), received)[0])
    calls.begin_step(in_step=True)
    with pytest.raises(PipelineOrderError, match=message):
        model(torch.randn(2, 4))


class ConcatenatedSkip(nn.Module):
    """A U-Net skip as U-Nets write it: the earlier output concatenated to the next block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 4)])

    def forward(self, x):
        down = self.blocks[0](x)
        middle = self.blocks[1](down)
        return self.blocks[2](torch.cat([middle, down], dim=1))


def first_step(model: nn.Module, stage_index: int, num_stages: int) -> None:
    """The model's calls of its blocks as a pipeline stage sees them in a step, up to the pipeline's run."""
    region = container_region(model, "blocks")
    per_stage = len(region) // num_stages
    local = range(stage_index * per_stage, len(region) if stage_index == num_stages - 1 else (stage_index + 1) * per_stage)
    stage = StageBlocks(model, region, local, stage_index, num_stages)
    stage.install()
    calls = BlockCalls(stage, lambda chunk: pytest.fail("the pipeline ran: the order check came too late"))
    calls.begin_step(in_step=True)
    model(torch.randn(2, 4))


@pytest.mark.parametrize("stage_index", [1, 2])
def test_code_that_changes_a_block_output_is_refused_naming_both_blocks(stage_index):
    """Every stage that holds blocks.1 or a later block refuses before its blocks run (a stage whose blocks all come
    before runs them and hands off; the launcher re-raises the refusing stage's error on every rank)."""
    with pytest.raises(PipelineOrderError) as error:
        first_step(Scaled(), stage_index, num_stages=3)
    assert str(error.value).startswith(
        "the model's code changes the output of blocks.0 before blocks.1 receives it (the first argument of blocks.1"
        " is not what blocks.0 returned). Only code that passes each block's output straight to the next block can be"
        " pipelined: move that code into a block, or pipeline a shorter chain (GPipeStrategy(module_name=...))."
    )


def test_a_skip_past_the_next_block_is_refused_naming_both_blocks():
    with pytest.raises(PipelineOrderError) as error:
        first_step(UNetSkip(), 2, num_stages=3)
    assert str(error.value).startswith(
        "the output of blocks.0 reaches blocks.2 (argument 'input2') past the blocks between them (a skip connection);"
        " a pipeline passes each block's output to the next block only. Keep skip connections inside one block"
    )


def test_a_concatenated_skip_is_refused_at_the_block_whose_input_it_changes():
    with pytest.raises(PipelineOrderError, match="changes the output of blocks.1 before blocks.2 receives it"):
        first_step(ConcatenatedSkip(), 2, num_stages=3)


# -- the pipelined container keeps working as a container -------------------------------------------------------


def test_the_pipelined_container_iterates_indexes_slices_and_counts_as_before():
    model = Scaled()
    blocks = list(model.blocks)
    stage = StageBlocks(model, container_region(model, "blocks"), range(0, 1), stage_index=0, num_stages=2)
    stage.install()
    assert len(model.blocks) == 3
    assert model.blocks[0] is blocks[0]  # this stage's block stays where it is, its state-dict keys unchanged
    assert [type(block).__name__ for block in model.blocks] == ["Linear", "RemoteBlock", "RemoteBlock"]
    assert len(model.blocks[1:]) == 2 and isinstance(model.blocks[1:], nn.ModuleList)
    assert model.blocks[-1].out_features == 4  # a remote block reads through to the original's attributes
    assert not hasattr(model.blocks[2], "weight")  # its weights are another stage's
    assert list(model.state_dict()) == ["blocks.0.weight", "blocks.0.bias"]
    stage.uninstall()
    assert list(model.blocks) == blocks


def test_time_balance_profiles_a_region_whose_first_layers_work_in_place():
    """VGG-11's features: in-place ReLUs, profiled on the example input as the strategy does at set-up (the
    region's blocks are gathered in a Sequential the model never calls: its input is the first block's)."""
    torch.manual_seed(0)
    model = STOCK_MODELS["vgg11"]()
    region = find_region(model, "model.features")
    blocks = nn.Sequential(*region.blocks(model))
    sample = torch.randn(8, 3, 32, 32)
    plan = plan_partition(model, blocks, PipelineParallelConfig(4, 4), "time", sample, torch.device("cpu"))
    assert plan.method == "time" and len(plan.ranges) == 4 and plan.profiles is not None
    assert sum(len(r) for r in plan.ranges) == len(region) == 21
    assert all(p.forward_seconds > 0 for p in plan.profiles)


class MetaCounted(nn.Linear):
    """A block that counts its calls on the meta device (the placeholders of its output)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.meta_calls = 0

    def forward(self, x, scale=1.0, mask=None):
        self.meta_calls += x.is_meta
        return super().forward(x) * scale


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MetaCounted() for _ in range(3)])

    def forward(self, x, scale=1.0, mask=None):
        for block in self.blocks:
            x = block(x, scale=scale, mask=mask)
        return x


def test_blocks_run_on_the_meta_device_once_per_input_signature():
    """A stage answers the model's calls of blocks it does not run now with meta tensors of their output's shape.
    Each block runs on the meta device once per signature (shapes, dtypes, plain values); a later step with the same
    signature gets the same answer again, unless the model's code changed it in place. An argument of another kind
    makes it run every time."""
    model = Chain()
    stage = StageBlocks(model, container_region(model, "blocks"), range(0, 1), stage_index=0, num_stages=2)
    stage.install()
    block_calls = BlockCalls(stage, lambda chunk: None)

    def step(x, **kwargs):
        block_calls.begin_step(in_step=True)
        output = model(x, **kwargs)
        assert output.is_meta and output.shape == (len(x), 4)
        return output, [block.meta_calls for block in model.blocks]

    first, calls = step(torch.randn(8, 4))
    assert calls == [1, 1, 1]
    again, calls = step(torch.randn(8, 4))
    assert calls == [1, 1, 1] and again is first  # the same signature: no block ran, the same answer
    with torch.no_grad():
        first.unsqueeze_(0)  # the model's code changes an answer's shape in place: it is not given out again
    changed, calls = step(torch.randn(8, 4))
    assert calls == [1, 1, 1] and changed is not first and changed.shape == (8, 4)
    with torch.inference_mode():  # Lightning evaluates under it with NCCL: inference tensors, made anew every call
        evaluated = [step(torch.randn(8, 4))[0] for _ in range(2)]
    assert evaluated[0] is not evaluated[1] and step(torch.randn(8, 4))[0] is changed
    assert step(torch.randn(5, 4))[1] == [2, 2, 2]  # another batch size
    assert step(torch.randn(5, 4), scale=2.0)[1] == [3, 3, 3]  # another plain value
    assert step(torch.randn(5, 4), scale=2.0)[1] == [3, 3, 3]
    step(torch.randn(5, 4), mask=object())
    assert step(torch.randn(5, 4), mask=object())[1] == [5, 5, 5]  # an object: no signature, every call runs
