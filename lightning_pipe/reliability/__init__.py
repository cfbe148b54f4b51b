"""What keeps a failing run from hanging: the stall watchdog, stop signals, and the root cause named on every rank.

Holds: the watchdog's rule (``stall_rule``) and its run-time half (``watchdog``: every wait on another rank goes
through it), SIGTERM and SIGINT heard while a rank is blocked (``stop_signals``), and the first failing stage's
exception re-raised everywhere (``root_cause``).

May import: ``schedules``, ``partition``. Imported by ``execution`` (its waits), the launchers and the
strategy.
"""
