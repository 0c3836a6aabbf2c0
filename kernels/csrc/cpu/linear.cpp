// y = x W^T + b on CPU, fp32, for the rows of a decode batch and for a prefill's tokens alike.
//
// Two inner loops, picked by how many rows of x there are:
//
// * A few rows (decode with a small batch): reading W is the cost, and BLAS sgemm, tuned for
//   large products, spends much of it packing W. Each thread takes chunks of output features
//   and, for every tile of 8 weight rows, runs every row of x against the tile while it sits in
//   L1, prefetching the tiles ahead; one transposing reduction turns 8 accumulators into
//   y[m][n .. n+8).
// * More rows: arithmetic is the cost, and the 8-row tile loads 9 vectors for 8 FMAs, so the
//   load ports, not the FMA units, set its pace. A 3 x 4 register block (3 rows of x against 4
//   weight rows, 12 accumulators) loads 7 vectors for 12 FMAs instead. Rows are cut into panels
//   of at most 192, each swept over a chunk of W, so a prefill's thousands of rows run the same
//   way: 100-115 GFLOP/s on two cores of an AMD machine without AVX-512 from 64 rows up, where
//   MKL's sgemm made 85-118 and the 8-row tile 85-90 (peak 182).
//
// Both loops run on 16-float vectors where the CPU has AVX-512 and in_features is a multiple of
// 16, with 3 x 8 blocks. On two cores of such a Xeon, 30 layers of SmolLM2's four shapes took
// 21 ms at 8 rows and 30 ms at 16, against 28 and 44 ms on 8-float vectors in a run minutes
// before; from about 48 rows MKL's sgemm, which packs W, is faster there, and layer_ops.linear
// hands it those rows (`bench/linear.py` prints the two side by side).
//
//   x  [M, K]   rows m .. m+2, 8 floats at a time       acc[r][c] += x[m+r][k..k+8) * W[n+c][k..k+8)
//   W  [N, K]   rows n .. n+3
//   y  [M, N]   y[m+r][n .. n+4) = lane sums of acc[r][0..3] + b
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "cpu_kernels.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kTileCols = kWidth;  // weight rows per tile of the few-rows loop
constexpr int64_t kBlockRows = 3;      // rows of x per register block
constexpr int64_t kBlockedMinRows = 24;  // from here on the register block is faster (measured)
constexpr int64_t kPanelRows = 192;    // rows of x a thread sweeps W with, at most
constexpr int64_t kGrainCols = 64;     // weight rows per chunk handed to a thread
constexpr int64_t kPrefetchCols = 16;  // how far ahead (weight rows) W is prefetched
constexpr int64_t kLineFloats = 64 / sizeof(float);  // floats per cache line

// The loops below take their vector type V as a parameter: vfloat everywhere, and 16 floats
// (one AVX-512 register) on the machines that have them, where it doubles the FMAs per
// instruction. Each accumulator is folded to a vfloat before the lane sums.
using vfloat16 = float __attribute__((vector_size(64)));

template <typename V>
constexpr int64_t kLanes = sizeof(V) / sizeof(float);

