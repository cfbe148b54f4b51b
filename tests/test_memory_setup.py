"""Memory-efficient setup: a model built on the meta device takes memory only for each rank's own stage (through fit,
test and checkpointing, and after them), starts from the same weights on any number of stages, trains as on one
device, saves sharded checkpoints that consolidate into the gathered file, and resumes reading only what a rank
needs."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torchmetrics import MeanMetric

from helpers.deferred_models import DEPTH, DeferredClassifier, EagerClassifier, fit, layers
from helpers.launch import launch, launches_started_with_first_test, run_python
from lightning_pipe import GPipeStrategy, PipelineParallelConfig, init_weights
from lightning_pipe.checkpoints.sharded import committed_directory
from lightning_pipe.execution.materialize import holds_meta_tensors, layer_seed, mark_held_elsewhere, materialize
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.balance import plan_partition
from lightning_pipe.partition.region import container_region
from lightning_pipe.trace.stage_summary import build_stage_summary

TOLERANCE = 1e-5  # of the total weight change during training
MICRO_BATCHES = 4
PAGE_SLACK = 64 * 1024  # Linux maps up to 64 KiB of cached file around each page a process touches
# The model whose peaks are measured: 32 x Linear(1024, 1024), 128 MiB of parameters, 32 MiB per stage on 4.
PEAKS = {"width": 1024, "depth": 32}
# What a phase may take above the stage's share and the fixed footprint: activations, buffers, allocator slack
# (measured: 4 MiB at most). Less than one stage's parameters (32 MiB): holding the whole model after the run
# (96 MiB of other stages' parameters on rank 0) or gathering a checkpoint (256 MiB) does not fit in it.
PEAK_SLACK = 24 * 2**20
# Every tensor of 64 KiB or more gets its own mapping, returned to the system when freed: resident memory then
# follows the live tensors instead of what glibc's heap keeps.
SMALL_HEAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}


# ---- materialisation, without processes ----------------------------------------------------------------------------


class Tied(nn.Module):
    """An embedding whose weight the output projection shares, and a layer built with real tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 10))
        self.body[2].weight = self.embed.weight


def test_materialized_weights_equal_init_weights_on_real_tensors_and_ties_survive():
    real = Tied()
    init_weights(real, seed=7)
    with torch.device("meta"):
        deferred = Tied()
    assert materialize(deferred, torch.device("cpu"), seed=7) == ["embed", "body.0", "body.1", "body.2"]
    assert not holds_meta_tensors(deferred)
    assert deferred.body[2].weight is deferred.embed.weight
    for (key, expected), (_, actual) in zip(real.state_dict().items(), deferred.state_dict().items()):
        assert torch.equal(expected, actual), key
    assert not torch.equal(deferred.body[0].weight, real.body[0].weight.new_zeros(4, 4))


def test_a_stage_materialises_the_same_weights_as_the_whole_model():
    """Layer 5 gets the same weights whether its stage holds layers 0-8 or 4-7: the seed follows its name."""
    with torch.device("meta"):
        whole = nn.Module()
        whole.layers = layers(width=8)
        split = nn.Module()
        split.layers = layers(width=8)
    materialize(whole, torch.device("cpu"), seed=3)
    StageBlocks(split, container_region(split, "layers"), range(4, 8), 1, 4).install()
    assert materialize(split, torch.device("cpu"), seed=3) == ["layers.4", "layers.6"]
    for key, value in split.state_dict().items():
        assert torch.equal(value, whole.state_dict()[key]), key
    assert layer_seed(3, "layers.4") != layer_seed(3, "layers.6") != layer_seed(4, "layers.6")


def test_init_weights_leaves_meta_tensors_and_the_global_random_stream_alone():
    with torch.device("meta"):
        meta_layer = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(3, 3), meta_layer)
    random_state = torch.random.get_rng_state()
    assert init_weights(model, seed=1) == ["0"]
    assert meta_layer.weight.is_meta
    assert torch.equal(torch.random.get_rng_state(), random_state)


