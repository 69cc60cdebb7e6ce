"""Shared helpers for end-to-end tests: run bigclip, read what it wrote."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
    Killing the launcher's group alone leaves the ranks training on. A PreloadedJob: every rank's session."""
    if hasattr(proc, "signal_groups"):
        proc.signal_groups(signal.SIGKILL)
        proc.wait()
        return
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


def fork_ranks(fn, args: tuple, nprocs: int) -> None:
    """mp.spawn's contract (rank r runs fn(r, *args); a rank's exception fails the call with its traceback), but
    each rank forked from this test process instead of a fresh interpreter that imports torch again (~2.5 s of CPU
    per rank). A rank starts with this process's imported modules and their state: not for code that must import a
    library afresh (TRITON_INTERPRET set before triton is imported: test_loss_distributed's interpreted ranks).
    Safe to fork where torch runs on one thread (conftest sets one per test process under -n), as DataLoader forks
    its workers. Spawned instead in two cases. Once an earlier test in this process has started autograd's device
    threads, autograd refuses a backward in a forked child ("Unable to handle autograd's threading in combination
    with fork-based multiprocessing"); which tests ran before is up to the scheduler. And where torch runs on more
    than one thread (pytest without -n: torch's default), a child forked after an OpenMP parallel region waits in
    its next one for the parent's pool threads, which it does not have (seen: both ranks of test_distill's two-rank
    test stuck in cross_entropy)."""
    import torch
    import torch.multiprocessing as mp

    forkable = torch.get_num_threads() == 1 and _forked_children_can_backward()
    start_method = "fork" if forkable else "spawn"
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=start_method)


_FORKED_BACKWARD_REFUSED = False  # once refused, always: the threads, once started, stay


def _forked_children_can_backward() -> bool:
    """Whether a child forked now can run autograd's backward (probed with one tiny backward in a child)."""
    global _FORKED_BACKWARD_REFUSED
    if _FORKED_BACKWARD_REFUSED:
        return False
    pid = os.fork()
    if pid == 0:  # the child: one tiny backward, then out without any of the parent's exit handlers
        code = 1
        try:
            import torch

            torch.ones(1, requires_grad=True).sum().backward()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    _FORKED_BACKWARD_REFUSED = os.waitstatus_to_exitcode(status) != 0
    return not _FORKED_BACKWARD_REFUSED


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


