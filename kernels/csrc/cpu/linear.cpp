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
//   way: 100-115 GFLOP/s on two cores of this AMD machine from 64 rows up, where MKL's sgemm
//   made 85-118 and the 8-row tile 85-90 (peak 182).
//
//   x  [M, K]   rows m .. m+2, 8 floats at a time       acc[r][c] += x[m+r][k..k+8) * W[n+c][k..k+8)
//   W  [N, K]   rows n .. n+3
//   y  [M, N]   y[m+r][n .. n+4) = lane sums of acc[r][0..3] + b
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "cpu_kernels.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kTileCols = kWidth;  // weight rows per tile of the few-rows loop
constexpr int64_t kBlockRows = 3;      // rows of x per register block
constexpr int64_t kBlockCols = 4;      // weight rows per register block
constexpr int64_t kBlockedMinRows = 24;  // from here on the register block is faster (measured)
constexpr int64_t kPanelRows = 192;    // rows of x a thread sweeps W with, at most
constexpr int64_t kGrainCols = 64;     // weight rows per chunk handed to a thread
constexpr int64_t kPrefetchCols = 16;  // how far ahead (weight rows) W is prefetched
constexpr int64_t kLineFloats = 64 / sizeof(float);  // floats per cache line

PAGEDSERVE_INLINE float bias_at(const LinearParams& p, int64_t n) {
  return p.bias ? p.bias[n] : 0.0f;
}

// y[m][n .. n+C) for C weight rows, C = kTileCols or 1.
template <int C>
PAGEDSERVE_INLINE void tile(const LinearParams& p, int64_t m, int64_t n) {
  vfloat acc[C] = {};
  const float* x = p.x + m * p.x_row_stride;
  const float* w = p.weight + n * p.in_features;
  for (int64_t k = 0; k < p.in_features; k += kWidth) {
    const vfloat xk = load(x + k);
    for (int c = 0; c < C; ++c) acc[c] += xk * load(w + c * p.in_features + k);
  }
  float sums[kTileCols];
  if constexpr (C == kTileCols) {
    store(sums, transpose_sums(acc));
  } else {
    sums[0] = hsum(acc[0]);
  }
  float* y = p.y + m * p.out_features + n;
  for (int c = 0; c < C; ++c) y[c] = sums[c] + bias_at(p, n + c);
}

// y[m .. m+R)[n .. n+kBlockCols) from R x kBlockCols accumulators.
template <int R>
PAGEDSERVE_INLINE void block(const LinearParams& p, int64_t m, int64_t n) {
  vfloat acc[R][kBlockCols] = {};
  const float* x = p.x + m * p.x_row_stride;
  const float* w = p.weight + n * p.in_features;
  for (int64_t k = 0; k < p.in_features; k += kWidth) {
    vfloat xk[R];
    for (int r = 0; r < R; ++r) xk[r] = load(x + r * p.x_row_stride + k);
    for (int c = 0; c < kBlockCols; ++c) {
      const vfloat wk = load(w + c * p.in_features + k);
      for (int r = 0; r < R; ++r) acc[r][c] += xk[r] * wk;
    }
  }
  for (int r = 0; r < R; ++r) {
    // Lanes 0..3 and 4..7 hold the low and high halves of the four sums.
    const vfloat s = pair_sums(pair_sums(acc[r][0], acc[r][1]), pair_sums(acc[r][2], acc[r][3]));
    float* y = p.y + (m + r) * p.out_features + n;
    for (int c = 0; c < kBlockCols; ++c) y[c] = s[c] + s[c + kBlockCols] + bias_at(p, n + c);
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

// y[m0 .. m1)[n0 .. n1) with the loop that suits m1 - m0 rows.
PAGEDSERVE_CPU_CLONES void chunk(const LinearParams& p, int64_t m0, int64_t m1, int64_t n0,
                                 int64_t n1) {
  const int64_t rows = m1 - m0;
  int64_t n = n0;
  if (rows < kBlockedMinRows) {
    for (; n + kTileCols <= n1; n += kTileCols) {
      for (int64_t m = m0; m < m1; ++m) {
        prefetch_slice(p, n, kTileCols, n1, m - m0, rows);
        tile<kTileCols>(p, m, n);
      }
    }
  } else {
    const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
    for (; n + kBlockCols <= n1; n += kBlockCols) {
      int64_t m = m0;
      for (; m + kBlockRows <= m1; m += kBlockRows) {
        // Only the first panel: later ones find W in L3.
        if (m0 == 0) prefetch_slice(p, n, kBlockCols, n1, (m - m0) / kBlockRows, blocks);
        block<kBlockRows>(p, m, n);
      }
      for (; m < m1; ++m) block<1>(p, m, n);
    }
  }
  for (; n < n1; ++n) {
    for (int64_t m = m0; m < m1; ++m) tile<1>(p, m, n);
  }
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
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t piece = next++; piece < num_pieces; piece = next++) {
      const int64_t m0 = piece / num_chunks * panel_rows;
      const int64_t n0 = piece % num_chunks * kGrainCols;
      chunk(params, m0, std::min(m0 + panel_rows, params.rows), n0,
            std::min(n0 + kGrainCols, params.out_features));
    }
  });
}

}  // namespace pagedserve::cpu
