"""A training run whose saves' background copies start only when the loop waits for them (tests/test_ckpt.py).

    python tests/held_staging_worker.py BIGCLIP_TRAIN_FLAGS...

A save copies the state in the background while the loop runs the next step's forward and backward, and the
loop waits for the copy before the next optimizer step (CheckpointManager.wait_staged). Here each copy is held
until that wait begins, so it always runs after the forward and backward: what they change must already be
copied when the save starts, or the checkpoint holds the next step's values.
"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from bigclip import cli
from bigclip.ckpt.manager import CheckpointManager

RELEASED = threading.Event()
COPIER = ThreadPoolExecutor(1, thread_name_prefix="held-copy")


def held(copy):
    """A future of copy(), run once the loop waits for it."""
    return COPIER.submit(lambda: (RELEASED.wait(), copy())[1])


def hold_dcp_copies() -> None:
    from bigclip.ckpt.dcp_layout import DCPLayout

    usable = DCPLayout._usable_stager

    class HeldStager:
        def __init__(self, stager):
            self.stager = stager

        def stage(self, state):
            return held(lambda: self.stager.stage(state).result())

    DCPLayout._usable_stager = lambda self: HeldStager(usable(self))


def hold_deepspeed_copies() -> None:
    from bigclip.ckpt.deepspeed_staging import StagingCheckpointEngine

    copy_files = StagingCheckpointEngine.copy
    StagingCheckpointEngine.copy = lambda self, files: held(lambda: copy_files(self, files)).result()


def release_when_waited_for() -> None:
    """The loop waits for the copy before the next optimizer step (wait_staged), for the whole save at the run's
    end (wait), or writes a save itself (_write_and_commit, blocking saves): the copy goes ahead then. Where
    HELD_WAITS_LOG names a file, each wait_staged for a copy in flight appends whether it came from inside a
    backward (--optimizer-in-backward: right before the first update)."""
    import os

    import torch

    log = os.environ.get("HELD_WAITS_LOG")

    def releasing(method):
        def wrapper(self, *args, **kwargs):
            in_the_loop = threading.current_thread() is threading.main_thread()
            if log and method.__name__ == "wait_staged" and self._staging is not None:
                with open(log, "a") as f:
                    f.write(f"{'backward' if torch._C._current_graph_task_id() != -1 else 'loop'}\n")
            if in_the_loop:
                RELEASED.set()
            try:
                return method(self, *args, **kwargs)
            finally:
                if in_the_loop:
                    RELEASED.clear()

        return wrapper

    for name in ("wait_staged", "wait", "_write_and_commit"):
        setattr(CheckpointManager, name, releasing(getattr(CheckpointManager, name)))


if __name__ == "__main__":
    argv = sys.argv[1:]
    hold_deepspeed_copies() if "--ds-config" in argv else hold_dcp_copies()
    release_when_waited_for()
    code = cli.main(argv)
    COPIER.shutdown()
    sys.exit(code)
