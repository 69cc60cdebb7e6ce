"""Shared helpers for end-to-end tests: run bigclip, read what it wrote."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time


def loss_for(siglip, local_loss=False, gather_with_grad=False, impl="auto", dist_impl=None, rank=0, world_size=1):
    """The loss module OpenCLIP's flags (--siglip, --local-loss, --gather-with-grad) and bigclip's --loss-impl /
    --loss-dist-impl make, in that order."""
    from bigclip.loss import LossConfig, build_loss

    family = "siglip" if siglip else "clip"
    cfg = LossConfig(
        loss=family, local_loss=local_loss, gather_with_grad=gather_with_grad, loss_impl=impl, loss_dist_impl=dist_impl
    )
    return build_loss(cfg, rank, world_size)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_SCRIPT = os.path.join(REPO, "launch", "train.py")

# A small, fast synthetic run of the tiny model; tests add or override flags.
TINY_SYNTHETIC = [
    "--model",
    "test-tiny",
    "--dataset-type",
    "synthetic",
    "--train-num-samples",
    "64",
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--precision",
    "fp32",
    "--workers",
    "0",
    "--warmup",
    "2",
    "--lr",
    "1e-3",
    "--log-every-n-steps",
    "1",
    "--seed",
    "0",
]


@functools.cache
def bf16_emulated() -> bool:
    """Whether this CPU has no bf16 units (torch emulates bf16 there: 40-130x slower matmuls than float32), measured
    as a run measures it at its start (bigclip/precision.py). Tests whose point is not the bf16 arithmetic then run
    in float32, as the run's own warning advises there."""
    import torch

    from bigclip.precision import SLOW_FACTOR, cpu_matmul_slowdown

    return cpu_matmul_slowdown(torch.bfloat16) >= SLOW_FACTOR


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def wait_for_step(run_dir: str, step: int, proc=None, timeout: float = 240) -> bool:
    """Poll the run's metrics.jsonl until it shows `step`; False if proc exits or time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and any(
            r.get("step", 0) >= step for r in read_metrics(run_dir)
        ):
            return True
        time.sleep(0.02)
    return False


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def sigkill_job(proc) -> None:
    """SIGKILL a launched job whole, as a lost node would: the launcher (started with start_new_session) and, as
    torchrun starts each rank in a session of its own, every rank's session (the rank and its loader workers).
    Killing the launcher's group alone leaves the ranks training on."""
    ranks = child_pids(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:  # ended on its own meanwhile
            pass
    proc.wait()


def step_losses(run_dir: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "WANDB_MODE": "offline", **extra})
    return env


def torchrun_cmd(nproc: int, script: str, *args: str) -> list[str]:
    """`python -m torch.distributed.run` on a free local port: nproc processes of `script` with `args`."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", script, *args]  # fmt: skip


class RunTimedOut(AssertionError):
    """A training launch still going at its time limit; the message ends with its processes' Python stacks."""


def run_training(cmd: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run for training launches, but one still going at `timeout` is not just killed: each of its
    training processes first prints every thread's stack (launch/train.py's SIGUSR2), which the failure shows,
    and then its whole process group goes (a launcher killed alone would leave its ranks running)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import psutil  # DeepSpeed's dependency

        for child in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                if any(arg.endswith(os.path.join("launch", "train.py")) for arg in child.cmdline()[:4]):
                    child.send_signal(signal.SIGUSR2)
                    with contextlib.suppress(subprocess.TimeoutExpired):  # one at a time: ranks share stderr
                        proc.communicate(timeout=2)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        stacks = err[-15000:]
        raise RunTimedOut(f"{' '.join(cmd)[:400]} timed out after {timeout} s; its stderr ends:\n{stacks}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(nproc: int, args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    # "--" keeps torchrun's own parser off bigclip's flags: it would reject --logs as an ambiguous
    # abbreviation of its --logs-specs.
    cmd = torchrun_cmd(nproc, TRAIN_SCRIPT, "--", *args)
    return run_training(cmd, timeout, env=subprocess_env(**env))


def python_train(args: list[str], timeout: int = 300, cwd: str | None = None, **env: str):
    cmd = [sys.executable, TRAIN_SCRIPT, *args]
    return run_training(cmd, timeout, cwd=cwd, env=subprocess_env(**env))


def tiny_hf_clip(directory, kind: str = "roberta", embed_dim: int = 16, coca: bool = False) -> str:
    """An OpenCLIP local-dir: model whose text tower is a tiny Hugging Face model created here (no hub): its
    weights in DIRECTORY/hf (transformers' save_pretrained), a word-level tokenizer trained on a few captions
    beside open_clip_config.json (where OpenCLIP's local-dir: looks for it). kind: roberta (mean pooler, mlp
    projection), mt5 (mean pooler, mlp), or m2m_100 (NLLB's encoder; cls pooler, linear projection, as OpenCLIP's
    nllb-clip configs). coca: a CoCa (OpenCLIP's coca_roberta layout: no attentional pooler, the ViT's tokens and
    the text states as wide as the decoder). Returns the --model name."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModel, M2M100Config, MT5Config, PreTrainedTokenizerFast, RobertaConfig

    directory = str(directory)
    words = Tokenizer(models.WordLevel(unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    captions = ["a photo of a cat", "two dogs playing on a beach at sunset", "a red car", "digit zero one two three"]
    words.train_from_iterator(captions, trainers.WordLevelTrainer(special_tokens=["<pad>", "<s>", "</s>", "<unk>"]))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, **special)
    tokenizer.save_pretrained(directory)
    if kind == "roberta":
        config = RobertaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=2, intermediate_size=64, max_position_embeddings=80,
                               pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    elif kind == "m2m_100":
        config = M2M100Config(vocab_size=tokenizer.vocab_size, d_model=32, encoder_layers=2, decoder_layers=1,
                              encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                              decoder_ffn_dim=64, max_position_embeddings=80, pad_token_id=tokenizer.pad_token_id,
                              dropout=0.0)  # fmt: skip
    else:
        config = MT5Config(vocab_size=tokenizer.vocab_size, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                           pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(os.path.join(directory, "hf"))
    vision = {"image_size": 16, "layers": 2, "width": 32, "head_width": 16, "patch_size": 4}
    text = {
        "hf_model_name": os.path.join(directory, "hf"),
        "hf_tokenizer_name": directory,
        "hf_pooler_type": "cls_pooler" if kind == "m2m_100" else "mean_pooler",
    }
    if kind == "m2m_100":
        text["hf_proj_type"] = "linear"
    model_cfg = {"embed_dim": embed_dim, "vision_cfg": vision, "text_cfg": text}
    if coca:  # the vocabulary given, as OpenCLIP 3.3 would otherwise size the decoder for its own (49408)
        vision["output_tokens"] = text["output_tokens"] = True
        text.update(width=32, vocab_size=tokenizer.vocab_size, context_length=12, hf_proj_type="linear")
        model_cfg["multimodal_cfg"] = {"width": 32, "heads": 2, "layers": 1, "context_length": 12}
    with open(os.path.join(directory, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": model_cfg, "preprocess_cfg": {}}, f)
    return f"local-dir:{directory}"
