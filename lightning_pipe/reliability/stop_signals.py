"""SIGTERM and SIGINT end a rank within seconds, even when its main thread is blocked in a wait on another rank.

Python runs a signal's handler in the main thread, between two bytecodes: a main thread blocked in gloo's wait for a
peer (a stage that is stuck, or itself waiting) runs none, however long the wait, so a rank told to stop would not
stop, nor pass the signal on to the ranks it started. So each rank also hears of the signal from a thread of its
own (:class:`StopSignals`): the C-level handler writes the signal's number into a pipe (``signal.set_wakeup_fd``),
which the thread reads at once. The thread then

1. passes the signal on to the ranks this process started (the default launcher's children), as Lightning's own
   handler does once it runs;
2. gives the run ``STOP_GRACE_S`` to stop by itself, as Lightning stops it: at the next training step
   (``SIGTERMException``), or by ``KeyboardInterrupt``;
3. then closes the rank's gloo connections (:func:`~lightning_pipe.reliability.watchdog.close_gloo_groups`): the
   wait its main thread is blocked in fails, and the rank ends with Lightning's exception for the signal
   (:func:`stop_exception`) through Lightning's usual exception handling;
4. and ends the process ``EXIT_GRACE_S`` later if it still runs (its started ranks with it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_pipe.reliability.watchdog import close_gloo_groups

STOP_GRACE_S = 1.0  # how long a rank told to stop may take to stop at its next step, Lightning's way
EXIT_GRACE_S = 3.0  # then, with its waits failed, how long it may take to end before its process is ended
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []  # the stop signal this process received, once its thread heard it


def stop_exception(cause: BaseException) -> BaseException | None:
    """What a rank raises when ``cause`` (a failed wait) follows from a stop signal: Lightning's ``SIGTERMException``
    for SIGTERM (exit status 0, as Lightning ends a run it was told to stop), ``KeyboardInterrupt`` for SIGINT;
    ``None`` when no stop signal was received."""
    if not _received:
        return None
    return SIGTERMException() if _received[0] == signal.SIGTERM else KeyboardInterrupt()


class StopSignals:
    """Hears SIGTERM and SIGINT from a thread while the rank runs (see the module). ``started_ranks`` returns the
    processes this one started (the default launcher's), which get the signal passed on.

    Start it from the main thread (only it may set the wakeup descriptor); a descriptor set before (asyncio's) still
    gets every signal's number."""

    def __init__(self, name: str, started_ranks: Callable[[], list[subprocess.Popen]] = list) -> None:
        self.name = name  # "stage 0 (rank 1)", for the message when it must end the process
        self._started_ranks = started_ranks
        self._read_fd = self._write_fd = -1
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None or threading.current_thread() is not threading.main_thread():
            return
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._listen, name="lightning_pipe-stop-signals", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Give the wakeup descriptor back (at teardown). A stop already under way goes on: its process must end."""
        if self._thread is None:
            return
        with contextlib.suppress(ValueError):  # not the main thread: the descriptor stays (the thread goes on)
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write_fd)  # the thread reads the end of the pipe and returns
        self._thread = None

    def _listen(self) -> None:
        read_fd = self._read_fd
        try:
            while data := os.read(read_fd, 64):
                if self._previous_fd >= 0:
                    with contextlib.suppress(OSError):
                        os.write(self._previous_fd, data)
                stop = next((signum for signum in data if signum in STOP_SIGNALS), None)
                if stop is not None and not _received:
                    _received.append(stop)
                    self._stopping(signal.Signals(stop))
                    return
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                os.close(read_fd)

    def _stopping(self, signum: signal.Signals) -> None:
        started = self._started_ranks()
        for process in started:
            with contextlib.suppress(OSError):
                process.send_signal(signum)
        time.sleep(STOP_GRACE_S)
        close_gloo_groups()
        time.sleep(EXIT_GRACE_S)
        sys.stderr.write(
            f"\n{self.name} did not end within {STOP_GRACE_S + EXIT_GRACE_S:g} s of {signum.name}; ending its process.\n"
        )
        sys.stderr.flush()
        for process in started:
            with contextlib.suppress(OSError):
                process.kill()
        os._exit(128 + signum)
