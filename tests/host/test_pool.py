"""Host pool: alignment, views, lifetime, the loader's allocator, page backing."""
import os

import numpy as np
import pytest

from ftjax import _host
from ftjax.host import HostPool
from ftjax.host.pool import smaps_backing


def test_banks_are_2mib_aligned_views():
    pool = HostPool(6, 64, 32, "bf16")
    assert pool.shape("gate_up") == (6, 64, 64) and pool.shape("down") == (6, 64, 32)
    for b in ("gate_up", "down"):
        view = pool.bank(b)
        assert view.ctypes.data % (2 << 20) == 0
        assert view.flags.c_contiguous and view.flags.writeable
        assert view.nbytes == 6 * pool.expert_bytes(b)
    assert pool.total_bytes == 6 * (64 * 64 + 64 * 32) * 2
    int4 = HostPool(2, 64, 32, "int4")
    assert int4.expert_bytes("gate_up") == 64 * 64 // 2 + 64 * 2 * 2
    with pytest.raises(ValueError, match="typed view"):
        int4.bank("gate_up")


def test_views_outlive_close_and_ids_are_unregistered():
    pool = HostPool(2, 32, 32, "f32")
    view = pool.bank("down")
    view[...] = 1.5
    pid = pool.id
    pool.close()
    assert view.sum() == 1.5 * view.size  # memory kept alive by the view
    x = np.ones((1, 32), np.float32)
    one = np.zeros(1, np.int32)
    # the handle still computes; only the id is gone from the registry used by FFI calls
    _host.run_experts(pool._h, x, one, one, np.ones(1, np.float32), 1)
    assert pool._h.closed and pid > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="format"):
        HostPool(2, 32, 32, "fp8")
    with pytest.raises(ValueError, match="divisible by 32"):
        HostPool(2, 48, 40, "int4")
    with pytest.raises(ValueError, match=">= 1"):
        _host.HostPool(0, 32, 32, "bf16")
    pool = HostPool(2, 32, 32, "bf16")
    with pytest.raises(KeyError, match="valid: gate_up, down"):
        pool.raw("up")
    alloc = pool.allocator()
    with pytest.raises(ValueError, match="pool holds"):
        alloc("down", (2, 32, 16), np.float32)


@pytest.mark.skipif(_host.cuda_built(), reason="CUDA build: pinning is covered by the GPU tests")
def test_pin_without_cuda_raises():
    with pytest.raises(RuntimeError, match="without CUDA"):
        HostPool(1, 32, 32).pin()
    assert HostPool(1, 32, 32).pin_if_cuda() is False


def test_smaps_backing_scales_each_mapping_by_its_overlap(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "00400000-00600000 r--p 00000000 08:01 12 /usr/bin/x\n"
        "Rss:                2048 kB\nAnonHugePages:         0 kB\n"
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0 \n"
        "Size:               4096 kB\nRss:                4096 kB\nAnonHugePages:      2048 kB\n"
        "VmFlags: rd wr mr mw me ac hg\n")
    lo = 0x7f0000000000
    # the first half of the anonymous mapping: half its resident and huge bytes; the binary not at all
    assert smaps_backing([(lo, lo + (2 << 20))], str(smaps)) == {"resident": 2 << 20, "huge": 1 << 20}
    assert smaps_backing([(0, 1)], str(smaps)) == {"resident": 0, "huge": 0}
    assert smaps_backing([(lo, lo + 1)], str(tmp_path / "missing")) == {"resident": 0, "huge": 0}


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc/self/smaps")
def test_page_backing_counts_the_touched_banks():
    pool = HostPool(2, 1024, 512, "bf16")  # banks of 4 and 2 MiB: whole 2 MiB-aligned mappings
    pool.raw("gate_up")[...] = 1
    pool.raw("down")[...] = 2
    got = pool.page_backing()
    # (a mapping the kernel merged with a neighbour is counted by its share, hence not ==)
    assert 0.5 * pool.total_bytes <= got["resident"] <= 1.5 * pool.total_bytes
    assert 0 <= got["huge"] <= got["resident"]  # huge pages: the OS's THP setting decides


