"""A preemption notice: SIGTERM (SLURM's --signal=TERM@N, a cloud spot reclaim, torchrun or the DeepSpeed
launcher forwarding one) or SIGUSR1 (SLURM's --signal=USR1@N, for users who keep TERM for cancellation).

The handler only raises a flag; the loop reads it at the next step boundary, where every rank agrees to
stop (cadence.py), writes a final checkpoint, waits for it to commit and exits cleanly. Further notices while
that is under way are ignored: under a launcher each rank hears the same preemption twice (from the
scheduler, which signals every process of the job step, and again from the launcher forwarding it), and the
save must not be cut short by the echo. What stops a rank for good is the scheduler's SIGKILL after its grace
period; an uncommitted checkpoint it leaves behind is never loaded (the commit marker is written last).

`NOTICE` is the process's one flag. launch/train.py installs it before anything heavy is imported, so a
notice that comes while a big run is still starting (imports, sharded init, loading weights) is kept, not
fatal: the run then stops after its first step with a checkpoint. This module imports nothing of bigclip's
or torch's for that reason.
"""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger("bigclip")

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionFlag:
    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""  # the notice that came first
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. a test harness thread)
        if self._previous:
            return  # already installed (early, by launch/train.py); a notice received since stays
        for sig in NOTICE_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """The run is over: the previous handlers again, and the flag down (a next run in this process, as in
        tests, starts without a notice)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        self.requested, self.signal_name = False, ""

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            logger.info(f"{name} received again: the final checkpoint is already under way")
            return
        self.requested = True
        self.signal_name = name
        logger.warning(f"{name} received: saving a final checkpoint at the next step, then exiting")


NOTICE = PreemptionFlag()
