"""Tensor parallelism inside a stage (``tensor_parallel_size=T``): blocks split with DTensor by a user's plan, a
Hugging Face model's own, or the module's configure_model itself (Lightning's convention) train as one device does,
alone and with the sharded data-parallel replicas (the 3D layout); clipping by one norm over the slices; a rank holds
about 1/T of its blocks, and the start-up table says so; what does not fit is refused at set-up."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.utils.data import DataLoader

from helpers.compare import merged_state_dict, rank_results, relative_weight_error
from helpers.launch import REPO, launch, run_python, selected_tests_use, started_together
from helpers.recording import MetricRecorder
from helpers.stock_models import LlamaModule, Qwen2Module
from helpers.tensor_parallel_models import BLOCK_PLAN, TENSOR_PARALLEL_MODELS, Block, loaders_for
from lightning_pipe import GPipeStrategy
from lightning_pipe.execution.tensor_parallel import BlockPlans, TakenSplit, resolve_plan
from lightning_pipe.integration.hydra_schema import validate_config
from lightning_pipe.commands.plan import main as plan_command
from lightning_pipe.partition.balance import plan_partition
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.trace.stage_summary import build_stage_summary, chunk_parameters_per_rank

CLIP = {"gradient_clip_val": 0.1}  # clips every step (the norms are 0.5-2)


def split(name: str, model: str, schedule: str = "gpipe", data_parallel: str = "replicate", **extra) -> dict:
    strategy = {"num_stages": 2, "tensor_parallel_size": 2, "num_micro_batches": 2, "schedule": schedule,
                "data_parallel": data_parallel}
    if model.startswith("block") and model != "block_configured":
        strategy["tensor_parallel_plan"] = BLOCK_PLAN  # the Hugging Face models and configure_model bring their own
    return {"name": name, "model": model, "strategy": strategy, "trainer": CLIP, **extra}


# 2 stages x T=2 (4 processes): the plain block by the user's plan, Llama and Qwen2 (its head tied to the embedding,
# outside the blocks) by their own, under GPipe and 1F1B; the negative control counts every slice on every rank in
# the norm. Last, a plan naming a module no block has: refused on every rank at set-up.
TWO_BY_TWO = [
    split("block_gpipe", "block"),
    split("block_1f1b", "block_momentum", "1f1b"),
    split("llama_gpipe", "llama", save_pretrained=True),
    split("llama_1f1b", "llama", "1f1b"),
    split("qwen2_gpipe", "qwen2"),
    split("qwen2_1f1b", "qwen2", "1f1b"),
    split("uncounted_slices", "block", uncounted_slices=True),
    # Lightning's convention: configure_model splits the blocks itself over self.device_mesh["tensor_parallel"]; the
    # split is taken as it is (no plan), with its negative control.
    split("configured_gpipe", "block_configured", validate_after=True),
    split("configured_uncounted_slices", "block_configured", uncounted_slices=True),
    # An epoch checkpointed (SGD momentum: optimizer state), resumed for a second on another T and S: one file and
    # torch.distributed.checkpoint, T=2 -> 1 and 1 -> 2.
    {**split("resumed_2_to_1", "block_momentum"), "first_strategy": split("", "block")["strategy"],
     "strategy": {"num_stages": 4, "num_micro_batches": 2}},
    {**split("resumed_2_to_1_dcp", "block_momentum"),
     "first_strategy": {**split("", "block")["strategy"], "save_distributed_checkpoint": True},
     "strategy": {"num_stages": 4, "num_micro_batches": 2, "save_distributed_checkpoint": True}},
    {**split("resumed_1_to_2_dcp", "block_momentum"),
     "first_strategy": {"num_stages": 4, "num_micro_batches": 2, "save_distributed_checkpoint": True},
     "strategy": {**split("", "block")["strategy"], "save_distributed_checkpoint": True}},
    {**split("missing_module", "block"), "expect_error": True,
     "strategy": {"num_stages": 2, "tensor_parallel_size": 2, "tensor_parallel_plan": {"attn.qkv": "colwise"}}},
]
# 2 stages x 2 replicas x T=2 (8 processes): torchtitan's 3D layout (FSDP2 over the replicas of split blocks), and
# replicated stages; the replicas' logged losses averaged (sync_dist) where the model's step allows.
THREE_D = [
    split("block_shard_gpipe", "block_synced", data_parallel="shard"),
    split("block_shard_1f1b", "block_synced", "1f1b", data_parallel="shard"),
    split("block_replicate_1f1b", "block_synced", "1f1b"),
    split("llama_shard_gpipe", "llama", data_parallel="shard"),
]
RESUMED = [run for run in TWO_BY_TWO if "first_strategy" in run]
MATCHING = {"two_by_two": [run for run in TWO_BY_TWO if not (run.get("expect_error") or run.get("uncounted_slices")
                                                            or run in RESUMED)],
            "three_d": THREE_D}


def fits(runs: list[dict], devices: int, cwd: Path) -> Path:
    launch("tensor_parallel_worker.py", {"devices": devices, "out": str(cwd), "runs": runs}, cwd, timeout=900)
    return cwd


@pytest.fixture(scope="module")
def launches(request, tmp_path_factory):
    if not selected_tests_use(request, "launches"):
        return {}
    jobs = {"two_by_two": partial(fits, TWO_BY_TWO, 4), "three_d": partial(fits, THREE_D, 8),
            "example": partial(run_python, REPO / "examples" / "three_dimensions.py", timeout=900, prestarted=True)}
    return started_together({name: partial(job, cwd=tmp_path_factory.mktemp(name)) for name, job in jobs.items()})


def one_device(model_name: str, replicas: int = 1, max_epochs: int = 1) -> tuple[dict, dict, list[float]]:
    """Initial and final weights and per-step losses of the same training on one device: with ``replicas``, each
    step takes every replica's samples, in the order the distributed sampler deals them."""
    seed_everything(0)
    hugging_face = model_name in ("llama", "qwen2")
    model = TENSOR_PARALLEL_MODELS[model_name](**({"batch_size": 8 * replicas} if hugging_face else {}))
    model.configure_model()  # the blocks a model builds there (whole: no mesh on one device) have initial weights
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    train, val = loaders_for(model, 8 * replicas) or (model.train_dataloader(), model.val_dataloader())
    if replicas > 1:  # a shuffling DistributedSampler's order (seed 0, epoch 0), one step of all replicas a batch
        order = torch.randperm(len(train.dataset), generator=torch.Generator().manual_seed(0)).tolist()
        train = DataLoader(train.dataset, batch_size=8 * replicas, sampler=order)
    recorder = MetricRecorder()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
                      limit_val_batches=2, **CLIP)
    trainer.fit(model, train, val)
    return initial, model.state_dict(), recorder.train_losses


