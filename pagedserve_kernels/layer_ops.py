"""Dense decoder ops (linear, RMSNorm, SwiGLU, rotary): fused C++ kernels for fp32 activations
on CPU (linear's weights packed in fp32, bf16 or fp16), the equivalent torch expressions on any
other device or dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedserve_kernels.ops import cpu_extension


def _cpu_fp32(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


# Output features per panel of a packed weight: kLinearPanel in csrc/cpu/cpu_kernels.h.
LINEAR_PANEL = 32


# Weight dtypes the CPU linear kernel reads (widened to fp32 in registers).
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pack_linear_weight(
    weight: Tensor,  # [out_features, in_features]
    dtype: torch.dtype | None = None,  # one of PACKED_DTYPES; None: weight's own
) -> Tensor:  # [ceil(out / 32), in, 32]
    """W in panels of LINEAR_PANEL output features, each a contiguous [in_features, 32] run
    (zero rows pad the last): the layout linear() streams on CPU, rounded to ``dtype``."""
    dtype = dtype or weight.dtype
    if dtype not in PACKED_DTYPES:
        raise ValueError(f"packed weights are float32, bfloat16 or float16, not {dtype}")
    out_features, in_features = weight.shape
    padded = F.pad(weight.to(dtype), (0, 0, 0, -out_features % LINEAR_PANEL))
    return padded.view(-1, LINEAR_PANEL, in_features).transpose(1, 2).contiguous()


def is_packed(weight: Tensor) -> bool:
    return weight.dim() == 3


def linear(
    x: Tensor,  # [num_tokens, in_features]
    weight: Tensor,  # [out_features, in_features], or packed by pack_linear_weight
    bias: Tensor | None = None,  # [out_features]
    out_features: int | None = None,  # needed with a packed weight
) -> Tensor:  # [num_tokens, out_features]
    """x W^T + b: a packed weight through the C++ kernel (CPU; x, b and the result fp32, W fp32,
    bf16 or fp16, all arithmetic fp32), a plain one through torch."""
    if not is_packed(weight):
        return F.linear(x, weight, bias)
    if out_features is None:
        raise ValueError("a packed weight needs out_features")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return cpu_extension().linear(x, weight, bias, out_features)


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