def test_calibration_table_reports_the_page_backing():
    from ftjax.host import calibrate, measure

    assert measure.thp_setting() in ("always", "madvise", "never", None)
    prof = {"machine": {"cpu": "c", "gpu": None}, "cpu_tier": "avx512bf16", "workers": {"n_threads": 3},
            "format": "bf16", "expert_shape": {"hidden": 2048, "inter": 512}, "b_host_gbps": 80.0,
            "stream_read_gbps": 100.0, "b_pcie_gbps": None, "memcpy_h2d_gbps": None, "concurrent": None}
    assert "huge pages" not in calibrate.table(prof)  # a profile written before the field
    text = calibrate.table({**prof, "pool_huge_page_fraction": 0.25, "transparent_hugepage": "never"})
    assert "B_H: CPU expert kernel (alone)" in text and "0.80" in text
    assert "expert window on huge pages: 25% (transparent_hugepage: never)" in text
    assert "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in text  # the remedy, below 50%
    short = calibrate.table({**prof, "pool_huge_page_fraction": 0.1, "transparent_hugepage": "madvise"})
    assert "free 2 MiB pages were short" in short and "echo madvise" not in short  # THP on, pages short
    full = calibrate.table({**prof, "pool_huge_page_fraction": 1.0, "transparent_hugepage": "madvise"})
    assert "expert window on huge pages: 100%" in full and "echo madvise" not in full


def test_cpu_kernel_variants_routings():
    """bench/host_runtime.py's CPU cases: each routing reads the experts it says (bytes per call = distinct experts x
    expert bytes): the window (top-8 of 16), shared (the same 8), trace (one synthetic-trace step: 8 tokens x top-8 of
    256 experts over ~20-45 distinct ones); a bad routing name raises."""
    from ftjax.experts.traces import synthetic_trace
    from ftjax.host import measure

    shape = measure.ExpertShape(64, 32)
    pool = measure.make_pool(shape, "bf16", 400 * shape.expert_bytes("bf16"))
    per_expert = pool.expert_bytes("gate_up") + pool.expert_bytes("down")
    try:
        for routing, lo, hi in (("window", 9, 16), ("shared", 8, 8), ("trace", 20, 45)):
            r = measure.cpu_kernel_variants(pool, shape, 8, {"": None}, calls=3, routing=routing)[""]
            assert lo * per_expert <= r["bytes_per_call"] <= hi * per_expert, routing
        steps = synthetic_trace(5, 1, 256, 8, batch=8, seed=0).ids[2:, 0]
        want = np.median([len(np.unique(s)) for s in steps]) * per_expert
        r = measure.cpu_kernel_variants(pool, shape, 8, {"": None}, calls=3, routing="trace")[""]
        assert r["bytes_per_call"] == want
        with pytest.raises(ValueError, match="window, shared or trace"):
            measure.cpu_kernel_variants(pool, shape, 8, {"": None}, calls=1, routing="uniform")
    finally:
        pool.close()


def test_stream_read_by_the_worker_pool_or_a_pool_of_its_own():
    from ftjax.host import measure

    # the kernels' ceiling (the worker pool) and the all-thread read (a pool of its own, every logical CPU)
    assert measure.host_threads() >= 1
    for threads in (None, 1, measure.host_threads()):
        assert measure.stream_read_gbps(8 << 20, reps=1, threads=threads) > 0
    for bad in (0, -1, 1025):
        with pytest.raises(ValueError, match="threads"):
            measure.stream_read_gbps(1 << 20, reps=1, threads=bad)
    with pytest.raises(ValueError, match="reps"):
        _host.stream_read_seconds(np.zeros(64, np.uint8), 0, 0)