def test_meta_module_without_reset_parameters_is_refused_naming_the_fix():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled())
    named = r"module '1' \(Scaled\) holds tensors \['scale'\].*define `Scaled.reset_parameters"
    with pytest.raises(TypeError, match=named):
        materialize(model, torch.device("cpu"), seed=0)


def test_a_layer_trained_on_another_rank_is_never_initialised_afresh():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)))
    mark_held_elsewhere([model[1]])  # what teardown records for the layers other ranks trained
    with pytest.raises(RuntimeError, match=r"module '1.0' \(Linear\) .* trained it on another rank"):
        materialize(model, torch.device("cpu"), seed=0)


def test_metric_created_on_meta_is_refused():
    with torch.device("meta"):
        model = nn.Module()
        model.loss = MeanMetric()
    with pytest.raises(TypeError, match="create torchmetrics metrics in __init__"):
        materialize(model, torch.device("cpu"), seed=0)


def test_strategy_builds_configure_model_and_empty_init_on_the_meta_device():
    strategy = GPipeStrategy(parallel_devices=[torch.device("cpu")])
    with strategy.model_sharded_context():
        assert nn.Linear(2, 2).weight.is_meta
    with strategy.tensor_init_context(empty_init=True):
        assert nn.Linear(2, 2).weight.is_meta
    with strategy.tensor_init_context(empty_init=False):
        assert not nn.Linear(2, 2).weight.is_meta


def test_summary_says_what_deferred_construction_would_save():
    sequential = layers()
    plan = plan_partition(nn.Module(), sequential, PipelineParallelConfig(4, 4), None)
    stage_bytes = [sum(p.numel() * 4 for i in r for p in sequential[i].parameters()) for r in plan.ranges]
    kwargs = dict(plan=plan, module_name="layers", ranks=[3, 2, 1, 0], devices=["cpu"] * 4, replicated_parameters=0,
                  num_micro_batches=4, recompute="except_last")
    whole = str(build_stage_summary(**kwargs, built_whole=True))
    said = re.search(r"building it in configure_model\(\) would save up to ([\d.]+) MB of parameters per rank", whole)
    assert said, whole
    assert float(said.group(1)) == pytest.approx((sum(stage_bytes) - min(stage_bytes)) / 2**20, abs=0.05)
    assert "configure_model()" not in str(build_stage_summary(**kwargs, built_whole=False))


# ---- pipelined runs ------------------------------------------------------------------------------------------------


def two_stage_runs(tmp) -> dict[str, list[dict]]:
    runs = [{"name": "deferred"}, {"name": "init_module", "model": "init_module"}, {"name": "eager", "model": "eager"},
            {"name": "memory", "balance": "memory"}, {"name": "profiled", "balance": "time", "fails": True}]
    launch("memory_setup_worker.py", {"devices": 2, "out": str(tmp), "runs": runs}, tmp)
    return {run["name"]: ranks(tmp / run["name"], 2) for run in runs}


WHOLE = {"gather_model_after_run": True, "save_distributed_checkpoint": False}  # the whole model asked for


def four_stage_runs(tmp) -> dict:
    last = str(tmp / "gathered" / "ckpt" / "last.ckpt")  # written by the second run, gathered, after its epoch
    runs = [{"name": "deferred", "save_after_fit": True}, {"name": "gathered", "strategy": WHOLE},
            {"name": "resumed", "epochs": 2, "ckpt_path": last},
            {"name": "peaks", "peaks": PEAKS}, {"name": "peaks_gathered", "peaks": PEAKS, "strategy": WHOLE}]
    launch("memory_setup_worker.py", {"devices": 4, "out": str(tmp), "runs": runs}, tmp, timeout=900, env=SMALL_HEAP)
    return {run["name"]: ranks(tmp / run["name"], 4) for run in runs} | {"checkpoint": last, "dir": tmp}


# Both launches, started with the file's first test: the in-process tests and fits run meanwhile.
launches = launches_started_with_first_test(("two_stages", "four_stages"), lambda tmp: {
    "two": partial(two_stage_runs, tmp.mktemp("memory2")), "four": partial(four_stage_runs, tmp.mktemp("memory4")),
})


