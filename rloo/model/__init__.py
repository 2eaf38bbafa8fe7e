"""The network side: building and loading models, LoRA, the output head and log-probabilities, micro-batches, data parallelism and checkpoints."""
