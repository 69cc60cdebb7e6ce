"""DataLoader worker processes: started so that a preemption SIGTERM does not kill them, and stopped by bigclip.

A preemption SIGTERM reaches every process of the job (SLURM signals the whole job step), but the main process
still needs its workers for the steps before its final checkpoint, so workers ignore it. bigclip then stops
them itself: DataInfo.close() at the end of a run, and at the latest at interpreter exit.
"""

from __future__ import annotations

import atexit
import signal
import warnings
import weakref

import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader


def ignore_sigterm(worker_id: int) -> None:
    """DataLoader worker init: a preemption SIGTERM reaches every process of the job (SLURM signals the whole
    job step), but the main process still needs its workers for the steps before its final checkpoint.
    Workers end when the main process shuts the loader down (DataInfo.close, at the latest at exit: see
    _shut_down_at_exit), or dies (DataLoader's parent watchdog). SIGUSR1, the other preemption notice, would
    kill a worker by default: ignored too."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


_LIVE_LOADERS: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def shut_down_workers(loader) -> None:
    """Stop a loader's persistent worker processes now (DataLoader's own shutdown: tell, then join)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shutdown = getattr(iterator, "_shutdown_workers", None)  # --workers 0: a single-process iterator, none
        if shutdown is not None:
            shutdown()
        loader._iterator = None


@atexit.register  # after multiprocessing's exit handler (torch imported it first), so it runs before it
def _shut_down_at_exit() -> None:
    # multiprocessing's handler would SIGTERM the SIGTERM-ignoring workers of a loader still alive at exit,
    # then wait for them forever.
    for loader in list(_LIVE_LOADERS):
        shut_down_workers(loader)


def worker_loader(dataset, workers: int, stateful: bool = False, **kwargs) -> DataLoader:
    """A DataLoader whose workers survive a preemption SIGTERM. `stateful`: torchdata's StatefulDataLoader, which
    keeps per worker the state (dataset.state_dict()) that came with the last batch taken from it."""
    cls = StatefulDataLoader if stateful else DataLoader
    with warnings.catch_warnings():
        # torchdata's constructor calls torch.set_vital, which torch now warns is deprecated: on every run, and
        # nothing the user can act on
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = cls(
            dataset,
            num_workers=workers,
            persistent_workers=workers > 0,
            worker_init_fn=ignore_sigterm if workers > 0 else None,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )
    if workers > 0:
        _LIVE_LOADERS.add(loader)
    return loader
