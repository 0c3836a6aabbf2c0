// y = x W^T + b on CPU with W packed once, at load, into panels of 32 output features.
//
// x, b and y are fp32; W is fp32, bf16 or fp16. Two paths for 16-bit W:
// - widening (every CPU): each weight widened exactly to fp32 (bf16: its bits moved to the
//   upper half; fp16: a few integer operations) in registers as each panel row is loaded, or
//   once per panel into an L2 buffer when several row blocks sweep it (piece_widened). Every
//   product and sum is the fp32 one over W's values.
// - bf16 dot products (bf16 W, CPUs with AVX512-BF16, picked at run time; piece_bf16_dot):
//   x rounded to bf16 once per call, vdpbf16ps multiplies bf16 pairs and sums in fp32.
// Either way a 16-bit W halves the bytes a decode step reads. AMX (tile multiplies of bf16) is
// not used: no CPU this was built on had it to test with.
//
// A decode step's few rows read every weight once, so W's memory traffic sets the pace up to a
// few dozen rows, and arithmetic beyond. Packed, a panel is one contiguous [K, 32] run
// (layer_ops.pack_linear_weight): a single sequential stream the prefetchers follow, and each
// step of k loads the panel's 32 weights of that k in whole vectors. A block of R rows of x then
// takes the panel as an outer product, broadcasting x[m][k]:
//
//   packed W  [N/32, K, 32]     panel p: W[p*32 + j][k] at [p][k][j]
//   acc[r][c] += x[m+r][k] * W[p][k][c*L .. c*L+L)    for every k; c < 32 / L vectors of L floats
//   y[m+r][p*32 .. p*32+32) = acc[r][0..] + b
//
// 16-bit W is packed in pairs of consecutive k, [N/32, ceil(K/2), 32, 2] (W[p*32 + j][2q + h] at
// [p][q][j][h], K padded with a zero to even), the operand layout of vdpbf16ps: each 32-bit
// lane holds one feature's pair, so the widening path reads it with no lane moving (the lower
// half is k, the upper k + 1) and a 128-byte packed row holds 2 values of k instead of 1.
//
// 8 rows x 2 16-float vectors on AVX-512 (16 accumulators, 10 loads per 16 FMAs), 3 rows x 4
// 8-float vectors elsewhere (12 of AVX2's 16 registers; the fourth vector of weights is a memory
// operand, so 7 loads per 12 FMAs): the taller the block, the less often each panel comes from
// L2. No horizontal sums: each accumulator lane is one output, summed over k in order, so a
// row's result does not depend on the batch around it. The first sweep of a panel streams it
// from memory while prefetching the panel kPrefetchPanels ahead, spread over the panel's row
// blocks; later sweeps (more rows) find it in L2.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "grain.h"
#include "vec.h"

#ifdef PAGEDSERVE_CPU_CLONES_X86
#include <immintrin.h>
#endif

