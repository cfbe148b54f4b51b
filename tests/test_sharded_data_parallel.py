"""Pipeline x sharded data parallel (``data_parallel="shard"`` and ``"full_shard"``, torch's FSDP2): each stage's blocks
sharded over its replicas train as one device does, every schedule, with clipping and tied parameters; one gather and
one reduce-scatter per block per step under "shard"; what is not supported yet is refused at set-up."""

from __future__ import annotations

import dataclasses
import json
import re
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch, started_together
from helpers.models import COMPILE_BACKEND, MODELS
from test_reliability import assert_ended_fast_everywhere, fault, run_with_faults
from lightning_pipe import GPipeStrategy
from lightning_pipe.checkpoints.sharded import committed_directory, consolidate
from lightning_pipe.execution.sharding import refuse_sharded_already
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.integration.hydra_schema import validate_config
from lightning_pipe.integration.model_summary import held_per_rank
from lightning_pipe.partition.balance import plan_partition
from lightning_pipe.commands.plan import main as plan_command
from lightning_pipe.schedules.choice import BlockCosts
from lightning_pipe.trace.stage_summary import build_stage_summary, largest_shard

# Per replica 8 samples a step (4 micro-batches of 2); one device takes both replicas' 16 in the order the
# distributed sampler deals them. Clipping at 0.1 clips every step (the norms are 0.3-0.7).
CLIP = {"gradient_clip_val": 0.1}
SHARDED = {"num_micro_batches": 4, "batch_size": 8, "trainer": CLIP, "record_clipping_norms": True,
           "count_collectives": True}


def sharded(name: str, model: str, num_stages: int, mode: str, schedule: str = "gpipe", strategy_extra: dict | None = None,
            **extra) -> dict:
    strategy = {"num_stages": num_stages, "data_parallel": mode, "schedule": schedule, **(strategy_extra or {})}
    return {**SHARDED, "name": name, "model": model, "strategy": strategy, **extra}


# 2 stages x 2 replicas: both modes, GPipe and three per-micro-batch schedules (ZB-V's loss on stage 0, zero bubble's
# deferred weight gradients), a weight tied across the two stages' blocks (kept whole, summed, then averaged) and
# GPT-2's tie outside the blocks; the negative control sums the replicas' shards instead of averaging them.
RESUMED = {"model": "tied_momentum", "num_micro_batches": 4, "batch_size": 8, "max_epochs": 2, "resume_after_epoch": True,
           "lr": 0.2}