@pytest.mark.parametrize("layout", ["two_by_two", "three_d"])
def test_split_blocks_train_as_one_device(launches, layout):
    """Per-step losses within 1e-5 and weights within 1e-5 of their change, every schedule and model of the launch;
    every rank clipped by the same norm, bit for bit."""
    run_dirs = launches[layout].result()
    replicas = 2 if layout == "three_d" else 1
    for run in MATCHING[layout]:
        initial, expected, losses = one_device(run["model"], replicas)
        results = rank_results(run_dirs / run["name"])
        error = relative_weight_error(initial, expected, merged_state_dict(run_dirs / run["name"]))
        assert error < 1e-5, f"{layout} {run['name']}: weights {error:.2e} of their change from one device's"
        if replicas == 1 or run["model"] == "block_synced":
            for result in results:
                assert result["train_losses"] == pytest.approx(losses, rel=1e-5), f"{layout} {run['name']}"
        else:  # each replica logged its own batch's loss: their mean is one device's (equal-length sequences)
            by_rank = [result["train_losses"] for result in results]
            mean = [sum(step) / len(step) for step in zip(*by_rank)]
            assert mean == pytest.approx(losses, rel=1e-5), f"{layout} {run['name']}: the replicas' mean loss"
        assert len({tuple(result["clipping_norms"]) for result in results}) == 1, f"{run['name']}: clipping norms"
        assert len(results[0]["clipping_norms"]) == len(losses)


