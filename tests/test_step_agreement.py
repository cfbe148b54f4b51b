"""Ranks that disagree are named: stages whose data loaders give different batches, or one rank an extra batch, end
every process within a minute with an error naming both stages, both batches and the usual causes; and the launching
process reports the failing rank's own error, not one that follows from it (a block's dict output, a rank killed in a
checkpoint's collectives).

The pure comparison is checked here without processes; the runs launch ``workers/reliability_faults_worker.py``
(shared with ``test_reliability.py``, whose helpers follow every process of a run) with data loaders that differ by
rank. Under the default launcher the last stage is global rank 0, the launching process.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lightning_pipe.execution.p2p import ACTIVATION, HEADER_LENGTH, Header, TensorMeta
from lightning_pipe.execution.step_agreement import (
    UNCHECKED,
    StepMismatchError,
    StepSignature,
    check_same_step,
    step_signature,
)
from test_reliability import FAULT_TO_EXIT_LIMIT_S, FaultRun, assert_ended_fast_everywhere, fault, run_with_faults

HERE, THERE = "stage 1 (rank 0)", "stage 0 (rank 1)"
CAUSES = "a sampler that does not deal the batches the same way on every rank"


def batch(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(size, 3, 4), torch.zeros(size, dtype=torch.long)


def refusal(mine: StepSignature, theirs: StepSignature | None) -> str:
    with pytest.raises(StepMismatchError) as raised:
        check_same_step(mine, theirs, HERE, THERE)
    assert CAUSES in str(raised.value)
    return str(raised.value)


# ---- the comparison, without processes ----------------------------------------------------------------------------


def test_stages_with_the_same_step_and_batch_agree():
    """The negative control: equal steps pass, as every regular step of every other test does."""
    check_same_step(step_signature("training_step", batch(), 3, 0, 6, False),
                    step_signature("training_step", batch(), 3, 0, 6, False), HERE, THERE)
    check_same_step(step_signature("training_step", batch(), 0), UNCHECKED, HERE, THERE)  # nothing to compare


def test_different_batch_sizes_name_both_stages_and_both_shapes():
    said = refusal(step_signature("training_step", batch(16), 0, 0, 6, False),
                   step_signature("training_step", batch(12), 0, 0, 6, False))
    assert said.startswith(
        f"the stages got different batches in training batch 0: {HERE} has (16, 3, 4) float32, (16,) int64, {THERE}"
        " has (12, 3, 4) float32, (12,) int64."
    ), said


def test_the_same_tensors_in_another_structure_are_refused():
    x, y = batch()
    said = refusal(step_signature("training_step", (x, y), 2), step_signature("training_step", {"x": x, "y": y}, 2))
    assert "(the same tensors, in another structure: here tuple(float32[16, 3, 4], int64[16]))" in said, said


def test_loaders_of_different_lengths_are_refused_at_the_first_batch():
    said = refusal(step_signature("training_step", batch(), 0, 0, 6, False),
                   step_signature("training_step", batch(), 0, 0, 7, False))
    assert said.startswith(
        f"the stages' training data loaders have different lengths: {HERE} runs 6 batches, {THERE} 7"
    ), said


def test_an_extra_batch_of_a_loader_without_length_is_refused_in_the_last_common_step():
    said = refusal(step_signature("training_step", batch(), 5, 0, None, True),
                   step_signature("training_step", batch(), 5, 0, None, False))
    assert said.startswith(
        f"training batch 5 is the last of the training data loader on {HERE} but not on {THERE}: {THERE} has more"
        f" batches, so it would enter a step that {HERE} never enters."
    ), said


def test_stages_in_different_loops_or_outside_a_step_are_refused():
    said = refusal(step_signature("validation_step", batch(), 0, 1), step_signature("training_step", batch(), 6))
    assert said.startswith(f"{HERE} is in validation batch 0 of dataloader 1 but {THERE} is in training batch 6"), said
    said = refusal(step_signature("training_step", batch(), 4), None)
    assert f"{THERE} sent its activations from outside a step" in said, said


def test_the_signature_travels_in_the_header_and_a_full_header_leaves_it_unchecked():
    signature = step_signature("test_step", {"ids": torch.zeros(8, 5, dtype=torch.long), "text": ["a"] * 20}, 3, 1, 9, True)
    metas = (TensorMeta((2, 16), torch.float32, True),)
    received = Header.decode(Header(ACTIVATION, 0, 4, metas, False, 1, (), signature).encode()).step
    assert received == signature and received.shapes == "(8, 5) int64"
    assert Header.decode(Header(ACTIVATION, 1, 4, metas, False, 1).encode()).step is None  # later messages: none
    # An activation that leaves room for the signature but not its tensors; one that leaves none: nothing checked.
    roomy = tuple(TensorMeta((1, 1, 1, 1, 1), torch.float32, False) for _ in range(6))
    received = Header.decode(Header(ACTIVATION, 0, 4, roomy, False, 1, (), signature).encode()).step
    assert received.tensors is None and received.fingerprint == signature.fingerprint
    crowded = roomy + (TensorMeta((1, 1, 1, 1, 1), torch.float32, False),)
    assert Header.decode(Header(ACTIVATION, 0, 4, crowded, False, 1, (), signature).encode()).step is UNCHECKED
    assert len(Header(ACTIVATION, 0, 4, crowded, False, 1, (), signature).encode()) == HEADER_LENGTH


# ---- real processes -----------------------------------------------------------------------------------------------

RUNS = {
    # Rank 1 (stage 0 of 2) loads batches of 12, rank 0 (stage 1) of 16: rank 0 refuses the first step.
    "batch-size": {"devices": 2, "batch_size_by_rank": {"1": 12}},
    # A loader without a length, with one batch more on rank 1 (stage 1 of 3): refused in the last common step.
    "extra-batch": {"devices": 3, "iterable": True, "train_batches_by_rank": {"1": 7}},
    # A pipelined block returns a dict on every rank (its meta-device placeholder on the other ranks too).
    "dict-block": {"devices": 2, "faults": [fault("non_tensor_everywhere", "layer", 0)]},
    # Stage 1 of 3 (rank 1) SIGKILLed while the run saves a sharded checkpoint: the others are in its collectives.
    "killed-in-checkpoint": {"devices": 3, "checkpoint_every": 2, "sharded_checkpoints": True,
                             "faults": [fault("sigkill", "checkpoint", 1)]},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, FaultRun]:
    """Every run of this file, two at a time (each is mostly start-up)."""
    def run(name: str) -> FaultRun:
        spec = dict(RUNS[name])
        return run_with_faults(tmp_path_factory.mktemp(name), spec.pop("devices"), spec.pop("faults", []), **spec)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, name) for name in RUNS}
    return {name: future.result() for name, future in futures.items()}


def launching_process_error(run: FaultRun) -> str:
    """The launching process's last error line on the terminal (rank 0's, under the default launcher)."""
    lines = [line for line in run.stderr.splitlines() if re.match(r"\[rank0\]: [\w.]+(Error|Exception): ", line)]
    assert lines, run.stderr[-4000:]
    return lines[-1].removeprefix("[rank0]: ")


def check_ended_with(run: FaultRun, error: str, pattern: str) -> None:
    """Every rank that recorded its end (the launching process always does) ended with ``error`` matching
    ``pattern``, and so does the launching process's last line; nothing was left running."""
    assert not run.leftovers and run.returncode != 0, (run.leftovers, run.returncode)
    assert "rank0" in run.ends, f"the launching process recorded no end: {run.stderr[-4000:]}"
    for name, end in run.ends.items():
        assert end["ended"] == error and re.search(pattern, end["message"]), (name, end["traceback"])
    assert re.search(pattern, launching_process_error(run)), launching_process_error(run)
    assert launching_process_error(run).split(":")[0].endswith(error)


