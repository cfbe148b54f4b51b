"""The stock models of tests/helpers/stock_models.py, pipelined unchanged: the strategy is the only change, and
per-step losses and final weights equal training on one device.

One launch per stage count trains every model (a launch costs seconds); the single-device baselines are the runs of
tests/test_stock_models.py. Dropout is 0 in every model; ResNet-18's BatchNorm sees the whole batch
(``num_micro_batches=1``), so that one device and the pipeline compute the same statistics.
"""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import Trainer

from helpers.compare import relative_weight_error
from helpers.launch import launch
from helpers.stock_models import STOCK_MODELS
from test_stock_models import STEPS, train_on_one_device

pytest.importorskip("transformers")

TOLERANCE = 1e-5  # of the weights' change over the run, as tests/test_equivalence.py
LOSS_TOLERANCE = 1e-4  # relative; ResNet-18's BatchNorm sums in another order on a stage (measured 1.3e-5)

# name -> (model, strategy settings); 4 stages where the model has a block for each at little cost
RUNS = {
    2: {
        "gpt2": ("gpt2", {"num_micro_batches": 2}),
        "llama": ("llama", {"num_micro_batches": 2}),
        "encoder": ("encoder", {"num_micro_batches": 2}),
        "demo": ("demo", {"num_micro_batches": 2}),
        "resnet18": ("resnet18", {"num_micro_batches": 1}),
        "vgg11": ("vgg11", {"num_micro_batches": 2}),
        "vgg11_features": ("vgg11", {"num_micro_batches": 2, "module_name": "model.features"}),
        # What works for a pipelined nn.Sequential works for blocks in the model's own loop: each mode on GPT-2.
        "gpt2_always": ("gpt2", {"num_micro_batches": 2, "checkpoint": "always"}),
        "gpt2_never": ("gpt2", {"num_micro_batches": 4, "checkpoint": "never"}),
        "gpt2_parameters": ("gpt2", {"num_micro_batches": 2, "balance": "parameters"}),
        "gpt2_list": ("gpt2", {"num_micro_batches": 2, "balance": [1, 3]}),
        # Every schedule with a loss per micro-batch: as one device accumulating the micro-batches (the language
        # models' token means over padded sequences differ from the whole batch's).
        "gpt2_1f1b": ("gpt2", {"num_micro_batches": 4, "schedule": "1f1b"}),
        "llama_interleaved": ("llama", {"num_micro_batches": 2, "schedule": "interleaved_1f1b"}),
        "llama_zero_bubble": ("llama", {"num_micro_batches": 4, "schedule": "zero_bubble"}),
        "gpt2_zbv": ("gpt2", {"num_micro_batches": 2, "schedule": "zbv"}),
    },
    4: {
        "gpt2": ("gpt2", {"num_micro_batches": 4}),
        "llama": ("llama", {"num_micro_batches": 4}),
        "encoder": ("encoder", {"num_micro_batches": 4}),
        "resnet18": ("resnet18", {"num_micro_batches": 1}),
        "vgg11": ("vgg11", {"num_micro_batches": 4}),
    },
}
NEGATIVE_CONTROL = "vgg11_dropped_gradient"
# NOTE: the attention's key bias gets a gradient that is zero in exact arithmetic (softmax ignores a constant added
# to every score), so it is round-off; Adam divides it by its own size and moves the bias by the full learning rate
# in a direction that any change of summation order flips (measured: 3e-4 of the weights' change with one
# micro-batch, 5e-4 with two, while the losses agree to 1e-6). The encoder is compared by its losses.
LOSSES_ONLY = {"encoder"}


@pytest.fixture(scope="module", params=sorted(RUNS))
def pipelined(request, tmp_path_factory):
    devices = request.param
    tmp = tmp_path_factory.mktemp(f"stock{devices}")
    runs = [{"name": name, "model": model, "strategy": settings} for name, (model, settings) in RUNS[devices].items()]
    if devices == 2:
        runs[[run["name"] for run in runs].index("encoder")]["predict"] = True
        runs[[run["name"] for run in runs].index("gpt2")].update(save=True, validate=True)
        runs.append({"name": NEGATIVE_CONTROL, "model": "vgg11", "strategy": {"num_micro_batches": 2},
                     "drop_gradient_of": 0})
    launch("stock_pipelines_worker.py", {"devices": devices, "out": str(tmp), "steps": STEPS, "runs": runs}, tmp,
           timeout=900)
    return devices, tmp


_baselines: dict[tuple[str, int], tuple] = {}


def one_device(model: str, accumulate: int = 1) -> tuple[list[float], dict, dict]:
    if (model, accumulate) not in _baselines:
        _baselines[(model, accumulate)] = train_on_one_device(model, accumulate)
    return _baselines[(model, accumulate)]


def differences(tmp, name: str, model: str, settings: dict | None = None) -> tuple[float, float]:
    """(largest relative difference of a step's loss, weights' difference relative to their change) vs one device:
    under a per-micro-batch schedule, one device accumulating the micro-batches."""
    settings = settings or {}
    per_micro_batch = settings.get("schedule", "gpipe") != "gpipe"
    losses, before, after = one_device(model, settings["num_micro_batches"] if per_micro_batch else 1)
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
    loss_error, weight_error = differences(tmp, name, *RUNS[devices][name])
    assert loss_error < LOSS_TOLERANCE, f"{name} on {devices} stages: step losses differ by {loss_error:.2e} (relative)"
    if name in LOSSES_ONLY:
        return
    assert weight_error < TOLERANCE, f"{name} on {devices} stages: weights differ by {weight_error:.2e} of their change"


def test_a_trained_encoder_predicts_as_on_one_device_with_its_padding_mask(pipelined):
    """In eval without gradients nn.TransformerEncoder would pack the padded batch into a NestedTensor; pipelined,
    its layers take the padded path, whose outputs are the same."""
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("predict runs on 2 stages")
    predictions = torch.load(tmp / "encoder" / "predictions.pt")
    model = STOCK_MODELS["encoder"]()
    model.load_state_dict(torch.load(tmp / "encoder" / "rank0.pt"))
    model.eval()
    with torch.no_grad():
        expected = torch.cat([model.predict_step(batch, i) for i, batch in enumerate(model.predict_dataloader())])
    assert predictions.shape == expected.shape == (32, 3)
    assert torch.allclose(predictions, expected, atol=1e-5), (predictions - expected).abs().max()


def test_comparison_detects_a_dropped_micro_batch_gradient(pipelined):
    devices, tmp = pipelined
    if devices != 2:
        pytest.skip("the negative control runs on 2 stages")
    _, weight_error = differences(tmp, NEGATIVE_CONTROL, "vgg11")
    assert weight_error > 100 * TOLERANCE


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


@pytest.mark.parametrize("case", TOO_SMALL_FOR_BATCH_NORM)
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
