"""The sampler, its arithmetic and the loaders it feeds."""
