"""ftjax: FreeToken-style MoE inference with host-resident experts, on JAX."""
__version__ = "0.1.0"

# Load jax (and its ml_dtypes) before the native ``ftjax._host`` module. On the GPU machine, loading
# ``_host`` first made ml_dtypes crash inside libstdc++; the cause (our module exported the symbols of
# a statically linked libstdc++) is fixed by --exclude-libs in CMakeLists.txt, but this order was not
# yet re-checked there without it, so it stays.
import jax as _jax  # noqa: E402,F401

