"""Engine state for DeepSpeed: DeepSpeed's own ZeRO checkpoint files, uploaded in the background.

`engine.save_checkpoint(dir, tag)` is DeepSpeed's save: collective on the training group, every rank writing
its optimizer partitions (and at ZeRO-3 its parameter partitions) with torch.save. It must run on the main
thread, so for this engine the loop is blocked while DeepSpeed writes to local disk (page cache); hashing,
fsync, upload and the commit run in the background like every other engine.

Which rank wrote which file follows DeepSpeed's names: `zero_pp_rank_{r}_…` files belong to data-parallel
rank r, everything else (mp_rank_00_model_states.pt, zero_to_fp32.py) to rank 0.

Loading at another world size goes through DeepSpeed's universal checkpoint: the ZeRO files are converted
(deepspeed.checkpoint.ds_to_universal) and loaded with `load_universal`.
"""

from __future__ import annotations

import os
import re

from ..errors import UserError
from .upload import FileSink

ENGINE_DIR = "engine_state"
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_")


class DeepSpeedLayout:
    layout = "deepspeed"
    writes_while_staging = True

    def __init__(self, engine, world, group, mode: str = "thread"):
        self.engine = engine
        self.world = world
        self.group = group
        self.mode = "thread"  # DeepSpeed writes on the main thread; only the upload is asynchronous

    def stage(self, directory: str) -> None:
        """Blocking and collective: DeepSpeed writes this rank's files under directory/engine_state/."""
        self.engine.save_checkpoint(directory, ENGINE_DIR)

    def write(self, handle, directory: str, sink: FileSink) -> None:
        for dirpath, _, names in os.walk(directory):
            for name in sorted(names):
                m = _RANK_FILE.search(name)
                owner = int(m.group(1)) if m else 0
                if owner == self.world.rank and not name.endswith(".pt.tmp"):
                    sink.submit(os.path.join(dirpath, name))

    def load(self, directory: str, saved_world_size: int | None = None) -> None:
        if saved_world_size is not None and saved_world_size != self.world.world_size:
            self._load_universal(directory, saved_world_size)
            return
        self.engine.load_checkpoint(directory, ENGINE_DIR)

    def _load_universal(self, directory: str, saved_world_size: int) -> None:
        """ZeRO files are partitioned for the world size that wrote them: convert to DeepSpeed's universal
        format (rank 0, once), then load that at this world size."""
        import torch.distributed as dist

        universal = os.path.join(directory, ENGINE_DIR + "_universal")
        problem = None
        if self.world.is_main and not os.path.isdir(universal):
            try:
                _convert_to_universal(os.path.join(directory, ENGINE_DIR), universal)
            except Exception as e:  # noqa: BLE001 — DeepSpeed's converter raises assorted types
                problem = f"{type(e).__name__}: {e}"
        if dist.is_initialized():
            box = [problem]
            dist.broadcast_object_list(box, src=0)
            problem = box[0]
        if problem:
            raise UserError(f"checkpoint {directory}: saved by {saved_world_size} DeepSpeed ranks, and converting "
                            f"it for {self.world.world_size} failed ({problem}); resume with "
                            f"{saved_world_size} processes")
        ds = self.engine.ds
        ds._config.load_universal_checkpoint = True
        try:
            path, _ = ds.load_checkpoint(directory, tag=ENGINE_DIR + "_universal", load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
        finally:
            ds._config.load_universal_checkpoint = False
        if path is None:
            raise UserError(f"checkpoint {directory}: DeepSpeed could not load the converted state")

    def close(self) -> None:
        pass


def _convert_to_universal(src: str, dst: str) -> None:
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    ds_to_universal(Namespace(input_folder=src, output_folder=dst, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=True))


def read_model_state(directory: str) -> dict:
    """Full fp32 model weights of a DeepSpeed checkpoint, in one process (DeepSpeed's zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(directory, tag=ENGINE_DIR))
