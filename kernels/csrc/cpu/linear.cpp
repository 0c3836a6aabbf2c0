// y = x W^T + b for a few rows of x (decode batches) on CPU, fp32.
//
// With a few rows a linear layer is bound by reading W, and BLAS sgemm, tuned for large
// products, spends much of that time packing W. This kernel streams W once instead: each thread
// takes chunks of output features and, for every tile of kTileCols weight rows, runs all rows
// of x against the tile while it sits in L1, prefetching the tiles ahead:
//
//   x  [M, K]   row m, 8 floats at a time
//   W  [N, K]   rows n .. n+7 (one tile)       acc[c] += x[m][k..k+8) * W[n+c][k..k+8)
//   y  [M, N]   y[m][n .. n+8) = lane sums of acc[0..7] (one transposing reduction) + b
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "cpu_kernels.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

constexpr int64_t kTileCols = kWidth;   // weight rows per tile: one reduction fills 8 outputs
constexpr int64_t kGrainCols = 64;      // weight rows per chunk handed to a thread
constexpr int64_t kPrefetchTiles = 2;   // how far ahead W is prefetched

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
  for (int c = 0; c < C; ++c) y[c] = sums[c] + (p.bias ? p.bias[n + c] : 0.0f);
}

// Asks for weight rows [n, n + count) to be brought into the cache.
PAGEDSERVE_INLINE void prefetch_weight_rows(const LinearParams& p, int64_t n, int64_t count) {
  const float* rows = p.weight + n * p.in_features;
  for (int64_t i = 0; i < count * p.in_features; i += 64 / sizeof(float)) {
    __builtin_prefetch(rows + i);
  }
}

PAGEDSERVE_CPU_CLONES void column_range(const LinearParams& p, int64_t begin, int64_t end) {
  int64_t n = begin;
  for (; n + kTileCols <= end; n += kTileCols) {
    // Keeps more of W in flight than the hardware prefetcher does while the tile computes.
    const int64_t ahead = n + kPrefetchTiles * kTileCols;
    if (ahead + kTileCols <= end) prefetch_weight_rows(p, ahead, kTileCols);
    for (int64_t m = 0; m < p.rows; ++m) tile<kTileCols>(p, m, n);
  }
  for (; n < end; ++n) {
    for (int64_t m = 0; m < p.rows; ++m) tile<1>(p, m, n);
  }
}

}  // namespace

void skinny_linear(const LinearParams& params) {
  // Chunks are handed out one at a time, so a thread that starts late (another process holds
  // its core) leaves its share to the others instead of holding up the whole layer.
  const int64_t num_chunks = (params.out_features + kGrainCols - 1) / kGrainCols;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_chunks);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t chunk = next++; chunk < num_chunks; chunk = next++) {
      const int64_t begin = chunk * kGrainCols;
      column_range(params, begin, std::min(begin + kGrainCols, params.out_features));
    }
  });
}

}  // namespace pagedserve::cpu
