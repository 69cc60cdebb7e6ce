"""--remote-sync for everything that is not a checkpoint: out.log, metrics.jsonl, params.yaml, tensorboard.

Rank 0 copies new or changed files of the run directory to the remote run directory every
--remote-sync-frequency seconds, and once more when the run ends. Checkpoints are not copied here: the
manager uploads their files as they are written and commits them with a manifest, so a half-written
checkpoint is never copied (what OpenCLIP's periodic `aws s3 sync` can do).

Both --remote-sync-protocol values use the same fsspec/s3fs path with parallel, retried uploads; "s3"
only insists on an s3:// URL, as OpenCLIP's aws-cli path did.
"""

from __future__ import annotations

import logging
import os
import threading

from bigclip.ckpt.storage import Storage, StorageError, StorageUnavailable

logger = logging.getLogger("bigclip")
SKIP_DIRS = ("checkpoints",)


class RemoteSync:
    def __init__(self, local_root: str, remote: Storage, every_seconds: float):
        self.local_root = local_root
        self.remote = remote
        self.every_seconds = max(1.0, float(every_seconds))
        self._seen: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bigclip-remote-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_seconds):
            self.sync_once()

    def sync_once(self, store: Storage | None = None, stop_at_first_failure: bool = False) -> int:
        """Upload what changed since the last pass; returns the number of files sent."""
        store = store or self.remote
        sent = 0
        for dirpath, dirnames, files in os.walk(self.local_root):
            if dirpath == self.local_root:
                dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
            for name in files:
                if name.startswith("."):  # a file being written beside its final name (report.html's)
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, self.local_root).replace(os.sep, "/")
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                stamp = (st.st_size, st.st_mtime_ns)
                if self._seen.get(rel) == stamp:
                    continue
                try:
                    # A snapshot of the bytes: out.log and metrics.jsonl keep growing while we upload.
                    with open(path, "rb") as f:
                        data = f.read()
                    store.put_bytes(rel, data)
                except (OSError, StorageError, StorageUnavailable) as e:
                    logger.warning(f"--remote-sync: could not copy {rel} to {store.display} ({e}); will try again")
                    if stop_at_first_failure:
                        return sent
                    continue
                self._seen[rel] = stamp
                sent += 1
        return sent

    def stop(self, timeout: float) -> None:
        """Stop the periodic copy and make one last pass; the run's end waits for it, but a store that does not
        answer holds it at most `timeout` s per file, and the first file that fails ends the pass."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck in a store's socket (a daemon thread: it does not hold the exit)
            logger.warning(f"--remote-sync: {self.remote.display} did not answer; the last copy of the logs is skipped")
            return
        final = Storage(self.remote.root, self.remote.options, timeout, bounded=True)
        self.sync_once(final, stop_at_first_failure=True)
