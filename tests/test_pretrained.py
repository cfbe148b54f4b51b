"""Fine-tuning from pretrained weights: each rank reads only its stage's tensors (and the replicated modules'), the
pipelined fine-tune equals one device that called ``from_pretrained``, weights that do not fit fail on every rank
before the first step, and the trained model goes back out as a directory ``from_pretrained`` loads.

Checkpoints of another shape of the model are read as ``from_pretrained`` reads them: a task model's into its base
model held at any attribute (its head left out), a base model's into a task model (its new head initialised), names
renamed by the model class (BERT's old ``gamma``/``beta``) or by the user's ``key_mapping``.

No downloads: tiny GPT-2, Llama and BERT models (tests/helpers/stock_models.py) are saved with ``save_pretrained``
into temporary directories, as one safetensors file, as shards with an index, and as ``pytorch_model.bin``.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.utils.data import DataLoader

from helpers.compare import relative_weight_error
from helpers.launch import launch, started_together
from helpers import stock_models
from helpers.stock_models import PretrainedCausalLM, bert_config, gpt2_config, llama_config
from lightning_pipe import PretrainedWeights, init_weights
from lightning_pipe.checkpoints.export import library_model_prefix
from lightning_pipe.checkpoints.pretrained import PretrainedLoad, PretrainedMismatchError, checked_pretrained
from lightning_pipe.checkpoints.sharded import committed_directory, consolidate
from lightning_pipe.checkpoints.stored_weights import open_stored_weights, read_tensors
from lightning_pipe.checkpoints.whole_model import WholeModelLayout, tied_aliases
from lightning_pipe.execution.materialize import materialize
from lightning_pipe.commands.export_pretrained import main as export_command

transformers = pytest.importorskip("transformers")

STEPS = 3
TOLERANCE = 1e-5  # of the weights' change over the run, as the stock pipelines' tests
FAMILIES = {"gpt2": (transformers.GPT2LMHeadModel, gpt2_config), "llama": (transformers.LlamaForCausalLM, llama_config),
            "bert": (transformers.BertForSequenceClassification, bert_config)}
GPT2_BLOCKS_RENAMED = {r"^transformer\.blocks\.": "transformer.h."}  # the key_mapping of the "gpt2_renamed" weights
# SGD for the Llama runs' weight comparisons: AdamW amplifies the round-off of a weight whose gradient is near its
# epsilon, and one such weight of `llama_task_into_backbone` ended 1.6e-5 of the change apart on a fresh machine.
LLAMA_SGD = {"sgd_lr": 0.5}
# Runs of the two-stage launch whose checkpoint is of another shape than the model: the run -> (its weights, its
# LightningModule of helpers.stock_models, the directory of its config, the keys that start at their initialisation,
# the LightningModule's options).
ANOTHER_SHAPE = {
    "llama_task_into_backbone": ("llama_sharded", "BackboneCausalLM", "llama_sharded", "lm_head.", LLAMA_SGD),
    "bert_task_into_encoder": ("bert_legacy", "BertClassifier", "bert_legacy", "classifier.", {}),
    "llama_base_into_task": ("llama_base", "PretrainedCausalLM", "llama_sharded", "model.lm_head.", LLAMA_SGD),
}


# ---- the pretrained models, saved as their library saves them ------------------------------------------------------


def pretrained_model(family: str, seed: int = 1, **config_changes) -> nn.Module:
    model_class, config = FAMILIES[family]
    torch.manual_seed(seed)
    configured = config()
    for name, value in config_changes.items():
        setattr(configured, name, value)
    return model_class(configured)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Every pretrained directory the tests read (the same GPT-2 and the same Llama weights in each format)."""
    root = tmp_path_factory.mktemp("pretrained")
    gpt2, llama = pretrained_model("gpt2"), pretrained_model("llama")
    gpt2.save_pretrained(root / "gpt2")  # model.safetensors
    gpt2.save_pretrained(root / "gpt2_sharded", max_shard_size="40KB")  # shards and model.safetensors.index.json
    llama.save_pretrained(root / "llama_sharded", max_shard_size="40KB")
    llama.config.save_pretrained(root / "llama_bin")
    torch.save(llama.state_dict(), root / "llama_bin" / "pytorch_model.bin")
    gpt2.to(torch.bfloat16).save_pretrained(root / "gpt2_bf16")
    base = pretrained_model("gpt2").transformer  # GPT2Model: the checkpoint of the model without its head
    base.save_pretrained(root / "gpt2_base")
    # Weights that do not fit the 4-layer config saved beside them: a fifth layer, wpe of 64 positions, a bias lost.
    other = pretrained_model("gpt2", n_layer=5, n_positions=64).state_dict()
    del other["lm_head.weight"], other["transformer.h.0.ln_1.bias"]
    (root / "gpt2_mismatch").mkdir()
    save_file(other, str(root / "gpt2_mismatch" / "model.safetensors"), metadata={"format": "pt"})
    gpt2_config().save_pretrained(root / "gpt2_mismatch")
    pretrained_model("llama").model.save_pretrained(root / "llama_base")  # LlamaModel: a task model's body
    # A BERT classifier's checkpoint with the LayerNorm names of old files (gamma, beta), which transformers renames.
    pretrained_model("bert").save_pretrained(root / "bert_legacy")
    renamed_file(root / "bert_legacy" / "model.safetensors", {"LayerNorm.weight": "LayerNorm.gamma",
                                                               "LayerNorm.bias": "LayerNorm.beta"})
    # GPT-2 with its blocks stored under another name, read with key_mapping=GPT2_BLOCKS_RENAMED.
    pretrained_model("gpt2").save_pretrained(root / "gpt2_renamed")
    renamed_file(root / "gpt2_renamed" / "model.safetensors", {"transformer.h.": "transformer.blocks."})
    return {path.name: path for path in root.iterdir()}


