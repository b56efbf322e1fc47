"""ftjax: FreeToken-style MoE inference with host-resident experts, on JAX."""
__version__ = "0.1.0"

# Before jax starts a backend: XLA's command-buffer update mode (``ftjax.xla_flags``).
from ftjax.xla_flags import apply_scheduling_mode as _apply_scheduling_mode  # noqa: E402
from ftjax.xla_flags import apply_update_mode as _apply_update_mode  # noqa: E402

XLA_UPDATE_MODE = _apply_update_mode()
XLA_CB_SCHEDULING = _apply_scheduling_mode()

# Load jax (and its ml_dtypes) before the native ``ftjax._host`` module. On the GPU machine, loading
# ``_host`` first made ml_dtypes crash inside libstdc++; the cause (our module exported the symbols of
# a statically linked libstdc++) is fixed by --exclude-libs in CMakeLists.txt, but this order was not
# yet re-checked there without it, so it stays.
import jax as _jax  # noqa: E402,F401

