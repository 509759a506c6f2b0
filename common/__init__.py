"""Everything that does not change between steps: config, weights, layers, the reference
model, the block hash, workloads and the step registry; and, for real checkpoints, the loader
(checkpoint.py), text in and out (text.py) and Hugging Face's model as an oracle (hf.py)."""
