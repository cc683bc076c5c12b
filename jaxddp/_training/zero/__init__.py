"""The optimizer state sharded across the ranks (ZeRO stage 1): the optax transform, where
the parameters lie in its packed vectors and how their slices travel, and its refusals."""