namespace pagedserve::cpu {
namespace {

constexpr int64_t kPanelRows = 192;    // rows of x a piece sweeps its panels with, at most
constexpr int64_t kPiecePanels = 2;    // panels per piece of work handed to a thread
constexpr int64_t kPrefetchPanels = 4;  // how far ahead panels are prefetched (the best
                                        // distance timed: bench/RESULTS.md)

using vfloat16 = float __attribute__((vector_size(64)));

template <typename V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);

template <typename V>
constexpr int kVectors = kLinearPanel / kLanes<V>;  // vectors per panel row

template <typename V>
constexpr int kBlockRows = kLanes<V> == 16 ? 8 : 3;

template <typename V>
PAGEDSERVE_INLINE V load_as(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
PAGEDSERVE_INLINE void store_as(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

// 32-bit integer vectors of N lanes (a vector_size may not depend on a template parameter).
template <int64_t N>
struct IntLanes;
template <>
struct IntLanes<8> {
  using Type = int32_t __attribute__((vector_size(32)));
};
template <>
struct IntLanes<16> {
  using Type = int32_t __attribute__((vector_size(64)));
};

// fp16 bit patterns (the lower halves of 32-bit lanes) as fp32, exactly: subnormals, infinities and NaN too.
// Integer operations only (F. Giesen's conversion), since the baseline x86-64 clone has no
// vcvtph2ps and GCC converts _Float16 vectors lane by lane.
template <typename V, typename Wide>
PAGEDSERVE_INLINE V half_bits_to_float(Wide h) {
  constexpr int32_t kExponent = 0x7c00 << 13;  // fp16's exponent field, moved to fp32's place
  Wide bits = (h & 0x7fff) << 13;
  const Wide exponent = bits & kExponent;
  bits += (127 - 15) << 23;                              // rebias
  bits += (exponent == kExponent) & ((128 - 16) << 23);  // Inf / NaN stay so
  const Wide tiny = exponent == 0;                       // zero or subnormal: all ones
  bits += tiny & (1 << 23);
  V v, renormalised;
  std::memcpy(&v, &bits, sizeof(v));
  renormalised = v - 6.103515625e-05f;  // minus 2^-14
  Wide out, fixed;
  std::memcpy(&out, &v, sizeof(out));
  std::memcpy(&fixed, &renormalised, sizeof(fixed));
  out = ((out & ~tiny) | (fixed & tiny)) | ((h & 0x8000) << 16);
  std::memcpy(&v, &out, sizeof(v));
  return v;
}

// kLanes<V> fp32 weights from p.
template <typename V>
PAGEDSERVE_INLINE V load_weights(const float* p) {
  return load_as<V>(p);
}

// kLanes<V> features' k-pairs of 16-bit weights from p, as fp32: (W[.][k], W[.][k+1]). A pair is
// one 32-bit lane, k in its lower half, so no lane moves: bf16 is fp32's upper half, fp16 needs
// a few integer operations.
template <typename V, typename W>
PAGEDSERVE_INLINE void load_pair_weights(const W* p, V& even, V& odd) {
  using Lanes = typename IntLanes<kLanes<V>>::Type;
  Lanes pairs;
  std::memcpy(&pairs, p, sizeof(pairs));
  if constexpr (std::is_same_v<W, c10::Half>) {
    even = half_bits_to_float<V>(pairs);  // reads the lower 16 bits only
    odd = half_bits_to_float<V>(pairs >> 16);
  } else {
    static_assert(std::is_same_v<W, c10::BFloat16>);
    const Lanes low = pairs << 16, high = pairs & ~0xffff;
    std::memcpy(&even, &low, sizeof(even));
    std::memcpy(&odd, &high, sizeof(odd));
  }
}

// Values of k one packed row holds: fp32 weights one, 16-bit ones a pair (the operand layout of
// vdpbf16ps below). A packed row is 128 bytes either way.
template <typename W>
constexpr int64_t kRowK = std::is_same_v<W, float> ? 1 : 2;

constexpr int64_t kRowBytes = kLinearPanel * 4;

// Packed rows per panel: in_features in whole rows.
template <typename W>
PAGEDSERVE_INLINE int64_t panel_rows(int64_t in_features) {
  return (in_features + kRowK<W> - 1) / kRowK<W>;
}

// The next panel's rows a row block pulls in as it sweeps: one every `every` packed rows, from
// `next`, `remaining` of them. A countdown, not k % every: a division in the loop would cost
// more than the prefetch saves.
struct PanelPrefetch {
  const char* next = nullptr;
  int64_t remaining = 0, every = 1;
};

// Row block b of `blocks`' share of the panel kPrefetchPanels after `panel` (`rows` packed rows),
// or nothing when `ahead` is false.
PAGEDSERVE_INLINE PanelPrefetch block_prefetch(const void* panel, int64_t rows, int64_t b,
                                               int64_t blocks, bool ahead) {
  if (!ahead) return {};
  const int64_t share = (rows + blocks - 1) / blocks, first = b * share;
  return {static_cast<const char*>(panel) + (kPrefetchPanels * rows + first) * kRowBytes,
          std::max<int64_t>(0, std::min(share, rows - first)), blocks};
}

// Called before each packed row a block sweeps.
PAGEDSERVE_INLINE void prefetch_step(PanelPrefetch& prefetch, int64_t& wait) {
  if (--wait > 0) return;
  wait = prefetch.every;
  if (prefetch.remaining > 0) {
    --prefetch.remaining;
#pragma GCC unroll 2
    for (int64_t line = 0; line < kRowBytes; line += 64) __builtin_prefetch(prefetch.next + line);
    prefetch.next += kRowBytes;
  }
}

// One packed row of weights as fp32 vectors: w[h * C + c] holds k + h of features c*L .. c*L+L.
template <typename V, typename W>
PAGEDSERVE_INLINE void load_row(const W* row, V* w) {
  constexpr int C = kVectors<V>;
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    if constexpr (std::is_same_v<W, float>) {
      w[c] = load_weights<V>(row + c * kLanes<V>);
    } else {
      load_pair_weights<V>(row + 2 * c * kLanes<V>, w[c], w[C + c]);
    }
  }
}

// acc[r][c] += w[h][c] * x[r][h] for the first H values of k in a packed row, k in order.
template <typename V, int R, int H>
PAGEDSERVE_INLINE void accumulate(V* acc, const V* w, const float* x, int64_t x_row_stride) {
  constexpr int C = kVectors<V>;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      // Vector times scalar: a broadcast load, where GCC builds V{x, x, ...} lane by lane.
      const float xk = x[r * x_row_stride + h];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r * C + c] += w[h * C + c] * xk;
    }
  }
}

