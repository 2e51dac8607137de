"""Model architectures the engine runs (their forward passes over the paged KV cache)."""
