"""Suite-wide settings.

The tests compare fp32 numerics against references at 1e-4..1e-5; on GPUs JAX's default matmul
precision may use TF32, so ask for full fp32 everywhere (a no-op on the CPU)."""
import jax

jax.config.update("jax_default_matmul_precision", "highest")
