"""A server that imports the heavy libraries once, then forks each training process the tests start.

Why: a process the tests start (`python launch/train.py ...`, or one rank under torchrun) spends ~5 s of CPU importing
torch, timm with torchvision, DTensor's sympy, wandb and open_clip before ~1 s of work, and the suite starts ~160 of
them: about half of CI's CPU time. This server (one per test process, started on first use by helpers.py) imports
those libraries once; each run is a fork of it that takes its own environment, working directory, output files and
process group, then runs its script as `__main__` the way `python script args` does: an uncaught exception prints
its traceback and exits 1, SystemExit's code is the exit status, non-daemon threads are joined and atexit handlers
run. bigclip itself is not preloaded: each run imports it (~0.15 s), so what it reads from the environment at import
is the run's own. Nothing here runs before the fork that a fresh process would not also run (imports, and a
gc.freeze that each run's exit undoes; no thread, no process group, no RNG draw), and the server refuses to serve if
an import started a thread.

Protocol, one JSON line each way over a socket pair (its fd is argv[1]): a request {"script" (a path, or "-m module"),
"argv", "env", "cwd", "stdout", "stderr" (stdout's path for 2>&1)} is answered {"pid"} once forked; each run's end is
told {"pid", "status"} (the exit code as subprocess gives it: negative for a signal). The server exits when the socket
closes.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading

# What a training process imports before it works, bigclip aside (measured with -X importtime: torch 2.8 s of
# self time, timm 0.8, sympy 0.4, wandb 0.4, torchvision 0.3, open_clip 0.8). Not DeepSpeed (it picks its
# accelerator from DS_ACCELERATOR when imported, which tests set per run) nor torchao (it logs a warning when
# imported, which a run's stderr should show as a real run shows it). They bring triton, huggingface_hub and
# transformers along: the HF_* variables those read when imported are not RUN_VARIABLES (tests/helpers.py), so a
# run that sets one gets a server of its own.
PRELOAD = (
    "numpy",
    "PIL.Image",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.nn.parallel",
    "torchvision",
    "timm",
    "timm.data",
    "timm.layers",
    "timm.models",
    "timm.utils",
    "wandb",
    "open_clip",
    "fsspec",
    "safetensors.torch",
)


def _preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:  # a fork keeps only the forking thread: the others' state would be lost
        raise SystemExit(f"preloading started threads: {[t.name for t in threading.enumerate()]}")
    # What the gc module's documentation advises before forking without exec: the preloaded objects move to a
    # permanent generation, so no run's collections walk them again and copy their pages. A run's own objects are
    # collected as in any process; its exit unfreezes them all (below).
    gc.freeze()


def _become_the_run(request: dict, sock: socket.socket, wakeup: tuple[int, int]) -> str:
    """In the forked child: drop the server's plumbing and take on the run's environment, files and arguments."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(sock.detach())  # detach: the socket object must not close the fd number again when collected
    for fd in wakeup:
        os.close(fd)
    os.setsid()  # the run's own session, as torchrun gives each rank: a kill of its group reaches its workers
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                           (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):  # fmt: skip
        if fd == 2 and path == request["stdout"]:  # stderr into stdout (2>&1): one descriptor, one file offset
            os.dup2(1, 2)
            continue
        opened = os.open(path, mode, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    script = request["script"]
    if script.startswith("-m "):  # `python -m module`: the working directory first on the path, as python puts it
        sys.argv = ["-m", *request["argv"]]  # argv[0] becomes the module's file when it runs, as under python -m
        sys.path[0] = os.getcwd()
    else:
        sys.argv = [script, *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` puts the script's folder first
    # Registered first, so run last of the atexit handlers: the interpreter's exit then collects and finalizes every
    # object as a fresh process's exit does (objects left frozen would be reported by extension modules as leaked:
    # triton's nanobind prints "leaked 4 instances!" at the end of stderr).
    atexit.register(gc.unfreeze)
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator from the OS; a fork would share it
        sys.modules["numpy"].random.seed()
    return script


def _serve(sock: socket.socket) -> dict | None:
    """Fork a run per request and report its end; returns only in a forked child (its request), or None at the
    socket's close."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup fd
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    reader = sock.makefile("r")
    running: set[int] = set()

    def reply(message: dict) -> None:
        sock.sendall((json.dumps(message) + "\n").encode())

    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                line = reader.readline()
                if not line:  # the test process is gone: so are its runs
                    for pid in running:
                        os.killpg(pid, signal.SIGKILL)
                    return None
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    request["script"] = _become_the_run(request, sock, (wake_r, wake_w))
                    return request
                running.add(pid)
                reply({"pid": pid})
            else:
                while True:  # drain the wakeup bytes, then reap every run that ended
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                while running:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    running.discard(pid)
                    reply({"pid": pid, "status": os.waitstatus_to_exitcode(status)})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    request = _serve(sock)
    if request is None:
        return
    # The run, as `python script args`: whatever it raises ends this process as it would end that one.
    script = request["script"]
    if script.startswith("-m "):
        runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