@pytest.mark.parametrize("model, run", [("block", "uncounted_slices"), ("block_configured", "configured_uncounted_slices")])
def test_counting_a_slice_on_every_rank_is_caught(launches, model, run):
    """Negative control: a norm that counts the row-wise biases (whole on each tensor-parallel rank) twice clips by
    another coefficient, and the comparison fails (blocks split by a plan, or by configure_model itself)."""
    run_dir = launches["two_by_two"].result()
    initial, expected, _ = one_device(model)
    assert relative_weight_error(initial, expected, merged_state_dict(run_dir / run)) > 1e-3


def test_blocks_configure_model_split_are_trained_as_it_split_them(launches):
    """Lightning's convention: configure_model's own parallelize_module over self.device_mesh["tensor_parallel"] is
    taken as it is: each rank holds half of its blocks' split layers (DTensors), the norms and row-wise biases whole,
    as the same split by a plan holds them (its equality with one device: test_split_blocks_train_as_one_device).
    A trainer.validate after the fit, whose configure_model builds nothing again, splits the blocks as before: the
    fit's last val_loss again."""
    run_dir = launches["two_by_two"].result()
    planned = {result["held"]["parameters"] for result in rank_results(run_dir / "block_gpipe")}
    stage_bytes = sum(p.numel() * p.element_size() for p in TENSOR_PARALLEL_MODELS["block"]().blocks[:2].parameters())
    for result in rank_results(run_dir / "configured_gpipe"):
        assert {result["held"]["parameters"]} == planned
        assert result["held"]["parameters"] / stage_bytes == pytest.approx(0.5, rel=0.05)
        whole = {name.split(".", 1)[1] for name in result["held"]["whole"]}
        assert whole == {"norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.out.bias", "mlp.down.bias"}
        assert result["validated"] == pytest.approx(result["final_metrics"]["val_loss"], rel=1e-6)


def test_a_checkpoint_resumes_on_another_tensor_parallel_size_as_one_device(launches):
    """Written at T=2 and resumed at T=1 (4 stages), or the other way, one file or torch.distributed.checkpoint: the
    two epochs equal one device's (the weights and the momentum came back whole, and split again)."""
    run_dir = launches["two_by_two"].result()
    initial, expected, losses = one_device("block_momentum", max_epochs=2)
    for run in RESUMED:
        error = relative_weight_error(initial, expected, merged_state_dict(run_dir / run["name"]))
        assert error < 1e-5, f"{run['name']}: weights {error:.2e} of their change from one device's"
        for result in rank_results(run_dir / run["name"]):  # the resumed epoch's steps
            assert result["train_losses"] == pytest.approx(losses[len(losses) // 2:], rel=1e-5), run["name"]


def test_a_distributed_checkpoint_holds_each_ranks_slice_of_a_split_layer(launches):
    """torch.distributed.checkpoint at T=2 writes split layers as DTensors, each tensor-parallel rank its slice (two
    chunks, never gathered whole), their optimizer state alike; the norms whole (which the resume above reads back
    at T=1, whole)."""
    import torch.distributed.checkpoint as dcp

    from lightning_pipe.checkpoints.sharded import committed_directory

    saved = next((launches["two_by_two"].result() / "resumed_2_to_1_dcp" / "checkpoints").iterdir())
    metadata = dcp.FileSystemReader(str(committed_directory(saved))).read_metadata().state_dict_metadata

    def chunks(key: str) -> list[tuple[list[int], list[int]]]:
        return sorted((list(c.offsets), list(c.sizes)) for c in metadata[key].chunks)

    assert chunks("model/blocks.0.attn.q.weight") == [([0, 0], [8, 16]), ([8, 0], [8, 16])]
    assert chunks("model/blocks.0.attn.out.weight") == [([0, 0], [16, 8]), ([0, 8], [16, 8])]
    assert chunks("optimizer0/state/blocks.0.attn.q.weight/momentum_buffer") == [([0, 0], [8, 16]), ([8, 0], [8, 16])]
    assert chunks("model/blocks.0.norm1.weight") == [([0], [16])]


def test_save_pretrained_from_split_blocks_loads_with_from_pretrained(launches):
    """save_pretrained at T=2 writes whole tensors (each once, by tensor-parallel index 0 of the first replica):
    LlamaForCausalLM.from_pretrained loads the trained model."""
    from transformers import LlamaForCausalLM

    run_dir = launches["two_by_two"].result() / "llama_gpipe"
    loaded = LlamaForCausalLM.from_pretrained(run_dir / "pretrained").state_dict()
    trained = {key.removeprefix("model."): value for key, value in merged_state_dict(run_dir).items()}
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[key], trained[key]) for key in loaded)


