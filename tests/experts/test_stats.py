"""ExpertStats: int64 host totals from wrapping int32 device counters, resets, non-blocking reads."""
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts.cache import STAT_KEYS
from ftjax.experts.stats import ExpertStats


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def _state(calls, hits, misses):
    s = {k: jnp.zeros((2,), jnp.int32) for k in STAT_KEYS}
    s["calls"] = jnp.asarray(np.asarray(calls, np.int64).astype(np.int32))
    s["hits"] = jnp.asarray(np.asarray(hits, np.int64).astype(np.int32))  # wraps like the device counter
    s["misses"] = jnp.asarray(np.asarray(misses, np.int64).astype(np.int32))
    s["hist"] = jnp.zeros((4,), jnp.int32)
    return {"stats": s}


def _push(st, state):
    version = st.version
    st.after_step(state)
    for _ in range(2000):  # the host copy lands asynchronously; read() never waits for it
        if st.read() is not None and st.version > version:
            break
        time.sleep(0.001)
    assert st.version == version + 1
    return st.read()


def test_totals_survive_int32_wrap_and_resets():
    st = ExpertStats()
    assert st.read() is None and st.misses() == (None, 0)
    top = 2**31 - 5
    got = _push(st, _state([1, 1], [top, 7], [3, 0]))
    assert list(got["hits"]) == [top, 7]
    got = _push(st, _state([2, 2], [top + 10, 9], [4, 1]))  # layer 0's counter wrapped negative
    assert list(got["hits"]) == [top + 10, 9] and got["hits"].dtype == np.int64
    assert st.misses()[0] == 5
    got = _push(st, _state([1, 1], [6, 1], [2, 0]))  # state re-initialised: counts restart and add on
    assert list(got["hits"]) == [top + 16, 10] and list(got["calls"]) == [3, 3]
    s = st.summary()
    assert s["hits"] == top + 26 and s["misses"] == 7 and 0 < s["miss_rate"] < 1e-8
