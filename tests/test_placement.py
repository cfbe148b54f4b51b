"""Where each module outside the pipelined blocks runs, found by following its output through the training step on
the meta device (lightning_pipe/partition/placement.py), and how the balance charges it. One process, no launch:
the multi-process consequences (each rank holding only what its stage runs, equal to one device) are in
tests/test_stock_pipelines.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.stock_models import STOCK_MODELS
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.partition.balance import charged, plan_partition
from lightning_pipe.partition.placement import (
    EVERY, LOSS, observe_places, outside_modules, parameter_holders, unobserved_note,
)
from lightning_pipe.partition.region import Region, find_region
from lightning_pipe.partition.step_probe import training_step_on
from lightning_pipe.trace.stage_summary import build_stage_summary

pytest.importorskip("transformers")


def meta_batch(model):
    batch = next(iter(model.train_dataloader()))
    return torch.utils._pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)


def places_of(name: str) -> dict[str, frozenset]:
    model = STOCK_MODELS[name]()
    step = training_step_on(meta_batch(model))
    region = find_region(model, None, getattr(model, "example_input_array", None), step, num_stages=2)
    return observe_places(model, region, step).places


EXPECTED = {
    "gpt2": {"model.transformer.wte": {0}, "model.transformer.wpe": {0}, "model.transformer.ln_f": {LOSS},
             "model.lm_head": {LOSS}},
    "llama": {"model.model.embed_tokens": {0}, "model.model.norm": {LOSS}, "model.lm_head": {LOSS}},
    "qwen2": {"model.model.embed_tokens": {0}, "model.model.norm": {LOSS}, "model.lm_head": {LOSS}},
    "bert": {"model.bert.embeddings": {0}, "model.bert.pooler": {LOSS}, "model.classifier": {LOSS}},
    "vit": {"model.patch_embed": {0}, "model.norm": {LOSS}, "model.head": {LOSS}},
    # The decoder's embedding runs where the decoder's first block (a restart of the chain) is; the shared embedding,
    # never called itself, wherever a module using its weight runs.
    "t5": {"model.shared": {0, 3, LOSS}, "model.encoder.embed_tokens": {0}, "model.decoder.embed_tokens": {3},
           "model.decoder.final_layer_norm": {LOSS}, "model.lm_head": {LOSS}},
    "bart": {"model.model.shared": {0, 2, LOSS}, "model.model.encoder.embed_tokens": {0},
             "model.model.encoder.embed_positions": {0}, "model.model.encoder.layernorm_embedding": {0},
             "model.model.decoder.embed_tokens": {2}, "model.model.decoder.embed_positions": {2},
             "model.model.decoder.layernorm_embedding": {2}, "model.lm_head": {LOSS}},
    "resnet18": {"model.fc": {LOSS}},
    # Mixtures of experts, whose blocks cannot run on the meta device: answered with their input's shapes there.
    "mixtral": {"model.model.embed_tokens": {0}, "model.model.norm": {LOSS}, "model.lm_head": {LOSS}},
    "qwen2_moe": {"model.model.embed_tokens": {0}, "model.model.norm": {LOSS}, "model.lm_head": {LOSS}},
    "topk_moe": {"embedding": {0}, "norm": {LOSS}, "head": {LOSS}},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_embeddings_run_on_the_first_stage_and_the_head_on_the_loss_stage(name):
    assert places_of(name) == {module: frozenset(places) for module, places in EXPECTED[name].items()}


class Conditioned(nn.Module):
    """Blocks that all take a side argument computed outside them: a diffusion model's time embedding."""

    def __init__(self, aux_loss: bool = False) -> None:
        super().__init__()
        self.aux_loss = aux_loss
        self.embed = nn.Linear(4, 8)
        self.time = nn.Sequential(nn.Linear(1, 8), nn.SiLU())
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, t = batch
        h = self.embed(x)
        condition = self.time(t)
        start = h
        for block in self.blocks:
            h = block(h, condition)
        loss = self.head(h).square().mean()
        return loss + start.square().mean() if self.aux_loss else loss


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, h, condition):
        return torch.tanh(self.linear(h) + condition)


def conditioned_places(**options) -> dict[str, frozenset]:
    model = Conditioned(**options)
    batch = (torch.zeros(6, 4, device="meta"), torch.zeros(6, 1, device="meta"))
    region = Region(tuple(f"blocks.{i}" for i in range(4)), "blocks")
    return observe_places(model, region, training_step_on(batch)).places