def test_a_plan_naming_a_missing_module_is_refused_on_every_rank(launches):
    run_dir = launches["two_by_two"].result() / "missing_module"
    errors = sorted(run_dir.glob("error*.txt"))
    assert len(errors) == 4
    for error in errors:
        assert "names 'attn.qkv', but no pipelined block holds a module of that name" in error.read_text()


def test_a_rank_holds_half_of_its_blocks_at_two(launches):
    """A rank's parameters, gradients and optimizer state (SGD momentum) in the blocks at T=2: half of what the
    same stage holds whole at T=1 (within 5%), the norms and the row-wise layers' biases whole on every rank."""
    run_dir = launches["two_by_two"].result() / "block_1f1b"
    model = TENSOR_PARALLEL_MODELS["block_momentum"]()
    stage_bytes = sum(p.numel() * p.element_size() for p in model.blocks[:2].parameters())
    for result in rank_results(run_dir):
        held = result["held"]
        ours = held["parameters"] + held["gradients"] + held["optimizer"]
        assert ours / (3 * stage_bytes) == pytest.approx(0.5, rel=0.05)
        whole = {name.split(".", 1)[1] for name in held["whole"]}
        assert whole == {"norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.out.bias", "mlp.down.bias"}


def test_the_guides_three_dimensional_example_trains_on_eight_processes(launches):
    """docs/guide.md, "Three dimensions": examples/three_dimensions.py runs as written (a tiny Llama, 2 x 2 x 2)."""
    finished = launches["example"].result()
    assert "trained 4 steps on 2 stages x 2 replicas x 2 tensor-parallel ranks; last loss" in finished.stdout


# ---- the plan and the refusals, in one process -------------------------------------------------------------------


def test_the_hugging_face_plan_applies_to_each_block_with_its_prefix():
    for module in (LlamaModule(layers=2), Qwen2Module(layers=2)):
        names = [f"model.model.layers.{i}" for i in range(2)]
        plans = resolve_plan(module, names, [module.get_submodule(n) for n in names], None, 2)
        assert plans.styles[1] == {
            "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        }


def test_what_a_split_cannot_divide_is_refused_with_the_fix():
    holder = nn.Module()
    holder.blocks = nn.Sequential(Block(), Block())
    blocks, names = list(holder.blocks), ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match=r"'blocks.0.attn.q' column-wise over tensor_parallel_size=3 ranks, but its"
                                         r" out_features=16 does not divide by 3"):
        resolve_plan(holder, names, blocks, BLOCK_PLAN, 3)
    with pytest.raises(ValueError, match=r"blocks.0.attn.num_heads=4 does not divide by 8; choose a"):
        resolve_plan(holder, names, blocks, {"mlp.up": "colwise"}, 8)
    with pytest.raises(ValueError, match=r"splits 'blocks.0.norm1' \(LayerNorm\) as 'colwise', but column- and"):
        resolve_plan(holder, names, blocks, {"norm1": "colwise"}, 2)
    llama = LlamaModule(layers=2)  # 4 attention heads, 2 key-value heads
    layers = [llama.get_submodule(f"model.model.layers.{i}") for i in range(2)]
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 does not divide by 4"):
        resolve_plan(llama, [f"model.model.layers.{i}" for i in range(2)], layers, None, 4)
    with pytest.raises(ValueError, match=r"no Hugging Face model with a tensor-parallel plan .* holds the blocks"):
        resolve_plan(holder, names, blocks, None, 2)


