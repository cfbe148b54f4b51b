"""The spawn and fork launchers train the same model, and the launching process gets the trained model back: whole,
or for a model built on the meta device, what rank 0 keeps unless the whole model is asked for."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from helpers.compare import merged_state_dict, relative_weight_error, single_device_run
from helpers.launch import launch, started_together

# Models whose pipelined layers the launching process never held: built in configure_model, or created on the meta
# device under init_module(empty_init=True).
MODELS = {"classifier": {}, "deferred": {"model": "deferred"},
          "empty_init": {"model": "resettable", "empty_init": True}}
# The spawn runs ask for the whole model after the run (gather_model_after_run=True); the fork runs keep the
# default, under which a model built on the meta device stays distributed.
ASKED_WHOLE = {"spawn": {"strategy": {"gather_model_after_run": True}}, "fork": {}}
RUNS = [{"name": f"{method}_{model}", "num_micro_batches": 4, "start_method": method, "save_after_fit": True,
         **options, **ASKED_WHOLE[method]}
        for model, options in MODELS.items() for method in ("spawn", "fork")]
WHOLE = [("spawn", model) for model in MODELS] + [("fork", "classifier")]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The spawn runs and the fork runs, two launches started together; each run's files in ``tmp/RUN``, each
    launch's terminal output in ``tmp/METHOD/stderr.txt``."""
    tmp = tmp_path_factory.mktemp("launchers")
    launches = started_together({
        method: partial(launch, "fits_worker.py", {"devices": 2, "out": str(tmp),
                                                   "runs": [run for run in RUNS if run["start_method"] == method]},
                        tmp / method)
        for method in ("spawn", "fork")
    })
    for launched in launches.values():
        launched.result()
    return tmp


def test_no_advice_to_synchronise_values_every_stage_already_holds(launched):
    """One pipeline is not data-parallel: Lightning's advice to log epoch values with sync_dist=True is moot (the
    model logs val_loss on epoch level without it) and must not be printed."""
    for method in ("spawn", "fork"):
        assert "sync_dist=True" not in (launched / method / "stderr.txt").read_text()


@pytest.mark.parametrize("method, model", WHOLE)
def test_launching_process_holds_the_whole_trained_model(launched, method, model):
    run = f"{method}_{model}"
    # Only the launching process continues after fit: it is the one that wrote its state dict.
    assert [p.name for p in (launched / run).glob("rank*.pt")] == ["rank0.pt"]
    initial, expected, _ = single_device_run(MODELS[model])
    actual = merged_state_dict(launched / run)
    assert actual.keys() == expected.keys()
    assert relative_weight_error(initial, expected, actual) < 1e-5


@pytest.mark.parametrize("model", ["deferred", "empty_init"])
def test_launching_process_keeps_a_model_built_on_meta_distributed(launched, model):
    """By default the launching process receives what rank 0 keeps: the last stage, trained; the first stage's
    layers stay on the meta device (a later run refuses to start them afresh)."""
    _, expected, _ = single_device_run(MODELS[model])
    actual = torch.load(launched / f"fork_{model}" / "rank0.pt")
    assert actual.keys() == expected.keys()
    held = {key for key, value in actual.items() if not value.is_meta}
    assert held and held != set(actual), "rank 0 kept its stage and nothing else"
    for key in held:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_checkpoint_in_the_launching_process_is_refused_or_weights_only(launched, method):
    """After fit, the launching process of spawn/fork holds no stage's optimizer: a full checkpoint there would hold
    part of the training state, so it is refused with the ways out; a weights-only checkpoint is written."""
    run = launched / f"{method}_classifier"
    message = (run / "save_error.txt").read_text()
    assert "cannot write a complete checkpoint in the launching process of the spawn/fork launcher" in message
    assert "weights_only=True" in message and "strategy='gpipe'" in message
    assert not (run / "after_fit.ckpt").exists()
    weights = torch.load(run / "weights.ckpt", weights_only=False)
    assert "optimizer_states" not in weights
    _, expected, _ = single_device_run(MODELS["classifier"])
    assert weights["state_dict"].keys() == expected.keys()


def test_the_prestarted_server_drops_a_client_that_closes_before_its_request_is_whole():
    """A test killed while asking for a fork leaves half a request: the server's read ends, it does not spin."""
    import socket

    from helpers.prestarted import _request_line

    server, client = socket.socketpair()
    client.sendall(b'{"argv": ["worker.py"')
    client.close()
    assert _request_line(server) is None
    server, client = socket.socketpair()
    client.sendall(b'{"argv": []}\n')
    assert _request_line(server) == b'{"argv": []}\n'
