"""Do two CUDA streams run at the same time on this GPU? (GPU machine; torch and ftjax._host, no XLA)

bench/overlap.py found no overlap between an expert fill and independent work inside one jitted step,
whatever the stream arrangement or the fill's block count (session 9). This separates the GPU from XLA.
Per case, A and B are each timed alone, then started together on two streams (B from a second thread
where it is ours); each side's time beside the other over its time alone is its slowdown (1.0: it ran
as if alone, i.e. concurrently; ~(a + b) / a: serialized).
- sleep | sleep: two spin kernels of one block each (`torch.cuda._sleep`): concurrent kernels at all;
- gemv | sleep: a chain of [1, 2048] x [2048, 2048] bf16 GEMVs beside a spin kernel;
- gemv | h2d: the GEMV chain beside pinned host -> device copies of 6.3 MB (the copy engine);
- gemv | fill bN: the GEMV chain beside ftjax's expert fill kernel (zero-copy reads of the pinned pool,
  1 expert per launch, N thread blocks, 0 = occupy the GPU) on a stream of its own.
Also prints CUDA_DEVICE_MAX_CONNECTIONS and the device's concurrency properties.

    python bench/streams.py [--ms 30] [--blocks 0 16]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", type=float, default=30.0, help="length of each side alone, about")
    ap.add_argument("--blocks", type=int, nargs="+", default=[0, 16])
    args = ap.parse_args(argv)
    import torch

    from ftjax.host import _host, cuda, measure
    if not torch.cuda.is_available() or not _host.cuda_built():
        print("needs a GPU, torch with CUDA and the CUDA build of ftjax._host", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}; CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', '(unset)')}, "
          f"CUDA_MPS_PIPE_DIRECTORY={os.environ.get('CUDA_MPS_PIPE_DIRECTORY', '(unset)')}, "
          f"SMs {props.multi_processor_count}")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16) * 0.02
    x0 = torch.randn(1, 2048, device=dev, dtype=torch.bfloat16)

    def gemv_chain(n):
        x = x0
        for _ in range(n):
            x = torch.tanh(x @ w)
        return x

    def timed(fn, stream):
        with torch.cuda.stream(stream):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
        return a, b

    def elapsed(ev):
        return ev[0].elapsed_time(ev[1])

    # size each side to about --ms alone
    torch.cuda.synchronize()
    ev = timed(lambda: gemv_chain(200), s1)
    torch.cuda.synchronize()
    n_gemv = max(10, int(200 * args.ms / elapsed(ev)))
    cycles = int(1.4e9 * args.ms / 1e3)  # ~1.4-2 GHz: rescaled below
    ev = timed(lambda: torch.cuda._sleep(cycles), s1)
    torch.cuda.synchronize()
    cycles = int(cycles * args.ms / elapsed(ev))
    host = torch.randn(6_291_456 // 2, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty_like(host, device=dev)
    ev = timed(lambda: [dst.copy_(host, non_blocking=True) for _ in range(10)], s2)
    torch.cuda.synchronize()
    n_h2d = max(1, int(10 * args.ms / elapsed(ev)))
    sides = {"gemv": lambda: gemv_chain(n_gemv), "sleep": lambda: torch.cuda._sleep(cycles),
             "h2d": lambda: [dst.copy_(host, non_blocking=True) for _ in range(n_h2d)]}

    def pair(a_name, b_name):
        alone = []
        for name, st in ((a_name, s1), (b_name, s2)):
            ev = timed(sides[name], st)
            torch.cuda.synchronize()
            alone.append(elapsed(ev))
        ea, eb = timed(sides[a_name], s1), timed(sides[b_name], s2)
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        both = (elapsed(ea), elapsed(eb))
        return alone, both, time.perf_counter() - t0

    print(f"{'case':24} {'A alone':>8} {'B alone':>8} {'A beside':>9} {'B beside':>9} {'A slow':>7} {'B slow':>7}")

    def row(case, alone, both):
        print(f"{case:24} {alone[0]:8.2f} {alone[1]:8.2f} {both[0]:9.2f} {both[1]:9.2f} "
              f"{both[0] / alone[0]:7.2f} {both[1] / alone[1]:7.2f}")

    for a_name, b_name in (("sleep", "sleep"), ("gemv", "sleep"), ("gemv", "h2d")):
        pair(a_name, b_name)  # warm
        alone, both, _ = pair(a_name, b_name)
        row(f"{a_name} | {b_name}", alone, both)

    shape = measure.ExpertShape(2048, 512)
    pool = measure.make_pool(shape, "bf16", 64 * shape.expert_bytes("bf16"))
    pool.pin()
    for blocks in args.blocks:
        gbps = cuda.fill_gbps(pool, 1, reps=50, blocks=blocks)
        reps = max(1, int(args.ms * 1e-3 * gbps * 1e9 / shape.expert_bytes("bf16")))
        fill_alone = cuda.fill_gbps(pool, 1, reps=reps, blocks=blocks)
        ev = timed(sides["gemv"], s1)
        torch.cuda.synchronize()
        gemv_alone = elapsed(ev)
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("gbps", cuda.fill_gbps(pool, 1, reps=reps, blocks=blocks)))
        th.start()
        time.sleep(0.002)  # the thread's setup (allocations, one warm-up fill) before the chain starts
        ev = timed(sides["gemv"], s1)
        th.join()
        torch.cuda.synchronize()
        t_fill = reps * shape.expert_bytes("bf16") / (fill_alone * 1e9) * 1e3
        t_fill_both = reps * shape.expert_bytes("bf16") / (out["gbps"] * 1e9) * 1e3
        row(f"gemv | fill b{blocks} ({fill_alone:.0f} GB/s)", (gemv_alone, t_fill), (elapsed(ev), t_fill_both))
    print("slow: time beside the other / time alone (1.0 = concurrent; the fill's thread starts ~2 ms late, "
          "so its row is indicative only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
