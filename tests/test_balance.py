"""Balancing: the exact min-max partition, profiled costs, and the same valid split on every rank."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from torch import nn

from helpers.launch import launch
from helpers.models import PipeClassifier, loaders
from lightning_pipe import GPipeStrategy, PipelineParallelConfig
from lightning_pipe.partition.balance import min_max_partition, plan_partition, ranges_from_sizes, recompute_fraction, stage_costs
from lightning_pipe.partition.profiling import pipelined_input, profile_blocks
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.trace.stage_summary import build_stage_summary, stage_devices


def brute_force_best(costs: list[float], num_stages: int) -> float:
    """The cheapest most-expensive stage over every contiguous split into non-empty stages."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), num_stages - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_min_max_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(600):
        num_layers = rng.randint(1, 10)
        num_stages = rng.randint(1, num_layers)
        # Integers (many ties), floats over several magnitudes, and zeros (parameter-free layers).
        costs = [rng.choice([0, rng.randint(0, 9), rng.random() * 10 ** rng.randint(-3, 3)]) for _ in range(num_layers)]
        sizes = min_max_partition(costs, num_stages)
        assert len(sizes) == num_stages and min(sizes) >= 1 and sum(sizes) == num_layers
        got = max(stage_costs(costs, ranges_from_sizes(sizes)))
        assert got == pytest.approx(brute_force_best(costs, num_stages), rel=1e-12, abs=1e-12), (costs, sizes)


def test_min_max_partition_moves_layers_off_an_expensive_first_half():
    # First half 7 times as costly as the second: a split by layer count leaves 7/8 of the work on stage 0.
    assert min_max_partition([7.0] * 8 + [1.0] * 8, 2) == [5, 11]
    assert min_max_partition([1.0] * 12, 4) == [3, 3, 3, 3]


@pytest.mark.parametrize(
    ("costs", "stages", "message"),
    [([1.0, 2.0], 3, "cannot split 2 blocks into 3 non-empty stages"), ([1.0, -1.0], 2, "block 1 costs -1.0")],
)
def test_min_max_partition_rejects_impossible_input(costs, stages, message):
    with pytest.raises(ValueError, match=message):
        min_max_partition(costs, stages)


class Wrapper(nn.Module):
    """A model whose forward runs code (a BatchNorm, dropout) before the pipelined Sequential."""

    def __init__(self, layers: nn.Sequential) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(self.drop(self.norm(x)))


def unbalanced_layers() -> nn.Sequential:
    """Four wide layers followed by four narrow ones: the wide ones cost far more time and memory."""
    wide = [nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 32)) for _ in range(4)]
    narrow = [nn.Linear(32, 32) for _ in range(4)]
    return nn.Sequential(*wide, *narrow)


def test_pipelined_input_is_the_sequential_input_and_changes_nothing():
    model = Wrapper(unbalanced_layers()).train()
    model.norm.running_mean.fill_(0.5)
    x = torch.randn(8, 32)
    rng_before = torch.get_rng_state()
    captured = pipelined_input(model, model.layers, x)
    assert torch.allclose(captured, (x - 0.5) / torch.sqrt(torch.ones(32) + model.norm.eps))  # eval norm, no dropout
    assert torch.equal(model.norm.running_mean, torch.full((32,), 0.5))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert model.training and model.norm.training


def test_memory_profile_counts_parameters_and_saved_activations():
    layers = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    profiles = profile_blocks(layers, torch.randn(8, 64), torch.device("cpu"), num_micro_batches=2)
    micro_batch_bytes = 4 * 64 * 4  # 4 samples of 64 float32
    assert profiles[0].parameter_bytes == (64 * 64 + 64) * 4
    assert profiles[0].activation_bytes == micro_batch_bytes  # Linear saves its input (its weight is not counted)
    assert profiles[1].parameter_bytes == 0 and profiles[1].activation_bytes == micro_batch_bytes  # ReLU: its output
    assert all(p.forward_seconds > 0 and p.backward_seconds > 0 for p in profiles)


def vgg_shaped_layers() -> nn.Sequential:
    """Convolutions each followed by an in-place ReLU, as torchvision's VGG builds them, with one starting a stage."""
    return nn.Sequential(
        nn.ReLU(inplace=True),
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 2 * 2, 10),
    )


def test_layers_that_work_in_place_are_profiled_without_changing_the_sample():
    layers = vgg_shaped_layers()
    sample = torch.randn(4, 3, 8, 8)
    before = sample.clone()
    profiles = profile_blocks(layers, sample, torch.device("cpu"), num_micro_batches=2)
    assert torch.equal(sample, before)  # the in-place ReLU ran on a copy of the first micro-batch
    micro_batch_bytes = 2 * 3 * 8 * 8 * 4
    assert profiles[0].activation_bytes == micro_batch_bytes  # the in-place ReLU saves its output
    assert profiles[2].activation_bytes == 2 * 8 * 8 * 8 * 4  # after the first convolution: 8 channels
    assert all(p.forward_seconds > 0 and p.backward_seconds > 0 for p in profiles)
    model = Wrapper(layers)
    model.norm = nn.Identity()
    plan = plan_partition(model, layers, PipelineParallelConfig(3, 2), "time", sample=sample)
    assert sum(len(r) for r in plan.ranges) == len(layers) and all(len(r) > 0 for r in plan.ranges)