RESUMED_RUNS = ("shard_resumed", "shard_resumed_dcp", "replicate_then_shard", "shard_then_replicate")
# The first two also compile each stage's blocks (GPipeStrategy(compile=...), which compiles a block before FSDP2
# wraps it, as torchtitan does): checked equal to one device and for their collectives as the others are.
COMPILED = {"compile": {"backend": COMPILE_BACKEND}}
TWO_BY_TWO = [
    sharded("shard_gpipe", "synced_tied", 2, "shard", strategy_extra=COMPILED),
    sharded("full_shard_1f1b", "synced_tied_outside", 2, "full_shard", "1f1b", strategy_extra=COMPILED),
    sharded("shard_zbv", "synced_tied", 2, "shard", "zbv"),
    sharded("full_shard_zero_bubble", "synced_tied", 2, "full_shard", "zero_bubble"),
    sharded("unaveraged", "synced_tied", 2, "shard", unaveraged_shards=True),
    # 50 steps of Adam with both ties: every rank's clipping norm, and every copy of a replicated tensor, the same bits.
    # trainer.save_checkpoint after fit: the whole model and Adam's moments whole, in one file.
    sharded("fifty_steps", "tied_everywhere", 2, "shard", "1f1b", train_samples=800, val_samples=16,
            save_after_fit=True),
    # bf16-mixed: FSDP2's MixedPrecisionPolicy (weights gathered in bf16, gradients reduced in fp32) under Lightning's
    # autocast: losses as one device's within 1e-2, as with replicated stages.
    sharded("bf16", "synced_tied", 2, "shard", "1f1b", trainer={**CLIP, "precision": "bf16-mixed"}),
    sharded("bf16_full_shard", "synced_tied_outside", 2, "full_shard", trainer={**CLIP, "precision": "bf16-mixed"}),
    # Interleaved 1F1B: two chunks per stage, each block sharded alike.
    sharded("shard_interleaved", "synced_tied", 2, "shard", "interleaved_1f1b"),
    # A block's branch taken by some micro-batches and replicas only: both modes against replicated stages.
    {**SHARDED, "name": "branching_replicate", "model": "branching", "strategy": {"num_stages": 2}},
    sharded("branching_shard", "branching", 2, "shard"),
    sharded("branching_full_shard", "branching", 2, "full_shard", "1f1b"),
    # Checkpointed after epoch 1 (momentum: optimizer state), resumed for epoch 2: each against the same resume with
    # replicated stages. Sharded to sharded (one file; and torch.distributed.checkpoint), replicated <-> sharded.
    {**RESUMED, "name": "replicated_resumed", "strategy": {"num_stages": 2}},
    {**RESUMED, "name": "shard_resumed", "strategy": {"num_stages": 2, "data_parallel": "shard"}},
    {**RESUMED, "name": "shard_resumed_dcp", "save_after_fit": True,
     "strategy": {"num_stages": 2, "data_parallel": "full_shard", "save_distributed_checkpoint": True}},
    # (a torch.distributed.checkpoint of whole tensors, read into the shards)
    {**RESUMED, "name": "replicate_then_shard",
     "first_strategy": {"data_parallel": "replicate", "save_distributed_checkpoint": True},
     "strategy": {"num_stages": 2, "data_parallel": "full_shard", "schedule": "1f1b"}},
    {**RESUMED, "name": "shard_then_replicate", "first_strategy": {"data_parallel": "shard"},
     "strategy": {"num_stages": 2, "data_parallel": "replicate"}},
    # Written at 2 stages x 2 replicas, resumed on 4 stages x 1 (the other layout), against the replicated same.
    {**RESUMED, "name": "replicated_then_4x1", "first_strategy": {"num_stages": 2}, "strategy": {"num_stages": 4}},
    {**RESUMED, "name": "shard_then_4x1", "first_strategy": {"num_stages": 2, "data_parallel": "full_shard"},
     "strategy": {"num_stages": 4}},
    # A torch.distributed.checkpoint of shards (DTensors) read whole on the other layout.
    {**RESUMED, "name": "shard_dcp_then_4x1",
     "first_strategy": {"num_stages": 2, "data_parallel": "shard", "save_distributed_checkpoint": True},
     "strategy": {"num_stages": 4}},
]
# 4 stages x 2 replicas (8 processes): the tie then joins stage 1 and stage 3.
FOUR_BY_TWO = [
    sharded("shard_gpipe", "synced_tied", 4, "shard"),
    sharded("full_shard_zbv", "synced_tied_outside", 4, "full_shard", "zbv"),
    sharded("shard_1f1b", "synced_tied", 4, "shard", "1f1b"),
    sharded("with_fp16", "synced", 4, "full_shard", fp16=True, expect_error=True),  # last: it fails at set-up
]
SHARDED_FITS = [run for run in TWO_BY_TWO if run.get("strategy", {}).get("data_parallel", "replicate") != "replicate"
                and "resume_after_epoch" not in run]
MATCHING = {"two_by_two": [run for run in SHARDED_FITS if run["name"] not in ("unaveraged", "fifty_steps")
                           and "bf16" not in run["name"]
                           and run["model"] != "branching"],
            "four_by_two": FOUR_BY_TWO[:-1]}


def fits(runs: list[dict], devices: int, tmp_path: Path) -> Path:
    launch("fits_worker.py", {"devices": devices, "out": str(tmp_path), "runs": runs}, tmp_path, timeout=900)
    return tmp_path


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    jobs = {"two_by_two": partial(fits, TWO_BY_TWO, 4), "four_by_two": partial(fits, FOUR_BY_TWO, 8)}
    return started_together({name: partial(job, tmp_path_factory.mktemp(name)) for name, job in jobs.items()})


