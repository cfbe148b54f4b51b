"""The examples run end to end as a user runs them, and the README's first command is the one a new user needs.

Each run is a fresh ``python examples/...`` process (Lightning's default launcher re-runs the script per rank),
with tiny overrides: a few steps of a narrow model. One single run and one four-job sweep cover one and two stages,
two schedules and both launchers (``popen`` for a single run, ``spawn`` inside a sweep).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
import torch

from helpers.launch import REPO, Finished, python_environment, run_python, started_together

EXAMPLES = REPO / "examples"
TINY = [
    "trainer.max_steps=4",
    "trainer.val_check_interval=4",
    "model.width=32",
    "data.batch_size=8",
    "data.val_windows=32",
]


def run(script: str, *args: str, cwd: Path, timeout: float = 240) -> Finished:
    return run_python(EXAMPLES / script, *args, cwd=cwd, timeout=timeout, check=False, prestarted=True)


def succeeded(result: Finished) -> Finished:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    return result


def model_parameters(width: int = 32, depth: int = 8) -> tuple[int, int]:
    """The whole model's parameter count and that of its pipelined blocks, for the TINY model."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from lm import ByteGPT
    finally:
        sys.path.remove(str(EXAMPLES))
    model = ByteGPT(width=width, depth=depth)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.blocks.parameters())