// y[r][n .. n+32) = acc[r][..] + b for R rows; the last panel's columns cut to out_features.
template <typename V, int R>
PAGEDSERVE_INLINE void store_block(const LinearParams& p, const V* acc, int64_t n, float* y) {
  constexpr int C = kVectors<V>;
  const int64_t width = std::min(kLinearPanel, p.out_features - n);
  for (int r = 0; r < R; ++r) {
    float out[kLinearPanel];
    for (int c = 0; c < C; ++c) {
      V v = acc[r * C + c];
      if (p.bias && width == kLinearPanel) v += load_as<V>(p.bias + n + c * kLanes<V>);
      store_as(out + c * kLanes<V>, v);
    }
    if (p.bias && width < kLinearPanel) {
      for (int64_t j = 0; j < width; ++j) out[j] += p.bias[n + j];
    }
    std::memcpy(y + r * p.out_features, out, width * sizeof(float));
  }
}

// y[m .. m+R)[panel's columns] for R rows of x starting at x.
template <typename V, int R, typename W>
PAGEDSERVE_INLINE void sweep(const LinearParams& p, const float* x, const W* panel, int64_t n,
                             float* y, PanelPrefetch prefetch) {
  constexpr int C = kVectors<V>;
  constexpr int H = kRowK<W>;
  V acc[R * C];  // row r, vector c at r * C + c
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i] = V{};
  V w[H * C];
  const int64_t whole = p.in_features / H;  // rows whose every k is below in_features
  for (int64_t row = 0, wait = 1; row < whole; ++row) {
    prefetch_step(prefetch, wait);
    load_row<V>(panel + row * H * kLinearPanel, w);
    accumulate<V, R, H>(acc, w, x + row * H, p.x_row_stride);
  }
  if (whole * H < p.in_features) {  // an odd in_features: the last pair's second k is padding
    load_row<V>(panel + whole * H * kLinearPanel, w);
    accumulate<V, R, 1>(acc, w, x + whole * H, p.x_row_stride);
  }
  store_block<V, R>(p, acc, n, y);
}

// sweep<V, R> for a run-time R < kBlockRows<V>: the rows left after the whole blocks.
template <typename V, int R, typename W>
PAGEDSERVE_INLINE void sweep_tail(int64_t rows, const LinearParams& p, const float* x,
                                  const W* panel, int64_t n, float* y, PanelPrefetch prefetch) {
  if constexpr (R > 0) {
    if (rows == R) return sweep<V, R>(p, x, panel, n, y, prefetch);
    sweep_tail<V, R - 1>(rows, p, x, panel, n, y, prefetch);
  }
}

// x rounded to bf16 for the dot-product path, in pairs of consecutive k (see below).
struct XPairs {
  const uint32_t* data = nullptr;  // [rows, stride]: x[m][2q] | x[m][2q + 1] << 16 at [m][q]
  int64_t stride = 0;
};

// What a piece reads besides the layer: room for one widened panel (16-bit weights, widening
// path), x in bf16 pairs (dot-product path).
struct Scratch {
  float* wide;
  XPairs x_pairs;
};

