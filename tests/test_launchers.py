"""The spawn and fork launchers train the same model, and the launching process gets the whole model back."""

from __future__ import annotations

import pytest

from helpers.compare import merged_state_dict, relative_weight_error, single_device_run
from helpers.launch import launch

# Models whose pipelined layers the launching process never held: built in configure_model, or created on the meta
# device under init_module(empty_init=True).
MODELS = {"classifier": {}, "deferred": {"model": "deferred"},
          "empty_init": {"model": "resettable", "empty_init": True}}
RUNS = [{"name": f"{method}_{model}", "num_micro_batches": 4, "start_method": method, **options}
        for model, options in MODELS.items() for method in ("spawn", "fork")]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launchers")
    launch("fits_worker.py", {"devices": 2, "out": str(tmp), "runs": RUNS}, tmp)  # its output: tmp/stderr.txt
    return tmp


def test_no_advice_to_synchronise_values_every_stage_already_holds(launched):
    """One pipeline is not data-parallel: Lightning's advice to log epoch values with sync_dist=True is moot (the
    model logs val_loss on epoch level without it) and must not be printed."""
    assert "sync_dist=True" not in (launched / "stderr.txt").read_text()


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_launching_process_holds_the_whole_trained_model(launched, method, model):
    run = f"{method}_{model}"
    # Only the launching process continues after fit: it is the one that wrote its state dict.
    assert [p.name for p in (launched / run).glob("rank*.pt")] == ["rank0.pt"]
    initial, expected, _ = single_device_run(MODELS[model])
    actual = merged_state_dict(launched / run)
    assert actual.keys() == expected.keys()
    assert relative_weight_error(initial, expected, actual) < 1e-5
