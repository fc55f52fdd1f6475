"""Embeddings of samples: the sources a training step reads them from (cached, live, lazy, with loss
masks), the encoders that make them, the start-up readiness check of a cache and the cache manager of the API."""