@pytest.fixture(scope="module")
def two_stages(launches):
    return launches["two"].result()


@pytest.fixture(scope="module")
def four_stages(launches):
    return launches["four"].result()


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memory1")
    return {
        "deferred": fit(tmp / "deferred", "deferred", devices=1),
        "resumed": fit(tmp / "resumed", "deferred", epochs=2, devices=1),
        # The model built under init_module(empty_init=True) on the gpipe strategy starts from the weights the same
        # model built with real tensors (and init_weights) starts from on one device.
        "eager": fit(tmp / "eager", "eager", devices=1),
    }


def ranks(run_dir, devices: int) -> list[dict]:
    return [torch.load(run_dir / f"rank{rank}.pt", weights_only=False) for rank in range(devices)]


def merged(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    whole: dict[str, torch.Tensor] = {}
    for result in results:
        whole.update({k: v for k, v in result[key].items() if not v.is_meta})
    return whole


def relative_error(initial: dict, expected: dict, actual: dict) -> float:
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    error = torch.sqrt(sum(((actual[k] - v) ** 2).sum() for k, v in expected.items()))
    change = torch.sqrt(sum(((v - initial[k]) ** 2).sum() for k, v in expected.items()))
    assert change > 1e-2, "the reference training barely changed the weights"
    return float(error / change)


def stage_share(model_kind: str, devices: int, rank: int) -> int:
    """Parameters rank ``rank`` must hold: its stage's layers, the head on the last stage, the input scale (a loose
    parameter of the LightningModule) everywhere."""
    model = EagerClassifier() if model_kind != "deferred" else DeferredClassifier()
    model.configure_model()
    assert model.layers is not None
    stage = devices - 1 - rank  # global rank 0 holds the last stage
    layer_range = PipelineParallelConfig(devices, MICRO_BATCHES).split_into_stages(len(model.layers))[stage]
    own = sum(p.numel() for i in layer_range for p in model.layers[i].parameters())
    pipelined = sum(p.numel() for p in model.layers.parameters())
    head = sum(p.numel() for p in model.head.parameters())  # runs after the blocks: held by the last stage only
    everywhere = sum(p.numel() for p in model.parameters()) - pipelined - head  # the input scale, before them
    return own + everywhere + (head if stage == devices - 1 else 0)


@pytest.mark.parametrize("devices, name", [(2, "deferred"), (2, "init_module"), (4, "deferred")])
def test_each_rank_holds_only_its_stage(two_stages, four_stages, devices, name):
    results = (two_stages if devices == 2 else four_stages)[name]
    for rank, result in enumerate(results):
        assert not result["meta_in_module"], "a meta tensor was left in the stage this rank runs"
        # Every real parameter in the process, found by the garbage collector: exactly this rank's share.
        assert result["real_parameters"] == result["local_parameters"] == stage_share(name, devices, rank)


def test_initial_weights_are_equal_on_one_two_and_four_stages(two_stages, four_stages, single_device):
    expected = single_device["deferred"]["initial"]
    for results in (two_stages["deferred"], four_stages["deferred"]):
        initial = merged(results, "initial")
        assert initial.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(initial[key], value), key
    initial = merged(two_stages["init_module"], "initial")
    for key, value in single_device["eager"]["initial"].items():
        assert torch.equal(initial[key], value), key


@pytest.mark.parametrize(
    "devices, name",
    [(2, "deferred"), (2, "init_module"), (4, "deferred"), (4, "gathered"), (4, "resumed")],
)
def test_training_matches_single_device(two_stages, four_stages, single_device, devices, name):
    results = (two_stages if devices == 2 else four_stages)[name]
    reference = single_device["eager" if name == "init_module" else "resumed" if name == "resumed" else "deferred"]
    initial = single_device["deferred"]["initial"] if name == "resumed" else reference["initial"]
    # The trained model, from the stages each rank kept after fit.
    assert relative_error(initial, reference["final"], merged(results, "final")) < TOLERANCE
    for result in results:  # trainer.test(model) after fit runs on the same split: every rank logs the same loss
        assert result["tested"][0]["test_loss"] == pytest.approx(reference["tested"][0]["test_loss"], rel=1e-5)


def test_after_fit_every_rank_keeps_its_trained_stage_and_nothing_else(four_stages, single_device):
    """A model built on the meta device stays distributed after fit and test: no rank, rank 0 included, receives
    the other stages; with gather_model_after_run=True, rank 0 (the launching process) holds the whole model."""
    expected = single_device["deferred"]["final"]
    for rank, result in enumerate(four_stages["deferred"]):
        stage = 4 - 1 - rank
        layer_range = PipelineParallelConfig(4, MICRO_BATCHES).split_into_stages(2 * DEPTH + 1)[stage]
        for key, value in result["final"].items():
            if key.startswith("layers."):
                local = int(key.split(".")[1]) in layer_range
            else:  # the head lives on the last stage, the input scale everywhere
                local = not key.startswith("head.") or stage == 3
            assert value.is_meta != local, key
            if local:
                torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5)
    whole = four_stages["gathered"][0]["final"]
    assert not any(value.is_meta for value in whole.values())
    assert relative_error(single_device["deferred"]["initial"], expected, whole) < TOLERANCE


