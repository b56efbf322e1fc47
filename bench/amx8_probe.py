"""TEMPORARY (session 29): where the amx8 path's time goes on one core. One cache-resident int4 expert matrix
(Qwen3.6 gate/up [1024, 2048] and down [2048, 512]) times 1 / 8 bf16 vectors through `_host.dot_rows` on one thread,
the amx8 path whole and with parts left out (probe bits: 1 no expansion, 2 no tile products, 4 no C tiles / scaling, 8 / 16 three / four staging buffers;
results wrong then, times only), against the q15 loop; round robin, medians."""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "host"))
from kernel_helpers import BF16, make_pool  # noqa: E402

from ftjax import _host  # noqa: E402
from ftjax.host import set_kernel_knobs, set_tier  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=60)
args = ap.parse_args()
try:
    set_tier("amx")
except ValueError:  # (no AMX here: the tile model, a smoke run)
    _host.set_amx8_emulate(True)
set_kernel_knobs(int4_vnni_tokens=8)
rng = np.random.default_rng(0)
pool, _ = make_pool(rng, "int4", 1, 2048, 512)
variants = [("q15", None), ("amx8", 0), ("amx8 -expand", 1), ("amx8 -tdp", 2), ("amx8 -C", 4),
            ("amx8 -expand-C", 5), ("amx8 -all", 7), ("amx8 ring3", 8), ("amx8 ring4", 16)]
print(f"{'bank':8s} {'tok':>3s} " + " ".join(f"{n:>14s}" for n, _ in variants) + "   (us per call, medians)")
for bank, K in (("gate_up", 2048), ("down", 512)):
    rows = 1024 if bank == "gate_up" else 2048
    for n in (1, 8):
        x = rng.standard_normal((n, K)).astype(BF16).view(np.uint16)
        times = {name: [] for name, _ in variants}
        for _ in range(args.reps):
            for name, probe in variants:
                if probe is not None:
                    _host._amx8_probe(probe)
                t0 = time.perf_counter()
                _host.dot_rows(pool._h, bank, 0, x, x_bf16=True, amx8=probe is not None)
                times[name].append(time.perf_counter() - t0)
        _host._amx8_probe(0)
        med = {k: 1e6 * float(np.median(v[5:])) for k, v in times.items()}
        gbs = rows * K / 2 / (med["q15"] * 1e3)
        print(f"{bank:8s} {n:3d} " + " ".join(f"{med[name]:14.1f}" for name, _ in variants) +
              f"   (q15 {gbs:.1f} GB/s; {rows * K / 512} group-units)")