def one_device(model: str, **changes) -> tuple[dict, dict, dict]:
    return single_device_run({"model": model, "batch_size": 16, "shuffled_like_distributed_sampler": True,
                              "trainer": CLIP, "train_samples": 80, **changes})


def weight_error_and_losses(run_dir: Path, model: str) -> tuple[float, list[tuple[list, list]]]:
    initial, expected, metrics = one_device(model)
    error = relative_weight_error(initial, expected, merged_state_dict(run_dir))
    return error, [(result["train_losses"], metrics["train_losses"]) for result in rank_results(run_dir)]


@pytest.mark.parametrize("layout", ["two_by_two", "four_by_two"])
def test_sharded_stages_match_one_device_with_clipping_and_ties(launches, layout):
    run_dirs = launches[layout].result()
    for run in MATCHING[layout]:
        error, losses = weight_error_and_losses(run_dirs / run["name"], run["model"])
        assert error < 1e-5, f"{layout} {run['name']}: weights {error:.2e} of their change from one device's"
        for ours, expected in losses:
            assert ours == pytest.approx(expected, rel=1e-5), f"{layout} {run['name']}: per-step losses"


def test_a_sharded_runs_distributed_checkpoint_consolidates_to_the_replicated_runs_file(launches, tmp_path):
    """consolidate_checkpoint makes one file of the torch.distributed.checkpoint directory a full_shard run wrote: the
    whole model and its optimizer state, as the one-file checkpoint of the replicated run after the same epoch."""
    run_dir = launches["two_by_two"].result()
    consolidate(next((run_dir / "shard_resumed_dcp" / "checkpoints").glob("*.ckpt")), tmp_path / "one.ckpt")
    ours = torch.load(tmp_path / "one.ckpt", weights_only=True)
    replicated = torch.load(next((run_dir / "replicated_resumed" / "checkpoints").glob("*.ckpt")), weights_only=True)
    initial = one_device(RESUMED["model"], lr=RESUMED["lr"])[0]
    assert relative_weight_error(initial, replicated["state_dict"], ours["state_dict"]) < 1e-5
    momenta = [(ours_state["momentum_buffer"], theirs["momentum_buffer"]) for ours_state, theirs in zip(
        ours["optimizer_states"][0]["state"].values(), replicated["optimizer_states"][0]["state"].values())]
    assert len(momenta) == len(replicated["state_dict"]) - 1  # every parameter's, the tied weight's once
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in momenta)


def test_a_sharded_stage_writes_its_distributed_checkpoint_shard_by_shard(launches):
    """Each replica writes its own shard of a sharded parameter and of its momentum (torch.distributed.checkpoint's
    DTensor chunks, half the rows each): no rank gathers its stage whole to save it. A parameter kept whole (the
    weight tied across the stages) is written once."""
    run_dir = launches["two_by_two"].result() / "shard_resumed_dcp"
    directory = committed_directory(next((run_dir / "checkpoints").glob("*.ckpt")))
    entries = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    for key in ("model/net.model.0.weight", "optimizer0/state/net.model.0.weight/momentum_buffer",
                "model/head.weight"):  # (the head's 3 rows split 2 + 1)
        whole = tuple(entries[key].size)
        chunks = [tuple(chunk.sizes) for chunk in entries[key].chunks]
        assert len(chunks) == 2 and sum(rows for rows, *_ in chunks) == whole[0] and chunks[0][0] < whole[0], key
    assert len(entries["model/net.model.2.weight"].chunks) == 1  # tied across the stages: kept whole


