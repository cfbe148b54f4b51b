"""With ``-n 2 --dist loadfile`` (pytest-xdist) the suite runs two files at a time: a file's launches are partly waits
(gloo messages, stall bounds), so two files keep both cores of a 2-core machine busy.

A file is one unit of work for xdist, handed out in collection order: the files that take longest go first, so that
the run does not end on one long file started last. Each worker computes with one thread (two workers share the two
cores; the ranks that launches start set their own threads, as Lightning's launchers do)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

# Longest first (measured in a full run on 2 cores, 2026-12-03): each starts several multi-process launches.
LONGEST_FILES = (
    "test_reliability.py",
    "test_examples.py",
    "test_memory_setup.py",
    "test_launchers.py",
    "test_stock_pipelines.py",
    "test_checkpoints.py",
    "test_exactness.py",
    "test_equivalence.py",
    "test_benchmarks.py",
    "test_stall_watchdog.py",
    "test_data_parallel.py",
    "test_schedules_fit.py",
    "test_pretrained.py",
    "test_docs.py",
    "test_micro_batch_weights.py",
    "test_from_scratch.py",
    "test_trace.py",
    "test_outside_step.py",
    "test_activation_memory.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: within a file, and among the other files, the collection order stays


def pytest_configure(config: pytest.Config) -> None:
    # A shell without job control starts a background command (`pytest ... &`, some CI runners) with SIGINT ignored,
    # and every process it starts inherits that: the launches of the stop-signal tests could not hear their SIGINT.
    # The tests run as from a terminal, where Ctrl-C is heard.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
