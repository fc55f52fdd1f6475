"""Training: the flow-matching step, LoRA, quantization, checkpoints, logging and the loop."""
