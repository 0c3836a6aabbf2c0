"""Model architectures written for the paged KV cache."""