def outside_by_stage(width: int = 32, depth: int = 8) -> tuple[int, int]:
    """The parameters of the TINY model's modules outside the blocks that the first stage holds (the token embedding)
    and that the last holds (the final norm and the head)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from lm import ByteGPT
    finally:
        sys.path.remove(str(EXAMPLES))
    model = ByteGPT(width=width, depth=depth)
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    return count(model.token), count(model.norm, model.head)


SWEEP = [(1, "gpipe"), (1, "1f1b"), (2, "gpipe"), (2, "1f1b")]  # (stages, schedule) of jobs 0..3


def single_run(out: Path) -> tuple[Finished, dict]:
    """``python examples/train.py`` with its default 2 stages, as the README runs it (tiny overrides)."""
    result = succeeded(run("train.py", *TINY, f"hydra.run.dir={out}", cwd=out))
    return result, json.loads((out / "report.json").read_text())


def sweep_run(out: Path) -> tuple[Finished, Path, list[dict]]:
    """``python examples/train.py -m strategy.num_stages=1,2 strategy.schedule=gpipe,1f1b``: four jobs, one
    comparison table."""
    result = succeeded(run("train.py", "-m", "strategy.num_stages=1,2", "strategy.schedule=gpipe,1f1b", *TINY,
                           f"hydra.sweep.dir={out}", cwd=out, timeout=480))
    reports = [json.loads((out / str(job) / "report.json").read_text()) for job in range(len(SWEEP))]
    return result, out, reports


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory) -> dict[str, Future]:
    """Every example run of this file, started together."""
    jobs = {"single": single_run, "sweep": sweep_run, "resume": stopped_and_resumed, "existing": existing_project,
            "invalid": invalid_value}
    return started_together({name: partial(job, tmp_path_factory.mktemp(name)) for name, job in jobs.items()})


@pytest.fixture(scope="module")
def single(example_runs) -> tuple[Finished, dict]:
    return example_runs["single"].result()


@pytest.fixture(scope="module")
def sweep(example_runs) -> tuple[Finished, Path, list[dict]]:
    return example_runs["sweep"].result()


def test_default_run_trains_two_stages_with_progress_bar_and_summary(single):
    result, report = single
    assert report["num_stages"] == 2 and report["num_micro_batches"] == 8 and report["steps"] == 4
    assert report["val_loss"] < math.log(256)  # better than guessing bytes uniformly
    assert report["samples_per_second"] > 0
    # Lightning's progress bar: tqdm's "Epoch 0: 100%" or, when `rich` is installed, RichProgressBar's "Epoch 0/-2 ━━━ 4/4"
    assert re.search(r"Epoch 0(: 100%|/-?\d+ .* 4/4)", result.stdout), result.stdout
    summary = result.stdout[result.stdout.index("Summary: 2 stage(s)") :]
    assert f"final val_loss    {report['val_loss']:.4f}" in summary
    assert "samples/s" in summary and "peak RSS (MB)" in summary


def test_stages_hold_disjoint_halves_of_the_pipelined_blocks(single):
    _, report = single
    total, blocks = model_parameters()
    first, last = outside_by_stage()
    everywhere = total - blocks - first - last
    stages = report["stages"]
    assert [stage["stage"] for stage in stages] == [0, 1]
    assert [stage["rank"] for stage in stages] == [1, 0]  # rank 0 holds the last stage
    # The token embedding on the first stage, the final norm and the head on the last, the position table on both.
    assert [stage["parameters"] - everywhere for stage in stages] == [blocks // 2 + first, blocks // 2 + last]
    assert all(stage["peak_rss_mb"] > 50 for stage in stages)


def test_single_stage_job_holds_the_whole_model(sweep):
    _, _, (single, *_) = sweep
    assert single["num_stages"] == 1
    assert [stage["parameters"] for stage in single["stages"]] == [model_parameters()[0]]


def test_pipelined_and_single_stage_training_reach_the_same_loss(single, sweep):
    """On one or two stages, under GPipe or 1F1B (the language model's loss is a mean over equally many tokens per
    sample, so a loss per micro-batch gives the whole batch's gradient)."""
    _, _, (one_stage, *others) = sweep
    _, popen_run = single
    for report in others:
        assert report["val_loss"] == pytest.approx(one_stage["val_loss"], rel=1e-4)
    assert popen_run["val_loss"] == pytest.approx(others[1]["val_loss"], rel=1e-4)  # spawn and popen alike


def test_sweep_over_stage_counts_and_schedules_writes_comparison_table(sweep):
    result, out, reports = sweep
    with open(out / "comparison.csv") as file:
        rows = list(csv.DictReader(file))
    assert [(row["overrides"], row["stages"], row["schedule"]) for row in rows] == [
        (f"strategy.num_stages={stages} strategy.schedule={schedule}", str(stages), schedule)
        for stages, schedule in SWEEP
    ]
    assert [row["ideal_bubble"] for row in rows] == ["0.00", "0.00", f"{1 / 9:.2f}", f"{1 / 9:.2f}"]  # (S-1)/(M+S-1)
    for row, report in zip(rows, reports):
        assert float(row["samples_per_s"]) == pytest.approx(report["samples_per_second"], abs=0.05)
        assert float(row["val_loss"]) == pytest.approx(report["val_loss"], abs=1e-4)
        assert float(row["max_peak_rss_mb"]) > 50
    markdown = (out / "comparison.md").read_text()
    assert markdown.count("| strategy.num_stages=") == 4 and "| schedule |" in markdown
    assert "Sweep comparison" in result.stdout


# 12 steps with a checkpoint (and last.ckpt) at every validation, every 3 steps; the schedule set for 12 steps.
RESUMABLE = [*TINY, "trainer.max_steps=12", "trainer.val_check_interval=3", "model.total_steps=12"]


def run_until_a_checkpoint_then_kill(run_dir: Path, timeout: float = 240) -> int:
    """``python examples/train.py`` into ``run_dir``, SIGKILLed with every rank as soon as its first checkpoint is
    written (mid-way: a run of 12 steps writes one at step 3); its exit status."""
    command = [sys.executable, str(EXAMPLES / "train.py"), *RESUMABLE, f"hydra.run.dir={run_dir}"]
    with open(run_dir.parent / "stopped.txt", "w") as output:
        process = subprocess.Popen(command, cwd=run_dir.parent, env=python_environment(), stdout=output,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while process.poll() is None and time.monotonic() < deadline:
            if (run_dir / "checkpoints" / "last.ckpt").exists():
                break
            time.sleep(0.05)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def weights(checkpoint: Path) -> tuple[int, dict[str, torch.Tensor]]:
    loaded = torch.load(checkpoint, map_location="cpu", weights_only=False)
    return loaded["global_step"], loaded["state_dict"]


def relative_difference(initial: dict, expected: dict, actual: dict) -> float:
    """|actual - expected| over |expected - initial|, over every weight: 0 for identical training."""
    error = sum(float(((actual[k] - expected[k]) ** 2).sum()) for k in expected) ** 0.5
    change = sum(float(((expected[k] - initial[k]) ** 2).sum()) for k in expected) ** 0.5
    assert change > 1e-2, "training barely changed the weights"
    return error / change


def stopped_and_resumed(tmp_path: Path) -> tuple[int, int, Path]:
    """A 12-step run SIGKILLed at its first checkpoint, beside the same run uninterrupted, then resumed with
    ``ckpt_path=last``: the stopped run's exit status, the step it stopped at, and where the runs are."""
    stopped_dir, whole_dir = tmp_path / "stopped" / "run", tmp_path / "whole" / "run"
    stopped_dir.mkdir(parents=True)
    whole_dir.mkdir(parents=True)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(run, "train.py", *RESUMABLE, f"hydra.run.dir={whole_dir}", cwd=whole_dir.parent)
        status = pool.submit(run_until_a_checkpoint_then_kill, stopped_dir).result()
        succeeded(whole.result())
    step_stopped, at_stop = weights(stopped_dir / "checkpoints" / "last.ckpt")
    torch.save(at_stop, tmp_path / "at_stop.pt")
    if status == -signal.SIGKILL and 0 < step_stopped < 12:
        succeeded(run("train.py", *RESUMABLE, f"hydra.run.dir={stopped_dir}", "ckpt_path=last", cwd=stopped_dir.parent))
    return status, step_stopped, tmp_path


def test_run_stopped_mid_way_resumes_from_last_to_the_uninterrupted_weights(example_runs):
    """`ckpt_path=last` in the stopped run's directory continues from its last checkpoint, mid-epoch (the data
    order picks up where it stopped), to the weights of the same 12 steps run without a stop."""
    status, step_stopped, root = example_runs["resume"].result()
    assert status == -signal.SIGKILL and 0 < step_stopped < 12, (status, step_stopped)
    (step, resumed), (whole_step, uninterrupted) = weights(root / "stopped" / "run" / "checkpoints" / "last.ckpt"), \
        weights(root / "whole" / "run" / "checkpoints" / "last.ckpt")
    assert step == whole_step == 12
    sys.path.insert(0, str(EXAMPLES))
    try:
        from lm import ByteGPT
    finally:
        sys.path.remove(str(EXAMPLES))
    torch.manual_seed(0)
    initial = ByteGPT(width=32, total_steps=12).state_dict()
    difference = relative_difference(initial, uninterrupted, resumed)
    print(f"resumed from step {step_stopped}: the weights differ from uninterrupted training by {difference:.1e}")
    assert difference < 1e-6
    # The comparison can fail: the weights at the stop are far from the final ones.
    assert relative_difference(initial, uninterrupted, torch.load(root / "at_stop.pt")) > 0.1


def invalid_value(tmp_path: Path) -> tuple[Finished, Path]:
    return run("train.py", "strategy.checkpoint=sometimes", f"hydra.run.dir={tmp_path}", cwd=tmp_path), tmp_path


def test_invalid_value_stops_the_run_before_training_naming_the_key(example_runs):
    result, run_dir = example_runs["invalid"].result()
    assert result.returncode != 0
    assert "strategy.checkpoint='sometimes' is not a checkpoint mode" in result.stderr
    assert "Initializing distributed" not in result.stdout + result.stderr  # no rank started
    assert not (run_dir / "report.json").exists()


def existing_project(tmp_path: Path) -> Finished:
    return run("existing_project.py", "--max-steps", "4", "--val-every", "4", cwd=tmp_path)


def test_existing_project_trains_on_two_stages_unchanged(example_runs):
    result = succeeded(example_runs["existing"].result())
    assert re.search(r"pipelining 'encoder\.model' \(14 blocks\) over 2 stages", result.stdout + result.stderr)
    metrics = json.loads(result.stdout.split("final metrics: ", 1)[1].splitlines()[0])
    assert {"train_loss", "val_loss", "val_acc", "train_acc_epoch"} <= metrics.keys()
    assert 0.0 <= metrics["val_acc"] <= 1.0 and metrics["val_loss"] > 0


def test_readme_first_command_installs_then_trains_and_readme_links_the_docs():
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip()
    assert first_block == "pip install torch==2.13.0 -e . && python examples/train.py"
    for page in ("docs/index.md", "docs/guide.md", "docs/existing_project.md", "docs/troubleshooting.md"):
        assert f"]({page})" in readme, f"README does not link {page}"
        assert (REPO / page).is_file()