def test_no_rank_holds_more_than_its_stage_in_fit_test_and_checkpointing(four_stages):
    """Peak resident memory per rank in each phase (fit with its teardown, test, trainer.save_checkpoint after
    them) of a 128 MiB model built in configure_model on 4 stages: within the stage's share (parameters, gradients,
    momentum) plus the fixed footprint of a process (the same phases with a tiny model) plus a slack smaller than
    one stage. Negative control: asking for the whole model (gathered after the run, gathered checkpoints) shows."""
    for rank, result in enumerate(four_stages["peaks"]):
        bound = result["fixed_bytes"] + result["share_bytes"] + PEAK_SLACK
        assert 80 * 2**20 < result["share_bytes"] < 128 * 2**20, result["share_bytes"]  # 3 x 32 MiB, about
        for phase, peak in result["peak"].items():
            assert peak <= bound, (rank, phase, peak / 2**20, bound / 2**20)
    gathered = four_stages["peaks_gathered"][0]  # rank 0 receives the other three stages
    bound = gathered["fixed_bytes"] + gathered["share_bytes"] + PEAK_SLACK
    assert gathered["peak"]["fit"] > bound and gathered["peak"]["checkpoint"] > bound, gathered


# Runs the consolidate command in this Python and prints its peak resident set (VmHWM, KiB).
CONSOLIDATE_WITH_PEAK = """
import runpy, sys
from pathlib import Path
sys.argv = ["consolidate_checkpoint", *sys.argv[1:]]
runpy.run_module("lightning_pipe.commands.consolidate_checkpoint", run_name="__main__")
print("VmHWM", next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmHWM:")))
"""


def consolidation_peak(sharded: Path, out: Path) -> int:
    result = run_python("-c", CONSOLIDATE_WITH_PEAK, sharded, out, cwd=out.parent / f"{out.stem}_run", env=SMALL_HEAP)
    return int(result.stdout.split("VmHWM")[-1].split()[0]) * 1024


def test_consolidating_takes_about_one_stage_of_memory(four_stages, tmp_path):
    """The command writes the 4-stage checkpoint of the 128 MiB model (weights and momentum: 256 MiB, 64 MiB per
    shard) holding about one shard at a time: its peak over the same command on a tiny checkpoint stays within the
    largest shard plus a slack, far below the whole checkpoint."""
    run = four_stages["dir"] / "peaks"
    shards = [path.stat().st_size for path in committed_directory(run / "measured.ckpt").glob("*.distcp")]
    assert len(shards) == 4
    footprint = consolidation_peak(run / "tiny.ckpt", tmp_path / "tiny.ckpt")
    peak = consolidation_peak(run / "measured.ckpt", tmp_path / "measured.ckpt")
    assert peak - footprint <= max(shards) + PEAK_SLACK, ((peak - footprint) / 2**20, max(shards) / 2**20)
    assert peak - footprint < sum(shards) / 2
    consolidated = torch.load(tmp_path / "measured.ckpt", mmap=True, weights_only=True)
    assert len(consolidated["optimizer_states"][0]["state"]) == len(consolidated["state_dict"])  # all parameters


