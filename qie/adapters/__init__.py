"""Adapters: LoRA (and LoHa, LoKr) on a transformer, their files in every format qie reads and writes, LoRA
extraction, and the fused base (LoRAs merged into the base weights)."""
