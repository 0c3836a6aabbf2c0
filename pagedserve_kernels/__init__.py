"""PagedAttention kernels: CUDA sources, typed wrappers with a CPU path, and a naive reference."""
