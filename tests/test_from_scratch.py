"""Models built from scratch in ``configure_model()``: a Hugging Face model with no pretrained weights starts from its
model's own initialisation (``_init_weights``, as ``post_init`` applies it), a model of the user's own from the
``init_module`` it passes; each rank initialises only its stage's blocks, the weights equal one device's whatever the
split, and training matches one device."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers.compare import relative_weight_error
from helpers.from_scratch import BLOCKS, LAYERS, Gain, fit, init_gain
from helpers.launch import launch
from helpers.stock_models import gpt2_config, llama_config
from lightning_pipe import GPipeStrategy, init_weights
from lightning_pipe.execution.materialize import materialize
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.region import container_region

# Of the weights' change over the run. AdamW divides each gradient by its running magnitude, which turns the float
# summation order's differences in near-zero gradients into visible ones: measured 1e-6 (Llama), 8e-6 (GPT-2).
TOLERANCE = 1e-4


def hf_model(kind: str, layers: int = 2, **config_changes):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    config = llama_config(layers) if kind == "llama" else gpt2_config(layers)
    for name, value in config_changes.items():
        setattr(config, name, value)
    return (LlamaForCausalLM if kind == "llama" else GPT2LMHeadModel)(config)


def on_meta(build, *args, **kwargs):
    with torch.device("meta"):
        return build(*args, **kwargs)


def assert_same_tensors(expected: nn.Module, actual: nn.Module) -> None:
    expected_state, actual_state = expected.state_dict(), actual.state_dict()
    assert expected_state.keys() == actual_state.keys()
    for key, value in expected_state.items():
        assert torch.equal(actual_state[key], value), key


# ---- materialisation, without processes ----------------------------------------------------------------------------


def test_llama_built_on_meta_gets_its_models_own_initialisation():
    """Linear layers and the embedding normal(0, initializer_range), its padding row zero, norms one, the rotary
    frequencies computed as in __init__; the same tensors as the model built on the CPU and given init_weights."""
    deferred = on_meta(hf_model, "llama", pad_token_id=5)
    initialised = materialize(deferred, torch.device("cpu"), seed=3)
    real = hf_model("llama", pad_token_id=5)
    assert init_weights(real, seed=3) == initialised
    assert_same_tensors(real, deferred)
    std = deferred.config.initializer_range
    state = deferred.state_dict()
    linear = torch.cat([v.flatten() for k, v in state.items() if k.endswith("proj.weight") or k == "lm_head.weight"])
    assert linear.std().item() == pytest.approx(std, rel=0.05)  # nn.Linear's own reset: std 1/sqrt(3 * 32) = 0.1
    embedding = deferred.model.embed_tokens.weight
    assert torch.equal(embedding[5], torch.zeros(32)) and embedding.std().item() == pytest.approx(std, rel=0.1)
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in state.items() if k.endswith("norm.weight"))
    rotary = deferred.model.rotary_emb
    assert torch.equal(rotary.inv_freq, hf_model("llama").model.rotary_emb.inv_freq)
    assert torch.equal(rotary.original_inv_freq, rotary.inv_freq)


def test_gpt2_built_on_meta_keeps_its_tie_and_its_scaled_residual_projections():
    """GPT-2's attention and MLP (no tensors of their own) rescale their output projection after it is initialised,
    as transformers visits them after their children: std initializer_range / sqrt(2 * n_layer)."""
    deferred = on_meta(hf_model, "gpt2", layers=4)
    initialised = materialize(deferred, torch.device("cpu"), seed=3)
    real = hf_model("gpt2", layers=4)
    assert init_weights(real, seed=3) == initialised
    assert_same_tensors(real, deferred)
    assert deferred.lm_head.weight is deferred.transformer.wte.weight
    std = deferred.config.initializer_range
    blocks = deferred.transformer.h
    projections = torch.cat([p.flatten() for b in blocks for p in (b.attn.c_proj.weight, b.mlp.c_proj.weight)])
    inputs = torch.cat([p.flatten() for b in blocks for p in (b.attn.c_attn.weight, b.mlp.c_fc.weight)])
    assert projections.std().item() == pytest.approx(std / math.sqrt(2 * 4), rel=0.05)
    assert inputs.std().item() == pytest.approx(std, rel=0.05)
    assert all(torch.equal(b.attn.c_attn.bias, torch.zeros(96)) for b in blocks)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_stage_of_a_hf_model_materialises_what_the_whole_model_does(kind):
    """Blocks 2 and 3 of 4 get the same tensors whether their rank holds them alone or the whole model, and the
    other stage's blocks are not initialised there."""
    whole = on_meta(hf_model, kind, layers=4)
    materialize(whole, torch.device("cpu"), seed=1)
    split = on_meta(hf_model, kind, layers=4)
    blocks = BLOCKS[kind].removeprefix("model.")
    StageBlocks(split, container_region(split, blocks), range(2, 4), 1, 2).install()
    initialised = materialize(split, torch.device("cpu"), seed=1)
    assert {block_of(kind, name, prefix=blocks) for name in initialised} - {None} == {2, 3}
    whole_state = whole.state_dict()
    for key, value in split.state_dict().items():
        assert torch.equal(value, whole_state[key]), key


