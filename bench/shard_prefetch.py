"""--shard-prefetch-mb on object storage: bigclip's WebDataset loader with and without shard read-ahead, side by side,
on a store with an object store's latency and per-connection bandwidth.

    python bench/shard_prefetch.py                                    # 50 ms / 100 MB/s and 100 ms / 25 MB/s
    python bench/shard_prefetch.py --stores 100:25 --workers 2 --repeats 3

The shards are data_throughput.py's photographs (long side --photos px, JPEG quality 90-95), uploaded to a moto S3
server on 127.0.0.1. Between the loader and the server sits a proxy that makes each store slow the way a remote
bucket is: every request waits LATENCY ms before it reaches the server (time to first byte), and each connection
delivers at most MBPS MB/s. Each measurement is a fresh child process running data_throughput.py's timed loop
(decode, augment, tokenize, batch; bigclip's --image-decode reduced transform; the first batch of each worker
excluded), every shard read once (--train-num-samples = all samples); the two settings alternate.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time

import data_throughput as dt


class SlowProxy:
    """Loopback TCP proxy: `latency` seconds before each client burst (a request) is relayed to the server, and
    the server's bytes paced to `rate` bytes/s per connection."""

    def __init__(self, upstream: tuple[str, int], latency: float, rate: float):
        self.upstream, self.latency, self.rate = upstream, latency, rate
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, self.latency, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, 0.0, self.rate), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, latency: float, rate: float | None) -> None:
        chunk = 64 << 10
        started, sent = time.monotonic(), 0
        try:
            while data := src.recv(chunk):
                if latency:
                    time.sleep(latency)
                if rate:
                    sent += len(data)
                    ahead = sent / rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
                    elif ahead < -0.05:  # idle in between (between requests): pace from now, not from the start
                        started, sent = time.monotonic() - len(data) / rate, len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--samples-per-shard", type=int, default=256)
    p.add_argument("--photos", type=int, nargs="+", default=[512])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--stores", nargs="+", default=["50:100", "100:25"], help="LATENCY_MS:MBPS per setting")
    p.add_argument("--prefetch-mb", type=int, default=32, help="the read-ahead compared with none")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    folder = tempfile.mkdtemp(prefix="bigclip-prefetch-bench-")
    started = time.perf_counter()
    try:
        paths = dt.write_photo_shards(folder, args.shards, args.samples_per_shard, args.photos, args.seed)
        mb = sum(os.path.getsize(p) for p in paths) / 2**20
        s3 = dt._S3(paths)
        num_samples = args.shards * args.samples_per_shard
        print(
            f"{args.shards} shards x {args.samples_per_shard} photographs ({mb:.0f} MB, long side "
            f"{'/'.join(map(str, args.photos))} px), batch {args.batch_size}, every shard once; "
            f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} at start\n"
        )
        header = (
            "| store latency / bandwidth per connection | workers | samples/s, no read-ahead "
            f"| samples/s, --shard-prefetch-mb {args.prefetch_mb} | ratio | first batches (s) none / read-ahead |"
        )
        print(header)
        print("|" + "---|" * (header.count("|") - 1), flush=True)
        for store in args.stores:
            latency_ms, mbps = (float(v) for v in store.split(":"))
            proxy = SlowProxy(("127.0.0.1", s3.server.port), latency_ms / 1000, mbps * 1e6)
            env = dict(s3.env(), AWS_ENDPOINT_URL=proxy.endpoint)
            for workers in args.workers:
                runs: dict[int, list[dict]] = {0: [], args.prefetch_mb: []}
                for _ in range(args.repeats):
                    for prefetch in runs:  # the two settings alternate
                        spec = {
                            "side": "bigclip",
                            "url": dt.brace(f"s3://{dt.BUCKET}/shards/", args.shards),
                            "resampled": False,
                            "workers": workers,
                            "batch_size": args.batch_size,
                            "num_samples": num_samples,
                            "seed": args.seed,
                            "decode": "reduced",
                            "prefetch_mb": prefetch,
                        }
                        runs[prefetch].append(dt.run_child(spec, env))
                errors = [r["error"] for rs in runs.values() for r in rs if "error" in r]
                if errors:
                    raise SystemExit(f"{store} {workers} workers: {errors[0]}")
                none, ahead = (dt._median_run(rs) for rs in runs.values())
                rate = [r["samples"] / r["seconds"] for r in (none, ahead)]
                print(
                    f"| {latency_ms:.0f} ms / {mbps:.0f} MB/s | {workers} | {rate[0]:.0f} | {rate[1]:.0f} | "
                    f"{rate[1] / rate[0]:.2f}x | {none['first_seconds']:.1f} / {ahead['first_seconds']:.1f} |",
                    flush=True,
                )
            proxy.close()
        print(f"\n- load average {os.getloadavg()[0]:.2f} at the end; {time.perf_counter() - started:.0f} s in all")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(NameError):
            s3.server.stop()


if __name__ == "__main__":
    main()
