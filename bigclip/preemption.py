"""A preemption notice: SIGTERM (SLURM's --signal=TERM@N, a cloud spot reclaim, torchrun or the DeepSpeed
launcher forwarding one) or SIGUSR1 (SLURM's --signal=USR1@N, for users who keep TERM for cancellation).

The handler only raises a flag; the loop reads it at the next step boundary, where every rank agrees to
stop (cadence.py), writes a final checkpoint, waits for it to commit and exits cleanly. Further notices while
that is under way are ignored: under a launcher each rank hears the same preemption twice (from the
scheduler, which signals every process of the job step, and again from the launcher forwarding it), and the
save must not be cut short by the echo. What stops a rank for good is the scheduler's SIGKILL after its grace
period; an uncommitted checkpoint it leaves behind is never loaded (the commit marker is written last).

After the last step (the run waiting for its final checkpoint to commit, which a store that does not answer
can make long) a notice ends the wait at once (`StoppedAfterTraining`): the checkpoint in flight never
commits, the last committed one stays latest.

Before training starts (setup: imports, downloads, a resume retrying an unreachable store, building a giant
model) there is nothing to save, and the loop that would read the flag is not running yet: a notice then
stops the process at once, with one line (`StoppedBeforeTraining`, a BaseException so that no retry loop's
`except Exception` swallows it). The run arms the flag (`arm()`) right before its first step. `NOTICE` is the
process's one flag; launch/train.py installs it before anything heavy is imported, which is why this module
imports nothing of bigclip's or torch's. A wait inside C++ (a rendezvous, a collective) only sees the signal
when it returns; --dist-timeout bounds those.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

logger = logging.getLogger("bigclip")

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StoppedBeforeTraining(BaseException):
    """A preemption notice came before the first training step: nothing to save, the process ends now."""


class StoppedAfterTraining(BaseException):
    """A preemption notice came after the last training step, while the run waits for its final checkpoint
    and log copy: the process ends now, without them."""


class PreemptionFlag:
    def __init__(self) -> None:
        self.requested = False
        self.armed = False  # True from the first training step on: a notice then means "save and stop"
        self.over = False  # the last training step is behind (training_over())
        self.ending = False  # inside cuts_short(): a notice ends the wait at once
        self.ending_name = ""  # a notice that came after the last step, outside such a wait
        self.signal_name = ""  # the notice that came first
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        """The training loop is about to run: from now on a notice is read at the next step boundary."""
        self.armed = True

    def training_over(self) -> None:
        """The last step is behind and no notice stopped training: a notice from now on ends the run's waits
        for its last save (see cuts_short)."""
        if not self.requested:
            self.over = True

    @contextlib.contextmanager
    def cuts_short(self):
        """Inside: a notice raises StoppedAfterTraining (for the run's waits after its last step; only around
        plain waits, never around collectives, which every rank must finish together). A notice that came
        after the last step but before this wait raises at once."""
        if self.ending_name:
            raise StoppedAfterTraining(self._after_training(self.ending_name))
        self.ending = True
        try:
            yield
        finally:
            self.ending = False

    @staticmethod
    def _after_training(name: str) -> str:
        return (
            f"{name} received after training ended: not waiting for the last checkpoint to commit (the last "
            f"committed one stays latest); stopping"
        )

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
        self.requested, self.armed, self.signal_name = False, False, ""
        self.over, self.ending, self.ending_name = False, False, ""

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.armed:
            raise StoppedBeforeTraining(f"{name} received before training started: nothing to save; stopping")
        if self.requested:
            logger.info(f"{name} received again: the final checkpoint is already under way")
            return
        if self.over:
            if self.ending:
                raise StoppedAfterTraining(self._after_training(name))
            self.ending_name = name  # the next wait for the last save raises at once
            return
        self.requested = True
        self.signal_name = name
        logger.warning(f"{name} received: saving a final checkpoint at the next step, then exiting")


NOTICE = PreemptionFlag()
