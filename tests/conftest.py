"""Suite-wide settings.

The tests compare fp32 numerics against references at 1e-4..1e-5; on GPUs JAX's default matmul
precision may use TF32, so ask for full fp32 everywhere (a no-op on the CPU). Fixtures
``mgpu_interpret`` / ``mgpu`` skip tests where this jax cannot interpret / lower Mosaic GPU kernels."""
import functools
import os

import ftjax  # noqa: F401  (first: it sets XLA_FLAGS before any JAX backend starts, as for users)
import jax
import jax.numpy as jnp
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

# $FTJAX_TEST_JAX_CACHE (the Makefile sets it): JAX's persistent compilation cache for the suite, every compilation
# kept (the tests compile the same tiny models' steps again and again, across tests and across pytest-xdist's
# processes). Entries are keyed by the program, the compile options and the jax / XLA version. No size cap: with
# one (jax_compilation_cache_max_size) jax's cache locks a file and may scan the directory on every write, and the
# suite (~6,500 entries, ~50 MB a run) took 21 min with a 2 GiB cap against 14.5 without (session 31); `make clean`
# empties it.
if os.environ.get("FTJAX_TEST_JAX_CACHE"):
    jax.config.update("jax_compilation_cache_dir", os.environ["FTJAX_TEST_JAX_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # the same for the processes the tests start (the CLI, `ftjax serve`, `ftjax batch`): jax reads its options'
    # defaults from these variables
    os.environ.update(JAX_COMPILATION_CACHE_DIR=os.environ["FTJAX_TEST_JAX_CACHE"],
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")

# $FTJAX_TEST_FAST_COMPILE=1 (`make test` sets it): jax's jax_disable_most_optimizations for the suite and the
# processes it starts: XLA's LLVM back end at -O0 without its expensive passes (the HLO passes, fusion and buffer
# aliasing included, are unchanged). The suite's time is mostly compiling tiny models' steps: two compile-bound
# tests took 24% less CPU time with it (session 32). `make test-jax-min` runs with XLA's defaults.
if os.environ.get("FTJAX_TEST_FAST_COMPILE") == "1":
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"

# --one-case-per-test (`make test-jax-min`): of each parametrized test only its first case; the second jax's run
# checks that every test's code path works there, the pinned jax runs every case. The host runtime's tests keep
# every case: they are parametrized by ISA tier (the first may be one this CPU lacks) and take seconds.
ALL_CASES_UNDER = ("tests/host/",)


def pytest_addoption(parser):
    parser.addoption("--one-case-per-test", action="store_true",
                     help="run only the first case of each parametrized test (outside tests/host)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--one-case-per-test"):
        return

    def sampled(item):
        return hasattr(item, "callspec") and not str(item.path.relative_to(config.rootpath)).startswith(ALL_CASES_UNDER)

    first = {}  # per test function, its first case
    for item in filter(sampled, items):
        first.setdefault((item.path, item.cls, item.originalname), item)
    kept = set(first.values())
    dropped = [item for item in items if sampled(item) and item not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not sampled(item) or item in kept]


@functools.cache
def mgpu_unavailable():
    """None when jax.experimental.pallas.mosaic_gpu imports, else the reason."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"no jax.experimental.pallas.mosaic_gpu: {e!r}"
    return None


@functools.cache
def mgpu_interpret_unavailable():
    """None when Mosaic GPU interpret mode runs a tiny kernel here, else the reason."""
    if reason := mgpu_unavailable():
        return reason
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if not hasattr(plgpu, "InterpretGPUParams"):
        return f"jax {jax.__version__} has no plgpu.InterpretGPUParams (Mosaic GPU interpret mode)"
    try:
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        out = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                             interpret=plgpu.InterpretGPUParams())(jnp.ones((8, 128), jnp.float32))
        if not bool(jnp.all(out == 2.0)):
            return "Mosaic GPU interpret mode gave a wrong result on a probe kernel"
    except Exception as e:  # noqa: BLE001
        return f"Mosaic GPU interpret mode failed on a probe kernel: {e!r}"
    return None


@pytest.fixture
def mgpu_interpret():
    """Skip the test where this jax cannot run Mosaic GPU kernels in interpret mode."""
    if reason := mgpu_interpret_unavailable():
        pytest.skip(reason)


@pytest.fixture
def mgpu():
    """Skip the test where this jax has no Mosaic GPU (lowering for CUDA needs it)."""
    if reason := mgpu_unavailable():
        pytest.skip(reason)
