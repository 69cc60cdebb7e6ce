"""Where is a stuck rank? `kill -USR2 <pid>` prints every thread's Python stack of that process to its stderr
(and it goes on running); a crash inside C++ (a segfault in an op) prints the Python stack that called it.

A hung multi-process run (a collective one rank never reached, a lock) otherwise says nothing until
--dist-timeout ends it. SIGUSR2 because SIGTERM and SIGUSR1 are preemption notices (preemption.py) and SIGQUIT
is the shell's core dump. launch/train.py installs this before anything heavy is imported; stdlib only.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

STACKS_SIGNAL = signal.SIGUSR2


def dump_stacks_on_request() -> None:
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