def test_a_split_from_configure_model_is_taken_alone_and_inside_the_blocks():
    """What configure_model split itself is each block's plan, by name inside the block; a plan set as well is
    refused naming both, and a split module outside the blocks naming it."""
    holder = nn.Module()
    holder.blocks, holder.head = nn.Sequential(Block(), Block()), nn.Linear(16, 3)
    blocks, names = list(holder.blocks), ["blocks.0", "blocks.1"]
    taken = {"blocks.0.attn.q": TakenSplit({}, {}), "blocks.1.mlp.up": TakenSplit({}, {})}
    plans = resolve_plan(holder, names, blocks, None, 2, taken=taken)
    assert plans.styles == {0: {"attn.q": taken["blocks.0.attn.q"]}, 1: {"mlp.up": taken["blocks.1.mlp.up"]}}
    with pytest.raises(ValueError, match=r"configure_model\(\) split \['blocks.0.attn.q', 'blocks.1.mlp.up'\] with"
                                         r" parallelize_module, and tensor_parallel_plan=\{'mlp.up': 'colwise'\} is"
                                         r" set as well: a block is split once"):
        resolve_plan(holder, names, blocks, {"mlp.up": "colwise"}, 2, taken=taken)
    with pytest.raises(ValueError, match=r"split 'head' with parallelize_module, but it lies outside the pipelined"):
        resolve_plan(holder, names, blocks, None, 2, taken={"head": TakenSplit({}, {})})


def test_the_stage_table_says_what_a_tensor_parallel_rank_holds():
    """The start-up table's T column, and Params/rank: a block of 2,224 parameters holds 1,160 on a rank at T=2
    (q, k, v and mlp.up split column-wise with their biases, attn.out and mlp.down row-wise with their biases
    whole, the norms whole); a split that configure_model made counts by its placements; with replicas sharding the
    stage too, the slices are sharded again."""
    holder = nn.Module()
    holder.blocks = nn.Sequential(*(Block() for _ in range(4)))
    blocks, names = list(holder.blocks), [f"blocks.{i}" for i in range(4)]
    plans = resolve_plan(holder, names, blocks, BLOCK_PLAN, 2)
    plan = plan_partition(holder, holder.blocks, PipelineParallelConfig(2, 2), None)
    held = chunk_parameters_per_rank(blocks, plan.ranges, 1, plans.rank_shapes)
    assert sum(p.numel() for p in blocks[0].parameters()) == 2224 and held == [2 * 1160, 2 * 1160]
    text = str(build_stage_summary(plan, "blocks", [2, 0], ["cpu", "cpu"], 0, 2, "never", held_per_rank=held,
                                   tensor_parallel=2))
    header, rows = text.splitlines()[1], text.splitlines()[3:5]
    assert [cell.strip() for cell in header.split("|")][5:8] == ["Params", "T", "Params/rank"]
    assert [[cell.strip() for cell in row.split("|")][5:8] for row in rows] == [["4.4 K", "2", "2.3 K"]] * 2
    assert "tensor_parallel_size=2: each stage's blocks split over its T ranks (DTensor)" in text
    assert "data_parallel=" not in text
    layouts = {"q": {"weight": (None, (Shard(0),)), "bias": (None, (Shard(0),))},
               "out": {"weight": (None, (Shard(1),)), "bias": (None, (Replicate(),))}}
    taken = BlockPlans({0: {f"attn.{n}": TakenSplit(layout, {}) for n, layout in layouts.items()}}, size=2)
    assert taken.rank_shapes(0, blocks[0]) == {"attn.q.weight": (8, 16), "attn.q.bias": (8,), "attn.out.weight": (16, 8)}
    sharded = chunk_parameters_per_rank(blocks, plan.ranges, 2, plans.rank_shapes)
    assert sharded == [2 * 580, 2 * 580]  # each slice's rows halved again: norms 32, q/k/v 3 x 68, out 72, mlp 2 x 136