// Rows [m0, m1) against 16-bit panels [first, end), each widened once into `wide` (a [K, 32]
// fp32 panel, in L2) and swept from there by every row block: only the first block would read
// the panel from memory, and the others then skip the conversions. The same sums as sweeping
// the 16-bit panel, since widening is exact.
template <typename V, typename W>
PAGEDSERVE_INLINE void piece_widened(const LinearParams& p, int64_t m0, int64_t m1,
                                     int64_t first, int64_t end, float* wide) {
  constexpr int R = kBlockRows<V>, C = kVectors<V>;
  const int64_t rows = panel_rows<W>(p.in_features);
  for (int64_t panel = first; panel < end; ++panel) {
    const W* w = static_cast<const W*>(p.weight) + panel * rows * kRowBytes / sizeof(W);
    V row[2 * C];
    for (int64_t i = 0; i < rows; ++i) {
      load_row<V>(w + i * 2 * kLinearPanel, row);
      for (int c = 0; c < 2 * C; ++c) store_as(wide + (2 * i * C + c) * kLanes<V>, row[c]);
    }
    const int64_t n = panel * kLinearPanel;
    for (int64_t m = m0; m < m1; m += R) {
      const float* x = p.x + m * p.x_row_stride;
      float* y = p.y + m * p.out_features + n;
      if (m + R <= m1) {
        sweep<V, R>(p, x, static_cast<const float*>(wide), n, y, PanelPrefetch{});
      } else {
        sweep_tail<V, R - 1>(m1 - m, p, x, static_cast<const float*>(wide), n, y,
                             PanelPrefetch{});
      }
    }
  }
}

// Rows [m0, m1) against panels [first, end); prefetching ahead when this is the first row panel.
template <typename V, typename W>
PAGEDSERVE_INLINE void piece(const LinearParams& p, int64_t m0, int64_t m1, int64_t first,
                             int64_t end, const Scratch& scratch) {
  constexpr int R = kBlockRows<V>;
  const int64_t num_panels = (p.out_features + kLinearPanel - 1) / kLinearPanel;
  const int64_t blocks = (m1 - m0 + R - 1) / R;
  if constexpr (!std::is_same_v<W, float>) {
    if (blocks > 1) return piece_widened<V, W>(p, m0, m1, first, end, scratch.wide);
  }
  const int64_t rows = panel_rows<W>(p.in_features);
  for (int64_t panel = first; panel < end; ++panel) {
    const W* w = static_cast<const W*>(p.weight) + panel * rows * kRowBytes / sizeof(W);
    const int64_t n = panel * kLinearPanel;
    const bool ahead = m0 == 0 && panel + kPrefetchPanels < num_panels;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m = m0 + b * R;
      const PanelPrefetch prefetch = block_prefetch(w, rows, b, blocks, ahead);
      const float* x = p.x + m * p.x_row_stride;
      float* y = p.y + m * p.out_features + n;
      if (m + R <= m1) {
        sweep<V, R>(p, x, w, n, y, prefetch);
      } else {
        sweep_tail<V, R - 1>(m1 - m, p, x, w, n, y, prefetch);
      }
    }
  }
}

using PieceFn = void (*)(const LinearParams&, int64_t, int64_t, int64_t, int64_t, const Scratch&);

// One clone set per weight dtype and vector width.
PAGEDSERVE_CPU_CLONES void piece_narrow_float(const LinearParams& p, int64_t m0, int64_t m1,
                                              int64_t first, int64_t end, const Scratch& s) {
  piece<vfloat, float>(p, m0, m1, first, end, s);
}
PAGEDSERVE_CPU_CLONES void piece_narrow_bfloat16(const LinearParams& p, int64_t m0, int64_t m1,
                                                 int64_t first, int64_t end, const Scratch& s) {
  piece<vfloat, c10::BFloat16>(p, m0, m1, first, end, s);
}
PAGEDSERVE_CPU_CLONES void piece_narrow_half(const LinearParams& p, int64_t m0, int64_t m1,
                                             int64_t first, int64_t end, const Scratch& s) {
  piece<vfloat, c10::Half>(p, m0, m1, first, end, s);
}

#ifdef PAGEDSERVE_CPU_CLONES_X86
#define PAGEDSERVE_X86_64_V4 __attribute__((target("arch=x86-64-v4")))
PAGEDSERVE_X86_64_V4 void piece_wide_float(const LinearParams& p, int64_t m0, int64_t m1,
                                           int64_t first, int64_t end, const Scratch& s) {
  piece<vfloat16, float>(p, m0, m1, first, end, s);
}
PAGEDSERVE_X86_64_V4 void piece_wide_bfloat16(const LinearParams& p, int64_t m0, int64_t m1,
                                              int64_t first, int64_t end, const Scratch& s) {
  piece<vfloat16, c10::BFloat16>(p, m0, m1, first, end, s);
}
PAGEDSERVE_X86_64_V4 void piece_wide_half(const LinearParams& p, int64_t m0, int64_t m1,
                                          int64_t first, int64_t end, const Scratch& s) {
  piece<vfloat16, c10::Half>(p, m0, m1, first, end, s);
}

