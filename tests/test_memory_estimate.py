"""``balance="memory"`` on a model built on the meta device: each block's bytes estimated without weights (state from
shapes and dtypes, activations from the saved tensors of a meta-device run), equal to what the measured path counts,
and the split that follows (the first and last stages, holding the embedding and the head, get fewer blocks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.stock_models import llama_config
from lightning_pipe import PipelineParallelConfig
from lightning_pipe.partition.balance import min_max_partition, plan_partition
from lightning_pipe.partition.memory_estimate import (
    OPTIMIZER_STATES,
    BlockMemory,
    estimate_block_memory,
    held_micro_batches,
    memory_costs,
)
from lightning_pipe.partition.profiling import profile_blocks

# ---- the pure part: byte counts to a split -----------------------------------------------------------------------


def test_blocks_charged_with_the_ends_get_fewer_blocks():
    # 8 equal blocks; the embedding's state charged to the first, the head's state and the logits to the last.
    blocks = [BlockMemory(100, 40) for _ in range(8)]
    blocks[0] = BlockMemory(100 + 150, 40)
    blocks[-1] = BlockMemory(100 + 150, 40, outside_activation_bytes=80)
    costs = memory_costs(blocks, blocks_share=0.25, outside_share=1.0)
    assert costs[1] == 110 and costs[0] == 260 and costs[-1] == 340
    assert min_max_partition(costs, 4) == [1, 3, 3, 1]
    # Negative control: without the charges the same blocks split evenly.
    assert min_max_partition(memory_costs([BlockMemory(100, 40)] * 8, 0.25, 1.0), 4) == [2, 2, 2, 2]


@pytest.mark.parametrize(("micro_batches", "fraction", "share"), [(8, 0.0, 1.0), (8, 7 / 8, 1 / 8), (4, 1.0, 1 / 4)])
def test_held_share_of_the_batch_follows_re_computation(micro_batches, fraction, share):
    assert held_micro_batches(micro_batches, fraction) == share


# ---- the estimate: equal to the measurement --------------------------------------------------------------------------


class Tokens(nn.Module):
    """An embedding, MLP blocks in an nn.Sequential, a norm and a head with a cross-entropy loss."""

    def __init__(self, vocab: int = 50, width: int = 16, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                                      for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(tokens))))


def loss_step(tokens: torch.Tensor):
    def step(model: nn.Module) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return step


def test_estimate_on_the_meta_device_equals_the_measured_bytes():
    torch.manual_seed(0)
    real = Tokens()
    with torch.device("meta"):
        deferred = Tokens()
    tokens = torch.randint(0, 50, (8, 13))
    charges = [(0, deferred.embed), (5, deferred.norm), (5, deferred.head)]
    estimated = estimate_block_memory(deferred, list(deferred.layers), loss_step(tokens.to("meta")), charges)
    assert all(p.is_meta for p in deferred.parameters())  # nothing was made real
    measured = profile_blocks(real.layers, real.embed(tokens[:, :-1]).detach(), torch.device("cpu"), 2, 0.0, 1)
    for index, (estimate, profile) in enumerate(zip(estimated, measured)):
        own = (2 + OPTIMIZER_STATES) * profile.parameter_bytes  # parameters, gradients, Adam's two moments
        ends = {0: deferred.embed.weight.numel(), 5: deferred.head.weight.numel() + 2 * 16}.get(index, 0)
        assert estimate.state_bytes == own + (2 + OPTIMIZER_STATES) * 4 * ends
        # The whole batch's saved tensors: twice one of the 2 micro-batches the profile measured.
        assert estimate.activation_bytes == 2 * profile.activation_bytes, index
    logits = 8 * 12 * 50 * 4
    assert estimated[-1].outside_activation_bytes >= logits  # the loss's saved log-softmax, on the last block
    # The embedding saves its int64 indices: a view of the batch's tokens, whose whole storage it keeps.
    assert estimated[0].outside_activation_bytes == 8 * 13 * 8
    assert all(e.outside_activation_bytes == 0 for e in estimated[1:-1])


def test_outside_training_only_the_parameters_count():
    with torch.device("meta"):
        deferred = Tokens()
    estimated = estimate_block_memory(deferred, list(deferred.layers), None)
    assert [e.state_bytes for e in estimated] == [sum(p.numel() * 4 for p in b.parameters()) for b in deferred.layers]
    assert all(e.activation_bytes == 0 for e in estimated)


def test_a_step_that_cannot_run_on_the_meta_device_is_refused_naming_the_fix():
    with torch.device("meta"):
        deferred = Tokens()

    def reads_values(model: nn.Module) -> None:
        model(torch.zeros(2, 3, dtype=torch.long, device="meta")).tolist()

    with pytest.raises(ValueError, match=r"balance='memory'.*step failed there.*use balance='parameters'"):
        estimate_block_memory(deferred, list(deferred.layers), reads_values)


# ---- the split of a Hugging Face Llama built on the meta device ------------------------------------------------------


def llama_on_meta(layers: int, vocab: int):
    from transformers import LlamaForCausalLM

    config = llama_config(layers)
    config.vocab_size = vocab
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def llama_step(tokens: torch.Tensor):
    return lambda model: model(input_ids=tokens, labels=tokens).loss


def test_llama_on_the_meta_device_gives_the_ends_fewer_blocks_under_memory():
    model = llama_on_meta(layers=8, vocab=512)  # the embedding and the head: 16k parameters each, a block's 10k
    layers = nn.Sequential(*model.model.layers)
    charges = [(0, model.model.embed_tokens), (7, model.model.norm), (7, model.lm_head)]
    config = PipelineParallelConfig(num_stages=4, num_micro_batches=4)
    tokens = torch.randint(0, 512, (4, 16), device="meta")
    plan = plan_partition(model, layers, config, "memory", charges=charges, step=llama_step(tokens),
                          recompute_fraction=0.75)
    sizes = [len(r) for r in plan.ranges]
    assert plan.profiles is None and plan.cost_unit == "bytes"  # estimated, not profiled
    assert sizes[0] < 2 and sizes[-1] < 2 and sum(sizes) == 8, sizes
    assert all(p.is_meta for p in model.parameters())
    # The logits (4 x 16 x 512 float32 and their log-softmax) are on the last block's cost.
    assert plan.costs[-1] - plan.costs[0] >= 4 * 16 * 512 * 4


def test_a_large_vocabulary_moves_blocks_off_the_loss_stage_where_parameters_would_not():
    # Small head, large batch: the logits outweigh every parameter; counting parameters cannot see them.
    model = llama_on_meta(layers=8, vocab=1024)
    layers = nn.Sequential(*model.model.layers)
    charges = [(0, model.model.embed_tokens), (7, model.model.norm), (7, model.lm_head)]
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=4)
    tokens = torch.randint(0, 1024, (64, 32), device="meta")  # 8 MiB of logits
    memory = plan_partition(model, layers, config, "memory", charges=charges, step=llama_step(tokens),
                            recompute_fraction=0.75)
    parameters = plan_partition(model, layers, config, "parameters", charges=charges)
    assert [len(r) for r in parameters.ranges] == [4, 4]
    assert len(memory.ranges[1]) < 4, [len(r) for r in memory.ranges]


def test_a_model_with_its_weights_keeps_the_measured_path():
    real = Tokens()
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=2)
    plan = plan_partition(real, real.layers, config, "memory", sample=torch.randint(0, 50, (8, 12)))
    assert plan.profiles is not None and len(plan.profiles) == 6  # profiled layer by layer, as before


def test_a_ranks_state_counts_its_slice_of_the_split_layers():
    """With tensor parallelism (T=2, Llama's own plan, on the meta device): a layer's state on a rank is its split
    projections' half and its norms whole (18,560 of 36,992 parameters), each with its gradient and Adam's two
    moments; an outside module charged to a block stays whole."""
    from transformers import LlamaForCausalLM

    from lightning_pipe.execution.tensor_parallel import resolve_plan
    from lightning_pipe.partition.memory_estimate import StateLayout, state_bytes

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(layers=2))  # hidden 32, intermediate 64, 4 heads, 2 key-value heads
    layers = list(model.model.layers)
    plans = resolve_plan(model, ["model.layers.0", "model.layers.1"], layers, None, 2)
    layout = StateLayout(rank_elements=plans.rank_elements(layers))
    whole = sum(p.numel() for p in layers[0].parameters())
    norms = sum(p.numel() for name, p in layers[0].named_parameters() if "norm" in name)
    held = norms + (whole - norms) // 2
    assert state_bytes(list(layers[0].parameters()), True, layout) == 4 * (2 + OPTIMIZER_STATES) * held
    assert state_bytes(list(layers[0].parameters()), True) == 4 * (2 + OPTIMIZER_STATES) * whole
    estimated = estimate_block_memory(model, layers, None, [(0, model.model.embed_tokens)], layout)
    embedding = model.model.embed_tokens.weight.numel()
    assert [b.state_bytes for b in estimated] == [4 * (held + embedding), 4 * held]
