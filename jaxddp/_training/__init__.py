"""What a training step uses: gradients, the sharded optimizer, metrics, state, batch norm,
checkpoints."""
