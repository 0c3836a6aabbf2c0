// y = x W^T + b on CPU with W packed once, at load, into panels of 32 output features.
//
// x, b and y are fp32; W is fp32, bf16 or fp16, widened exactly to fp32 (bf16: zero-extend to
// 32 bits, shift left 16; fp16: a few integer operations) in registers as each panel row is
// loaded, or once per panel into an L2 buffer when several row blocks sweep it (piece_widened).
// Every product and sum is the fp32 one over W's values, and a 16-bit W halves the bytes a
// decode step reads.
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
#include "vec.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kPanelRows = 192;    // rows of x a piece sweeps its panels with, at most
constexpr int64_t kPiecePanels = 2;    // panels per piece of work handed to a thread
constexpr int64_t kPrefetchPanels = 4;  // how far ahead panels are prefetched (the best
                                        // distance timed: bench/RESULTS.md)

template <typename V>
constexpr int kVectors = kLinearPanel / kLanes<V>;  // vectors per panel row

template <typename V>
constexpr int kBlockRows = kLanes<V> == 16 ? 8 : 3;

// 16-bit vectors of N lanes, and 32-bit ones as wide (a vector_size may not depend on a
// template parameter).
template <int64_t N>
struct HalfWidth;
template <>
struct HalfWidth<8> {
  using Bits = uint16_t __attribute__((vector_size(16)));
  using Wide = int32_t __attribute__((vector_size(32)));
};
template <>
struct HalfWidth<16> {
  using Bits = uint16_t __attribute__((vector_size(32)));
  using Wide = int32_t __attribute__((vector_size(64)));
};

// fp16 bit patterns (in 32-bit lanes) as fp32, exactly: subnormals, infinities and NaN too.
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

// kLanes<V> weights of type W from p, as fp32.
template <typename V, typename W>
PAGEDSERVE_INLINE V load_weights(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return load_as<V>(p);
  } else {
    using Narrow = HalfWidth<kLanes<V>>;
    typename Narrow::Bits bits;
    std::memcpy(&bits, p, sizeof(bits));
    const auto wide = __builtin_convertvector(bits, typename Narrow::Wide);  // zero-extended
    if constexpr (std::is_same_v<W, c10::Half>) {
      return half_bits_to_float<V>(wide);
    } else {
      static_assert(std::is_same_v<W, c10::BFloat16>);
      const auto upper = wide << 16;  // bf16 is fp32's upper half
      V v;
      std::memcpy(&v, &upper, sizeof(v));
      return v;
    }
  }
}

// The next panel's k-rows a row block pulls in as it sweeps: one every `every` steps of k, from
// `next`, `remaining` of them. A countdown, not k % every: a division in the loop would cost
// more than the prefetch saves.
struct PanelPrefetch {
  const char* next = nullptr;
  int64_t remaining = 0, every = 1;
};

// y[m .. m+R)[panel's columns] for R rows of x starting at x.
template <typename V, int R, typename W>
PAGEDSERVE_INLINE void sweep(const LinearParams& p, const float* x, const W* panel, int64_t n,
                             float* y, PanelPrefetch prefetch) {
  constexpr int C = kVectors<V>;
  constexpr int64_t kRowBytes = kLinearPanel * sizeof(W);  // a panel row: 1 or 2 cache lines
  V acc[R * C];  // row r, vector c at r * C + c
#pragma GCC unroll 32
  for (int i = 0; i < R * C; ++i) acc[i] = V{};
  for (int64_t k = 0, wait = 1; k < p.in_features; ++k) {
    if (--wait == 0) {
      wait = prefetch.every;
      if (prefetch.remaining > 0) {
        --prefetch.remaining;
#pragma GCC unroll 2
        for (int64_t line = 0; line < kRowBytes; line += 64) {
          __builtin_prefetch(prefetch.next + line);
        }
        prefetch.next += kRowBytes;
      }
    }
    V w[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      w[c] = load_weights<V>(panel + k * kLinearPanel + c * kLanes<V>);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      // Vector times scalar: a broadcast load, where GCC builds V{x, x, ...} lane by lane.
      const float xk = x[r * p.x_row_stride + k];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r * C + c] += w[c] * xk;
    }
  }
  const int64_t width = std::min(kLinearPanel, p.out_features - n);  // the last panel may be short
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

// sweep<V, R> for a run-time R < kBlockRows<V>: the rows left after the whole blocks.
template <typename V, int R, typename W>
PAGEDSERVE_INLINE void sweep_tail(int64_t rows, const LinearParams& p, const float* x,
                                  const W* panel, int64_t n, float* y, PanelPrefetch prefetch) {
  if constexpr (R > 0) {
    if (rows == R) return sweep<V, R>(p, x, panel, n, y, prefetch);
    sweep_tail<V, R - 1>(rows, p, x, panel, n, y, prefetch);
  }
}