def test_a_checkpoint_saved_after_a_sharded_fit_holds_the_whole_model_and_optimizer_state(launches):
    """trainer.save_checkpoint once fit returned (the stages whole again): one file, and one torch.distributed.checkpoint
    directory, each with the trained weights and every parameter's whole Adam moments or momentum."""
    run_dir = launches["two_by_two"].result()
    saved = torch.load(run_dir / "fifty_steps" / "after_fit.ckpt", weights_only=True)
    trained = merged_state_dict(run_dir / "fifty_steps")
    assert saved["state_dict"].keys() == trained.keys()
    assert all(torch.equal(saved["state_dict"][key], value) for key, value in trained.items())
    state = saved["optimizer_states"][0]["state"]
    # Every trained parameter's moments once (the model's head is never called: no gradient, no moments), whole.
    trainable = {id(p): p for p in MODELS["tied_everywhere"]().parameters()}
    assert len(state) == len(trainable) - 2
    shapes = {tuple(p.shape) for p in trainable.values()}
    assert all(type(entry["exp_avg"]) is torch.Tensor and tuple(entry["exp_avg"].shape) in shapes
               for entry in state.values())
    consolidate(run_dir / "shard_resumed_dcp" / "after_fit.ckpt", run_dir / "after_fit_dcp.ckpt")
    from_dcp = torch.load(run_dir / "after_fit_dcp.ckpt", weights_only=True)
    trained = merged_state_dict(run_dir / "shard_resumed_dcp")
    assert all(torch.equal(from_dcp["state_dict"][key], value) for key, value in trained.items())
    assert len(from_dcp["optimizer_states"][0]["state"]) == len(trained) - 1  # the tied weight's once


def test_a_branch_some_replicas_skip_reduces_as_with_replicated_stages(launches):
    """Where only some replicas computed a gradient for a parameter, every replica still reduce-scatters the same
    tensors (no hang), and the result is the replicated stages' (whose all-reduce averages in the others' zeros)."""
    run_dir = launches["two_by_two"].result()
    initial = one_device("branching")[0]
    replicated = merged_state_dict(run_dir / "branching_replicate")
    for name in ("branching_shard", "branching_full_shard"):
        assert relative_weight_error(initial, replicated, merged_state_dict(run_dir / name)) < 1e-5, name


def test_compiled_blocks_of_sharded_stages_match_one_device(launches):
    """GPipeStrategy(compile=...) with "shard" under GPipe and "full_shard" under 1F1B: every rank ran its blocks
    compiled (graphs made by torch.compile's backend), and the run matches one device (in the test above)."""
    run_dir = launches["two_by_two"].result()
    for name in ("shard_gpipe", "full_shard_1f1b"):
        graphs = [result["compiled_graphs"][COMPILE_BACKEND] for result in rank_results(run_dir / name)]
        assert all(count > 0 for count in graphs) and len(graphs) == 4, (name, graphs)
        assert name in [run["name"] for run in MATCHING["two_by_two"]]
    assert all(sum(result["compiled_graphs"].values()) == 0 for result in rank_results(run_dir / "shard_zbv"))


def test_shards_summed_instead_of_averaged_differ_from_one_device(launches):
    error, losses = weight_error_and_losses(launches["two_by_two"].result() / "unaveraged", "synced_tied")
    assert error > 1e-2
    assert any(ours != pytest.approx(expected, rel=1e-5) for ours, expected in losses)


def test_every_rank_clips_by_the_same_norm_and_keeps_replicated_tensors_identical(launches):
    for layout, runs in (("two_by_two", SHARDED_FITS), ("four_by_two", FOUR_BY_TWO[:-1])):
        for run in runs:
            run_dir = launches[layout].result() / run["name"]
            merged_state_dict(run_dir)  # raises where a tensor held by several ranks differs in any bit
            norms = [result["clipping_norms"] for result in rank_results(run_dir)]
            assert len(norms[0]) >= (50 if run["name"] == "fifty_steps" else 5)
            assert all(rank_norms == norms[0] for rank_norms in norms), f"{layout} {run['name']}: clipping norms"


