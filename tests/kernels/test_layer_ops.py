"""pagedserve_kernels.layer_ops (C++ on CPU in fp32) against the float64 reference.

Tolerances: fp32 accumulation over a few hundred terms, atol 1e-5 rtol 1e-4; silu and the rotary
tables add a couple of ulp.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve_kernels import layer_ops, reference
from pagedserve_kernels.ops import cpu_extension

TOL = {"atol": 1e-5, "rtol": 1e-4}
SHAPES = [(64, 9), (72, 13), (576, 960), (1536, 576)]  # (in_features, out_features)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_pack_linear_weight_lays_out_panels_of_32_features() -> None:
    weight = _randn(70, 5)
    packed = layer_ops.pack_linear_weight(weight)
    assert packed.shape == (3, 5, 32) and packed.is_contiguous()
    for n in (0, 31, 32, 69):
        torch.testing.assert_close(packed[n // 32, :, n % 32], weight[n], rtol=0, atol=0)
    assert not packed[2, :, 6:].any()  # features 70..95 are padding


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        *((rows, *shape) for rows in (1, 3, 8, 9, 17, 24, 64, 160, 385) for shape in SHAPES),
        (1100, 72, 13),
    ],
)
def test_linear_matches_reference(rows: int, in_features: int, out_features: int) -> None:
    # The kernel sweeps 8-row blocks with 16-float vectors on AVX-512 (vector_floats 8 forces
    # 3-row blocks of 8-float ones, the path of other x86 machines) over panels of at most 192
    # rows: 385 rows make three (129, 129, 127: tails of 1 and 7 rows in blocks of 8, 0 and 1
    # in blocks of 3), 1100 six (184 x 5, 180).
    # out_features 9 and 13 leave a short last panel. Weights scaled as initialised (outputs
    # ~ N(0, 1)), so fp32 rounding stays within TOL.
    x = _randn(rows, in_features)
    weight = _randn(out_features, in_features, seed=1) * in_features**-0.5
    packed = layer_ops.pack_linear_weight(weight)
    bias = _randn(out_features, seed=2)
    for b in (None, bias):
        expected = reference.linear(x, weight, b)
        for vector_floats in (0, 8):
            got = cpu_extension().linear(x, packed, b, out_features, vector_floats)
            torch.testing.assert_close(got, expected, **TOL)
        torch.testing.assert_close(layer_ops.linear(x, packed, b, out_features), expected, **TOL)
        torch.testing.assert_close(layer_ops.linear(x, weight, b), expected, **TOL)  # torch's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [(1, 64, 9), (1, 576, 960), (9, 72, 13), (17, 576, 960), (385, 1536, 576), (1100, 72, 13)],
)
def test_16_bit_weights_match_fp32_on_their_rounded_values(
    dtype: torch.dtype, rows: int, in_features: int, out_features: int
) -> None:
    # Weights packed in bf16 / fp16 are widened exactly to fp32 in registers, so the kernel
    # computes the fp32 product over the rounded weights: the fp32 tolerance holds against the
    # float64 reference on those weights.
    x = _randn(rows, in_features)
    weight = _randn(out_features, in_features, seed=1) * in_features**-0.5
    packed = layer_ops.pack_linear_weight(weight, dtype)
    assert packed.dtype == dtype and packed.shape == (-(-out_features // 32), in_features, 32)
    rounded = weight.to(dtype).float()
    bias = _randn(out_features, seed=2)
    for b in (None, bias):
        expected = reference.linear(x, rounded, b)
        for vector_floats in (0, 8):
            got = cpu_extension().linear(x, packed, b, out_features, vector_floats)
            torch.testing.assert_close(got, expected, **TOL)
    # Bit for bit the fp32 kernel's result on the rounded weights, whether each row block widens
    # the panel as it sweeps it (one block) or the panel is widened once for all (several).
    for vector_floats in (0, 8):
        fp32 = layer_ops.pack_linear_weight(rounded)
        want = cpu_extension().linear(x, fp32, bias, out_features, vector_floats)
        assert torch.equal(
            cpu_extension().linear(x, packed, bias, out_features, vector_floats), want
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_weights_widen_exactly(dtype: torch.dtype) -> None:
    # One-hot rows of x read W's columns back: every value widened bit for bit, subnormals and
    # the largest finite values included (not -0.0: the sum starts at +0.0).
    info = torch.finfo(dtype)
    special = [0.0, info.tiny, -info.tiny, info.smallest_normal / 4, info.max, -info.max]
    values = torch.tensor([*special, 1.5, -3.25, 1e-7, 7e-6, 300.0], dtype=dtype)
    weight = torch.cat([values, _randn(64 - values.numel()).to(dtype)]).view(1, 64).repeat(40, 1)
    packed = layer_ops.pack_linear_weight(weight)
    for vector_floats in (0, 8):
        got = cpu_extension().linear(torch.eye(64), packed, None, 40, vector_floats)
        assert torch.equal(got.view(torch.int32), weight.float().T.contiguous().view(torch.int32))


def test_pack_linear_weight_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        layer_ops.pack_linear_weight(_randn(8, 64), torch.float64)


@pytest.mark.parametrize("vector_floats", [0, 8])
def test_linear_gives_a_row_the_same_bits_in_any_batch(vector_floats: int) -> None:
    # Each output is summed over k in order by whichever block holds its row, so a sequence's
    # logits do not change with the batch it is decoded in.
    x = _randn(200, 576)
    packed = layer_ops.pack_linear_weight(_randn(960, 576, seed=1) / 24)
    whole = cpu_extension().linear(x, packed, None, 960, vector_floats)
    for start, stop in ((0, 1), (5, 8), (9, 26), (3, 196)):
        part = cpu_extension().linear(x[start:stop], packed, None, 960, vector_floats)
        assert torch.equal(part, whole[start:stop])


def test_linear_takes_no_rows() -> None:
    packed = layer_ops.pack_linear_weight(_randn(8, 64))
    out = layer_ops.linear(torch.empty(0, 64), packed, _randn(8, seed=1), 8)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("rows", [4, 30, 300])  # one row block, several, two row panels
def test_linear_reads_strided_rows(rows: int) -> None:
    wide = _randn(rows, 2 * 64)
    x = wide[:, :64]  # rows strided, elements contiguous
    weight = _randn(32, 64, seed=1) / 8
    packed = layer_ops.pack_linear_weight(weight)
    expected = reference.linear(x, weight)
    torch.testing.assert_close(cpu_extension().linear(x, packed, None, 32), expected, **TOL)
    torch.testing.assert_close(layer_ops.linear(x, packed, None, 32), expected, **TOL)
    torch.testing.assert_close(
        layer_ops.linear(wide[:, ::2], packed, None, 32),
        reference.linear(wide[:, ::2], weight),
        **TOL,
    )  # copied first


def test_linear_refuses_a_weight_it_cannot_read() -> None:
    weight = _randn(40, 64)
    packed = layer_ops.pack_linear_weight(weight)
    with pytest.raises(ValueError, match="out_features"):
        layer_ops.linear(_randn(2, 64), packed)
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        cpu_extension().linear(_randn(2, 64), weight, None, 40)  # not packed
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        cpu_extension().linear(_randn(2, 64), packed, None, 80)  # too few panels


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