def test_init_module_initialises_a_model_of_the_users_own_as_init_weights_does():
    def build():
        return nn.Sequential(nn.Linear(4, 4), Gain(4), nn.Linear(4, 2))

    deferred = on_meta(build)
    assert materialize(deferred, torch.device("cpu"), seed=2, init_module=init_gain) == ["0", "1", "2"]
    real = build()
    assert init_weights(real, seed=2, init_module=init_gain) == ["0", "1", "2"]
    assert_same_tensors(real, deferred)
    assert not torch.equal(deferred[1].gain, torch.ones(4))  # drawn by init_gain, not the ones it was built with


def test_a_module_with_no_initialiser_is_refused_naming_the_three_ways_out():
    deferred = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Gain(4)))
    with pytest.raises(TypeError) as error:
        materialize(deferred, torch.device("cpu"), seed=0)
    message = str(error.value)
    assert "module '1' (Gain) holds tensors ['gain'] on the meta device" in message
    assert "has no reset_parameters() and is not part of a Hugging Face PreTrainedModel" in message
    for way_out in ("define `Gain.reset_parameters(self)`", "pass `GPipeStrategy(init_module=fn)`",
                    "create the module outside configure_model()"):
        assert way_out in message


def test_a_tensor_no_initialiser_wrote_is_refused_naming_it():
    def forgets_gains(name: str, module: nn.Module) -> None:
        if not isinstance(module, Gain):
            module.reset_parameters()

    deferred = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Gain(4)))
    with pytest.raises(TypeError, match=r"module '1': its tensors \['gain'\].*after init_module\('1', Gain\)"):
        materialize(deferred, torch.device("cpu"), seed=0, init_module=forgets_gains)


def test_init_module_that_is_not_a_function_is_refused_where_it_enters():
    with pytest.raises(ValueError, match=r"init_module=3 is invalid; use a function fn\(name, module\)"):
        GPipeStrategy(init_module=3)


# ---- 4 stages, 4 processes ------------------------------------------------------------------------------------------

NEGATIVE_CONTROL = "llama_dropped_gradient"
RUNS = [{"name": "llama", "model": "llama"}, {"name": "gpt2", "model": "gpt2"},
        {"name": "scaled", "model": "scaled", "init_module": True},
        {"name": NEGATIVE_CONTROL, "model": "llama", "drop_gradient_of": 0}]