def ended_within_a_minute_of_training(run: FaultRun) -> float:
    """From the start of training (the ranks' pid files, written then) until no process of the run was left."""
    started = min(path.stat().st_mtime for path in run.out.glob("pid*"))
    took = run.gone - started
    assert took < FAULT_TO_EXIT_LIMIT_S, f"the run took {took:.0f} s to end after training started"
    return took


def test_different_batch_sizes_end_every_rank_with_both_shapes(runs):
    run = runs["batch-size"]
    check_ended_with(run, "StepMismatchError", re.escape(
        "the stages got different batches in training batch 0: stage 1 (rank 0) has (16, 3, 4) float32, (16,) int64,"
        " stage 0 (rank 1) has (12, 3, 4) float32, (12,) int64. Every stage of a pipeline must get the same batches"
    ))
    print(f"every process gone {ended_within_a_minute_of_training(run):.1f} s after training started")


def test_an_extra_batch_on_one_rank_ends_every_rank_naming_it(runs):
    run = runs["extra-batch"]
    check_ended_with(run, "StepMismatchError", (
        r"training batch 5 is the last of the training data loader on stage \d \(rank [02]\) but not on stage 1"
        r" \(rank 1\): stage 1 \(rank 1\) has more batches"
    ))
    assert set(run.ends) == {"rank0", "rank1", "rank2"}, run.ends.keys()  # every rank said it, none was killed
    assert "Received data size" not in run.stderr and "PipelineStallError" not in run.stderr
    print(f"every process gone {ended_within_a_minute_of_training(run):.1f} s after training started")


def test_a_block_returning_a_dict_is_reported_as_such_by_the_launching_process(runs):
    """Rank 1 runs the block; rank 0 (the launching process) computes its output's placeholder on the meta device and
    fed it to its next block, which raised its own ``TypeError: linear(): ... not dict``, the last line the user saw."""
    check_ended_with(runs["dict-block"], "TypeError", re.escape(
        "is a dict (item 0); only a tensor or a tuple of tensors can flow between pipeline stages"
    ))
    assert re.match(r"TypeError: the output of model chunk 0 (for micro-batch 0 )?is a dict",
                    launching_process_error(runs["dict-block"]))


def test_a_rank_killed_in_a_checkpoint_collective_is_named_as_the_lost_stage(runs):
    run = runs["killed-in-checkpoint"]
    assert_ended_fast_everywhere(run)
    check_ended_with(run, "PipelineCommunicationError", re.escape(
        "lost stage 1 (rank 1) while saving a checkpoint: its process ended without a Python error"
    ))
    assert set(run.ends) == {"rank0", "rank2"}, run.ends.keys()