def test_shard_gathers_and_reduce_scatters_each_block_once_per_step_not_per_micro_batch(launches):
    for layout, runs in (("two_by_two", SHARDED_FITS), ("four_by_two", FOUR_BY_TWO[:-1])):
        for run in runs:
            if run["strategy"]["data_parallel"] != "shard":
                continue
            results = rank_results(launches[layout].result() / run["name"])
            assert sum(result["outside_sharded"] for result in results) > 0  # the last stage's head
            table = results[0]["stage_table"]  # what each rank holds, in the start-up table
            assert "Params/rank" in table.splitlines()[1]
            assert "data_parallel='shard': each stage sharded over its 2 replicas (FSDP2)" in table
            for result in results:
                blocks = result["blocks_with_parameters"]  # each sharded: the Linear layers (a Tanh has none)
                steps = result["collectives_per_step"]  # the first also holds the sanity check's validation
                assert blocks > 0 and len(steps) >= 5
                modules = blocks + result["outside_sharded"]  # and the head on the last stage
                expected = {"all_gather": modules, "reduce_scatter": modules}
                assert all(step == expected for step in steps[1:]), f"{layout} {run['name']}: {steps}"


def test_full_shard_gathers_and_reduce_scatters_for_each_micro_batch(launches):
    """ZeRO-3: a block's weights gathered for each micro-batch's forward and again for its backward, and its gradient
    reduce-scattered after each micro-batch's backward (both halves, under zero bubble's split backward)."""
    for layout, name in (("two_by_two", "full_shard_zero_bubble"), ("two_by_two", "full_shard_1f1b"),
                         ("four_by_two", "full_shard_zbv")):
        for result in rank_results(launches[layout].result() / name):
            blocks, micro_batches, outside = result["blocks_with_parameters"], 4, result["outside_sharded"]
            for step in result["collectives_per_step"][1:]:  # a module outside the blocks: once at the step's end
                assert step["reduce_scatter"] == micro_batches * blocks + outside, (layout, name, step)
                assert step["all_gather"] >= 2 * micro_batches * blocks, (layout, name, step)


def test_sharding_one_replica_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="data_parallel='shard' shards each stage over its data-parallel replicas"
                                         ".*make one replica.*Use data_parallel='replicate'"):
        Trainer(strategy=GPipeStrategy(num_stages=2, data_parallel="shard"), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="strategy.data_parallel='full_shard'.*trainer.devices=2"):
        validate_config({"strategy": {"num_stages": 2, "data_parallel": "full_shard"}, "trainer": {"devices": 2}})


@pytest.mark.parametrize("options, message", [
    ({"data_parallel": "zero3"}, "data_parallel='zero3' is invalid; use 'replicate'"),
    ({"data_parallel": "full_shard", "deferred_batch_norm": True}, "with deferred_batch_norm=True is not supported"),
])
def test_bad_data_parallel_settings_are_refused_where_they_enter(options, message):
    with pytest.raises(ValueError, match=message):
        GPipeStrategy(**options)


def test_bf16_mixed_gathers_bf16_weights_reduces_fp32_gradients_and_matches_one_device(launches):
    """Under bf16-mixed, FSDP2's MixedPrecisionPolicy: every all-gather sends bf16 weights, every reduce-scatter fp32
    gradients; the losses are one device's (bf16 autocast) within 1e-2, as the replicated stages' bf16 test asks."""
    for name, model in (("bf16", "synced_tied"), ("bf16_full_shard", "synced_tied_outside")):
        _, _, expected = single_device_run({"model": model, "batch_size": 16, "shuffled_like_distributed_sampler":
                                            True, "trainer": {**CLIP, "precision": "bf16-mixed"}})
        for result in rank_results(launches["two_by_two"].result() / name):
            assert result["train_losses"] == pytest.approx(expected["train_losses"], rel=1e-2), name
            assert result["collective_dtypes"] == {"all_gather": ["torch.bfloat16"],
                                                   "reduce_scatter": ["torch.float32"]}, name
    fp32 = rank_results(launches["two_by_two"].result() / "shard_gpipe")[0]["collective_dtypes"]
    assert fp32 == {"all_gather": ["torch.float32"], "reduce_scatter": ["torch.float32"]}