@pytest.fixture(scope="module")
def four_stages(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("from_scratch4")
    launch("from_scratch_worker.py", {"devices": 4, "out": str(tmp), "runs": RUNS}, tmp, timeout=900)
    return {run["name"]: [torch.load(tmp / run["name"] / f"rank{r}.pt", weights_only=False) for r in range(4)]
            for run in RUNS}


_one_device: dict[str, dict] = {}


def one_device(kind: str, tmp_path_factory) -> dict:
    """The same model built on the CPU in configure_model, with init_weights, trained on one device."""
    if kind not in _one_device:
        _one_device[kind] = fit(kind, tmp_path_factory.mktemp(f"one_device_{kind}"), devices=1)
    return _one_device[kind]


def block_of(kind: str, name: str, prefix: str | None = None) -> int | None:
    """The block (of the pipelined ModuleList) that module ``name`` is part of, None outside the blocks."""
    prefix = f"{BLOCKS[kind] if prefix is None else prefix}."
    return int(name.removeprefix(prefix).split(".")[0]) if name.startswith(prefix) else None


# The modules outside the blocks, by the block whose stage holds them: the embeddings the first's, the head the last's.
OUTSIDE = {
    "llama": {"model.model.embed_tokens": 0, "model.model.norm": -1, "model.lm_head": -1},
    "gpt2": {"model.transformer.wte": 0, "model.transformer.wpe": 0, "model.transformer.ln_f": -1, "model.lm_head": -1},
}


def stage_bound(kind: str, name: str) -> int | None:
    """The block whose stage alone may initialise module ``name``; None where every rank may (a rotary embedding's
    buffers: every block takes its output)."""
    for module, block in OUTSIDE.get(kind, {}).items():
        if name == module or name.startswith(module + "."):
            return block % LAYERS
    return block_of(kind, name)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_each_rank_initialises_only_what_its_stage_holds(four_stages, kind):
    """Its blocks, and of the modules outside them only those its stage runs (the embeddings on the first stage, the
    final norm and the head on the last)."""
    for result in four_stages[kind]:
        held, initialised = result["held_blocks"], result["initialised"]
        assert len(held) == LAYERS // 4
        elsewhere = [name for name in initialised if stage_bound(kind, name) not in (None, *held)]
        assert not elsewhere, f"rank {result['global_rank']} initialised other stages' modules {elsewhere}"
        assert {block_of(kind, name) for name in initialised} - {None} == set(held)
        outside = {stage_bound(kind, name) for name in initialised if block_of(kind, name) is None} - {None}
        assert outside == {0, LAYERS - 1} & set(held), f"rank {result['global_rank']} initialised {initialised}"
        assert not any(value.is_meta for key, value in result["initial"].items() if block_of(kind, key) in held)


def merged(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    whole: dict[str, torch.Tensor] = {}
    for result in results:
        for name, value in result[key].items():
            if not value.is_meta:
                if name in whole:  # held by several ranks (outside the blocks): one value
                    assert torch.equal(whole[name], value), name
                whole[name] = value
    return whole


@pytest.mark.parametrize("kind", ["llama", "gpt2", "scaled"])
def test_initial_weights_equal_one_devices_init_weights(four_stages, tmp_path_factory, kind):
    expected = one_device(kind, tmp_path_factory)["initial"]
    initial = merged(four_stages[kind], "initial")
    assert initial.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(initial[key], value), key


def training_error(results: list[dict], reference: dict) -> float:
    floating = [key for key, value in reference["final"].items() if value.is_floating_point()]
    final = merged(results, "final")
    return relative_weight_error({k: reference["initial"][k] for k in floating},
                                 {k: reference["final"][k] for k in floating}, {k: final[k] for k in floating})


@pytest.mark.parametrize("kind", ["llama", "gpt2", "scaled"])
def test_training_from_scratch_matches_one_device(four_stages, tmp_path_factory, kind):
    assert training_error(four_stages[kind], one_device(kind, tmp_path_factory)) < TOLERANCE


def test_the_comparison_detects_a_dropped_micro_batch_gradient(four_stages, tmp_path_factory):
    assert training_error(four_stages[NEGATIVE_CONTROL], one_device("llama", tmp_path_factory)) > 100 * TOLERANCE


def test_init_module_under_hydra_is_a_node_naming_the_function():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from lightning_pipe.integration.hydra_schema import GPipeStrategyConfig, validate_config

    def config(init_module):
        return OmegaConf.merge(OmegaConf.structured(GPipeStrategyConfig), {"init_module": init_module})

    node = {"_target_": "helpers.from_scratch.init_gain", "_partial_": True}
    validate_config({"strategy": config(node)})
    strategy = instantiate(config(node), _convert_="all")
    deferred = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Gain(4)))
    materialize(deferred, torch.device("cpu"), seed=0, init_module=strategy._settings.init_module)
    assert not torch.equal(deferred[1].gain, torch.ones(4))
    for bad in ({"_target_": "helpers.from_scratch.no_such_function", "_partial_": True},
                {"_target_": "helpers.from_scratch.init_gain"}):  # without _partial_, Hydra would call it
        with pytest.raises(ValueError, match=r"strategy\.init_module=.* is invalid; use \{_target_: "):
            validate_config({"strategy": config(bad)})
