"""The GPU fill from a pool whose down bank is stored transposed (HostPool down_layout "ih": the fill kernel
transposes each expert's down [I, H] into the slot's [H, I]) against the same fill from an "hi" pool (straight
copies) and the pinned cudaMemcpy ceiling, in one run: Qwen3.6 experts (bf16, H 2048, I 512), synthetic values,
scattered ids, whole experts (expert_fill's kernel alone, outside XLA).

    python bench/fill_layout.py [--gib 4] [--rows 1 2 8 64] [--reps 20] [--rounds 5]

The layouts and row counts run round robin (--rounds), each case's best round is printed. Prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftjax.host import cuda, measure  # noqa: E402
from ftjax.host.calibrate import QWEN36  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="each pool's size")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 8, 64], help="experts per fill call")
    ap.add_argument("--reps", type=int, default=20, help="fills per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "fill_layout.json"))
    args = ap.parse_args(argv)
    if not cuda.available():
        print("fill_layout: needs a CUDA build, a GPU and JAX's GPU backend", file=sys.stderr)
        return 2
    pools = {d: measure.make_pool(QWEN36, "bf16", int(args.gib * 2**30), down_layout=d) for d in ("hi", "ih")}
    for p in pools.values():
        p.pin()
    n = min(p.n_experts for p in pools.values())
    bad = [r for r in args.rows if not 1 <= r <= n]
    if bad:
        ap.error(f"--rows must lie in [1, {n}] (the pools' experts): {bad}")
    best = {(d, r): 0.0 for d in pools for r in args.rows}
    ceiling = 0.0
    for k in range(args.rounds):
        ceiling = max(ceiling, cuda.memcpy_h2d_gbps(256 << 20, reps=args.reps))
        for r in args.rows:
            for d, p in pools.items():
                best[(d, r)] = max(best[(d, r)], cuda.fill_gbps(p, r, reps=args.reps, seed=k))
    print(f"Qwen3.6 bf16 experts ({pools['hi'].expert_bytes('gate_up') + pools['hi'].expert_bytes('down')} B), "
          f"{n} per pool; pinned cudaMemcpy ceiling {ceiling:.1f} GB/s (256 MiB, best of {args.rounds})")
    print(f"{'experts':>7} {'hi GB/s':>8} {'/ceiling':>8} {'ih GB/s':>8} {'/ceiling':>8} {'ih/hi':>6}")
    rows = []
    for r in args.rows:
        a, b = best[("hi", r)], best[("ih", r)]
        rows.append({"experts": r, "hi_gbps": a, "ih_gbps": b, "ceiling_gbps": ceiling})
        print(f"{r:7d} {a:8.1f} {a / ceiling:8.2f} {b:8.1f} {b / ceiling:8.2f} {b / a:6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ceiling_gbps": ceiling, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