def test_the_fp16_gradient_scaler_with_sharded_stages_is_refused_at_set_up(launches):
    errors = sorted((launches["four_by_two"].result() / "with_fp16").glob("error*.txt"))
    assert len(errors) == 8
    for error in errors:
        assert error.read_text().startswith("NotImplementedError: precision='16-mixed' with"
                                            " data_parallel='full_shard' is not supported yet")


def test_checkpoints_of_sharded_stages_resume_exactly_and_on_the_other_layout(launches):
    """A checkpoint of a sharded run holds whole tensors (gathered from the shards: one file, or one
    torch.distributed.checkpoint directory) and resumes sharded or replicated; the result is that of the same
    checkpoint and resume with replicated stages. (Not two epochs without a break: the worker seeds the resumed run
    differently, and Lightning's distributed sampler shuffles the second epoch by that seed.)"""
    run_dir = launches["two_by_two"].result()
    initial = one_device(RESUMED["model"], lr=RESUMED["lr"])[0]
    straight = merged_state_dict(run_dir / "replicated_resumed")
    assert [path.is_dir() for path in (run_dir / "shard_resumed_dcp" / "checkpoints").glob("*.ckpt")] == [True]
    for name in RESUMED_RUNS:
        assert relative_weight_error(initial, straight, merged_state_dict(run_dir / name)) < 1e-5, name
    other_layout = merged_state_dict(run_dir / "replicated_then_4x1")
    for name in ("shard_then_4x1", "shard_dcp_then_4x1"):
        assert relative_weight_error(initial, other_layout, merged_state_dict(run_dir / name)) < 1e-5, name
    assert relative_weight_error(initial, straight, other_layout) > 1e-2  # the layouts' second epochs differ


def test_a_block_the_user_sharded_is_refused_by_name():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        blocks = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
        fully_shard(blocks[1][0], mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
        refuse_sharded_already([("net.model.0", blocks[0])])  # not wrapped: taken
        with pytest.raises(ValueError, match="the pipelined module 'net.model.1.0' was already wrapped with"
                                             " fully_shard.*use GPipeStrategy\\(data_parallel='shard'\\)"):
            refuse_sharded_already([("net.model.0", blocks[0]), ("net.model.1", blocks[1])])
    finally:
        dist.destroy_process_group()


def test_plan_says_what_each_rank_holds_in_every_data_parallel_mode(tmp_path, capsys):
    block = BlockCosts(samples=4, forward=0.004, input_gradient=0.004, weight_gradient=0.004, activation_bytes=4e6,
                       input_bytes=1e6, parameter_bytes=2.0**30)  # 1 GiB of parameters a block, 2 blocks a stage
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"batch_size": 32, "small": [dataclasses.asdict(block)] * 8,
                                 "large": [dataclasses.asdict(block.scaled(16))] * 8}))
    plan_command(["--costs", str(costs), "--stages", "4", "--replicas", "4", "--memory-budget", "7GiB"])
    out = capsys.readouterr().out
    # Per parameter: 4 copies replicated (weight, gradient, Adam's two moments); sharded over 4 replicas, 1 (full_shard)
    # or 1 plus the whole weight and gradient the step holds (shard).
    assert "State per rank, 4 stages x 4 replicas" in out
    assert "data_parallel='replicate'     8.00 GiB  (exceeds the budget of 7.00 GiB)" in out
    assert "data_parallel='shard'         6.00 GiB  (fits the budget of 7.00 GiB)" in out
    assert "data_parallel='full_shard'    2.00 GiB  (fits the budget of 7.00 GiB)" in out


