"""kernels.layer_ops (C++ on CPU in fp32) against the float64 reference.

Tolerances: fp32 accumulation over a few hundred terms, atol 1e-5 rtol 1e-4; silu and the rotary
tables add a couple of ulp.
"""

from __future__ import annotations

import pytest
import torch

from kernels import layer_ops, reference
from kernels.ops import cpu_extension

TOL = {"atol": 1e-5, "rtol": 1e-4}


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 3, 8, 17, 23, 24, 64, 160, 385])
@pytest.mark.parametrize(
    ("in_features", "out_features"), [(64, 9), (72, 13), (576, 960), (1536, 576)]
)
def test_linear_matches_reference(rows: int, in_features: int, out_features: int) -> None:
    # Below 24 rows the kernel runs 8-wide weight tiles, from 24 on 3 x 4 (3 x 8 with AVX-512)
    # register blocks over panels of at most 192 rows: 385 rows make three panels (129, 129,
    # 127), the last not a multiple of 3; out_features 9 and 13 leave partial tiles and blocks.
    # 72 features are not whole 16-float vectors: 8-float ones even on AVX-512 machines.
    # Weights scaled as initialised (outputs ~ N(0, 1)), so fp32 rounding stays within TOL.
    x = _randn(rows, in_features)
    weight = _randn(out_features, in_features, seed=1) * in_features**-0.5
    bias = _randn(out_features, seed=2)
    for b in (None, bias):
        expected = reference.linear(x, weight, b)
        # The kernel itself at every row count, and layer_ops.linear, which hands rows from
        # SGEMM_MIN_ROWS on to torch's sgemm on AVX-512 machines.
        torch.testing.assert_close(cpu_extension().linear(x, weight, b), expected, **TOL)
        torch.testing.assert_close(layer_ops.linear(x, weight, b), expected, **TOL)


def test_linear_takes_no_rows() -> None:
    out = layer_ops.linear(torch.empty(0, 64), _randn(8, 64), _randn(8, seed=1))
    assert out.shape == (0, 8)


@pytest.mark.parametrize("rows", [4, 30])  # weight tiles, register blocks
def test_linear_reads_strided_rows_and_falls_back(rows: int) -> None:
    wide = _randn(rows, 2 * 64)
    x = wide[:, :64]  # rows strided, elements contiguous
    weight = _randn(32, 64, seed=1) / 8
    expected = reference.linear(x, weight)
    torch.testing.assert_close(cpu_extension().linear(x, weight, None), expected, **TOL)
    torch.testing.assert_close(layer_ops.linear(x, weight), expected, **TOL)
    odd = _randn(4, 60)  # in_features not a multiple of 8: torch's path
    odd_weight = _randn(32, 60, seed=1) / 8
    torch.testing.assert_close(layer_ops.linear(odd, odd_weight), reference.linear(odd, odd_weight))


@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (5, 576), (40, 100)])
def test_rms_norm_matches_reference(rows: int, hidden: int) -> None:
    x, weight = _randn(rows, hidden) * 3, _randn(hidden, seed=1)
    out = layer_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-5), **TOL)


@pytest.mark.parametrize(("rows", "width"), [(1, 16), (7, 1536), (33, 100)])
def test_silu_and_mul_matches_reference(rows: int, width: int) -> None:
    gate_up = _randn(rows, 2 * width) * 6  # both signs, large magnitudes
    gate_up[0, :3] = torch.tensor([-100.0, 0.0, 100.0])
    out = layer_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(out, reference.silu_and_mul(gate_up), **TOL)


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_rotates_views_in_place(head_dim: int) -> None:
    num_tokens, num_heads, num_kv_heads, max_pos = 11, 6, 2, 300
    angles = _randn(max_pos, head_dim // 2, seed=3) * 3
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1) for f in (torch.cos, torch.sin))
    positions = torch.randint(0, max_pos, (num_tokens,), generator=torch.Generator())
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    query = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value_before = qkv[:, q_size + kv_size :].clone()
    expected = reference.rotary_embedding(positions, query, key, cos, sin)
    out_q, out_k = layer_ops.rotary_embedding(positions, query, key, cos, sin)
    assert out_q.data_ptr() == query.data_ptr()  # in place, inside qkv
    torch.testing.assert_close(out_q, expected[0], **TOL)
    torch.testing.assert_close(out_k, expected[1], **TOL)
    assert torch.equal(qkv[:, q_size + kv_size :], value_before)


def test_rotary_rejects_position_past_the_tables() -> None:
    cos = sin = torch.ones(4, 16)
    query, key = _randn(1, 2, 16), _randn(1, 1, 16)
    with pytest.raises(RuntimeError, match="past the tables"):
        layer_ops.rotary_embedding(torch.tensor([4]), query, key, cos, sin)


def test_other_dtypes_take_the_torch_path() -> None:
    x, weight = _randn(3, 64).bfloat16(), _randn(64, seed=1).bfloat16()
    out = layer_ops.rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), atol=2e-2, rtol=2e-2)