// The dot-product path (AVX512-BF16), compiled for CPUs that have it and picked only on those.
// vdpbf16ps adds both products of a lane's bf16 pair to its fp32 accumulator: two values of k
// per instruction where the widening path does one, and no widening. x is rounded to bf16 (to
// nearest even) once per call, into pairs laid out as the weights' are:
//
//   x pairs   [rows, ceil(K/2)]          x[m][2q] | x[m][2q+1] << 16: one 32-bit lane, broadcast
//   W pairs   [N/32, ceil(K/2), 32, 2]   row q of panel p: 16 features a vector, their k-pairs
//   acc[r][c] = vdpbf16ps(acc[r][c], broadcast(x pairs[m+r][q]), W[p][q][c*16 .. c*16+16))
//
// 8 rows x 2 vectors as on the widening path; each product is exact in fp32, the sums fp32.
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4,avx512bf16")

constexpr int kDotRows = kBlockRows<vfloat16>;

template <int R>
inline __attribute__((always_inline)) void sweep_dot(const LinearParams& p, XPairs x,
                                                     const uint32_t* panel, int64_t n, float* y,
                                                     PanelPrefetch prefetch) {
  vfloat16 acc[R * 2];
#pragma GCC unroll 16
  for (int i = 0; i < R * 2; ++i) acc[i] = vfloat16{};
  const int64_t rows = panel_rows<c10::BFloat16>(p.in_features);
  for (int64_t q = 0, wait = 1; q < rows; ++q) {
    prefetch_step(prefetch, wait);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + q * kLinearPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + q * kLinearPanel + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh xq = (__m512bh)_mm512_set1_epi32(static_cast<int>(x.data[r * x.stride + q]));
      acc[r * 2] = _mm512_dpbf16_ps(acc[r * 2], xq, w0);
      acc[r * 2 + 1] = _mm512_dpbf16_ps(acc[r * 2 + 1], xq, w1);
    }
  }
  store_block<vfloat16, R>(p, acc, n, y);
}

template <int R>
inline __attribute__((always_inline)) void sweep_dot_tail(int64_t rows, const LinearParams& p,
                                                          XPairs x, const uint32_t* panel,
                                                          int64_t n, float* y,
                                                          PanelPrefetch prefetch) {
  if constexpr (R > 0) {
    if (rows == R) return sweep_dot<R>(p, x, panel, n, y, prefetch);
    sweep_dot_tail<R - 1>(rows, p, x, panel, n, y, prefetch);
  }
}

// piece() for the dot-product path: every row block reads the bf16 panel as it is.
void piece_bf16_dot(const LinearParams& p, int64_t m0, int64_t m1, int64_t first, int64_t end,
                    const Scratch& s) {
  constexpr int R = kDotRows;
  const int64_t num_panels = (p.out_features + kLinearPanel - 1) / kLinearPanel;
  const int64_t blocks = (m1 - m0 + R - 1) / R;
  const int64_t rows = panel_rows<c10::BFloat16>(p.in_features);
  for (int64_t panel = first; panel < end; ++panel) {
    const uint32_t* w = static_cast<const uint32_t*>(p.weight) + panel * rows * kLinearPanel;
    const int64_t n = panel * kLinearPanel;
    const bool ahead = m0 == 0 && panel + kPrefetchPanels < num_panels;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m = m0 + b * R;
      const PanelPrefetch prefetch = block_prefetch(w, rows, b, blocks, ahead);
      const XPairs x{s.x_pairs.data + m * s.x_pairs.stride, s.x_pairs.stride};
      float* y = p.y + m * p.out_features + n;
      if (m + R <= m1) {
        sweep_dot<R>(p, x, w, n, y, prefetch);
      } else {
        sweep_dot_tail<R - 1>(m1 - m, p, x, w, n, y, prefetch);
      }
    }
  }
}