def test_plan_says_what_each_rank_holds_from_a_transformers_configs_shapes(capsys):
    """A Llama of 4 blocks of 36,992 parameters, its 64,000-parameter embedding on the first stage and head (and
    norm) on the loss stage, built on the meta device: at 2 x 2 the larger stage holds 2 blocks, the head and the norm
    (138,048 parameters): 16 bytes each replicated, 8 sharded over 2, plus 6 (bf16 weights, fp32 gradient) for the
    whole stage under shard or for the largest module (the head) under full_shard."""
    config = ("llama:hidden_size=64,intermediate_size=128,num_hidden_layers=4,num_attention_heads=4,"
              "num_key_value_heads=2,vocab_size=1000")
    plan_command(["--transformers-config", config, "--layouts", "2x2", "4x1", "--memory-budget", "2MiB",
                  "--precision", "bf16-mixed"])
    out = capsys.readouterr().out
    assert "0.28 M parameters, 4 blocks in 'model.layers'; model.embed_tokens (64.00 K) on the stage of" in out
    stage = 2 * 36992 + 64000 + 64
    rows = [f"| 2 stages x 2 replicas | replicate | 0.14 M parameters | {16 * stage / 2**20:.2f} MiB | no | none |",
            f"| 2 stages x 2 replicas | shard | 0.14 M parameters | {(8 + 6) * stage / 2**20:.2f} MiB | yes |",
            f"| 2 stages x 2 replicas | full_shard | 0.14 M parameters | {(8 * stage + 6 * 64000) / 2**20:.2f} MiB | yes",
            "| 4 stages x 1 replicas | replicate |"]
    assert all(row in out for row in rows), out
    with pytest.raises(SystemExit):
        plan_command(["--transformers-config", config, "--layouts", "8by8"])
    assert "--layouts '8by8' is invalid; give stages x replicas, as 8x8 or 16x4" in capsys.readouterr().err


def test_a_stalled_replica_is_named_while_its_peers_wait_in_the_sharded_collectives(tmp_path):
    """Stage 0 of replica 1 (rank 3) stalls in a layer: its pipeline's next stage (rank 1) waits for its activation,
    and rank 1's other replica (rank 0) for rank 1 in the all-gather of their sharded weights, a wait the stall
    watchdog bounds: the run ends naming rank 3, and the table names the sharded collective."""
    stall = [{**fault("stall", "layer", 0, batch=1), "rank": 3}]
    watchdog = {"stall_floor": 3.0, "stall_multiple": 5.0, "stall_first_step": 5.0, "data_parallel": "shard"}
    run = run_with_faults(tmp_path, 4, stall, "gpipe", num_stages=2, watchdog=watchdog)
    assert_ended_fast_everywhere(run)
    assert "The rank that stopped: stage 0 (rank 3) (awaited, and waiting on no other rank)." in run.stderr, \
        run.stderr[-6000:]
    assert re.search(r"stage 1 \(rank 0\) waited [\d.]+ s for the sharded weights' all-gather over the replicas from"
                     r" stage 1 \(rank 1\)", run.stderr), run.stderr[-6000:]


def test_the_stage_table_and_lightnings_summary_say_what_each_rank_of_a_sharded_stage_holds():
    blocks = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 3), nn.Tanh())
    plan = plan_partition(blocks, blocks, PipelineParallelConfig(2, 2), None)
    # Split along the first dimension over 2 replicas: 8 of 16 rows (and bias values), 2 of the head's 3 rows.
    held = [sum(largest_shard(p.shape, 2) for i in chunk for p in blocks[i].parameters()) for chunk in plan.ranges]
    assert held == [8 * 12 + 8, 2 * 16 + 2]
    text = str(build_stage_summary(plan, "blocks", [0, 1], ["cpu", "cpu"], 0, 2, "never", data_parallel="full_shard",
                                   num_replicas=2, held_per_rank=held))
    header, rows = text.splitlines()[1], text.splitlines()[3:5]
    assert [cell.strip() for cell in header.split("|")][5:7] == ["Params", "Params/rank"]
    assert [[cell.strip() for cell in row.split("|")][5:7] for row in rows] == [["208", "104"], ["51", "34"]]
    assert "data_parallel='full_shard': each stage sharded over its 2 replicas (FSDP2)" in text
    assert "Params/rank" not in str(build_stage_summary(plan, "blocks", [0, 1], ["cpu", "cpu"], 0, 2, "never"))
    assert [held_per_rank(where, 4) for where in ("stage 1", "stages 0-1", "stages 0, 3", "every stage")] == [
        "stage 1, 1/4 per rank", "stages 0-1, 1/4 per rank", "stages 0, 3, whole", "every stage, whole"]
