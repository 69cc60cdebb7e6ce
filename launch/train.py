"""Entry point for every launcher.

    python launch/train.py [flags]                                   # one process (CPU or one GPU)
    torchrun --nproc_per_node N launch/train.py [flags]              # DDP on one node
    srun python launch/train.py [flags]                              # SLURM, one task per GPU
    deepspeed launch/train.py --ds_config ds_configs/zero2.json ...  # DeepSpeed launcher

The `if __name__ == "__main__"` guard matters: asynchronous checkpointing in a separate process
re-imports this file in the child and must not start a second training run there.
"""

import os
import sys

try:
    import bigclip  # noqa: F401  (installed with `pip install -e .`)
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Before the heavy imports: a preemption notice during startup is kept, not fatal (bigclip/preemption.py), and
# `kill -USR2 <pid>` prints where a stuck process is (bigclip/run/stack_dumps.py).
from bigclip.preemption import NOTICE  # noqa: E402
from bigclip.run.stack_dumps import dump_stacks_on_request  # noqa: E402

if __name__ == "__main__":
    NOTICE.install()
    dump_stacks_on_request()

from bigclip.cli import exit_process, main  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