def renamed_file(path: Path, renames: dict[str, str]) -> None:
    """The safetensors file at ``path`` rewritten with each name's parts renamed (``old -> new``)."""
    tensors = load_file(path)
    for old, new in renames.items():
        tensors = {name.replace(old, new): value for name, value in tensors.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


# ---- the pipelined runs -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipelined(saved, tmp_path_factory) -> dict[int, Path]:
    """One launch per stage count (a launch costs seconds); see tests/workers/pretrained_worker.py."""
    root = tmp_path_factory.mktemp("pipelined")
    two = [
        {"name": "gpt2", "path": str(saved["gpt2"]), "strategy": {"num_micro_batches": 2},
         "save_pretrained": True, "save_checkpoint": True, "validate_after_fit": True},
        {"name": "llama", "path": str(saved["llama_bin"]), "strategy": {"num_micro_batches": 2}},
        {"name": "gpt2_from_sharded_checkpoint", "path": str(root / "2" / "gpt2" / "sharded.ckpt"),
         "config": str(saved["gpt2"]), "validate_only": True},
        {"name": "gpt2_bf16", "path": str(saved["gpt2_bf16"]), "precision": "bf16-true"},
        *({"name": run, "path": str(saved[weights]), "module": module, "config": str(saved[config]),
           "module_options": options, "strategy": {"num_micro_batches": 2}}
          for run, (weights, module, config, _, options) in ANOTHER_SHAPE.items()),
        # Sequences of one length (a token mean is a sample mean) in batches of 16 on one replica: what 2 replicas
        # of 8 compute together (`gpt2_replicas` below); both exported, also cut into shards.
        {"name": "gpt2_one_replica", "path": str(saved["gpt2"]), "strategy": {"num_micro_batches": 2},
         "module_options": {"batch_size": 16, "padded": False}, "save_pretrained": True, "max_shard_size": "40KB"},
        {"name": "mismatch", "path": str(saved["gpt2_mismatch"]), "fails": True},
    ]
    four = [
        {"name": "gpt2", "path": str(saved["gpt2_sharded"]), "strategy": {"num_micro_batches": 4},
         "save_pretrained": True},
        {"name": "llama", "path": str(saved["llama_sharded"]), "strategy": {"num_micro_batches": 4}},
        {"name": "gpt2_replicas", "path": str(saved["gpt2"]), "strategy": {"num_stages": 2, "num_micro_batches": 2},
         "module_options": {"batch_size": 8, "padded": False}, "save_pretrained": True, "max_shard_size": "40KB"},
        # The same, each stage sharded over its 2 replicas (FSDP2), exported and checkpointed (torch.distributed.checkpoint,
        # shard by shard) as training ends, while the stages are sharded.
        {"name": "gpt2_sharded_replicas", "path": str(saved["gpt2"]),
         "strategy": {"num_stages": 2, "num_micro_batches": 2, "data_parallel": "shard",
                      "save_distributed_checkpoint": True},
         "module_options": {"batch_size": 8, "padded": False}, "export_in_run": True},
    ]
    launches = started_together({
        devices: partial(launch, "pretrained_worker.py",
                         {"devices": devices, "out": str(root / str(devices)), "steps": STEPS, "runs": runs},
                         root / str(devices), timeout=600)
        for devices, runs in ((2, two), (4, four))
    })
    for launched in launches.values():
        launched.result()
    return {2: root / "2", 4: root / "4"}


def rank_results(run_dir: Path) -> list[dict]:
    return [torch.load(path) for path in sorted(run_dir.glob("rank*.pt"))]


def merged(run_dir: Path, when: str = "final") -> dict[str, torch.Tensor]:
    """The whole model from the ranks' shares; a tensor held by several ranks must be the same on all of them."""
    whole: dict[str, torch.Tensor] = {}
    for result in rank_results(run_dir):
        for key, value in result[when].items():
            if key in whole:
                assert torch.equal(whole[key], value), f"{key} differs between ranks"
            whole[key] = value
    return whole


_one_device: dict[tuple[Path, str], tuple[dict, dict]] = {}


def fine_tuned_on_one_device(
    path: Path, module: str = "PretrainedCausalLM", start: dict[str, torch.Tensor] | None = None,
    options: dict | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights before and after ``STEPS`` steps on one device of the LightningModule ``module`` (made with
    ``options``) whose library model is made with ``from_pretrained(path)``; ``start``: tensors it starts from
    instead (a new head's)."""
    key = (path, module, tuple(sorted((options or {}).items())))
    if key not in _one_device:
        seed_everything(0, verbose=False)
        model = getattr(stock_models, module)(str(path), from_pretrained=True, **(options or {}))
        model.configure_model()  # the LightningModule's own head, if any (the Trainer's call then keeps it)
        if start:
            model.load_state_dict({**model.state_dict(), **start})
        before = {key: value.clone() for key, value in model.state_dict().items()}
        trainer = Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                          limit_val_batches=0)
        trainer.fit(model)
        _one_device[key] = before, model.state_dict()
    return _one_device[key]


@pytest.mark.parametrize("devices, family", [(2, "gpt2"), (2, "llama"), (4, "gpt2"), (4, "llama")])
def test_pipelined_fine_tune_from_pretrained_weights_equals_one_device_that_called_from_pretrained(
    pipelined, saved, devices, family
):
    before, after = fine_tuned_on_one_device(saved[family if family == "gpt2" else "llama_sharded"])
    results = rank_results(pipelined[devices] / family)
    assert [result["steps"] for result in results] == [STEPS] * devices
    started = merged(pipelined[devices] / family, "initial")
    assert started.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(started[key], value), f"{key}: not the pretrained weights at the start"
    error = relative_weight_error(before, after, merged(pipelined[devices] / family))
    assert error < TOLERANCE, f"{family} on {devices} stages: weights differ by {error:.2e} of their change"


@pytest.mark.parametrize("run", ANOTHER_SHAPE)
def test_a_checkpoint_of_another_shape_of_the_model_fine_tunes_as_one_device_that_called_from_pretrained(
    pipelined, saved, run
):
    """A task model's checkpoint into its base model at ``self.backbone``/``self.encoder`` (Llama; BERT with old
    LayerNorm names), a base model's into a task model: the pipelined start is ``from_pretrained``'s, the new head
    (initialised, not read) is taken over by the one device, and both end alike."""
    weights, module, _, new, options = ANOTHER_SHAPE[run]
    started = merged(pipelined[2] / run, "initial")
    head = {key: value for key, value in started.items() if key.startswith(new)}
    assert head, f"{run}: no key starts with {new!r}"
    before, after = fine_tuned_on_one_device(saved[weights], module, head, options)
    assert started.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(started[key], value), f"{run}: {key} is not from_pretrained's at the start"
    error = relative_weight_error(before, after, merged(pipelined[2] / run))
    assert error < TOLERANCE, f"{run}: weights differ by {error:.2e} of their change"


@pytest.mark.parametrize("run", ANOTHER_SHAPE)
def test_each_rank_reads_only_its_stage_of_a_checkpoint_of_another_shape(pipelined, saved, run):
    weights, module, config, _, _ = ANOTHER_SHAPE[run]
    mapping = PretrainedLoad.plan(built_on_meta(saved[config], module), PretrainedWeights(saved[weights])).mapping
    read_anywhere = set()
    for result in rank_results(pipelined[2] / run):
        assert len(result["read"]) == len(set(result["read"])), "a tensor was read twice"
        assert set(result["read"]) == {mapping.sources[key] for key in result["initial"] if key in mapping.sources}
        assert len(result["read"]) < len(set(mapping.sources.values()))
        read_anywhere |= set(result["read"])
    assert read_anywhere == set(mapping.sources.values())


def test_the_comparison_detects_one_tensor_read_wrong(pipelined, saved, tmp_path):
    """Negative control: one device that started from a checkpoint whose one layer differs by 1e-3 of its values
    (what a stage reading one wrong tensor would start from) ends measurably elsewhere."""
    model = pretrained_model("gpt2")
    with torch.no_grad():
        model.transformer.h[3].attn.c_attn.weight.mul_(1.001)
    model.save_pretrained(tmp_path / "gpt2_one_layer_off")
    before, after = fine_tuned_on_one_device(tmp_path / "gpt2_one_layer_off")
    assert relative_weight_error(before, after, merged(pipelined[2] / "gpt2")) > 100 * TOLERANCE


TIED_HEAD = {"lm_head.weight": "transformer.wte.weight"}  # GPT-2's stored name of its head's weight


@pytest.mark.parametrize("devices, family", [(2, "gpt2"), (4, "gpt2"), (4, "llama")])
def test_each_rank_reads_only_its_stage_and_the_replicated_tensors(pipelined, saved, devices, family):
    """Counted at safetensors' own ``get_tensor``: each stored tensor a rank holds, read once; none it does not."""
    stored = open_stored_weights(saved[family if devices == 2 else f"{family}_sharded"])
    read_anywhere = set()
    for result in rank_results(pipelined[devices] / family):
        # The loss stage holds GPT-2's head, not its embedding: the head's tied weight is read as the embedding's.
        ties = TIED_HEAD if family == "gpt2" else {}
        held = {ties.get(key.removeprefix("model."), key.removeprefix("model.")) for key in result["initial"]}
        assert len(result["read"]) == len(set(result["read"])), "a tensor was read twice"
        assert set(result["read"]) == held & set(stored.entries)
        read_anywhere |= set(result["read"])
        assert len(result["read"]) < len(stored.entries)
    assert read_anywhere == set(stored.entries)


@pytest.mark.parametrize("devices", [2, 4])
def test_the_exported_directory_loads_with_from_pretrained_and_equals_the_trained_weights(pipelined, saved, devices):
    run = pipelined[devices] / "gpt2"
    exported = run / "exported"
    assert sorted(path.name for path in exported.glob("*.safetensors")) == [
        f"model-{stage + 1:05d}-of-{devices:05d}.safetensors" for stage in range(devices)
    ]  # one shard per stage, each written by its stage
    trained = merged(run)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    state = loaded.state_dict()
    assert {f"model.{key}" for key in state} == set(trained)
    for key, value in state.items():
        assert torch.equal(value, trained[f"model.{key}"]), key
    source = json.loads((saved["gpt2"] / "config.json").read_text())
    assert json.loads((exported / "config.json").read_text())["n_layer"] == source["n_layer"] == 4
    cast = transformers.AutoModelForCausalLM.from_pretrained(run / "exported_bf16", dtype="auto").state_dict()
    for key, value in cast.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, trained[f"model.{key}"].bfloat16()), key


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, by name (a name in two files fails)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        shard = load_file(path)
        assert not tensors.keys() & shard.keys(), f"{sorted(tensors.keys() & shard.keys())} written twice"
        tensors.update(shard)
    return tensors


@pytest.mark.parametrize("devices", [2, 4])
def test_the_export_holds_the_names_and_size_that_save_pretrained_writes(pipelined, devices, tmp_path):
    """Each tensor once, under save_pretrained's name: the head tied to the embedding is not written (it is re-tied
    on load, as the test above shows); the files' total size is within 1% of save_pretrained's."""
    exported = pipelined[devices] / "gpt2" / "exported"
    transformers.AutoModelForCausalLM.from_pretrained(exported).save_pretrained(tmp_path)
    ours, theirs = stored_tensors(exported), stored_tensors(tmp_path)
    assert "lm_head.weight" not in ours and ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name
    size = sum(path.stat().st_size for path in exported.glob("*.safetensors"))
    expected = sum(path.stat().st_size for path in tmp_path.glob("*.safetensors"))
    assert abs(size - expected) < 0.01 * expected, (size, expected)
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(theirs)


def test_with_replicas_one_replica_writes_each_tensor_once(pipelined):
    """2 stages x 2 replicas: the ranks of replica 0 write every file, each tensor in one file; replica 1 writes
    nothing (counted at the export's own safetensors writes)."""
    results = rank_results(pipelined[4] / "gpt2_replicas")
    assert sorted(result["replica"] for result in results) == [0, 0, 1, 1]
    written: dict[str, list[str]] = {}
    for result in results:
        if result["replica"] == 1:
            assert result["wrote"] == {}
        for file, names in result["wrote"].items():
            assert file not in written, f"{file} written twice"
            written[file] = names
    for directory in ("exported", "exported_bf16", "exported_shards"):
        names = [name for file, tensors in written.items() if file.startswith(f"{directory}/") for name in tensors]
        assert len(names) == len(set(names)) == len(pretrained_model("gpt2").state_dict()) - 1  # less the head
    assert len([file for file in written if file.startswith("exported/")]) == 2  # a shard per stage


def test_the_export_of_two_replicas_equals_the_export_of_one(pipelined, saved, tmp_path):
    """2 stages x 2 replicas write what one replica writes (the same files, shards of at most 40KB numbered across
    the stages, the same index), and the model one device trains on the same samples and writes with
    save_pretrained: each replica reads every other sample of Lightning's shuffled DistributedSampler (seed 0, a
    new permutation each epoch), one device the step's 16 together; sequences of one length, so a token mean is a
    sample mean and the replicas' average is the whole step's."""
    replicas, one = pipelined[4] / "gpt2_replicas", pipelined[2] / "gpt2_one_replica"
    for directory in ("exported", "exported_shards"):
        names = sorted(path.name for path in (replicas / directory).glob("*.safetensors"))
        assert names == sorted(path.name for path in (one / directory).glob("*.safetensors"))
        index = json.loads((replicas / directory / "model.safetensors.index.json").read_text())
        assert index == json.loads((one / directory / "model.safetensors.index.json").read_text())
    shards = sorted((replicas / "exported_shards").glob("*.safetensors"))
    assert len(shards) > 2 and shards[-1].name.endswith(f"-of-{len(shards):05d}.safetensors")
    for path in shards:  # cut at 40KB, except a tensor larger than that alone
        sizes = [value.numel() * value.element_size() for value in load_file(path).values()]
        assert sum(sizes) <= 40 * 1024 or len(sizes) == 1, path.name
    seed_everything(0, verbose=False)
    model = PretrainedCausalLM(str(saved["gpt2"]), from_pretrained=True, batch_size=16, padded=False)
    start = {key: value.clone() for key, value in model.model.state_dict().items()}
    order = [i for epoch in (0, 1) for i in torch.randperm(32, generator=torch.Generator().manual_seed(epoch)).tolist()]
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, DataLoader(model.dataset(seed=0), batch_size=16, sampler=order))
    model.model.save_pretrained(tmp_path)
    expected, exported = stored_tensors(tmp_path), stored_tensors(replicas / "exported_shards")
    assert exported.keys() == expected.keys()
    for name, value in stored_tensors(replicas / "exported").items():  # the shards hold what one per stage holds
        assert torch.equal(exported[name], value), name
    start = {key: start[key] for key in expected}
    assert relative_weight_error(start, expected, exported) < TOLERANCE
    # Negative control: one device reading the samples in order (what no replica read) ends elsewhere.
    assert relative_weight_error(start, expected, stored_tensors(one / "exported")) > 100 * TOLERANCE


