// Fused element-wise layers of the decoder on CPU, fp32: RMSNorm, SiLU-and-multiply, rotary.
//
// Each replaces a chain of torch ops (five for RMSNorm, three for SwiGLU, about ten for rotary)
// that would each walk the activations and allocate a temporary: one pass per token row
// instead, parallel over tokens, rotary in place in the q/k projection output.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "cpu_kernels.h"
#include "grain.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

PAGEDSERVE_INLINE float sum_of_squares(const float* x, int64_t n) {
  vfloat acc = {};
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) acc += load(x + i) * load(x + i);
  float s = hsum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

PAGEDSERVE_CPU_CLONES void rms_norm_rows(const RmsNormParams& p, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float* x = p.x + t * p.x_row_stride;
    float* out = p.out + t * p.hidden_size;
    const float mean = sum_of_squares(x, p.hidden_size) / static_cast<float>(p.hidden_size);
    const float inv_rms = 1.0f / std::sqrt(mean + p.eps);
    for (int64_t i = 0; i < p.hidden_size; ++i) out[i] = p.weight[i] * (x[i] * inv_rms);
  }
}

// silu(g) = g * sigmoid(g), with e^-|g| so the exponent never overflows.
PAGEDSERVE_INLINE vfloat silu(vfloat g) {
  const vfloat e = exp_nonpositive(vmax(g, -g) * -1.0f);
  const vfloat sigmoid = (g >= splat(0.0f) ? splat(1.0f) : e) / (1.0f + e);
  return g * sigmoid;
}

PAGEDSERVE_CPU_CLONES void silu_and_mul_rows(const SiluAndMulParams& p, int64_t begin,
                                             int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const float* gate = p.gate_up + t * p.gate_up_row_stride;
    const float* up = gate + p.width;
    float* out = p.out + t * p.width;
    int64_t i = 0;
    for (; i + kWidth <= p.width; i += kWidth) store(out + i, silu(load(gate + i)) * load(up + i));
    for (; i < p.width; ++i) out[i] = silu(splat(gate[i]))[0] * up[i];
  }
}

// One head, in place: [x1 | x2] -> [x1 c - x2 s | x2 c + x1 s] (the rotate-half convention).
PAGEDSERVE_INLINE void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[half + i] = x2 * cos[i] + x1 * sin[i];
  }
}

PAGEDSERVE_CPU_CLONES void rotary_rows(const RotaryParams& p, int64_t begin, int64_t end) {
  const int64_t half = p.head_dim / 2;
  for (int64_t t = begin; t < end; ++t) {
    const int64_t pos = p.positions[t];
    const float* cos = p.cos + pos * p.table_row_stride;
    const float* sin = p.sin + pos * p.table_row_stride;
    for (int64_t h = 0; h < p.num_query_heads; ++h) {
      rotate(p.query + t * p.query_token_stride + h * p.head_dim, cos, sin, half);
    }
    for (int64_t h = 0; h < p.num_key_heads; ++h) {
      rotate(p.key + t * p.key_token_stride + h * p.head_dim, cos, sin, half);
    }
  }
}

}  // namespace

void rms_norm(const RmsNormParams& params) {
  at::parallel_for(0, params.num_tokens, grain_rows(params.hidden_size),
                   [&](int64_t begin, int64_t end) { rms_norm_rows(params, begin, end); });
}

void silu_and_mul(const SiluAndMulParams& params) {
  at::parallel_for(0, params.num_tokens, grain_rows(3 * params.width),
                   [&](int64_t begin, int64_t end) { silu_and_mul_rows(params, begin, end); });
}

void rotary_embedding(const RotaryParams& params) {
  // Checked here, not in the cloned loop: GCC treats a target_clones dispatcher as nothrow.
  for (int64_t t = 0; t < params.num_tokens; ++t) {
    const int64_t pos = params.positions[t];
    TORCH_CHECK(pos >= 0 && pos < params.max_positions, "position ", pos, " is past the tables");
  }
  const int64_t row_elements = (params.num_query_heads + params.num_key_heads) * params.head_dim;
  at::parallel_for(0, params.num_tokens, grain_rows(2 * row_elements),
                   [&](int64_t begin, int64_t end) { rotary_rows(params, begin, end); });
}

}  // namespace pagedserve::cpu
