"""How far the emulated section's *CPU ours / torch's* moves between launches of the same code.

Each launch measures one schedule's CPU per step, ours and torch's taking turns on the same emulated blocks
(``ranks.emulated.cpu_per_step``: 4 stages, uniform, M=8), and prints the ratio of all ranks' CPU (the median step
of each rank, summed), for the whole processes (as the section measures) and for their main threads alone. With no
wait (stage time 0) the CPU is the runtimes' own work and nothing else; with the section's 16 ms the waits come
between, and the machine's other work with them. Usage::

    python benchmarks/cpu_spread.py [--launches 4] [--schedule 1f1b] [--stage-times 0 0.016]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from harness.launch import launch
from ranks import emulated
from sections.bench_emulated import ROWS, WIDTH

NUM_STAGES = 4


def ratios(answers: list[dict], clock: str) -> tuple[float, float, float]:
    """All ranks' CPU per step (ms), ours and torch's, and their ratio, from each rank's median step on ``clock``."""
    ours = sum(statistics.median(answer["ours"][clock]) for answer in answers)
    peer = sum(statistics.median(answer["peer"][clock]) for answer in answers)
    return 1e3 * ours, 1e3 * peer, ours / peer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=sorted(emulated.CONFIGURATIONS))
    parser.add_argument("--stage-times", type=float, nargs="+", default=[0.0, 0.016])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| launch | stage time (ms) | CPU ours / torch's (ms) | ratio | main thread ours / torch's (ms) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for index in range(args.launches):
        for stage_time in args.stage_times:
            spec = {
                "configuration": args.schedule, "stage_time": stage_time, "micro_batches": 8, "rows": ROWS,
                "width": WIDTH, "warmup": 3, "rounds": args.rounds,
            }
            answers = launch(emulated.cpu_per_step, NUM_STAGES, spec)
            ours, peer, ratio = ratios(answers, "process")
            ours_main, peer_main, ratio_main = ratios(answers, "thread")
            print(
                f"| {index + 1} | {1e3 * stage_time:g} | {ours:.1f} / {peer:.1f} | {ratio:.2f} |"
                f" {ours_main:.1f} / {peer_main:.1f} | {ratio_main:.2f} |", flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
