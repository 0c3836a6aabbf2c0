"""Dense decoder ops (linear, RMSNorm, SwiGLU, rotary): fused C++ kernels for fp32 activations
on CPU (linear's weights packed in fp32, bf16 or fp16; bf16 ones multiplied with the CPU's bf16
dot products where it has them), the equivalent torch expressions on any other device or
dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.ops import cpu_extension


def _cpu_fp32(*tensors: Tensor) -> bool:
    return all(t.is_cpu and t.dtype == torch.float32 for t in tensors)


# Output features per panel of a packed weight: kLinearPanel in csrc/cpu/cpu_kernels.h.
LINEAR_PANEL = 32


# Weight dtypes the CPU linear kernel reads.
PACKED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pack_linear_weight(
    weight: Tensor,  # [out_features, in_features]
    dtype: torch.dtype | None = None,  # one of PACKED_DTYPES; None: weight's own
) -> Tensor:  # fp32 [ceil(out / 32), in, 32]; 16-bit [ceil(out / 32), ceil(in / 2), 32, 2]
    """W in panels of LINEAR_PANEL output features, each one contiguous run (zeros pad the
    last), rounded to ``dtype``: the layout linear() streams on CPU. 16-bit weights go in pairs
    of consecutive k, one pair per 32 bits, as the CPU's bf16 dot-product instruction takes
    them:

        fp32     panel p, row k:  W[32p][k]          W[32p+1][k]          ... W[32p+31][k]
        16-bit   panel p, row q:  W[32p][2q] W[32p][2q+1]  W[32p+1][2q] W[32p+1][2q+1]  ...
    """
    dtype = dtype or weight.dtype
    if dtype not in PACKED_DTYPES:
        raise ValueError(f"packed weights are float32, bfloat16 or float16, not {dtype}")
    out_features, in_features = weight.shape
    odd_k = in_features % 2 if dtype != torch.float32 else 0
    padded = F.pad(weight.to(dtype), (0, odd_k, 0, -out_features % LINEAR_PANEL))
    panels = padded.view(-1, LINEAR_PANEL, in_features + odd_k)  # [panels, 32, in]
    if dtype == torch.float32:
        return panels.transpose(1, 2).contiguous()
    pairs = panels.view(panels.shape[0], LINEAR_PANEL, -1, 2)  # [panels, 32, in / 2, 2]
    return pairs.transpose(1, 2).contiguous()


def is_packed(weight: Tensor) -> bool:
    return weight.dim() >= 3


def packed_columns(
    weight: Tensor,  # packed by pack_linear_weight
    columns: Tensor,  # [num_columns] int64, output features
    in_features: int,
) -> Tensor:  # [num_columns, in_features]
    """Rows of the unpacked W (an embedding's lookups in a tied, packed table)."""
    rows = weight[columns // LINEAR_PANEL, :, columns % LINEAR_PANEL]  # [n, in(/2)(, 2)]
    return rows.flatten(1)[:, :in_features]


def linear(
    x: Tensor,  # [num_tokens, in_features]
    weight: Tensor,  # [out_features, in_features], or packed by pack_linear_weight
    bias: Tensor | None = None,  # [out_features]
    out_features: int | None = None,  # needed with a packed weight
    bf16_dot: bool = True,
) -> Tensor:  # [num_tokens, out_features]
    """x W^T + b: a packed weight through the C++ kernel (CPU; x, b and the result fp32, W fp32,
    bf16 or fp16), a plain one through torch. The kernel multiplies in fp32, except bf16 weights
    with ``bf16_dot`` on a CPU with bf16 dot products: x is then rounded to bf16, as a bf16
    model's activations are, and the sums stay fp32."""
    if not is_packed(weight):
        return F.linear(x, weight, bias)
    if out_features is None:
        raise ValueError("a packed weight needs out_features")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return cpu_extension().linear(x, weight, bias, out_features, 0, bf16_dot)


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