def test_plan_tabulates_layouts_with_a_tensor_parallel_dimension(capsys):
    """``python -m lightning_pipe.plan --layouts SxDxT``: a Llama block of 36,992 parameters holds 36,864 in the
    layers its plan splits, so a rank of T=2 holds 18,560 of it; the loss stage's 2 blocks, head and norm stay
    whole otherwise (2 x 18,560 + 64,064). The bubble (S-1)/(M+S-1), M from the batch over the replicas."""
    config = ("llama:hidden_size=64,intermediate_size=128,num_hidden_layers=4,num_attention_heads=4,"
              "num_key_value_heads=2,vocab_size=1000")
    plan_command(["--transformers-config", config, "--layouts", "2x1x2", "2x2x2", "--batch-size", "32"])
    out = capsys.readouterr().out
    stage = 2 * 18560 + 64064
    assert (f"| 2 stages x 1 replicas x 2 tensor-parallel | replicate | 0.10 M parameters | {16 * stage / 2**20:.2f} MiB"
            " | - | - | 0.03 (M=32) |") in out, out
    assert "| 2 stages x 2 replicas x 2 tensor-parallel | shard |" in out
    assert "tensor-parallel | full_shard" not in out  # refused with T > 1: not offered


def test_the_settings_refuse_what_is_not_shown_equal_yet():
    with pytest.raises(ValueError, match=r"devices=6 on num_nodes=1 starts 6 processes, not a multiple of"
                                         r" num_stages=2 x tensor_parallel_size=2 = 4"):
        PipelineSettings(num_stages=2, tensor_parallel_size=2).check_counts(6, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with schedule='zbv' is not supported yet"):
        PipelineSettings(tensor_parallel_size=2, schedule="zbv")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 with data_parallel='full_shard' is not supported"):
        PipelineSettings(tensor_parallel_size=2, data_parallel="full_shard")
    with pytest.raises(ValueError, match=r"tensor_parallel_plan\['mlp.up'\]='diagonal' is invalid"):
        GPipeStrategy(tensor_parallel_size=2, tensor_parallel_plan={"mlp.up": "diagonal"})
    with pytest.raises(ValueError, match=r"strategy.tensor_parallel_size=2 .* trainer.devices to 4"):
        validate_config({"strategy": {"num_stages": 2, "tensor_parallel_size": 2}, "trainer": {"devices": 2}})
    # Without num_stages, the stages are the processes over T: 8 devices at T=2 make 4 stages, one replica.
    layout = PipelineSettings(tensor_parallel_size=2).layout(8)
    assert (layout.num_stages, layout.num_replicas, layout.tensor_parallel) == (4, 1, 2)


def test_a_stages_tensor_parallel_ranks_are_neighbours_unless_named_outermost():
    layout = PipelineLayout(num_stages=2, num_replicas=2, tensor_parallel=2)
    assert layout.tensor_parallel_ranks(stage=1, replica=0) == [0, 1]  # the loss stage: global rank 0
    assert layout.replica_ranks(stage=1, tensor=1) == [1, 3]
    assert layout.pipeline_ranks(replica=1, tensor=1) == [7, 3]  # activations between ranks of one index
    outermost = PipelineSettings(tensor_parallel_size=2, mesh_order=("tp", "pp", "dp")).layout(8)
    assert outermost.tensor_parallel_ranks(stage=3) == [0, 4]
    for each in (layout, outermost):
        seen = {(each.stage(r), each.replica(r), each.tensor_index(r)) for r in range(each.world_size)}
        assert len(seen) == each.world_size
        assert all(each.rank(*coordinates) == r for r, coordinates in enumerate(
            (each.stage(r), each.replica(r), each.tensor_index(r)) for r in range(each.world_size)))