@pytest.mark.parametrize(("mode", "fraction"), [("always", 1.0), ("except_last", 0.75), ("never", 0.0)])
def test_recompute_fraction_counts_the_micro_batches_that_re_compute(mode, fraction):
    assert recompute_fraction(mode, 4) == fraction


@pytest.mark.parametrize("mode", ["parameters", "time", "memory"])
def test_costly_first_half_gets_fewer_layers(mode):
    model = Wrapper(unbalanced_layers())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=2)
    plan = plan_partition(model, model.layers, config, mode, sample=torch.randn(512, 32))  # out of the noise
    sizes = [len(r) for r in plan.ranges]
    assert sizes[0] < 4 and sum(sizes) == 8, f"{mode} gave {sizes} for costs {plan.costs}"
    assert max(stage_costs(plan.costs, plan.ranges)) == pytest.approx(
        brute_force_best(plan.costs, 2), rel=1e-12
    )
    for key, value in model.state_dict().items():  # profiling ran on copies
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", ["time", "memory"])
def test_a_model_built_on_the_meta_device_can_be_profiled(mode):
    with torch.device("meta"):  # deferred initialisation: no weights exist yet
        model = Wrapper(unbalanced_layers())
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=2)
    # A batch large enough that the wide layers' time stands out of a loaded machine's noise.
    plan = plan_partition(model, model.layers, config, mode, sample=torch.randn(512, 32))
    assert [len(r) for r in plan.ranges][0] < 4 and all(p.is_meta for p in model.parameters())


def test_uniform_and_explicit_balance_need_no_profiling():
    model = Wrapper(unbalanced_layers())
    config = PipelineParallelConfig(num_stages=3, num_micro_batches=2)
    assert plan_partition(model, model.layers, config, "uniform").ranges == config.split_into_stages(8)
    assert plan_partition(model, model.layers, config, None).ranges == config.split_into_stages(8)
    explicit = plan_partition(model, model.layers, config, [1, 2, 5])
    assert explicit.ranges == [range(0, 1), range(1, 3), range(3, 8)] and explicit.method == "explicit"


def test_profiled_balance_without_a_sample_names_the_fix():
    model = Wrapper(unbalanced_layers())
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=2)
    with pytest.raises(ValueError, match=r"balance='time' profiles every block.*example_input_array.*first training batch.*sample="):
        plan_partition(model, model.layers, config, "time")


def test_unknown_balance_mode_is_rejected():
    with pytest.raises(ValueError, match="balance='fast' is not a balancing mode; use one of 'uniform'"):
        GPipeStrategy(balance="fast")


def test_profiled_balance_without_a_sample_outside_a_fit_fails_before_launch():
    """A fit profiles on its first training batch (``BALANCE_RUNS``' ``time_on_the_batch``); a validation has none."""
    from lightning.pytorch import Trainer

    trainer = Trainer(strategy=GPipeStrategy(balance="memory"), accelerator="cpu", devices=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="balance='memory' profiles every block on a sample input, but there is none"):
        trainer.validate(PipeClassifier(), loaders(16, 16, 16)[1])


def test_summary_reports_imbalance_of_the_split():
    model = Wrapper(unbalanced_layers())
    config = PipelineParallelConfig(num_stages=2, num_micro_batches=2)
    plan = plan_partition(model, model.layers, config, [4, 4])
    summary = build_stage_summary(plan, "layers", [1, 0], ["cpu", "cpu"], 64, 2, "never")
    wide = 4 * (32 * 512 + 512 + 512 * 32 + 32)
    assert [row.parameters for row in summary.rows] == [wide, 4 * (32 * 32 + 32)]
    assert summary.imbalance == pytest.approx(wide / ((wide + 4 * 1056) / 2))
    text = str(summary)
    assert "Stage | Rank | Device | Blocks" in text and "0-3" in text and "4-7" in text
    assert f"Imbalance (slowest stage / mean): {summary.imbalance:.2f} by parameters" in text


def test_summary_names_the_node_of_each_stage_when_there_are_several():
    cpus = [torch.device("cpu"), torch.device("cpu")]
    assert stage_devices([1, 0], cpus, num_nodes=1) == ["cpu", "cpu"]
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert stage_devices([3, 2, 1, 0], gpus, num_nodes=2) == [
        "node 1 cuda:1", "node 1 cuda:0", "node 0 cuda:1", "node 0 cuda:0"
    ]


