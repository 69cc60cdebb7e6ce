"""launch/train.py with a record of the samples of every step: `python data_keys_worker.py OUT_DIR -- FLAGS`.

Each rank appends {"step", "keys"} to OUT_DIR/keys-rank{R}.jsonl after every step, the keys being the captions
of the step's micro-batches (the test's captions are the samples' __key__, and test-tiny's byte tokenizer
decodes its tokens back to the caption). The run itself is bigclip's, unchanged.
"""

from __future__ import annotations

import json
import os
import sys

from bigclip import cli, loop
from bigclip.model import ByteTokenizer
from bigclip.train_state import TrainState

_pending: list[list[str]] = []
_decode = ByteTokenizer().decode


def _recording_forward_backward(original):
    def forward_backward(engine, loss_fn, micro, world, **kwargs):
        _pending[:] = [[_decode(row.tolist()) for row in texts] for _images, texts in micro]
        return original(engine, loss_fn, micro, world, **kwargs)

    return forward_backward


def _recording_advance(original, out_dir: str):
    def advance(self, samples, accum_freq):
        original(self, samples, accum_freq)
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(out_dir, f"keys-rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self.step, "keys": _pending}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    return advance


def main() -> int:
    out_dir, argv = sys.argv[1], sys.argv[2:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    loop.forward_backward = _recording_forward_backward(loop.forward_backward)
    TrainState.advance = _recording_advance(TrainState.advance, out_dir)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