// Rows [m0, m1) of x rounded to bf16 pairs into out (rows of `stride` pairs, room for K rounded
// up to 16 values; the values past K are zeros).
void round_rows_to_bf16(const LinearParams& p, int64_t m0, int64_t m1, uint32_t* out,
                        int64_t stride) {
  const int64_t k_size = p.in_features;
  for (int64_t m = m0; m < m1; ++m) {
    const float* x = p.x + m * p.x_row_stride;
    auto* row = reinterpret_cast<__m256i*>(out + m * stride);
    for (int64_t k = 0; k < k_size; k += 16) {
      const __mmask16 valid = k_size - k >= 16 ? 0xffff : (1u << (k_size - k)) - 1;
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, x + k));
      _mm256_storeu_si256(row + k / 16, (__m256i)rounded);
    }
  }
}

#pragma GCC pop_options

// x in bf16 pairs for piece_bf16_dot, rounded in parallel over rows into this thread's buffer
// (kept between calls, as widening_buffer's).
XPairs round_x_to_bf16(const LinearParams& p) {
  static thread_local std::vector<uint32_t> buffer;
  const int64_t stride = (p.in_features + 15) / 16 * 8;
  if (static_cast<int64_t>(buffer.size()) < p.rows * stride) buffer.resize(p.rows * stride);
  uint32_t* out = buffer.data();
  at::parallel_for(0, p.rows, grain_rows(p.in_features), [&](int64_t begin, int64_t end) {
    round_rows_to_bf16(p, begin, end, out, stride);
  });
  return {out, stride};
}
#endif

// This thread's room for one widened panel of `floats`, kept between calls (a fresh buffer per
// call would cost a page-faulted allocation each time).
float* widening_buffer(int64_t floats) {
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

#ifdef PAGEDSERVE_CPU_CLONES_X86
// x86-64-v4's features one by one: not every GCC takes the level's name here.
bool has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512cd") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}
#endif

// 16-float vectors where the CPU has them, unless the caller asks for 8; bf16 weights through
// vdpbf16ps where the CPU has it, unless the caller asks to widen them.
PieceFn pick_piece(c10::ScalarType weight_dtype, int64_t vector_floats, bool bf16_dot) {
#ifdef PAGEDSERVE_CPU_CLONES_X86
  if (has_avx512() && vector_floats != 8) {
    switch (weight_dtype) {
      case c10::ScalarType::BFloat16:
        return bf16_dot && has_bf16_dot() ? piece_bf16_dot : piece_wide_bfloat16;
      case c10::ScalarType::Half: return piece_wide_half;
      default: return piece_wide_float;
    }
  }
#endif
  switch (weight_dtype) {
    case c10::ScalarType::BFloat16: return piece_narrow_bfloat16;
    case c10::ScalarType::Half: return piece_narrow_half;
    default: return piece_narrow_float;
  }
}

}  // namespace

bool has_bf16_dot() {
#ifdef PAGEDSERVE_CPU_CLONES_X86
  static const bool has = has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

void linear(const LinearParams& params, int64_t vector_floats, bool bf16_dot) {
  // Work is cut into (panel of rows, run of weight panels) pieces handed out one at a time, so
  // a thread that starts late (another process holds its core) leaves its share to the others
  // instead of holding up the whole layer.
  if (params.rows == 0 || params.out_features == 0) return;  // e.g. a step with no logits to take
  const int64_t row_panels = (params.rows + kPanelRows - 1) / kPanelRows;
  const int64_t panel_rows = (params.rows + row_panels - 1) / row_panels;  // evened out
  const int64_t num_panels = (params.out_features + kLinearPanel - 1) / kLinearPanel;
  const int64_t runs = (num_panels + kPiecePanels - 1) / kPiecePanels;
  const int64_t num_pieces = row_panels * runs;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_pieces);
  const PieceFn run_piece = pick_piece(params.weight_dtype, vector_floats, bf16_dot);
  XPairs x_pairs;
  bool widen = params.weight_dtype != c10::ScalarType::Float;
#ifdef PAGEDSERVE_CPU_CLONES_X86
  if (run_piece == piece_bf16_dot) {
    x_pairs = round_x_to_bf16(params);
    widen = false;
  }
#endif
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // Room for an even number of k: the widened panel takes the padding of an odd one too.
    const Scratch scratch{widen ? widening_buffer((params.in_features + 1) * kLinearPanel)
                                : nullptr,
                          x_pairs};
    for (int64_t i = next++; i < num_pieces; i = next++) {
      const int64_t m0 = i / runs * panel_rows;
      const int64_t first = i % runs * kPiecePanels;
      run_piece(params, m0, std::min(m0 + panel_rows, params.rows), first,
                std::min(first + kPiecePanels, num_panels), scratch);
    }
  });
}

}  // namespace pagedserve::cpu