def test_sharded_stages_start_from_the_pretrained_weights_as_replicated_ones(pipelined, saved):
    """data_parallel="shard": each rank reads its stage's stored tensors once (as with replicated stages) and its
    stage's blocks are sharded from them; gathered, the weights each rank starts from are those ``from_pretrained``
    loads, bit for bit, and the fine-tune equals the replicated stages' on the same samples."""
    sharded, replicated = pipelined[4] / "gpt2_sharded_replicas", pipelined[4] / "gpt2_replicas"
    library = transformers.AutoModelForCausalLM.from_pretrained(saved["gpt2"]).state_dict()
    started = merged(sharded, "initial")
    assert started.keys() == {f"model.{key}" for key in library}
    for key, value in library.items():
        assert torch.equal(started[f"model.{key}"], value), key
    stored = open_stored_weights(saved["gpt2"])
    for result in rank_results(sharded):
        held = {TIED_HEAD.get(key.removeprefix("model."), key.removeprefix("model.")) for key in result["initial"]}
        assert sorted(result["read"]) == sorted(held & set(stored.entries))  # each once
        assert len(result["read"]) < len(stored.entries)
    before = merged(replicated, "initial")
    assert relative_weight_error(before, merged(replicated), merged(sharded)) < TOLERANCE


def test_a_sharded_runs_export_and_checkpoint_load_with_from_pretrained_equal_to_the_trained_model(
    pipelined, saved, tmp_path
):
    """Written while the stages were sharded (save_pretrained as training ends, and the torch.distributed.checkpoint
    each replica wrote its shards into, exported by the command): whole tensors, which ``from_pretrained`` loads
    equal to the trained model, bit for bit."""
    run = pipelined[4] / "gpt2_sharded_replicas"
    checkpoint = FileSystemReader(str(committed_directory(run / "in_run.ckpt"))).read_metadata().state_dict_metadata
    assert len(checkpoint["model/model.transformer.h.0.attn.c_attn.weight"].chunks) == 2  # a shard per replica
    export_command([str(run / "in_run.ckpt"), str(tmp_path / "out"), "--config", str(saved["gpt2"])])
    trained = merged(run)
    for exported in (run / "exported_in_run", tmp_path / "out"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
        state = loaded.state_dict()
        assert {f"model.{key}" for key in state} == set(trained)
        for key, value in state.items():
            assert torch.equal(value, trained[f"model.{key}"]), (exported.name, key)


def test_a_later_run_of_the_same_model_object_keeps_the_weights_it_trained(pipelined):
    run = pipelined[2] / "gpt2"
    for result in rank_results(run):
        assert result["after_validate"].keys() == result["final"].keys()
        for key, value in result["final"].items():
            assert torch.equal(result["after_validate"][key], value), key


def test_a_sharded_checkpoint_of_this_package_is_read_through_the_same_path(pipelined):
    """Its keys are the LightningModule's (the prefix inferred: none); each rank reads its share."""
    trained = merged(pipelined[2] / "gpt2")
    restored = merged(pipelined[2] / "gpt2_from_sharded_checkpoint", "initial")
    assert restored.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(restored[key], value), key


def test_bf16_weights_stay_bf16_under_bf16_true_precision(pipelined, saved):
    stored = read_tensors(open_stored_weights(saved["gpt2_bf16"]), open_stored_weights(saved["gpt2_bf16"]).entries)
    started = merged(pipelined[2] / "gpt2_bf16", "initial")
    assert all(value.dtype == torch.bfloat16 for value in started.values())
    for name, value in stored.items():
        assert torch.equal(started[f"model.{name}"], value), name


def test_weights_that_do_not_fit_fail_on_every_rank_before_the_first_step_naming_the_keys(pipelined):
    results = rank_results(pipelined[2] / "mismatch")
    assert len(results) == 2
    for result in results:
        assert result["steps"] == 0
        message = result["error"]
        assert message.startswith("PretrainedMismatchError: the pretrained weights"), message
        assert "keys of the model that the checkpoint lacks: ['model.transformer.h.0.ln_1.bias'] (1)" in message
        assert ("tensors stored with another shape: ['model.transformer.wpe.weight' (model [32, 32], stored [64,"
                " 32])] (1)") in message
        # The fifth layer's 12 tensors, less the one GPT-2's ignore pattern 'attn.bias' matches, as from_pretrained
        # ignores it (a causal-mask buffer older versions saved).
        assert "stored names that fill no key of the model: ['transformer.h.4.attn.c_attn.weight'," in message
        assert "...] (11). Mapping tried" in message
        assert "Mapping tried: stored name NAME -> model key 'model.' + NAME (prefix 'model.', inferred" in message


@pytest.mark.parametrize("source", ["sharded", "consolidated"])
def test_the_export_command_writes_a_directory_from_pretrained_loads_from_a_checkpoint(
    pipelined, saved, tmp_path, source, capsys
):
    checkpoint, cast = pipelined[2] / "gpt2" / "sharded.ckpt", []
    if source == "consolidated":  # and cast to bfloat16 on the way
        consolidate(checkpoint, tmp_path / "whole.ckpt", weights_only=True)
        checkpoint, cast = tmp_path / "whole.ckpt", ["--dtype", "bfloat16"]
    export_command([str(checkpoint), str(tmp_path / "out"), "--config", str(saved["gpt2"]), "--max-shard-size",
                    "100KB", *cast])
    assert "wrote" in capsys.readouterr().out
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1  # cut at --max-shard-size
    trained = merged(pipelined[2] / "gpt2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto").state_dict()
    for key, value in loaded.items():
        expected = trained[f"model.{key}"].to(torch.bfloat16 if cast else torch.float32)
        assert value.dtype == expected.dtype and torch.equal(value, expected), key


# ---- without processes: formats, mapping, initialisation, dtypes, messages ---------------------------------------


def built_on_meta(path: Path, module: str = "PretrainedCausalLM") -> nn.Module:
    """The LightningModule as the gpipe strategy has it before set-up: its model built on the meta device."""
    module = getattr(stock_models, module)(str(path))
    with torch.device("meta"):
        module.configure_model()
    return module


def loaded_on_one_process(
    module: nn.Module, weights: PretrainedWeights, precision_dtype: torch.dtype = torch.float32
) -> PretrainedLoad:
    """The strategy's steps with one stage holding everything: map, allocate and initialise the rest, fill."""
    load = PretrainedLoad.plan(module, weights)
    materialize(module, torch.device("cpu"), seed=0, filled=load.mapping.filled)
    load.fill(module, precision_dtype)
    return load


def test_every_format_indexes_the_same_tensors_and_reads_them_alike(saved, tmp_path):
    llama = transformers.LlamaForCausalLM.from_pretrained(saved["llama_sharded"]).state_dict()
    torch.save({"state_dict": llama, "epoch": 3}, tmp_path / "lightning.ckpt")  # a Lightning checkpoint's layout
    for path in (saved["llama_sharded"], saved["llama_bin"], saved["llama_bin"] / "pytorch_model.bin",
                 tmp_path / "lightning.ckpt"):
        stored = open_stored_weights(path)
        assert set(stored.entries) <= set(llama)
        tensors = read_tensors(stored, stored.entries)
        for name, value in tensors.items():
            assert torch.equal(value, llama[name]), (path, name)
    sharded, single = open_stored_weights(saved["gpt2_sharded"]), open_stored_weights(saved["gpt2"])
    assert len(sharded.files()) > 4 and len(single.files()) == 1
    assert {name: (e.shape, e.dtype) for name, e in sharded.entries.items()} == {
        name: (e.shape, e.dtype) for name, e in single.entries.items()
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_built_on_the_meta_device_holds_from_pretrained_weights_ties_and_buffers(saved, family):
    path = saved["gpt2" if family == "gpt2" else "llama_sharded"]
    module = built_on_meta(path)
    load = loaded_on_one_process(module, PretrainedWeights(path))
    assert load.mapping.prefix == "model." and load.mapping.inferred
    expected = transformers.AutoModelForCausalLM.from_pretrained(path)
    for key, value in expected.state_dict().items():
        assert torch.equal(module.model.state_dict()[key], value), key
    for name, buffer in expected.named_buffers():  # not stored: computed by the model (rotary frequencies)
        assert torch.equal(module.model.get_buffer(name), buffer), name
    if family == "gpt2":
        assert module.model.lm_head.weight is module.model.transformer.wte.weight


def test_a_checkpoint_of_the_base_model_fills_the_task_model_with_the_base_prefix_added_and_its_tied_head(saved):
    module = built_on_meta(saved["gpt2"])
    load = loaded_on_one_process(module, PretrainedWeights(saved["gpt2_base"]))
    assert load.mapping.prefix == "model."  # the task model's place: the export writes the task model
    assert "with the base-model prefix 'transformer.' added" in load.mapping.describe(load.stored)
    base = transformers.GPT2Model.from_pretrained(saved["gpt2_base"])
    assert torch.equal(module.model.lm_head.weight, base.wte.weight)


def test_a_base_checkpoint_leaves_the_task_models_new_head_at_its_initialisation(saved):
    module = built_on_meta(saved["llama_sharded"])
    load = loaded_on_one_process(module, PretrainedWeights(saved["llama_base"]))
    assert "model.lm_head.weight" not in load.mapping.filled
    assert load.mapping.sources["model.model.layers.0.mlp.up_proj.weight"] == "layers.0.mlp.up_proj.weight"
    expected = transformers.LlamaForCausalLM.from_pretrained(saved["llama_base"]).state_dict()
    for key, value in module.model.state_dict().items():
        assert torch.equal(value, expected[key]) != (key == "lm_head.weight"), key  # all but the new head


@pytest.mark.parametrize("weights, module, body, head", [
    ("llama_sharded", "BackboneCausalLM", "backbone", ["lm_head.weight"]),
    ("bert_legacy", "BertClassifier", "encoder", ["classifier.bias", "classifier.weight"]),
])
def test_a_task_checkpoint_fills_a_base_model_at_any_attribute_and_leaves_out_its_head(
    saved, weights, module, body, head
):
    """As ``AutoModel.from_pretrained`` of the task model's checkpoint: the base-model prefix dropped, the class's
    renames applied (BERT's old LayerNorm ``gamma``/``beta``), the task head's stored tensors not read."""
    built = built_on_meta(saved[weights], module)
    load = loaded_on_one_process(built, PretrainedWeights(saved[weights]))
    assert load.mapping.prefix == f"{body}." and sorted(load.mapping.left_out) == head
    line = load.mapping.describe(load.stored)
    assert f"less the base-model prefix '{'bert' if module == 'BertClassifier' else 'model'}.'" in line
    assert f"not read, as from_pretrained drops a task model's head: {head}" in line
    if module == "BertClassifier":
        assert "18 renamed ('bert.embeddings.LayerNorm.beta' -> 'bert.embeddings.LayerNorm.bias'" in line
    expected = transformers.AutoModel.from_pretrained(saved[weights]).state_dict()
    state = getattr(built, body).state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def test_stored_names_renamed_by_key_mapping_are_read_as_from_pretrained_reads_them(saved):
    module = built_on_meta(saved["gpt2"])
    load = loaded_on_one_process(module, PretrainedWeights(saved["gpt2_renamed"], key_mapping=GPT2_BLOCKS_RENAMED))
    assert "48 renamed ('transformer.blocks.0.attn.c_attn.bias' -> 'transformer.h.0.attn.c_attn.bias'" in load.mapping.describe(
        load.stored)
    expected = transformers.GPT2LMHeadModel.from_pretrained(saved["gpt2_renamed"], key_mapping=GPT2_BLOCKS_RENAMED)
    for key, value in expected.state_dict().items():
        assert torch.equal(module.model.state_dict()[key], value), key
    with pytest.raises(PretrainedMismatchError, match=r"lacks: \['model\.transformer\.h\.0\.ln_1\.weight',.*stored"
                       r" names that fill no key of the model: \['transformer\.blocks\.0\.attn\.c_attn\.weight',.*"
                       r"key_mapping=\{regex: replacement\} for names stored otherwise"):
        PretrainedLoad.plan(built_on_meta(saved["gpt2"]), PretrainedWeights(saved["gpt2_renamed"], prefix="model."))


def test_a_task_checkpoint_of_more_layers_than_the_base_model_is_refused_naming_them(saved, tmp_path):
    llama_config(3).save_pretrained(tmp_path)
    with pytest.raises(PretrainedMismatchError) as error:
        PretrainedLoad.plan(built_on_meta(tmp_path, "BackboneCausalLM"), PretrainedWeights(saved["llama_sharded"]))
    message = str(error.value)
    assert re.search(r"stored names that fill no key of the model: \['model\.layers\.3\.[^]]*\] \(9\)\.", message)
    assert "lm_head" not in message.split("Mapping tried")[0]  # the task head is left out, not a mismatch
    assert "'backbone.' + NAME less the base-model prefix 'model.'" in message


def test_a_key_mapping_that_is_not_a_regular_expression_is_refused_where_it_enters(saved):
    with pytest.raises(ValueError, match=r"pretrained\.key_mapping: '\(unclosed' is not a regular expression"):
        checked_pretrained(PretrainedWeights(saved["gpt2"], key_mapping={"(unclosed": "x"}))


def test_modules_outside_the_prefix_start_as_they_would_without_pretrained_weights(saved):
    """A new head beside the pretrained model: initialised by the package's seeded rule, never an error."""
    module = built_on_meta(saved["gpt2"])
    with torch.device("meta"):
        module.head = nn.Linear(32, 3)
    loaded_on_one_process(module, PretrainedWeights(saved["gpt2"], prefix="model."))
    real_head = nn.Module()
    real_head.head = nn.Linear(32, 3)
    init_weights(real_head, seed=0)
    assert torch.equal(module.head.weight, real_head.head.weight)


@pytest.mark.parametrize("dtype, precision, expected", [
    ("precision", torch.float32, torch.float32),  # precision="32-true" or a mixed precision: float32 weights
    ("precision", torch.bfloat16, torch.bfloat16),  # precision="bf16-true"
    ("checkpoint", torch.float32, torch.bfloat16),  # the stored dtype whatever the precision
])
def test_the_weights_take_the_precisions_dtype_or_the_stored_one(saved, dtype, precision, expected):
    module = built_on_meta(saved["gpt2_bf16"])  # from_config builds in config.json's dtype: bfloat16 here
    loaded_on_one_process(module, PretrainedWeights(saved["gpt2_bf16"], dtype=dtype), precision)
    stored = read_tensors(open_stored_weights(saved["gpt2_bf16"]), ["transformer.h.1.mlp.c_fc.weight"])
    weight = module.model.transformer.h[1].mlp.c_fc.weight
    assert weight.dtype == expected
    assert torch.equal(weight, stored["transformer.h.1.mlp.c_fc.weight"].to(expected))


def test_weights_that_do_not_fit_are_refused_naming_the_keys_and_the_mapping(saved):
    module = built_on_meta(saved["gpt2"])
    with pytest.raises(PretrainedMismatchError) as error:
        PretrainedLoad.plan(module, PretrainedWeights(saved["gpt2_mismatch"], prefix="model."))
    message = str(error.value)
    assert message.startswith(f"the pretrained weights {str(saved['gpt2_mismatch'])!r} (safetensors, 1 file, 63"
                              " tensors) do not fit the model: keys of the model that the checkpoint lacks:")
    assert "stored name NAME -> model key 'model.' + NAME (prefix 'model.', as given)" in message
    assert "Build the model from the checkpoint's own config (its config.json)" in message
    assert ("tensors stored with another shape: ['model.transformer.wpe.weight' (model [32, 32], stored [64, 32])]"
            " (1)") in message


def test_weights_of_another_model_are_refused_naming_the_prefixes_tried(saved):
    module = built_on_meta(saved["llama_sharded"])
    with pytest.raises(PretrainedMismatchError, match=r"no prefix makes a stored name a key of the model\. Stored"
                       r" names: \['h\.0\.attn\.c_attn\.bias'.*prefixes tried .*\[''"):
        PretrainedLoad.plan(module, PretrainedWeights(saved["gpt2_base"]))


def test_a_tensor_tied_across_stages_is_written_once_by_the_first_stage_that_holds_it():
    """A block sharing an earlier block's weight on another stage, a head sharing the embedding's: each written
    once, under the first name (save_pretrained's), by the first stage holding that name."""
    model = nn.Module()
    model.embed, model.head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    model.net = nn.Sequential(*(nn.Linear(4, 4) for _ in range(4)))
    model.net[3].weight, model.head.weight = model.net[0].weight, model.embed.weight
    keys = list(model.state_dict())
    layout = WholeModelLayout("net", model.net, [[0, 1], [2, 3]], keys, [name for name, _ in model.named_parameters()],
                              put_back=lambda: None, block_names=tuple(f"net.{i}" for i in range(4)),
                              aliases=tied_aliases(model))
    assert layout.aliases == {"net.3.weight", "head.weight"}
    assert layout.holders("net.3.bias") == [1] and layout.holders("embed.weight") == [0, 1]
    assert layout.stage_keys(0) == ["embed.weight", "net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias"]
    assert layout.stage_keys(1) == ["net.2.weight", "net.2.bias", "net.3.bias"]


def test_the_export_finds_where_the_library_model_sits(saved):
    module = built_on_meta(saved["gpt2"])
    assert library_model_prefix(module) == "model."  # the outermost Hugging Face model, not its GPT2Model inside
    module.other = transformers.GPT2Model(gpt2_config(1))
    assert library_model_prefix(module) == ""  # two: the LightningModule's own keys, as they are


def test_a_prefix_that_fits_several_places_equally_must_be_given(tmp_path):
    save_file({"weight": torch.zeros(4, 4), "bias": torch.zeros(4)}, str(tmp_path / "linear.safetensors"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(PretrainedMismatchError, match=r"several prefixes equally well \(2 stored names each\):"
                       r" \['0\.', '1\.'\] \(2\); give PretrainedWeights\(path, prefix=\.\.\.\)"):
        PretrainedLoad.plan(model, PretrainedWeights(tmp_path / "linear.safetensors"))
    load = PretrainedLoad.plan(model, PretrainedWeights(tmp_path / "linear.safetensors", prefix="1."))
    assert load.mapping.sources == {"1.weight": "weight", "1.bias": "bias"}