def test_checkpoints_are_sharded_and_consolidate_into_the_gathered_file(four_stages, tmp_path):
    """A model built on the meta device saves sharded (one shard per rank, nothing gathered), also from
    trainer.save_checkpoint after fit and test; the consolidate command turns the shards into the file the gathered
    run wrote, and that file loads with torch.load in a process that never imports lightning_pipe."""
    sharded = four_stages["dir"] / "deferred" / "ckpt" / "last.ckpt"
    for directory in (sharded, four_stages["dir"] / "deferred" / "after_fit.ckpt"):
        assert directory.is_dir() and len(list(committed_directory(directory).glob("*.distcp"))) == 4, directory
    out = tmp_path / "consolidated.ckpt"
    run_python("-m", "lightning_pipe.consolidate_checkpoint", sharded, out, cwd=tmp_path / "consolidate")
    script = f"""
import sys, torch
loaded = torch.load({str(out)!r}, weights_only=True)
assert 'lightning_pipe' not in sys.modules, 'the consolidated file needed lightning_pipe to load'
torch.save(loaded, {str(tmp_path / 'reloaded.pt')!r})
"""
    run_python("-c", script, cwd=tmp_path / "reload")
    consolidated = torch.load(tmp_path / "reloaded.pt", weights_only=True)
    gathered = torch.load(four_stages["checkpoint"], weights_only=True)
    assert list(consolidated) == list(gathered)
    assert list(consolidated["state_dict"]) == list(gathered["state_dict"])
    for key, value in gathered["state_dict"].items():
        assert torch.equal(consolidated["state_dict"][key], value), key
    ours, theirs = consolidated["optimizer_states"][0], gathered["optimizer_states"][0]
    assert ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
    for index, entries in theirs["state"].items():
        for entry, value in entries.items():
            assert torch.equal(ours["state"][index][entry], value), (index, entry)
    for key in ("epoch", "global_step", "lr_schedulers", "hyper_parameters"):
        assert consolidated.get(key) == gathered.get(key), key


def test_resuming_reads_only_the_local_stage_of_the_checkpoint(four_stages):
    file_bytes = Path(four_stages["checkpoint"]).stat().st_size
    for rank, result in enumerate(four_stages["resumed"]):
        # Weights and momentum of this rank's parameters, each read once from the memory-mapped file.
        local_tensors = 2 * len(result["initial"])
        share_bytes = 2 * 4 * stage_share("deferred", 4, rank)
        resident = result["resident_checkpoint_bytes"]
        assert share_bytes * 0.9 <= resident <= share_bytes + PAGE_SLACK * local_tensors, (rank, resident, share_bytes)
        assert resident < file_bytes / 2, f"rank {rank} read {resident} of the {file_bytes} bytes of the checkpoint"


def test_model_built_without_deferred_construction_works_as_before(two_stages, single_device):
    reference = single_device["eager"]
    for result in two_stages["eager"]:  # the whole model, real, on every rank, as before
        assert relative_error(reference["initial"], reference["final"], result["final"]) < TOLERANCE
        assert result["real_parameters"] > result["local_parameters"]
        assert "building it in configure_model() would save up to" in result["summary"]
    assert "configure_model()" not in two_stages["deferred"][0]["summary"]


def test_memory_balance_of_a_model_on_the_meta_device_is_estimated_and_trains_as_one_device(two_stages, single_device):
    reference = single_device["deferred"]
    assert relative_error(reference["initial"], reference["final"], merged(two_stages["memory"], "final")) < TOLERANCE
    for result in two_stages["memory"]:
        assert "balance='memory'" in result["summary"]
        assert "by estimated memory (parameters, gradients, optimizer state, activations)" in result["summary"]


def test_profiled_balance_of_a_model_on_the_meta_device_is_refused_naming_the_fix(two_stages):
    for result in two_stages["profiled"]:
        assert "balance='time' profiles every block with its weights" in result["error"]
        assert "use balance='parameters'" in result["error"]
