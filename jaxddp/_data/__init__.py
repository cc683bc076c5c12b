"""The sampler, its arithmetic and the loaders it feeds; join, for streams of uneven length."""
