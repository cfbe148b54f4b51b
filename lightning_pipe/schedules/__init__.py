"""Pipeline schedules: the ordered actions of each stage in one training step, and the simulator that checks them.

Holds: what a schedule is made of (``actions``: :class:`Action`, :class:`PipelineSchedule`, the user's own through
:func:`custom_schedule`), the built-in schedules (``builtin``: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V) and the
simulator (``simulator``: :func:`clock_cycles` checks and times a schedule, :func:`render_timeline` draws it) and the
planner's core (``planner``: :func:`predict` a step, its bubble and memory from measured costs). Pure
logic: nothing here runs a model or needs a process. The names below are the public ones::

    from lightning_pipe.schedules import render_timeline
    print(render_timeline(num_stages=4, num_micro_batches=8, schedule="1f1b"))

May import: nothing of the package. Imported by ``partition``, ``trace``, ``execution``, ``settings`` and the strategy.
"""

from lightning_pipe.schedules.actions import Action, PipelineSchedule, custom_schedule
from lightning_pipe.schedules.builtin import (
    SCHEDULES, gpipe, gpipe_schedule, interleaved_one_f_one_b, one_f_one_b, zbv, zero_bubble,
)
from lightning_pipe.schedules.simulator import Simulation, check_schedule, clock_cycles, render_timeline

__all__ = [
    "SCHEDULES", "Action", "PipelineSchedule", "Simulation", "check_schedule", "clock_cycles", "custom_schedule",
    "gpipe", "gpipe_schedule", "interleaved_one_f_one_b", "one_f_one_b", "render_timeline", "zbv", "zero_bubble",
]
