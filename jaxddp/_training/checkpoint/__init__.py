"""Checkpoints: the manager (every method collective), what a checkpoint holds and how it is
checked, and the background writes."""
