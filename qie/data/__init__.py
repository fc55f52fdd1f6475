"""Samples (folder, manifest, Hugging Face), image preprocessing, keys, buckets and collate; builds no model."""