def test_a_module_whose_output_every_block_takes_stays_on_every_stage():
    places = conditioned_places()
    assert places == {"embed": {0}, "time": {EVERY}, "head": {LOSS}}


def test_an_embedding_the_loss_also_reads_directly_stays_on_every_stage():
    assert conditioned_places(aux_loss=True)["embed"] == {EVERY}


def test_a_step_that_cannot_run_on_the_meta_device_keeps_every_module_on_every_stage():
    model = Conditioned()
    region = Region(tuple(f"blocks.{i}" for i in range(4)), "blocks")

    def step(module):
        h = module.embed(torch.zeros(6, 4, device="meta"))
        h.sum().item() > 0 and None  # reads a value: answered on the meta device
        raise RuntimeError("a step that needs real values")

    places = observe_places(model, region, step)
    assert set(places.places.values()) == {frozenset({EVERY})}
    assert places.unobserved == "RuntimeError: a step that needs real values"
    assert unobserved_note(places, model, region).startswith(
        "The training step could not run on the meta device on the first batch's shapes (RuntimeError: a step that"
        " needs real values), so where the modules outside the pipelined blocks are needed could not be seen: they"
        " stay on every stage, each held and run by every stage: embed ("
    )


def test_a_parameter_tied_between_the_embedding_and_the_head_is_held_by_both_their_stages():
    model = STOCK_MODELS["gpt2"]()
    holders, source, aliases = parameter_holders(
        model, {"model.transformer.wte": frozenset({0}), "model.transformer.wpe": frozenset({0}),
                "model.transformer.ln_f": frozenset({3}), "model.lm_head": frozenset({3})}
    )
    assert holders["model.transformer.wte.weight"] == {0, 3}
    assert holders["model.transformer.wpe.weight"] == {0}
    assert source["model.transformer.wte.weight"] == 3  # one device initialises it with the head, last
    assert aliases["model.transformer.wte.weight"] == ["model.transformer.wte.weight", "model.lm_head.weight"]
    assert "model.lm_head" in outside_modules(model, Region(tuple(f"model.transformer.h.{i}" for i in range(4)), None))


def test_the_balance_charges_the_embedding_to_the_first_stage_and_the_head_to_the_last():
    """Eight equal blocks, an embedding and a head each worth two blocks: the first and last stages get fewer."""
    blocks = nn.Sequential(*(nn.Linear(16, 16, bias=False) for _ in range(8)))
    embedding, head = nn.Embedding(32, 16), nn.Linear(16, 32, bias=False)
    config = PipelineParallelConfig(4, 4)
    even = plan_partition(blocks, blocks, config, "parameters")
    charged_plan = plan_partition(blocks, blocks, config, "parameters", charges=[(0, embedding), (7, head)])
    assert [len(r) for r in even.ranges] == [2, 2, 2, 2]
    assert [len(r) for r in charged_plan.ranges] == [1, 3, 3, 1]
    # Seconds: the head costs time at the blocks' rate per parameter; an embedding, a lookup, none.
    assert charged([1.0] * 8, "seconds", [(0, embedding), (7, head)], [256] * 8) == [1.0] * 7 + [3.0]
    assert charged([1.0] * 8, "bytes", [(0, embedding)])[0] == 1.0 + 32 * 16 * 4
    assert charged([1.0] * 8, "layers", [(0, embedding)]) == [1.0] * 8  # an explicit or even split is as asked


def test_the_stage_table_says_where_each_outside_module_lives():
    blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    plan = plan_partition(blocks, blocks, PipelineParallelConfig(2, 2), None)
    outside = [("embed", 40, "stage 0"), ("head", 0, "stage 1"), ("rotary", 8, "every stage")]
    text = str(build_stage_summary(plan, "blocks", [1, 0], ["cpu", "cpu"], 8, 2, "never", outside=outside))
    assert text.splitlines()[-5:] == [
        "Outside the blocks | Params | Held by",
        "embed              | 40     | stage 0",
        "head               | tied   | stage 1",
        "rotary             | 8      | every stage",
        "Held by every stage: 9% of the parameters",  # of 80 pipelined and 8 on every stage
    ]
