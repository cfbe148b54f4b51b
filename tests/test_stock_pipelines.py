"""The stock models of tests/helpers/stock_models.py, pipelined unchanged: the strategy is the only change, and
per-step losses and final weights equal training on one device.

One launch per stage count trains every model (a launch costs seconds); the single-device baselines are the runs of
tests/test_stock_models.py. Dropout is 0 in every model; ResNet-18's BatchNorm sees the whole batch
(``num_micro_batches=1``), so that one device and the pipeline compute the same statistics.
"""

from __future__ import annotations

import json
import re

from functools import partial
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

from helpers.compare import relative_weight_error
from helpers.launch import launch, launches_started_with_first_test
from helpers.moe_models import MOE_MODELS
from helpers.stock_models import BLOCKS, STOCK_MODELS
from test_stock_models import STEPS, train_on_one_device

pytest.importorskip("transformers")

TOLERANCE = 1e-5  # of the weights' change over the run, as tests/test_equivalence.py
LOSS_TOLERANCE = 1e-4  # relative; ResNet-18's BatchNorm sums in another order on a stage (measured 1.3e-5)
MOE_LOSS_TOLERANCE = 1e-5  # the mixtures of experts (measured: 2.4e-7 at most)

VIT_EMBEDDED = {"checkpointing": "loop_reentrant", "embedding_module": True}
# name -> (model, strategy settings[, the run's other keys: the model's "options", "hooks"]); 4 stages where the model
# has a block for each at little cost
RUNS = {
    2: {
        "gpt2": ("gpt2", {"num_micro_batches": 2}),
        "llama": ("llama", {"num_micro_batches": 2}),
        "encoder": ("encoder", {"num_micro_batches": 2}),
        # Encoder-decoders: both stacks one chain of stages, the encoder's output carried to every decoder stage.
        "demo": ("demo", {"num_micro_batches": 2}),
        "demo_restart_inside": ("demo", {"num_micro_batches": 2, "balance": [4, 1]}),
        "bart": ("bart", {"num_micro_batches": 2}),
        "bart_zero_bubble": ("bart", {"num_micro_batches": 4, "schedule": "zero_bubble"}),
        "t5": ("t5", {"num_micro_batches": 2}),
        # The position bias of T5's first block crosses the stage boundary right after it, with the hidden state.
        "t5_first_block_alone": ("t5", {"num_micro_batches": 2, "balance": [1, 4]}),
        "demo_interleaved": ("demo", {"num_micro_batches": 2, "schedule": "interleaved_1f1b"}),
        "resnet18": ("resnet18", {"num_micro_batches": 1}),
        "vgg11": ("vgg11", {"num_micro_batches": 2}),
        "vgg11_features": ("vgg11", {"num_micro_batches": 2, "module_name": "model.features"}),
        # What works for a pipelined nn.Sequential works for blocks in the model's own loop: each mode on GPT-2.
        "gpt2_always": ("gpt2", {"num_micro_batches": 2, "checkpoint": "always"}),
        "gpt2_never": ("gpt2", {"num_micro_batches": 4, "checkpoint": "never"}),
        "gpt2_parameters": ("gpt2", {"num_micro_batches": 2, "balance": "parameters"}),
        "gpt2_list": ("gpt2", {"num_micro_batches": 2, "balance": [1, 3]}),
        # The model's own activation checkpointing: around its block calls, five ways; inside its blocks (HF's).
        "vit_loop": ("vit", {"num_micro_batches": 2}, {"options": {"checkpointing": "loop"}}),
        "vit_loop_reentrant": ("vit", {"num_micro_batches": 2}, {"options": {"checkpointing": "loop_reentrant"},
                                                                 "hooks": True}),
        "vit_sequential": ("vit", {"num_micro_batches": 2}, {"options": {"checkpointing": "sequential"}}),
        "vit_timm": ("vit", {"num_micro_batches": 2}, {"options": {"checkpointing": "timm"}}),
        "vit_trunk": ("vit", {"num_micro_batches": 2}, {"options": {"checkpointing": "trunk"}}),
        # The patch embedding holds the class token and the position embedding (Hugging Face's layout): on the stage
        # without it, the blocks' input comes from its stand-in, whose answer needs a gradient as the real one does, or
        # the model's reentrant checkpoint would compute that stage's blocks without gradients (issue #43: a hang).
        "vit_embedded_reentrant": ("vit", {"num_micro_batches": 2}, {"options": VIT_EMBEDDED}),
        "vit_embedded_reentrant_1f1b": ("vit", {"num_micro_batches": 4, "schedule": "1f1b"}, {"options": VIT_EMBEDDED}),
        "vit_embedded_sequential": ("vit", {"num_micro_batches": 2},
                                    {"options": {**VIT_EMBEDDED, "checkpointing": "sequential"}}),
        "vit_embedded_sequential_1f1b": ("vit", {"num_micro_batches": 4, "schedule": "1f1b"},
                                         {"options": {**VIT_EMBEDDED, "checkpointing": "sequential"}}),
        # A block called plainly, then one under a reentrant checkpoint: the first one's placeholder needs a gradient.
        "vit_every_other_reentrant": ("vit", {"num_micro_batches": 2},
                                      {"options": {"checkpointing": "every_other_reentrant"}}),
        "gpt2_gradient_checkpointing": ("gpt2", {"num_micro_batches": 2}, {"options": {"gradient_checkpointing": True}}),
        # Value-reading hooks on every block, without re-computation: each fires once per micro-batch.
        "gpt2_hooks": ("gpt2", {"num_micro_batches": 2, "checkpoint": "never"},
                       {"hooks": True, "summary": {"max_depth": 4, "rich": True}}),
        # Lightning's first example: the chain its training step calls, found; its model summary as printed.
        # SGD: Adam amplifies round-off to the learning rate (the NOTE in helpers/stock_models.py)
        "autoencoder": ("autoencoder", {"num_micro_batches": 2},
                        {"summary": {"max_depth": 2, "rich": False}, "options": {"sgd_lr": 0.5}}),
        # Every schedule with a loss per micro-batch: as one device on the whole batch (the language models' token
        # means over padded sequences weighted by the labels their loss counts, see lightning_pipe.execution.loss_items).
        "gpt2_1f1b": ("gpt2", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "llama_interleaved": ("llama", {"num_micro_batches": 2, "schedule": "interleaved_1f1b"}),
        "llama_zero_bubble": ("llama", {"num_micro_batches": 4, "schedule": "zero_bubble"}),
        "gpt2_zbv": ("gpt2", {"num_micro_batches": 2, "schedule": "zbv"}),
        # Each model under gpipe and a per-micro-batch schedule, its embedding on the first stage, its head on the last.
        "qwen2": ("qwen2", {"num_micro_batches": 2}),
        "qwen2_1f1b": ("qwen2", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "bert": ("bert", {"num_micro_batches": 2}),
        "bert_zero_bubble": ("bert", {"num_micro_batches": 4, "schedule": "zero_bubble"}),
        "vit_1f1b": ("vit", {"num_micro_batches": 4, "schedule": "1f1b"}, {"options": {"checkpointing": "loop"}}),
        "t5_1f1b": ("t5", {"num_micro_batches": 4, "schedule": "1f1b"}),
        # Mixtures of experts whose routing cannot run on the meta device (Hugging Face's default experts kernel,
        # torch.nonzero): each block's output shapes come from the stage holding it. The language models with their
        # AdamW (measured: weights within 3.3e-6 of their change), the hand-written block with SGD.
        "mixtral": ("mixtral", {"num_micro_batches": 2}),
        "mixtral_1f1b": ("mixtral", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "qwen2_moe": ("qwen2_moe", {"num_micro_batches": 2}),
        "qwen2_moe_1f1b": ("qwen2_moe", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "topk_moe": ("topk_moe", {"num_micro_batches": 2}),
        "topk_moe_1f1b": ("topk_moe", {"num_micro_batches": 4, "schedule": "1f1b"}),
        # Another sequence length every step (12, 10, 8, 12 tokens): a new input signature, new shapes sent.
        "topk_moe_varying_length": ("topk_moe", {"num_micro_batches": 2}, {"options": {"varying_length": True}}),
        "topk_moe_varying_length_1f1b": ("topk_moe", {"num_micro_batches": 4, "schedule": "1f1b"},
                                         {"options": {"varying_length": True}}),
        # A loss that picks its tokens by a boolean mask: the step probe fails past the blocks, and says so.
        "topk_moe_masked_loss": ("topk_moe", {"num_micro_batches": 2}, {"options": {"masked_loss": True}}),
    },
    4: {
        "gpt2": ("gpt2", {"num_micro_batches": 4}),
        "llama": ("llama", {"num_micro_batches": 4}),
        "encoder": ("encoder", {"num_micro_batches": 4}),
        "demo": ("demo", {"num_micro_batches": 4}),
        "bart": ("bart", {"num_micro_batches": 4}),
        "t5": ("t5", {"num_micro_batches": 4}),
        "resnet18": ("resnet18", {"num_micro_batches": 1}),
        # (The classifier's blocks, the region found, are 3 Linears among ReLUs and Dropouts: 4 stages cannot each
        # hold one; see test_a_stage_without_parameters_is_refused_before_training_with_the_fix.)
        "vgg11_features": ("vgg11", {"num_micro_batches": 4, "module_name": "model.features"}),
        "vit_loop": ("vit", {"num_micro_batches": 4}, {"options": {"checkpointing": "loop"}}),
        "vit_loop_reentrant": ("vit", {"num_micro_batches": 4}, {"options": {"checkpointing": "loop_reentrant"},
                                                                 "hooks": True}),
        "vit_sequential": ("vit", {"num_micro_batches": 4}, {"options": {"checkpointing": "sequential"}}),
        "gpt2_hooks": ("gpt2", {"num_micro_batches": 4, "checkpoint": "never"}, {"hooks": True}),
        "qwen2": ("qwen2", {"num_micro_batches": 4}),
        "bert": ("bert", {"num_micro_batches": 4}),
        "gpt2_1f1b": ("gpt2", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "llama_zero_bubble": ("llama", {"num_micro_batches": 4, "schedule": "zero_bubble"}),
        "qwen2_1f1b": ("qwen2", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "bert_1f1b": ("bert", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "vit_zero_bubble": ("vit", {"num_micro_batches": 4, "schedule": "zero_bubble"}, {"options": {"checkpointing": "loop"}}),
        "t5_1f1b": ("t5", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "bart_1f1b": ("bart", {"num_micro_batches": 4, "schedule": "1f1b"}),
    },
}
NEGATIVE_CONTROL = "vgg11_dropped_gradient"
# The stand-ins' answers needing no gradient, as before issue #43's fix: the block after a plainly called one computes
# without gradients under the model's reentrant checkpoint, and training differs from one device.
STAND_INS_WITHOUT_GRADIENTS = "vit_every_other_reentrant_without_gradients"
MOE_NEGATIVE_CONTROL = "mixtral_dropped_gradient"
ROUTER_LOGITS = "mixtral_router_logits"  # output_router_logits=True: refused at set-up, naming the flag
UNSUMMED_TIE = "gpt2_unsummed_tie"  # the embedding's and the head's parts of their shared weight's gradient not summed
# NOTE: the attention's key bias gets a gradient that is zero in exact arithmetic (softmax ignores a constant added
# to every score), so it is round-off; Adam divides it by its own size and moves the bias by the full learning rate
# in a direction that any change of summation order flips (measured: 3e-4 of the weights' change with one
# micro-batch, 5e-4 with two, while the losses agree to 1e-6). The encoder is compared by its losses.
LOSSES_ONLY = {"encoder"}


def launched(devices: int, tmp: Path):
    runs = [{"name": name, "model": model, "strategy": settings, **(other[0] if other else {})}
            for name, (model, settings, *other) in RUNS[devices].items()]
    if devices == 2:
        for name in PREDICTED:
            runs[[run["name"] for run in runs].index(name)]["predict"] = True
        runs[[run["name"] for run in runs].index("gpt2")].update(save=True, validate=True)
        runs.append({"name": NEGATIVE_CONTROL, "model": "vgg11", "strategy": {"num_micro_batches": 2},
                     "drop_gradient_of": 0})
        runs.append({"name": STAND_INS_WITHOUT_GRADIENTS, "model": "vit", "strategy": {"num_micro_batches": 2},
                     "options": {"checkpointing": "every_other_reentrant"}, "stand_ins_without_gradients": True})
        runs.append({"name": MOE_NEGATIVE_CONTROL, "model": "mixtral", "strategy": {"num_micro_batches": 2},
                     "drop_gradient_of": 0})
        runs.append({"name": ROUTER_LOGITS, "model": "mixtral", "strategy": {"num_micro_batches": 2},
                     "options": {"router_logits": True}, "expect_error": True})

    if devices == 4:  # GPT-2's embedding and head on two of the four stages: their tie summed between those two
        runs.append({"name": UNSUMMED_TIE, "model": "gpt2", "strategy": {"num_micro_batches": 4},
                     "unsummed_outside": True})
        runs.append({"name": "vgg11_empty_stage", "model": "vgg11", "strategy": {"num_micro_batches": 4},
                     "expect_error": True})
    launch("stock_pipelines_worker.py", {"devices": devices, "out": str(tmp), "steps": STEPS, "runs": runs}, tmp,
           timeout=900)
    return devices, tmp


# Every launch of this file, started together with its first test.
launches = launches_started_with_first_test(
    ("pipelined",), lambda tmp: {n: partial(launched, n, tmp.mktemp(f"stock{n}")) for n in sorted(RUNS)}
)


@pytest.fixture(scope="module", params=sorted(RUNS))
def pipelined(request, launches):
    return launches[request.param].result()


_baselines: dict[tuple[str, int], tuple] = {}


def one_device(model: str, accumulate: int = 1, **options) -> tuple[list[float], dict, dict]:
    key = json.dumps([model, accumulate, options], sort_keys=True)
    if key not in _baselines:
        _baselines[key] = train_on_one_device(model, accumulate, **options)
    return _baselines[key]


def run_of(devices: int, name: str) -> tuple[str, dict, dict]:
    """(model, strategy settings, the run's other keys) of run ``name`` on ``devices`` stages."""
    model, settings, *other = RUNS[devices][name]
    return model, settings, other[0] if other else {}


def differences(
    tmp, name: str, model: str, options: dict | None = None, settings: dict | None = None
) -> tuple[float, float]:
    """(largest relative difference of a step's loss, weights' difference relative to their change) vs one device
    on the whole batch, under every schedule (``settings``)."""
    losses, before, after = one_device(model, 1, **(options or {}))
    result = json.loads((tmp / name / "rank0.json").read_text())  # rank 0 holds the last stage: the loss
    assert len(result["losses"]) == STEPS
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], losses))
    pipelined = torch.load(tmp / name / "rank0.pt")  # the whole trained model is put back on every rank
    floating = [key for key, value in after.items() if value.is_floating_point()]
    weight_error = relative_weight_error(
        {k: before[k] for k in floating}, {k: after[k] for k in floating}, {k: pipelined[k] for k in floating}
    )
    print(f"{name}: loss {loss_error:.2e}, weights {weight_error:.2e}")
    return loss_error, weight_error


@pytest.mark.parametrize("name", sorted({name for runs in RUNS.values() for name in runs}))
def test_stock_model_pipelines_unchanged_and_matches_one_device(pipelined, name):
    devices, tmp = pipelined
    if name not in RUNS[devices]:
        pytest.skip(f"{name} is not run on {devices} stages")
    model, settings, other = run_of(devices, name)
    loss_error, weight_error = differences(tmp, name, model, other.get("options"), settings)
    tolerance = MOE_LOSS_TOLERANCE if model in MOE_MODELS else LOSS_TOLERANCE
    assert loss_error < tolerance, f"{name} on {devices} stages: step losses differ by {loss_error:.2e} (relative)"
    if name in LOSSES_ONLY:
        return
    assert weight_error < TOLERANCE, f"{name} on {devices} stages: weights differ by {weight_error:.2e} of their change"


BATCH = 8  # every stock model's batch size


def hooks_seen(tmp, name: str, devices: int) -> dict[str, tuple[int, dict[str, int]]]:
    """What the value-reading hooks of tests/workers/stock_pipelines_worker.py saw: by block or module name, the rank
    where they fired and their counts. Checks that each block's hooks fired on one rank only: the rank that the
    strategy's stage table says runs it."""
    model, _, _ = run_of(devices, name)
    container = BLOCKS[model][0]
    seen: dict[str, tuple[int, dict[str, int]]] = {}
    for rank in range(devices):
        result = json.loads((tmp / name / f"hooks{rank}.json").read_text())
        runs_here = {f"{container}.{i}" for row in result["stages"] if row["rank"] == rank for i in row["layers"]}
        for module_name, counts in result["seen"].items():
            block = module_name if module_name.count(".") == container.count(".") + 1 else module_name.rpartition(".")[0]
            assert block in runs_here, f"{name}: hooks of {module_name} fired on rank {rank}, which does not run it"
            assert module_name not in seen, f"{name}: hooks of {module_name} fired on two ranks"
            seen[module_name] = (rank, counts)
    blocks = {f"{container}.{i}" for i in range(len(STOCK_MODELS[model]().get_submodule(container)))}
    assert blocks <= set(seen), f"{name}: the hooks of {sorted(blocks - set(seen))} never fired"
    return seen


def test_hooks_on_every_block_read_real_values_once_per_micro_batch_where_the_block_runs(pipelined):
    """Forward pre-hooks, forward hooks and full backward hooks on each GPT-2 block and on a layer inside it, and a
    global forward hook, all reading values (a meta tensor would raise): each fires on the rank that runs the block
    only, once per micro-batch of every step, on the micro-batch's samples (no re-computation here)."""
    devices, tmp = pipelined
    _, settings, _ = run_of(devices, "gpt2_hooks")
    per_step = settings["num_micro_batches"]
    seen = hooks_seen(tmp, "gpt2_hooks", devices)
    for module_name, (_, counts) in seen.items():
        kinds = ("pre", "forward", "backward") + (("global",) if "ln_1" not in module_name else ())
        expected = {kind: STEPS * per_step for kind in kinds} | {f"{kind}_samples": STEPS * BATCH for kind in kinds}
        assert counts == expected, module_name


def one_device_block_forwards(checkpointing: str) -> int:
    """How many times one device runs each ViT block's forward in a training step (the model's checkpoint runs it
    again in backward): counted by a forward pre-hook."""
    model = STOCK_MODELS["vit"](checkpointing=checkpointing)
    calls = []
    model.model.blocks[0].register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    images, labels = next(iter(model.train_dataloader()))
    model.training_step((images, labels), 0).backward()
    return sum(calls)


def test_the_models_own_checkpointing_computes_no_block_more_often_than_one_device(pipelined):
    """A ViT whose loop checkpoints every block call (reentrant): one device runs each block on the batch twice per
    step (forward, and the checkpoint's re-computation in backward). Pipelined, the strategy's re-computation takes
    the checkpoint's place: the block runs on each micro-batch and again on all but the last (checkpoint='except_last'),
    less than twice the batch; the start-up says so, once per fit."""
    devices, tmp = pipelined
    _, settings, _ = run_of(devices, "vit_loop_reentrant")
    m = settings["num_micro_batches"]
    one_device = one_device_block_forwards("loop_reentrant")
    assert one_device == 2 * BATCH
    seen = hooks_seen(tmp, "vit_loop_reentrant", devices)
    blocks = [counts for name, (_, counts) in seen.items() if name.count(".") == 2]  # model.blocks.N
    for counts in blocks:
        assert counts["pre"] == STEPS * (2 * m - 1)
        assert counts["pre_samples"] == STEPS * BATCH * (2 * m - 1) // m < STEPS * one_device
    output = (tmp / "stdout.txt").read_text() + (tmp / "stderr.txt").read_text()
    # Every ViT fit of the launch checkpoints its blocks, the negative control of 2 stages too.
    fits_checkpointing = sum(1 for name in RUNS[devices] if run_of(devices, name)[0] == "vit") + (devices == 2)
    assert output.count("The model calls its pipelined blocks under torch.utils.checkpoint") == fits_checkpointing


def test_blocks_that_checkpoint_themselves_warn_that_the_pipeline_recomputes_them_too(pipelined):
    """Hugging Face's gradient_checkpointing_enable() checkpoints inside each block: with checkpoint='except_last' the
    pipeline would re-compute the blocks once more, and the start-up says so, naming checkpoint='never'."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    output = (tmp / "stdout.txt").read_text() + (tmp / "stderr.txt").read_text()
    warning = "The pipelined blocks checkpoint themselves (gradient_checkpointing=True"
    assert output.count(warning) == 1  # the run with gradient_checkpointing_enable() only
    assert "Pass GPipeStrategy(checkpoint='never') to leave the re-computation to the blocks." in output


def test_lightnings_readme_autoencoder_is_pipelined_whole_from_what_its_training_step_calls(pipelined):
    """Its forward calls only the encoder; its training step calls the encoder, then the decoder: that chain is
    pipelined, nothing runs whole on every stage (the equality with one device is the test above)."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("two blocks: two stages")
    stages = json.loads((tmp / "autoencoder" / "stages.json").read_text())
    assert (stages["module_name"], stages["replicated"], stages["outside"]) == ("encoder .. decoder", 0, [])


ENCODER_DECODERS = {"demo": ("model.transformer", "layers"), "bart": ("model.model", "layers"), "t5": ("model", "block")}


def test_an_encoder_decoders_two_stacks_are_one_chain_of_stages_with_under_a_tenth_replicated(pipelined):
    """The demo Transformer (nn.Transformer), BART and T5: the encoder's blocks, then the decoder's, split over the stages
    (the equality with one device is the test above); what runs whole on every stage (embeddings, the head) is under
    10% of the parameters, and the start-up summary says how much."""
    devices, tmp = pipelined
    output = (tmp / "stdout.txt").read_text() + (tmp / "stderr.txt").read_text()
    for model, (stack, blocks) in ENCODER_DECODERS.items():
        stages = json.loads((tmp / model / "stages.json").read_text())
        assert stages["module_name"] == f"{stack}.encoder.{blocks}.0 .. {stack}.decoder.{blocks}.1"
        assert stages["replicated_share"] < 0.1
        assert f"Held by every stage: {stages['replicated_share']:.0%} of the parameters" in output


def test_lightnings_model_summary_lists_the_model_as_built_with_the_stage_of_each_layer(pipelined):
    """The summary the ModelSummary callback prints at fit start on rank 0 (the last stage): the other stage's
    modules with their own types and parameters, not stand-ins, and where each runs."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    rows = [[cell.strip() for cell in line.split("|")] for line in (tmp / "autoencoder" / "summary.txt").read_text().splitlines()
            if line.count("|") == 6]
    assert [(row[1], row[2], row[3], row[6]) for row in rows[1:]] == [
        ("encoder", "Sequential", "100 K", "stage 0"),
        ("encoder.0", "Linear", "100 K", "stage 0"),
        ("encoder.1", "ReLU", "0", "stage 0"),
        ("encoder.2", "Linear", "387", "stage 0"),
        ("decoder", "Sequential", "101 K", "stage 1"),
        ("decoder.0", "Linear", "512", "stage 1"),
        ("decoder.1", "ReLU", "0", "stage 1"),
        ("decoder.2", "Linear", "101 K", "stage 1"),
    ]
    assert "202 K     Total params" in (tmp / "autoencoder" / "summary.txt").read_text()


def test_rich_model_summary_shows_every_gpt2_block_with_its_parameters_and_stage(pipelined):
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    text = (tmp / "gpt2_hooks" / "summary.txt").read_text()
    assert "RemoteBlock" not in text
    for block, stage in (("h.0", 0), ("h.1", 0), ("h.2", 1), ("h.3", 1)):
        assert re.search(rf"model\.transformer\.{re.escape(block)} +│ GPT2Block │ 12\.7 K │.*│ stage {stage} ", text), block
    assert "Total params: 54.0 K" in text


PREDICTED = {"encoder": (32, 3), "bart": (32, 12, 64)}  # run -> the shape of its predictions


@pytest.mark.parametrize("name", sorted(PREDICTED))
def test_a_trained_model_predicts_as_on_one_device(pipelined, name):
    """In eval without gradients nn.TransformerEncoder would pack the padded batch into a NestedTensor; pipelined,
    its layers take the padded path, whose outputs are the same. BART's decoder stages get the encoder's output
    carried with the hidden state there too."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("predict runs on 2 stages")
    predictions = torch.load(tmp / name / "predictions.pt")
    model = STOCK_MODELS[name]()
    model.load_state_dict(torch.load(tmp / name / "rank0.pt"))
    model.eval()
    with torch.no_grad():
        expected = torch.cat([model.predict_step(batch, i) for i, batch in enumerate(model.predict_dataloader())])
    assert predictions.shape == expected.shape == PREDICTED[name]
    assert torch.allclose(predictions, expected, atol=1e-5), (predictions - expected).abs().max()


# Where the modules outside the blocks live: (module prefix, "first" or "loss"); a tied weight shows on both.
HELD_BY = {
    "gpt2": [("model.transformer.wte.", "first"), ("model.transformer.wpe.", "first"), ("model.transformer.ln_f.", "loss"),
             ("model.lm_head.", "loss")],
    "llama": [("model.model.embed_tokens.", "first"), ("model.model.norm.", "loss"), ("model.lm_head.", "loss")],
    "qwen2": [("model.model.embed_tokens.", "first"), ("model.model.norm.", "loss"), ("model.lm_head.", "loss")],
    "bert": [("model.bert.embeddings.", "first"), ("model.bert.pooler.", "loss"), ("model.classifier.", "loss")],
    "vit_loop": [("model.patch_embed.", "first"), ("model.head.", "loss")],
    "t5": [("model.encoder.embed_tokens.", "first"), ("model.lm_head.", "loss")],
    # Blocks that cannot run on the meta device: the step probe answers them with their input's shapes.
    "mixtral": [("model.model.embed_tokens.", "first"), ("model.model.norm.", "loss"), ("model.lm_head.", "loss")],
    "qwen2_moe_1f1b": [("model.model.embed_tokens.", "first"), ("model.model.norm.", "loss"), ("model.lm_head.", "loss")],
    "topk_moe": [("embedding.", "first"), ("norm.", "loss"), ("head.", "loss")],
    "bart": [("model.model.encoder.embed_positions.", "first"), ("model.lm_head.", "loss")],
}


@pytest.mark.parametrize("name", sorted(HELD_BY))
def test_each_rank_holds_only_what_its_stage_runs(pipelined, name):
    """The embeddings live on the first stage only, the head and the final norm on the loss stage only (a weight tied
    between them on both): each rank's parameters during training, and the start-up table's "Held by" column."""
    devices, tmp = pipelined
    if name not in RUNS[devices]:
        pytest.skip(f"{name} is not run on {devices} stages")
    stages = json.loads((tmp / name / "stages.json").read_text())
    ranks = {int(stage): rank for stage, rank in stages["ranks"].items()}
    first, loss = ranks[0], ranks[devices - 1]
    held = {rank: json.loads((tmp / name / f"held{rank}.json").read_text()) for rank in range(devices)}
    table = {module: where for module, _, where in stages["outside"]}
    for prefix, place in HELD_BY[name]:
        holder = first if place == "first" else loss
        stage = 0 if place == "first" else devices - 1
        assert table[prefix[:-1]].startswith("stage") and str(stage) in table[prefix[:-1]], (prefix, table)
        for rank, names in held.items():
            mine = [n for n in names if n.startswith(prefix)]
            if rank == holder:
                assert mine, f"{name}: rank {rank} runs {prefix[:-1]} but holds none of it"
            else:
                assert not mine, f"{name}: rank {rank} holds {mine}, which stage {stage} runs"
    # Held by every stage: only ViT's loose parameters (class token, position embedding) and, on 2 stages, the
    # encoder-decoders' shared embedding, which both stages use.
    everywhere = {module for module, _, where in stages["outside"] if where == "every stage"}
    allowed = {"vit_loop": {"model.cls_token", "model.pos_embed"}, "t5": {"model.shared"}, "bart": {"model.model.shared"}}
    assert everywhere <= (allowed.get(name, set()) if devices == 2 or name == "vit_loop" else set()), stages["outside"]


def test_comparison_detects_an_unsummed_tied_gradient_of_the_embedding_and_the_head(pipelined):
    """The negative control of the embedding tied to the head on two stages: without the sum, the comparison fails."""
    devices, tmp = pipelined
    if devices != 4:
        pytest.skip("the negative control runs on 4 stages")
    _, weight_error = differences(tmp, UNSUMMED_TIE, "gpt2", settings={"num_micro_batches": 4})
    assert weight_error > 100 * TOLERANCE


def test_a_stage_without_parameters_is_refused_before_training_with_the_fix(pipelined):
    """VGG-11's classifier pipelined over 4 stages: a stage of a ReLU and a Dropout would build its optimizer from no
    parameters."""
    devices, tmp = pipelined
    if devices != 4:
        pytest.skip("runs on 4 stages")
    error = (tmp / "vgg11_empty_stage" / "error.txt").read_text()
    assert error.startswith("ValueError: pipeline stage holds no parameters to train: stage 2 (model.classifier.4,"
                            " model.classifier.5).")
    assert "GPipeStrategy(balance=[...])" in error


def test_comparison_detects_stand_ins_whose_answers_need_no_gradient(pipelined):
    """The negative control of issue #43's fix: with the stand-ins' answers needing no gradient, the ViT whose odd blocks
    run under a reentrant checkpoint trains differently from one device (its embedded twin would hang instead)."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("the negative control runs on 2 stages")
    options = {"checkpointing": "every_other_reentrant"}
    loss_error, weight_error = differences(tmp, STAND_INS_WITHOUT_GRADIENTS, "vit", options)
    assert loss_error > 100 * LOSS_TOLERANCE and weight_error > 100 * TOLERANCE


def test_comparison_detects_a_dropped_micro_batch_gradient(pipelined):
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("the negative control runs on 2 stages")
    _, weight_error = differences(tmp, NEGATIVE_CONTROL, "vgg11")
    assert weight_error > 100 * TOLERANCE
    _, weight_error = differences(tmp, MOE_NEGATIVE_CONTROL, "mixtral")
    assert weight_error > 100 * TOLERANCE


def test_blocks_that_cannot_run_on_the_meta_device_learn_their_shapes_from_their_stage_said_once(pipelined):
    """Mixtral's and Qwen2-MoE's default experts kernel and a torch.nonzero routing fail on the meta device (their
    equality with one device is the test above): the start-up says so once per fit, naming the block and why."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    output = (tmp / "stdout.txt").read_text() + (tmp / "stderr.txt").read_text()
    said = re.findall(r"The pipelined block (\S+) \((\w+)\) cannot run on the meta device \((\w+Error): ", output)
    runs = {model: sum(run[0] == model for run in RUNS[2].values()) for model in ("mixtral", "qwen2_moe", "topk_moe")}
    runs["mixtral"] += 1  # the negative control's fit
    expected = [("model.model.layers.0", "MixtralDecoderLayer", "RuntimeError")] * runs["mixtral"]
    expected += [("model.model.layers.0", "Qwen2MoeDecoderLayer", "RuntimeError")] * runs["qwen2_moe"]
    expected += [("blocks.0", "TopKMoE", "NotImplementedError")] * runs["topk_moe"]
    assert sorted(said) == sorted(expected)


def test_a_mixtures_load_balancing_loss_is_refused_at_set_up_naming_the_flag(pipelined):
    """Mixtral with output_router_logits=True: hooks collect every block's router logits for its load-balancing
    loss, which no stage can compute as one device does; refused before training, with the fix."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    error = (tmp / ROUTER_LOGITS / "error.txt").read_text()
    assert error.startswith(
        "ValueError: model (MixtralForCausalLM) collects every block's router logits with hooks on each"
        " MixtralTopKRouter inside the pipelined blocks (output_router_logits=True), for its load-balancing loss"
    ), error
    assert "Set output_router_logits=False (`model.config.output_router_logits = False`" in error
    assert "MoEAuxLossAutoScaler" in error


def test_a_step_probe_that_fails_is_said_at_start_up_with_the_modules_left_on_every_stage(pipelined):
    """A loss that picks tokens by a boolean mask cannot run on the meta device: the start-up says the step could
    not be followed, why, and which modules therefore stay on every stage (the equality is the test above)."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    output = (tmp / "stdout.txt").read_text() + (tmp / "stderr.txt").read_text()
    note = "The training step could not run on the meta device on the first batch's shapes (NotImplementedError: "
    assert output.count(note) == 1, output[-3000:]
    assert "they stay on every stage, each held and run by every stage: embedding (3%), norm (0%), head (3%)." in output
    stages = json.loads((tmp / "topk_moe_masked_loss" / "stages.json").read_text())
    assert [where for _, _, where in stages["outside"]] == ["every stage"] * 3


TOO_SMALL_FOR_BATCH_NORM = {
    "every_batch": (
        STEPS, {"strategy": {"num_micro_batches": 8}},
        "ValueError: BatchNorm2d layer 'model.layer4.0.bn1' would get 1 value per channel in training: a batch of 8"
        " samples in num_micro_batches=8 gives micro-batches of 1 sample, and each sample brings it 1 value per"
        " channel. Use num_micro_batches=4 or fewer, or batches of at least 16 samples.",
    ),
    # 34 samples in batches of 8: the epoch's fifth batch holds 2, too few for 4 micro-batches; the first four fit.
    # 6 steps reach it (with 4, the check lets the fit run: see test_batch_norm_fit.py).
    "the_epochs_last_batch": (
        6, {"strategy": {"num_micro_batches": 4}, "options": {"samples": 34}},
        "ValueError: BatchNorm2d layer 'model.layer4.0.bn1' would get 1 value per channel in training: the epoch's"
        " last batch of 2 samples in num_micro_batches=4 gives micro-batches of 1 sample, and each sample brings it 1"
        " value per channel. Pass drop_last=True to the training DataLoader to leave that batch out, or use"
        " num_micro_batches=1 or fewer",
    ),
}


# Every batch too small: also test_batch_norm_fit.py, without a launch; the epoch's last batch needs the fit.
@pytest.mark.parametrize(
    "case", [pytest.param("every_batch", marks=pytest.mark.slow), "the_epochs_last_batch"]
)
def test_a_micro_batch_too_small_for_batch_norm_fails_before_training_with_the_fix(case, tmp_path):
    """ResNet-18's layer4 sees 1x1 maps: a micro-batch of one sample leaves its BatchNorm one value per channel.
    The last stage (layer2 .. avgpool) refuses in the first step, before its blocks run, whether every batch or
    only the epoch's last one is too small; the launching process raises that error, not a lost-stage message."""
    steps, settings, error = TOO_SMALL_FOR_BATCH_NORM[case]
    runs = [{"name": f"resnet18_{case}", "model": "resnet18", **settings}]
    finished = launch("stock_pipelines_worker.py", {"devices": 2, "out": str(tmp_path), "steps": steps, "runs": runs},
                      tmp_path, timeout=300, check=False)
    assert finished.returncode != 0
    assert error in finished.stderr, finished.stderr[-4000:]
    assert not (tmp_path / runs[0]["name"] / "rank0.json").exists()  # no step finished


def test_a_checkpoint_of_a_pipelined_gpt2_holds_the_stock_model_and_loads_without_lightning_pipe(pipelined):
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    _, _, after = one_device("gpt2")
    checkpoint = torch.load(tmp / "gpt2" / "model.ckpt", weights_only=True)  # plain tensors and containers only
    assert list(checkpoint["state_dict"]) == list(after)  # the unchanged model's keys, in its order
    pipelined_weights = torch.load(tmp / "gpt2" / "rank0.pt")
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(value, pipelined_weights[key]), key
    stock = STOCK_MODELS["gpt2"]()
    stock.load_state_dict(checkpoint["state_dict"])  # strict: every key of the stock class, nothing else
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(list(stock.parameters()))  # every stage's state


def test_validate_after_a_pipelined_fit_gives_one_devices_loss(pipelined):
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("checked on 2 stages")
    _, _, after = one_device("gpt2")
    model = STOCK_MODELS["gpt2"]()
    model.load_state_dict(after)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    expected = trainer.validate(model, verbose=False)[0]["val_loss"]
    for rank in range(devices):
        got = json.loads((tmp / "gpt2" / f"validated{rank}.json").read_text())[0]["val_loss"]
        assert got == pytest.approx(expected, rel=1e-5), f"rank {rank}"
