"""SIGTERM as a preemption notice (SLURM's --signal, a cloud spot reclaim, torchrun forwarding a TERM).

The handler only raises a flag; the loop reads it at the next step boundary, where every rank agrees to
stop (cadence.py), writes a final checkpoint, waits for it to commit and exits cleanly. A second SIGTERM
while that is under way means "now": the process exits at once (an uncommitted checkpoint is never loaded).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger("bigclip")


class PreemptionFlag:
    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. a test harness thread)
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        logger.warning("SIGTERM received: saving a final checkpoint at the next step, then exiting")
