"""The step's outcome travels to every stage in one collective when it is small, and whole when it is not: three gloo
ranks broadcast objects around the size of the first message from a rank other than 0 over a group of their own."""

from __future__ import annotations

import pickle
import socket
import subprocess
import sys

from helpers.launch import python_environment

RANK_SCRIPT = r"""
import os, pickle, random, sys
import torch, torch.distributed as dist
from lightning_pipe.execution.process_groups import SMALL_OBJECT_BYTES, broadcast_over_cpu_group
from lightning_pipe.execution.replayed_logs import adopt_random_states, random_states

dist.init_process_group("gloo")
group = dist.new_group(backend="gloo")
rank, src = dist.get_rank(), 2
head_room = SMALL_OBJECT_BYTES - 8

def sized(total):
    # An object whose pickle is `total` bytes: bytes and a short string of the lengths that make it so.
    for length in range(total - 64, total):
        for pad in range(8):
            candidate = (b"x" * length, "p" * pad)
            if len(pickle.dumps(candidate)) == total:
                return candidate
    raise AssertionError(total)

torch.manual_seed(7 + rank)  # every rank's generators differ until the last stage's are adopted
random.seed(rank)
objects = {"small": {"loss": 0.25, "logs": ["a"] * 3}, "exactly_the_first_message": sized(head_room),
           "one_byte_over": sized(head_room + 1), "large": sized(5 * SMALL_OBJECT_BYTES + 3), "none": None}
received = {}
for name, value in objects.items():
    received[name] = broadcast_over_cpu_group(value if rank == src else "not this one", src, group)
states = broadcast_over_cpu_group(random_states(torch.device("cpu")) if rank == src else None, src, group)
adopt_random_states(states, torch.device("cpu"))
received["draws"] = (torch.rand(4).tolist(), random.random())
with open(os.path.join(sys.argv[1], f"rank{rank}.pkl"), "wb") as out:
    pickle.dump({"received": received, "expected": objects}, out)
dist.destroy_process_group()
"""


def test_objects_of_every_size_reach_every_rank_whole_and_the_random_state_is_adopted(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(tmp_path)],
            env=python_environment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3",
                                    "RANK": str(rank), "OMP_NUM_THREADS": "1"}),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(3)
    ]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0], "\n".join(outputs)
    results = [pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes()) for rank in range(3)]
    expected = results[2]["expected"]
    for result in results:
        for name, value in expected.items():
            assert result["received"][name] == value, name
    assert results[0]["received"]["draws"] == results[1]["received"]["draws"] == results[2]["received"]["draws"]


def test_a_logged_loss_travels_without_the_buffer_it_was_reduced_from():
    """torch's CPU ``mse_loss`` returns a view into its batch-sized buffer; a pickled tensor carries its whole storage,
    so the step's outcome would carry 2 MiB a step for a logged loss of a 1024 x 512 batch."""
    import torch
    import torch.nn.functional as F
    from lightning.pytorch import LightningModule

    from lightning_pipe.execution.replayed_logs import recording_logs

    loss = F.mse_loss(torch.randn(1024, 512), torch.zeros(1024, 512))
    assert loss.untyped_storage().nbytes() > 1024 * 1024  # the premise: the loss is a view of the whole buffer
    module = LightningModule()
    with recording_logs(module, log=False) as records:
        module.log("train_loss", loss)
    assert records[0].value == loss and len(pickle.dumps(records)) < 2048