BALANCE_RUNS = [
    {"name": "uniform", "balance": "uniform"},
    {"name": "explicit", "balance": [3, 5]},
    {"name": "parameters", "balance": "parameters"},
    {"name": "time", "balance": "time"},  # profiles with the model's example_input_array
    {"name": "memory", "balance": "memory", "sample": True, "example_input_array": False},  # with sample=
    {"name": "time_on_the_batch", "balance": "time", "example_input_array": False},  # the first training batch's
    # Two chunks per stage: the 8 layers split into 4 chunks (interleaved: chunk k on stage k % 2; ZB-V: in a V).
    {"name": "explicit_interleaved", "balance": [1, 3, 2, 2], "strategy": {"schedule": "interleaved_1f1b"}},
    {"name": "parameters_interleaved", "balance": "parameters", "strategy": {"schedule": "interleaved_1f1b"}},
    {"name": "time_interleaved", "balance": "time", "strategy": {"schedule": "interleaved_1f1b"}},
    {"name": "memory_zbv", "balance": "memory", "sample": True, "example_input_array": False,
     "strategy": {"schedule": "zbv"}},
]


@pytest.fixture(scope="module")
def balanced_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("balance")
    launch("balance_trace_worker.py", {"devices": 2, "out": str(tmp), "runs": BALANCE_RUNS}, tmp)
    return tmp


@pytest.mark.parametrize("run", BALANCE_RUNS, ids=lambda run: run["name"])
def test_every_balance_mode_gives_one_valid_split_on_every_rank(balanced_runs, run):
    """One part per model chunk (per stage, or ``S·v`` with virtual stages), contiguous, the cheapest most expensive
    part for the costs it balanced; each chunk on the stage its schedule places it, the loss's on global rank 0."""
    results = [json.loads((balanced_runs / run["name"] / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    schedule = SCHEDULES[run.get("strategy", {}).get("schedule", "gpipe")]
    chunks = 2 * schedule.virtual_stages
    ranges = results[0]["ranges"]
    assert all(result["ranges"] == ranges for result in results), "ranks applied different splits"
    assert len(ranges) == chunks and ranges[0][0] == 0 and ranges[-1][1] == 8
    assert all(stop > start for start, stop in ranges) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert results[0]["method"] == ("explicit" if isinstance(run["balance"], list) else run["balance"])
    if isinstance(run["balance"], list):
        assert [stop - start for start, stop in ranges] == run["balance"]
    else:
        costs = results[0]["costs"]
        assert max(stage_costs(costs, [range(*r) for r in ranges])) == pytest.approx(brute_force_best(costs, chunks))
    assert results[0]["summary"] == results[1]["summary"]  # the same table on every rank
    rows = results[0]["rows"]
    assert [row["stage"] for row in rows] == [schedule.owner(k, 2) for k in range(chunks)]
    loss_stage = schedule.loss_stage(2, schedule.virtual_stages)
    assert {row["rank"] for row in rows if row["stage"] == loss_stage} == {0}  # the loss on global rank 0
    assert {row["rank"] for row in rows if row["stage"] != loss_stage} == {1}


@pytest.mark.parametrize(("name", "title"), [
    ("uniform", "over 2 stages, schedule='gpipe' (ideal bubble 0.20)"),  # (S-1)/(M+S-1), M=4
    ("explicit_interleaved", "over 2 stages in 4 chunks, schedule='interleaved_1f1b' (ideal bubble 0.11)"),  # /(vM+S-1)
    ("memory_zbv", "over 2 stages in 4 chunks, schedule='zbv' (ideal bubble 0.04)"),  # (S-1)/(6M+S-1)
])
def test_summary_names_the_schedule_its_ideal_bubble_and_each_chunk(balanced_runs, name, title):
    summary = json.loads((balanced_runs / name / "rank0.json").read_text())["summary"]
    assert title in summary.splitlines()[0]
    assert summary.splitlines()[1].startswith("Stage | Chunk | Rank" if "chunks" in title else "Stage | Rank")


def test_parameters_and_memory_count_a_ranks_slice_of_split_layers():
    """With tensor parallelism (T=2, Llama's own plan) a layer's split projections count half on a rank (36,864 of
    its 36,992 parameters), its norms whole, and the modules outside the blocks (charged to the end stages) whole:
    the embedding and the head then outweigh the blocks twice as much, and the middle stage takes more layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_pipe.execution.tensor_parallel import resolve_plan
    from lightning_pipe.partition.memory_estimate import StateLayout

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=1000))
    layers = nn.Sequential(*model.model.layers)
    charges = [(0, model.model.embed_tokens), (5, model.model.norm), (5, model.lm_head)]
    plans = resolve_plan(model, [f"model.layers.{i}" for i in range(6)], list(layers), None, 2)
    split = StateLayout(rank_elements=plans.rank_elements(list(layers)))
    config = PipelineParallelConfig(3, 4)
    whole = plan_partition(model, layers, config, "parameters", charges=charges)
    halved = plan_partition(model, layers, config, "parameters", charges=charges, state_layout=split)
    assert whole.costs == [64000 + 36992, *[36992] * 4, 36992 + 64064]
    assert halved.costs == [64000 + 18560, *[18560] * 4, 18560 + 64064]
    assert [len(r) for r in whole.ranges] == [2, 3, 1] and [len(r) for r in halved.ranges] == [1, 4, 1]
    # "memory" on the meta device (no step to run: the state alone, fp32): the same slices, in bytes.
    memory = plan_partition(model, layers, config, "memory", charges=charges, state_layout=split)
    assert memory.costs == [4.0 * c for c in halved.costs] and memory.ranges == halved.ranges
