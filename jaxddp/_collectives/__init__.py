"""Collectives on pytrees: the public API, argument checks, the wire, the host path,
the signature check and `synchronize`; `_jax/` is everything that touches JAX's tracing."""
