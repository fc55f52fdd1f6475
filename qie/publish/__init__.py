"""Sharing a training run: a Hub-ready folder (the LoRA in every format qie writes, a model card, sample edits) and
its upload with huggingface_hub (`qie.publish.hub`). The export stage (`python -m qie.export`) and the demo call it
with plain arguments; nothing here reads a stage's config."""