// Rows [m0, m1) against 16-bit panels [first, end), each widened once into `wide` (in_features
// x 32 floats, in L2) and swept from there by every row block: only the first block would read
// the panel from memory, and the others then skip the conversions. The same sums as sweeping
// the 16-bit panel, since widening is exact.
template <typename V, typename W>
PAGEDSERVE_INLINE void piece_widened(const LinearParams& p, int64_t m0, int64_t m1,
                                     int64_t first, int64_t end, float* wide) {
  constexpr int R = kBlockRows<V>;
  const int64_t panel_floats = p.in_features * kLinearPanel;
  for (int64_t panel = first; panel < end; ++panel) {
    const W* w = static_cast<const W*>(p.weight) + panel * panel_floats;
    for (int64_t i = 0; i < panel_floats; i += kLanes<V>) {
      store_as(wide + i, load_weights<V>(w + i));
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
// `wide`: room for one widened panel, or nullptr (fp32 weights).
template <typename V, typename W>
PAGEDSERVE_INLINE void piece(const LinearParams& p, int64_t m0, int64_t m1, int64_t first,
                             int64_t end, float* wide) {
  constexpr int R = kBlockRows<V>;
  const int64_t num_panels = (p.out_features + kLinearPanel - 1) / kLinearPanel;
  const int64_t blocks = (m1 - m0 + R - 1) / R;
  if constexpr (!std::is_same_v<W, float>) {
    if (blocks > 1) return piece_widened<V, W>(p, m0, m1, first, end, wide);
  }
  const int64_t share = (p.in_features + blocks - 1) / blocks;  // k-rows each block prefetches
  for (int64_t panel = first; panel < end; ++panel) {
    const W* w = static_cast<const W*>(p.weight) + panel * p.in_features * kLinearPanel;
    const int64_t n = panel * kLinearPanel;
    const bool ahead = m0 == 0 && panel + kPrefetchPanels < num_panels;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t m = m0 + b * R;
      PanelPrefetch prefetch;
      if (ahead) {
        const int64_t k0 = b * share;
        prefetch = {reinterpret_cast<const char*>(
                        w + (kPrefetchPanels * p.in_features + k0) * kLinearPanel),
                    std::max<int64_t>(0, std::min(share, p.in_features - k0)), blocks};
      }
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

// One clone set per weight dtype and vector width.
PAGEDSERVE_CPU_CLONES void piece_narrow_float(const LinearParams& p, int64_t m0, int64_t m1,
                                              int64_t first, int64_t end, float* wide) {
  piece<vfloat, float>(p, m0, m1, first, end, wide);
}
PAGEDSERVE_CPU_CLONES void piece_narrow_bfloat16(const LinearParams& p, int64_t m0, int64_t m1,
                                                 int64_t first, int64_t end, float* wide) {
  piece<vfloat, c10::BFloat16>(p, m0, m1, first, end, wide);
}
PAGEDSERVE_CPU_CLONES void piece_narrow_half(const LinearParams& p, int64_t m0, int64_t m1,
                                             int64_t first, int64_t end, float* wide) {
  piece<vfloat, c10::Half>(p, m0, m1, first, end, wide);
}

#ifdef PAGEDSERVE_CPU_CLONES_X86
PAGEDSERVE_X86_64_V4 void piece_wide_float(const LinearParams& p, int64_t m0, int64_t m1,
                                           int64_t first, int64_t end, float* wide) {
  piece<vfloat16, float>(p, m0, m1, first, end, wide);
}
PAGEDSERVE_X86_64_V4 void piece_wide_bfloat16(const LinearParams& p, int64_t m0, int64_t m1,
                                              int64_t first, int64_t end, float* wide) {
  piece<vfloat16, c10::BFloat16>(p, m0, m1, first, end, wide);
}
PAGEDSERVE_X86_64_V4 void piece_wide_half(const LinearParams& p, int64_t m0, int64_t m1,
                                          int64_t first, int64_t end, float* wide) {
  piece<vfloat16, c10::Half>(p, m0, m1, first, end, wide);
}
#endif

using PieceFn = void (*)(const LinearParams&, int64_t, int64_t, int64_t, int64_t, float*);

// This thread's room for one widened panel of `floats`, kept between calls (a fresh buffer per
// call would cost a page-faulted allocation each time).
float* widening_buffer(int64_t floats) {
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// 16-float vectors where the CPU has them, unless the caller asks for 8.
PieceFn pick_piece(c10::ScalarType weight_dtype, int64_t vector_floats) {
#ifdef PAGEDSERVE_CPU_CLONES_X86
  if (cpu_has_avx512() && vector_floats != 8) {
    switch (weight_dtype) {
      case c10::ScalarType::BFloat16: return piece_wide_bfloat16;
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

void linear(const LinearParams& params, int64_t vector_floats) {
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
  const PieceFn run_piece = pick_piece(params.weight_dtype, vector_floats);
  std::atomic<int64_t> next{0};
  const bool widen = params.weight_dtype != c10::ScalarType::Float;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    float* wide = widen ? widening_buffer(params.in_features * kLinearPanel) : nullptr;
    for (int64_t i = next++; i < num_pieces; i = next++) {
      const int64_t m0 = i / runs * panel_rows;
      const int64_t first = i % runs * kPiecePanels;
      run_piece(params, m0, std::min(m0 + panel_rows, params.rows), first,
                std::min(first + kPiecePanels, num_panels), wide);
    }
  });
}

}  // namespace pagedserve::cpu
