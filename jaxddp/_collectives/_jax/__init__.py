"""Everything that touches JAX's tracing and lowering: the compat module, the lowering,
the primitives and their chained / ordered / bridge forms, the restaging."""
