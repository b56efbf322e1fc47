"""ftjax: FreeToken-style MoE inference with host-resident experts, on JAX."""
__version__ = "0.1.0"

# Load jax (and its ml_dtypes) before the native ``ftjax._host`` module: on the GPU machine, loading
# ``_host`` first made ml_dtypes crash inside libstdc++ when jax was imported afterwards.
import jax as _jax  # noqa: E402,F401

