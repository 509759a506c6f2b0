"""Everything that does not change between steps: config, weights, layers, the reference
model, the block hash, workloads and the step registry."""