template <typename V>
PAGEDSERVE_INLINE V load_as(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

PAGEDSERVE_INLINE vfloat fold(vfloat v) { return v; }

PAGEDSERVE_INLINE vfloat fold(vfloat16 v) {  // lane l of the result: v[l] + v[l + 8]
  vfloat halves[2];
  std::memcpy(halves, &v, sizeof(v));
  return halves[0] + halves[1];
}

PAGEDSERVE_INLINE float bias_at(const LinearParams& p, int64_t n) {
  return p.bias ? p.bias[n] : 0.0f;
}

// y[m][n .. n+C) for C weight rows, C = kTileCols or 1.
template <typename V, int C>
PAGEDSERVE_INLINE void tile(const LinearParams& p, int64_t m, int64_t n) {
  V acc[C] = {};
  const float* x = p.x + m * p.x_row_stride;
  const float* w = p.weight + n * p.in_features;
  for (int64_t k = 0; k < p.in_features; k += kLanes<V>) {
    const V xk = load_as<V>(x + k);
    for (int c = 0; c < C; ++c) acc[c] += xk * load_as<V>(w + c * p.in_features + k);
  }
  float sums[kTileCols];
  if constexpr (C == kTileCols) {
    vfloat folded[kTileCols];
    for (int c = 0; c < C; ++c) folded[c] = fold(acc[c]);
    store(sums, transpose_sums(folded));
  } else {
    sums[0] = hsum(fold(acc[0]));
  }
  float* y = p.y + m * p.out_features + n;
  for (int c = 0; c < C; ++c) y[c] = sums[c] + bias_at(p, n + c);
}

// Weight rows per register block: with 16-float vectors a block of 3 x 4 would load x as
// often per FMA while each FMA does twice the work, and L2 cannot feed x that fast; 3 x 8 (24 of
// AVX-512's 32 registers) halves x's loads per FMA.
template <typename V>
constexpr int kBlockCols = kLanes<V> == 16 ? 8 : 4;

// y[m .. m+R)[n .. n+kBlockCols<V>) from R x kBlockCols<V> accumulators.
template <typename V, int R>
PAGEDSERVE_INLINE void block(const LinearParams& p, int64_t m, int64_t n) {
  constexpr int C = kBlockCols<V>;
  V acc[R][C] = {};
  const float* x = p.x + m * p.x_row_stride;
  const float* w = p.weight + n * p.in_features;
  for (int64_t k = 0; k < p.in_features; k += kLanes<V>) {
    V xk[R];
    for (int r = 0; r < R; ++r) xk[r] = load_as<V>(x + r * p.x_row_stride + k);
    for (int c = 0; c < C; ++c) {
      const V wk = load_as<V>(w + c * p.in_features + k);
      for (int r = 0; r < R; ++r) acc[r][c] += xk[r] * wk;
    }
  }
  for (int r = 0; r < R; ++r) {
    vfloat f[C];
    for (int c = 0; c < C; ++c) f[c] = fold(acc[r][c]);
    float sums[kWidth];
    if constexpr (C == kWidth) {
      store(sums, transpose_sums(f));
    } else {  // lanes 0..3 and 4..7 hold the low and high halves of the four sums
      const vfloat s = pair_sums(pair_sums(f[0], f[1]), pair_sums(f[2], f[3]));
      for (int c = 0; c < C; ++c) sums[c] = s[c] + s[c + C];
    }
    float* y = p.y + (m + r) * p.out_features + n;
    for (int c = 0; c < C; ++c) y[c] = sums[c] + bias_at(p, n + c);
  }
}

// Slice `i` of `slices` of the weight rows [n + kPrefetchCols, + count): the rows a later tile
// needs, asked for a slice between blocks of work rather than all at once, since a burst of
// prefetches fills the miss queue and the loads behind it wait (measured: 7-15 % faster
// linears from 4 to 20 rows). Keeps more of W in flight than the hardware prefetcher does.
PAGEDSERVE_INLINE void prefetch_slice(const LinearParams& p, int64_t n, int64_t count,
                                      int64_t end, int64_t i, int64_t slices) {
  if (n + kPrefetchCols + count > end) return;
  const float* rows = p.weight + (n + kPrefetchCols) * p.in_features;
  const int64_t lines = count * p.in_features / kLineFloats;
  for (int64_t l = lines * i / slices; l < lines * (i + 1) / slices; ++l) {
    __builtin_prefetch(rows + l * kLineFloats);
  }
}

// y[m0 .. m1)[n0 .. n1) with the loop that suits m1 - m0 rows; in_features % kLanes<V> == 0.
template <typename V>
PAGEDSERVE_INLINE void chunk(const LinearParams& p, int64_t m0, int64_t m1, int64_t n0,
                             int64_t n1) {
  const int64_t rows = m1 - m0;
  int64_t n = n0;
  if (rows < kBlockedMinRows) {
    for (; n + kTileCols <= n1; n += kTileCols) {
      for (int64_t m = m0; m < m1; ++m) {
        prefetch_slice(p, n, kTileCols, n1, m - m0, rows);
        tile<V, kTileCols>(p, m, n);
      }
    }
  } else {
    const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
    for (; n + kBlockCols<V> <= n1; n += kBlockCols<V>) {
      int64_t m = m0;
      for (; m + kBlockRows <= m1; m += kBlockRows) {
        // Only the first panel: later ones find W in L3.
        if (m0 == 0) prefetch_slice(p, n, kBlockCols<V>, n1, (m - m0) / kBlockRows, blocks);
        block<V, kBlockRows>(p, m, n);
      }
      for (; m < m1; ++m) block<V, 1>(p, m, n);
    }
  }
  for (; n < n1; ++n) {
    for (int64_t m = m0; m < m1; ++m) tile<V, 1>(p, m, n);
  }
}

PAGEDSERVE_CPU_CLONES void chunk_narrow(const LinearParams& p, int64_t m0, int64_t m1,
                                        int64_t n0, int64_t n1) {
  chunk<vfloat>(p, m0, m1, n0, n1);
}

#ifdef PAGEDSERVE_CPU_CLONES_X86
__attribute__((target("arch=x86-64-v4"))) void chunk_wide(const LinearParams& p, int64_t m0,
                                                           int64_t m1, int64_t n0, int64_t n1) {
  chunk<vfloat16>(p, m0, m1, n0, n1);
}
#endif

using ChunkFn = void (*)(const LinearParams&, int64_t, int64_t, int64_t, int64_t);

// 16-float vectors where the CPU has them and a row holds whole ones.
ChunkFn pick_chunk(const LinearParams& p) {
#ifdef PAGEDSERVE_CPU_CLONES_X86
  // x86-64-v4's features one by one: not every GCC takes the level's name here.
  static const bool has_avx512 = __builtin_cpu_supports("avx512f") &&
                                 __builtin_cpu_supports("avx512bw") &&
                                 __builtin_cpu_supports("avx512cd") &&
                                 __builtin_cpu_supports("avx512dq") &&
                                 __builtin_cpu_supports("avx512vl");
  if (has_avx512 && p.in_features % kLanes<vfloat16> == 0) return chunk_wide;
#endif
  return chunk_narrow;
}

}  // namespace

void linear(const LinearParams& params) {
  // Work is cut into (panel of rows, chunk of output features) pieces handed out one at a time,
  // so a thread that starts late (another process holds its core) leaves its share to the
  // others instead of holding up the whole layer.
  if (params.rows == 0 || params.out_features == 0) return;  // e.g. a step with no logits to take
  const int64_t num_panels = (params.rows + kPanelRows - 1) / kPanelRows;
  const int64_t panel_rows = (params.rows + num_panels - 1) / num_panels;  // evened out
  const int64_t num_chunks = (params.out_features + kGrainCols - 1) / kGrainCols;
  const int64_t num_pieces = num_panels * num_chunks;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_pieces);
  const ChunkFn run_chunk = pick_chunk(params);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t piece = next++; piece < num_pieces; piece = next++) {
      const int64_t m0 = piece / num_chunks * panel_rows;
      const int64_t n0 = piece % num_chunks * kGrainCols;
      run_chunk(params, m0, std::min(m0 + panel_rows, params.rows), n0,
                std::min(n0 + kGrainCols, params.out_features));
    }
  });
}

}  // namespace pagedserve::cpu
