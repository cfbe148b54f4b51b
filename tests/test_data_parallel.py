"""Pipeline x data parallel: replicas of a pipeline average their gradients; one node or several; any schedule."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest
from lightning.pytorch import Trainer

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch, started_together
from lightning_pipe import GPipeStrategy

# Per replica 8 samples a step; one device takes both replicas' 16: Lightning's distributed sampler shuffles the
# training set (seed 0) and deals it out to the replicas, so one device reads that permutation in batches of 16.
REPLICATED = {"model": "synced", "num_micro_batches": 4, "batch_size": 8, "strategy": {"num_stages": 2}}
SINGLE_DEVICE = {"model": "synced", "batch_size": 16, "shuffled_like_distributed_sampler": True}


def assert_matches_single_device(run_dir):
    initial, expected, expected_metrics = single_device_run(SINGLE_DEVICE)
    assert relative_weight_error(initial, expected, merged_state_dict(run_dir)) < 1e-5
    for result in rank_results(run_dir):
        assert result["train_losses"] == pytest.approx(expected_metrics["train_losses"], rel=1e-5)
        assert result["final_metrics"]["val_loss"] == pytest.approx(expected_metrics["final_metrics"]["val_loss"], rel=1e-5)


def replicated_fits(tmp_path: Path) -> Path:
    """2 stages x 2 replicas on one node (4 ranks): both mesh orders, a tied weight, per-micro-batch schedules."""
    runs = [{**REPLICATED, "name": "pp_outer"},
            {**REPLICATED, "name": "dp_outer", "strategy": {"num_stages": 2, "mesh_order": ["dp", "pp"]}},
            # A weight shared by both stages: summed within each replica's pair of stages, then averaged.
            {**REPLICATED, "name": "tied", "model": "tied"},
            # Per-micro-batch schedules with 2 chunks per stage: interleaved; and ZB-V, whose loss is on stage 0 (the
            # tie then joins chunk 1 on stage 1 and chunk 3 on stage 0).
            {**REPLICATED, "name": "interleaved", "strategy": {"num_stages": 2, "schedule": "interleaved_1f1b"}},
            {**REPLICATED, "name": "tied_zbv", "model": "tied",
             "strategy": {"num_stages": 2, "schedule": "zbv", "mesh_order": ["dp", "pp"]}}]
    launch("fits_worker.py", {"devices": 4, "out": str(tmp_path), "runs": runs}, tmp_path)
    return tmp_path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_processes(name: str, tmp_path: Path, envs: list[dict[str, str]]) -> Path:
    """Start one worker process per environment (as a cluster's launcher would) and wait for all of them."""
    run = {**REPLICATED, "name": name, "trainer": {"num_nodes": 2}}
    spec = {"devices": 2, "out": str(tmp_path), "runs": [run]}  # per node
    with ThreadPoolExecutor(len(envs)) as pool:  # all at once: they meet at the rendezvous
        processes = [pool.submit(launch, "fits_worker.py", spec, tmp_path / f"process{i}", check=False, env=env)
                     for i, env in enumerate(envs)]
    for process in (future.result() for future in processes):
        assert process.returncode == 0, process.stderr[-4000:]
    assert sorted(p.name for p in (tmp_path / name).glob("rank*.json")) == [f"rank{r}.json" for r in range(4)]
    return tmp_path / name


def two_nodes(tmp_path: Path) -> Path:
    """Lightning's default launcher on each of two nodes (NODE_RANK 0 and 1) starts the node's two ranks."""
    port = str(free_port())
    envs = [{"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} for node in range(2)]
    return run_processes("two_nodes", tmp_path, envs)


def slurm_tasks(tmp_path: Path) -> Path:
    """Under SLURM, srun starts every rank (2 nodes x 2 tasks); Lightning's SLURMEnvironment reads the ranks."""
    slurm = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "pipe",
             "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "127.0.0.1", "MASTER_PORT": str(free_port())}
    envs = [{**slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2)}
            for rank in range(4)]
    return run_processes("slurm", tmp_path, envs)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Every launch of this file, started together with the first test that reads one."""
    jobs = {"replicated": replicated_fits, "two_nodes": two_nodes, "slurm": slurm_tasks}
    return started_together({name: partial(job, tmp_path_factory.mktemp(name)) for name, job in jobs.items()})


def test_two_stages_times_two_replicas_match_one_device_with_twice_the_batch(launches):
    replicated = launches["replicated"].result()
    for name in ("pp_outer", "dp_outer", "interleaved"):
        assert_matches_single_device(replicated / name)
    initial, expected, _ = single_device_run({**SINGLE_DEVICE, "model": "tied"})
    for name in ("tied", "tied_zbv"):
        assert relative_weight_error(initial, expected, merged_state_dict(replicated / name)) < 1e-5


def test_two_simulated_nodes_train_like_one(launches):
    assert_matches_single_device(launches["two_nodes"].result())


def test_slurm_tasks_on_two_simulated_nodes_train_like_one(launches):
    run_dir = launches["slurm"].result()
    assert "SLURMEnvironment" in (run_dir / "environment.txt").read_text()
    assert_matches_single_device(run_dir)


def test_device_count_must_be_a_multiple_of_num_stages():
    with pytest.raises(ValueError, match="devices \\* num_nodes to be a multiple of the stage count"):
        Trainer(strategy=GPipeStrategy(num_stages=2), accelerator="cpu", devices=3)
