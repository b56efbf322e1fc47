"""ftjax: FreeToken-style MoE inference with host-resident experts, on JAX."""
__version__ = "0.1.0"
