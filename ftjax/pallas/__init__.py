"""Pallas expert kernels, one module per kernel, each beside a plain jax.numpy reference."""
