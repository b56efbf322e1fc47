"""``ftjax calibrate``: measure B_P (host-to-GPU expert fill) and B_H (CPU expert kernel), alone and
concurrently, with their ceilings in the same run; write the machine profile the runtime loads.

The profile is JSON keyed by GPU and CPU model (``profile_path()``), so a profile measured on
another machine is never applied. Without a CUDA GPU only the CPU half is measured (B_P is null).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import sys
from pathlib import Path

from ftjax import _host
from ftjax.host import measure

log = logging.getLogger(__name__)
PROFILE_VERSION = 1
QWEN36 = measure.ExpertShape(hidden=2048, inter=512, top_k=8)


def machine_key() -> dict:
    gpu = None
    if _host.cuda_built() and _host.cuda_device_count() > 0:
        gpu = _host.cuda_device_name(0)
    return {"cpu": _host.cpu_brand(), "gpu": gpu}


def profile_path(key: dict | None = None, directory: str | os.PathLike | None = None) -> Path:
    key = key or machine_key()
    base = Path(directory or os.environ.get("FTJAX_CACHE") or Path.home() / ".cache" / "ftjax") / "profiles"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{key['gpu'] or 'nogpu'}__{key['cpu']}").strip("-").lower()
    return base / f"{slug}.json"


def load_profile(directory: str | os.PathLike | None = None) -> dict | None:
    """This machine's profile, or None when it was never calibrated (or belongs to another machine)."""
    path = profile_path(directory=directory)
    if not path.is_file():
        return None
    prof = json.loads(path.read_text())
    if prof.get("version") != PROFILE_VERSION or prof.get("machine") != machine_key():
        log.warning("ignoring %s: measured on another machine or profile version", path)
        return None
    return prof


def calibrate(window_gib: float = 1.0, fmt: str = "bf16", calls: int = 20, seconds_concurrent: float = 2.0) -> dict:
    shape = QWEN36
    window = int(window_gib * 2**30)
    stream = measure.stream_read_gbps(window)
    pool = measure.make_pool(shape, fmt, window)
    b_h = measure.cpu_kernel_gbps(pool, shape, tokens=1, calls=calls)
    backing = pool.page_backing()
    result = {
        "version": PROFILE_VERSION, "machine": machine_key(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "format": fmt, "expert_shape": {"hidden": shape.hidden, "inter": shape.inter, "top_k": shape.top_k},
        "workers": _host.worker_info(), "cpu_tier": _host.active_tier(),
        "stream_read_gbps": stream, "b_host_gbps": b_h["gbps"], "b_host_ms_per_call": b_h["ms"],
        "pool_huge_page_fraction": backing["huge"] / backing["resident"] if backing["resident"] else None,
        "transparent_hugepage": measure.thp_setting(),
        "memcpy_h2d_gbps": None, "b_pcie_gbps": None,
        "concurrent": None,
    }
    if _host.cuda_built() and _host.cuda_device_count() > 0:
        from ftjax.host import cuda

        pool.pin()
        result.update(cuda.calibrate_fill(pool, shape, fmt, seconds_concurrent=seconds_concurrent))
    return result


def table(prof: dict) -> str:
    def f(v):
        return "-" if v is None else f"{v:.1f}"

    rows = [("B_H: CPU expert kernel (alone)", prof["b_host_gbps"], prof["stream_read_gbps"], "STREAM read"),
            ("B_P: fill kernel (alone)", prof["b_pcie_gbps"], prof["memcpy_h2d_gbps"], "pinned cudaMemcpy H2D")]
    conc = prof.get("concurrent") or {}
    rows += [("B_H while filling", conc.get("b_host_gbps"), prof["b_host_gbps"], "B_H alone"),
             ("B_P while CPU computes", conc.get("b_pcie_gbps"), prof["b_pcie_gbps"], "B_P alone")]
    out = [f"machine: cpu={prof['machine']['cpu']!r} gpu={prof['machine']['gpu']!r}; tier {prof['cpu_tier']}, "
           f"{prof['workers']['n_threads']} threads, {prof['format']} experts H={prof['expert_shape']['hidden']} "
           f"I={prof['expert_shape']['inter']}",
           f"{'measure':34} {'GB/s':>8} {'ceiling':>8}  {'ratio':>6}  ceiling is"]
    for name, v, c, what in rows:
        ratio = "-" if v is None or not c else f"{v / c:.2f}"
        out.append(f"{name:34} {f(v):>8} {f(c):>8}  {ratio:>6}  {what}")
    huge = prof.get("pool_huge_page_fraction")
    if huge is not None:
        out.append(f"expert window on huge pages: {huge:.0%} (transparent_hugepage: "
                   f"{prof.get('transparent_hugepage') or 'unknown'})")
        if huge < 0.5:
            why = ("as root, `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled` before loading"
                   if prof.get("transparent_hugepage") == "never" else
                   "THP is on, so free 2 MiB pages were short (fragmented memory; see "
                   "/sys/kernel/mm/transparent_hugepage/defrag)")
            out.append("  the pool asks for huge pages with madvise; on 4 KiB pages every page of a streamed "
                       f"expert costs a TLB walk and stops the hardware prefetcher: {why}")
    return "\n".join(out)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--window-gib", type=float, default=1.0, help="expert window (> CPU caches), GiB")
    ap.add_argument("--format", default="bf16", choices=["bf16", "int4"], help="expert weight format")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--out", help="profile path (default: the per-machine cache path)")
    ap.add_argument("--no-save", action="store_true", help="print only")


def run(args: argparse.Namespace) -> None:
    if args.window_gib <= 0 or args.calls < 1:
        raise ValueError(f"--window-gib must be > 0 and --calls >= 1 (got {args.window_gib}, {args.calls})")
    prof = calibrate(args.window_gib, args.format, args.calls)
    print(table(prof))
    if not args.no_save:
        path = Path(args.out) if args.out else profile_path(prof["machine"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(prof, indent=1) + "\n")
        print(f"profile written to {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ftjax calibrate", description=__doc__.splitlines()[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
