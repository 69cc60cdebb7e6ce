"""8-bit AdamW candidates side by side: torch's AdamW (fp32 moments), bigclip's --opt adamw8bit (torchao's
arithmetic in one packed update, bigclip/optim/packed_update.py), torchao's own AdamW8bit (its update compiled and
called once per tensor) and bitsandbytes' AdamW8bit, on the same model, data and steps.

    python bench/optim8bit.py                 # CPU: 4 ViT-B MLP blocks (768 -> 3072 -> 768), 19M parameters
    python bench/optim8bit.py --blocks 12 --device cuda

Per optimizer: optimizer state bytes (counted tensor by tensor, inside quantized tensors), bytes per parameter,
the first step's time (compiles included, inductor's on-disk cache empty: a fresh machine's first step), the number
of graphs compiled, the median optimizer-step time after --warmup steps, the
largest relative difference of the losses from fp32 AdamW's over --steps steps, and whether its step runs on
FSDP2's sharded parameters (two gloo processes on this machine, one step). bitsandbytes is optional: its row
says so when it is not installed.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

# A fresh machine's compiles: inductor's on-disk cache in a new folder (set before torch is imported)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="optim8bit-inductor-"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from ranks import free_port  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bigclip.engine.memory import tensor_bytes  # noqa: E402

HP = {"lr": 1e-3, "betas": (0.9, 0.98), "eps": 1e-6, "weight_decay": 0.1}


def make_optimizer(name: str, params):
    if name == "torch AdamW (fp32 moments)":
        return torch.optim.AdamW(params, **HP)
    if name == "bigclip --opt adamw8bit (packed)":
        from bigclip.optim.adamw8bit import AdamW8bit

        return AdamW8bit(params, **HP)
    if name == "torchao AdamW8bit (per tensor)":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, **HP)
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, **HP)


NAMES = (
    "torch AdamW (fp32 moments)",
    "bigclip --opt adamw8bit (packed)",
    "torchao AdamW8bit (per tensor)",
    "bitsandbytes AdamW8bit",
)


def model(blocks: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(768, 3072), nn.GELU(), nn.Linear(3072, 768)]
    return nn.Sequential(*layers).to(device)


def train(name: str, base: nn.Module, steps: int, warmup: int, device: str) -> dict:
    m = copy.deepcopy(base)
    opt = make_optimizer(name, m.parameters())
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 768, generator=g).to(device), torch.randn(256, 768, generator=g).to(device)
    losses, times = [], []
    for _ in range(steps):
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = sum(p.numel() for p in m.parameters())
    state = tensor_bytes(m, opt)["optimizer"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"losses": losses, "step_ms": 1e3 * statistics.median(times[warmup:]), "first_s": times[0], "graphs": graphs,
            "state": state, "params": params}  # fmt: skip


def _fsdp_worker(rank: int, name: str, port: int, result_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        m = nn.Sequential(nn.Linear(64, 257), nn.GELU(), nn.Linear(257, 64))  # 257 rows: uneven shards
        for layer in (m[0], m[2]):
            fully_shard(layer)
        fully_shard(m)
        opt = make_optimizer(name, m.parameters())
        m(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        verdict = "yes"
    except Exception as e:  # the answer is the error: which candidate cannot step sharded parameters
        verdict = f"no: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    with open(os.path.join(result_dir, f"{rank}.txt"), "w") as f:
        f.write(verdict)
    dist.destroy_process_group()


def fsdp2_verdict(name: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_fsdp_worker, args=(name, free_port(), d), nprocs=2)
        verdicts = {open(os.path.join(d, f"{r}.txt")).read() for r in range(2)}
    return "; ".join(sorted(verdicts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    base = model(args.blocks, args.device)
    rows = {}
    for name in NAMES:
        try:
            rows[name] = train(name, base, args.steps, args.warmup, args.device)
            rows[name]["fsdp2"] = fsdp2_verdict(name)
        except ImportError as e:
            rows[name] = {"missing": str(e)}
    ref = rows[NAMES[0]]
    print(f"{args.blocks} blocks, {ref['params'] / 1e6:.1f}M parameters, {args.steps} steps, device {args.device}\n")
    print("| optimizer | state MB | bytes/param | vs AdamW | first step s | graphs | step ms | vs AdamW "
          "| max loss rel diff | FSDP2 |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, r in rows.items():
        if "missing" in r:
            print(f"| {name} | not installed ({r['missing']}) | | | | | | | | |")
            continue
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        print(
            f"| {name} | {r['state'] / 1e6:.1f} | {r['state'] / r['params']:.3f} | {r['state'] / ref['state']:.3f}x "
            f"| {r['first_s']:.1f} | {r['graphs']} | {r['step_ms']:.1f} | {r['step_ms'] / ref['step_ms']:.2f}x "
            f"| {diff:.1e} | {r['fsdp2']} |"
        )


if __name__ == "__main__":
    main()
