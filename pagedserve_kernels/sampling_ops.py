"""Greedy decoding's one pass over the logits: a C++ kernel for fp32 on CPU, torch elsewhere."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedserve_kernels.ops import cpu_extension


def greedy(logits: Tensor) -> tuple[Tensor, Tensor]:  # [num_rows, vocab_size]
    """Each row's argmax (the first of equal maxima) and ``log_softmax`` at it:
    ``([num_rows] long, [num_rows] float32)``."""
    fp32_rows = logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2
    if fp32_rows and logits.stride(1) == 1 and logits.shape[1] > 0:
        return cpu_extension().greedy(logits)
    token_ids = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return token_ids, logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
