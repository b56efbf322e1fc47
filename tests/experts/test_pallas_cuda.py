"""The Pallas kernels in the CUDA offload path (GPU only): OffloadExperts(platform="cuda", kernel="pallas")
- the zero-copy fill, the CPU branch through the handshake, the Mosaic GPU decode GEMV over the cache slots
(with the unit split: each route's units [0, u)) and the prefill kernel - equals the jnp resident model
within bf16 tolerance. The CPU-platform twin (interpreted kernels) is test_pallas_backends.py."""
import pytest
from test_pallas_backends import E, L, _close, _model, _run  # tests/experts is on sys.path

from ftjax.experts.decode import OffloadExperts
from ftjax.experts.resident import ResidentExperts
from ftjax.host import HostPool, cuda

pytestmark = pytest.mark.gpu
if not cuda.available():
    pytest.skip("needs a CUDA build, a GPU and JAX's GPU backend", allow_module_level=True)


@pytest.mark.parametrize("unit_split", [False, True], ids=["whole", "units"])
def test_cuda_offload_pallas_equals_resident(unit_split):
    _, _, banks = _model()
    pool = HostPool.from_banks(banks)
    assert pool.pin_if_cuda()
    backend = OffloadExperts(pool, L, E, round(0.37 * L * E), "lru-split", platform="cuda", defer_fills=True,
                             unit_split=unit_split, kernel="pallas")
    got = _run(backend, backend.init_state(fill_fraction=0.4))
    backend.drain()
    _close(got, _run(ResidentExperts(E), ResidentExperts.init_state(banks)))