PRELOAD_SERVER = os.path.join(REPO, "tests", "preloaded.py")
# Variables a run may set differently from the preloaded server's start without the difference mattering: none of
# the preloaded libraries reads them when imported (each is read when a run uses it). A run whose environment
# differs in any other variable (TRITON_INTERPRET, HF_*, PYTHONPATH, OMP_NUM_THREADS, one a library set in the test
# process since, ...) gets a server started with its environment.
RUN_VARIABLES = ("BIGCLIP_", "WANDB_", "AWS_", "DS_ACCELERATOR", "PYTEST_CURRENT_TEST", "MASTER_ADDR", "MASTER_PORT",
                 "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_",
                 "TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "SLURM_")  # fmt: skip
TERMINATE_GRACE_S = 30  # torchrun's: a failed rank's peers get SIGTERM, then SIGKILL this long after


class PreloadedServer:
    """This test process's client of tests/preloaded.py: runs forked from a process that imported torch, timm,
    wandb and open_clip once (~5 s of CPU saved per process started)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        ours, theirs = socket.socketpair()
        self.log = tempfile.NamedTemporaryFile(prefix="bigclip-preload-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, PRELOAD_SERVER, str(theirs.fileno())], env=self.env,
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=self.log)  # fmt: skip
        theirs.close()
        self.sock = ours
        self.request_lock = threading.Lock()
        self.changed = threading.Condition()
        self.started: list[int] = []
        self.ended: dict[int, int] = {}
        self.alive = True
        self.reader = threading.Thread(target=self._read_replies, daemon=True, name="preloaded-replies")
        self.reader.start()

    def _read_replies(self) -> None:
        for line in self.sock.makefile("r"):
            message = json.loads(line)
            with self.changed:
                if "status" in message:
                    self.ended[message["pid"]] = message["status"]
                else:  # a pid the system gave again: the earlier run's end is no longer this pid's
                    self.ended.pop(message["pid"], None)
                    self.started.append(message["pid"])
                self.changed.notify_all()
        with self.changed:
            self.alive = False
            self.changed.notify_all()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # both ends read the end: the server stops its runs and exits
        self.proc.wait(timeout=60)
        self.reader.join()
        self.sock.close()
        os.remove(self.log.name)

    def serves(self, env: dict[str, str]) -> bool:
        differing = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return self.alive and all(k.startswith(RUN_VARIABLES) for k in differing)

    def start(self, script: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> int:
        request = {"script": script, "argv": list(argv), "env": env, "cwd": cwd, "stdout": out, "stderr": err}
        with self.request_lock:
            self.sock.sendall((json.dumps(request) + "\n").encode())
            with self.changed:  # the first request waits for the server's imports
                if not self.changed.wait_for(lambda: self.started or not self.alive, timeout=600) or not self.alive:
                    raise RuntimeError(f"the preloaded server did not start a run; its log: {self.log.name}")
                return self.started.pop(0)

    def live(self, pids: list[int]) -> list[int]:
        return [p for p in pids if p not in self.ended]

    def wait_until(self, done, deadline: float) -> None:
        """Until done() (read under the lock) or the monotonic `deadline`; raises if the server is gone."""
        with self.changed:
            self.changed.wait_for(lambda: done() or not self.alive, timeout=max(0.0, deadline - time.monotonic()))
            if not self.alive:
                raise RuntimeError(f"the preloaded server ended; its log: {self.log.name}")


_server: PreloadedServer | None = None


def preloaded_server(env: dict[str, str]) -> PreloadedServer:
    """The server for runs in `env`: this test process's current one, or a new one started in `env` where the two
    differ in a variable a preloaded library may read when imported (one server at a time: each holds ~0.8 GB)."""
    global _server
    if _server is None or not _server.serves(env):
        if _server is not None:
            _server.close()
        _server = PreloadedServer(env)
    return _server


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def torchrun_rank_env(env: dict[str, str], rank: int, nproc: int, port: int, error_file: str) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `nproc` on one node (torch's local_elastic_agent and its static
    rendezvous), but for one: without an agent, rank 0 hosts the store (TORCHELASTIC_USE_AGENT_STORE False).
    tests/test_preloaded.py compares them with a real torchrun's."""
    return {**env, "LOCAL_RANK": str(rank), "RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            "TORCHELASTIC_ERROR_FILE": error_file, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}  # fmt: skip


class PreloadedJob:
    """What the tests use of subprocess.Popen (args, poll, wait, communicate, send_signal, kill, returncode; pid for
    one process), for `python script argv` (nproc None) or `torchrun --nproc_per_node nproc script argv` forked from
    the preloaded server. A job of ranks ends as torchrun's does: a rank that fails stops its peers (SIGTERM, SIGKILL
    TERMINATE_GRACE_S later) and the status is 1; its output is the ranks' one after the other. Each process is a
    session of its own (as torchrun starts each rank): signal_groups reaches a rank's loader workers too."""

    def __init__(self, script: str, argv: list[str], env: dict[str, str], cwd: str | None = None,
                 nproc: int | None = None, merge_stderr: bool = False) -> None:  # fmt: skip
        self.server, cwd = preloaded_server(env), os.path.abspath(cwd or os.getcwd())
        self.nproc, self.merge_stderr = nproc, merge_stderr
        self.args = ["preloaded", *([] if nproc is None else [f"--nproc_per_node={nproc}"]), script, *argv]
        self.folder = tempfile.mkdtemp(prefix="bigclip-run-")
        port = free_port()
        envs = (
            [env]
            if nproc is None
            else [torchrun_rank_env(env, r, nproc, port, os.path.join(self.folder, f"{r}.error.json"))
                  for r in range(nproc)]
        )  # fmt: skip
        self.files = [(os.path.join(self.folder, f"{r}.out"), os.path.join(self.folder, f"{r}.err"))
                      for r in range(len(envs))]  # fmt: skip
        if merge_stderr:  # stderr=subprocess.STDOUT: one file, written through one descriptor
            self.files = [(out, out) for out, _ in self.files]
        self.pids = [self.server.start(script, argv, e, cwd, out, err) for e, (out, err) in zip(envs, self.files)]
        self.pid = self.pids[0] if nproc is None else None
        self.returncode: int | None = None
        self.outputs: tuple[str, str | None] | None = None
        self.stopping_at: float | None = None  # when a failed rank's peers were sent SIGTERM

    def _failed(self) -> bool:
        return any(self.server.ended.get(p) for p in self.pids)

    def _ended_or_failed_anew(self) -> bool:
        return not self.server.live(self.pids) or (self._failed() and self.stopping_at is None)

    def _advance(self) -> None:
        """torchrun's rule for a failed rank's peers, then the job's status once every process has ended."""
        live = self.server.live(self.pids)
        if live and self.nproc is not None and self._failed():
            if self.stopping_at is None:
                self.stopping_at = time.monotonic()
                for p in live:
                    _signal_group(p, signal.SIGTERM)
            elif time.monotonic() > self.stopping_at + TERMINATE_GRACE_S:
                for p in live:
                    _signal_group(p, signal.SIGKILL)
        if not live and self.returncode is None:
            codes = [self.server.ended[p] for p in self.pids]
            self.returncode = codes[0] if self.nproc is None else int(any(codes))
            self._read_outputs()

    def _read_outputs(self) -> None:
        outs = []
        for out, err in self.files:
            with open(out, errors="replace") as o:
                text = o.read()
            if err == out:
                outs.append((text, ""))
                continue
            with open(err, errors="replace") as e:
                outs.append((text, e.read()))
        shutil.rmtree(self.folder)
        stdout, stderr = "".join(o for o, _ in outs), "".join(e for _, e in outs)
        self.outputs = (stdout, None if self.merge_stderr else stderr)

    def poll(self) -> int | None:
        self._advance()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 10**9)
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            wake = deadline if self.stopping_at is None else min(deadline, self.stopping_at + TERMINATE_GRACE_S)
            self.server.wait_until(self._ended_or_failed_anew, max(time.monotonic() + 0.01, wake))
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        self.wait(timeout)
        return self.outputs

    def send_signal(self, sig: int) -> None:
        """To each process (Popen's: the process, not its group); one that has ended is left alone."""
        for p in self.server.live(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def signal_groups(self, sig: int) -> None:
        """To every process's session: the ranks and the loader workers they started."""
        for p in self.server.live(self.pids):
            _signal_group(p, sig)


def fresh_cmd(script: str, argv: list[str], nproc: int | None = None) -> list[str]:
    """`python script argv` (nproc None) or torchrun's nproc ranks of it, as a fresh process; `script` a path or
    "-m module" (python's -m, torchrun's too). "--" keeps torchrun's own parser off the script's flags: it would
    reject bigclip's --logs as an ambiguous abbreviation of its --logs-specs."""
    target = script.split(" ", 1) if script.startswith("-m ") else [script]
    return [sys.executable, *target, *argv] if nproc is None else torchrun_cmd(nproc, *target, "--", *argv)


def start_job(script: str, argv: list[str], nproc: int | None = None, cwd: str | None = None,
              merge_stderr: bool = False, **env: str):  # fmt: skip
    """A running `python script argv` (nproc None) or torchrun job of nproc ranks, with Popen's surface
    (PreloadedJob): forked from the preloaded server, or a fresh `python` / `torchrun` in its own session where
    BIGCLIP_TEST_PRELOAD is 0. For tests that act on a job while it runs (signals, kills, held stores)."""
    full_env = subprocess_env(**env)
    if os.environ.get("BIGCLIP_TEST_PRELOAD", "1") != "0":
        return PreloadedJob(script, argv, full_env, cwd=cwd, nproc=nproc, merge_stderr=merge_stderr)
    return subprocess.Popen(fresh_cmd(script, argv, nproc), cwd=cwd, env=full_env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                            start_new_session=True)  # fmt: skip


def preloaded_run(script: str, argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None,
                  nproc: int | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """`python script argv` (nproc None) or `torchrun --nproc_per_node nproc script argv`, forked from the preloaded
    server, with subprocess.run's result (PreloadedJob's status and output); a run still going at `timeout` prints
    its stacks (SIGUSR2, launch/train.py) and raises RunTimedOut like run_training."""
    job = PreloadedJob(script, argv, env, cwd=cwd, nproc=nproc)
    try:
        stdout, stderr = job.communicate(timeout)
    except subprocess.TimeoutExpired:
        server = job.server
        for p in server.live(job.pids):
            if os.path.basename(script) == "train.py":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGUSR2)  # each rank prints its threads' stacks (one at a time: read apart)
                server.wait_until(lambda p=p: p in server.ended, time.monotonic() + 2)
        job.signal_groups(signal.SIGKILL)
        _, stderr = job.communicate(60)
        raise RunTimedOut(f"{' '.join(job.args)[:400]} timed out after {timeout} s; its stderr ends:\n"
                          f"{stderr[-15000:]}") from None  # fmt: skip
    return subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)


def launch(script: str, args: list[str], timeout: float, nproc: int | None = None, cwd: str | None = None,
           **env: str) -> subprocess.CompletedProcess:  # fmt: skip
    """Run `script` (a path, or "-m module") as one process or as torchrun's nproc ranks: forked from a preloaded
    server, or as a fresh `python` or `torchrun` where BIGCLIP_TEST_PRELOAD is 0."""
    full_env = subprocess_env(**env)
    if os.environ.get("BIGCLIP_TEST_PRELOAD", "1") != "0":
        return preloaded_run(script, args, full_env, timeout, cwd=cwd, nproc=nproc)
    return run_training(fresh_cmd(script, args, nproc), timeout, cwd=cwd, env=full_env)


def torchrun(nproc: int, args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return launch(TRAIN_SCRIPT, args, timeout, nproc=nproc, **env)


def python_train(args: list[str], timeout: int = 300, cwd: str | None = None, **env: str):
    return launch(TRAIN_SCRIPT, args, timeout, cwd=cwd, **env)


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
