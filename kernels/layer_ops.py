"""Dense decoder ops (linear, RMSNorm, SwiGLU, rotary): fused C++ kernels for fp32 on CPU,
the equivalent torch expressions on any other device or dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.ops import cpu_extension


def _cpu_fp32(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


# On CPUs with 16-float (AVX-512) registers, torch's sgemm (MKL) packs W and outruns the C++
# kernel from about this many rows on. bench/results/linear_cpu.json, two cores of a Xeon with
# AVX-512, sgemm's time over the kernel's for SmolLM2's layer / lm_head shapes: 32 rows
# 1.05 / 0.87, 48 rows 1.02 / 0.95 (a step's linears take about the same time either way),
# 64 rows 0.83 / 0.75.
WIDE_SGEMM = torch.backends.cpu.get_cpu_capability() == "AVX512"
SGEMM_MIN_ROWS = 48


def takes_kernel(rows: int) -> bool:
    """Whether linear() runs the C++ kernel on this many rows (fp32 on CPU), or torch's sgemm."""
    return not (WIDE_SGEMM and rows >= SGEMM_MIN_ROWS)


def linear(
    x: Tensor,  # [num_tokens, in_features]
    weight: Tensor,  # [out_features, in_features]
    bias: Tensor | None = None,  # [out_features]
) -> Tensor:  # [num_tokens, out_features]
    """x W^T + b. On CPU in fp32 a C++ kernel takes a decode step's few rows, streaming W once
    where BLAS sgemm would spend its time packing W; it takes every row count on 8-float (AVX2)
    machines, where it is as fast as sgemm on a prefill's thousands, and below SGEMM_MIN_ROWS on
    AVX-512 ones (`python bench/linear.py` prints both side by side)."""
    if (
        _cpu_fp32(x, weight)
        and x.dim() == 2
        and x.shape[1] % 8 == 0
        and x.stride(1) == 1
        and weight.is_contiguous()
        and takes_kernel(x.shape[0])
    ):
        return cpu_extension().linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm(
    x: Tensor,  # [num_tokens, hidden]
    weight: Tensor,  # [hidden]
    eps: float,
) -> Tensor:  # [num_tokens, hidden]
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32 as transformers does."""
    if _cpu_fp32(x, weight) and x.dim() == 2 and x.stride(1) == 1:
        return cpu_extension().rms_norm(x, weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def silu_and_mul(gate_up: Tensor) -> Tensor:  # [num_tokens, 2 * width] -> [num_tokens, width]
    """SwiGLU's silu(gate) * up over a fused gate/up projection (gate first)."""
    if _cpu_fp32(gate_up) and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return cpu_extension().silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: Tensor,  # [num_tokens] int64
    query: Tensor,  # [num_tokens, num_heads, head_dim]
    key: Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: Tensor,  # [max_positions, head_dim], both halves equal
    sin: Tensor,  # [max_positions, head_dim], both halves equal
) -> tuple[Tensor, Tensor]:
    """x * cos + rotate_half(x) * sin at each token's position. On CPU in fp32 query and key
    are rotated in place (they may be views into one q/k/v projection); otherwise new tensors."""
    if _cpu_fp32(query, key, cos, sin) and _heads_contiguous(query) and _heads_contiguous(key):
        cpu_extension().rotary_embedding(positions, query, key, cos, sin)
        return query, key
    cos = cos[positions].unsqueeze(1).to(query.dtype)
    sin = sin[positions].unsqueeze(1).to(query.dtype)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _heads_contiguous(x: Tensor) -> bool:  # [num_tokens, num_heads, head_dim]
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
