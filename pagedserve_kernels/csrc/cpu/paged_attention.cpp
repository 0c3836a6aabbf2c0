// PagedAttention on CPU: each new token attends to its sequence's KV blocks, read in place.
//
// A work item is (sequence, run of kv heads, tile of new tokens, range of the context; the whole
// context unless a small decode batch cuts it into parts). It serves every query head of
// its kv heads: a block's K/V rows come from memory once (converted to fp32 once for bf16 / fp16)
// and are reused from L1 by all the group's query rows (grouped-query attention). A block holds
// [block_size, num_kv_heads, head_dim]: one kv head's rows are strided, and read alone they
// stream poorly (the hardware prefetchers follow whole lines), so a decode item takes all kv
// heads of its sequence and reads each block as one run. It walks the sequence's blocks through
// the block table, prefetching the next one as it goes, with an online softmax over rows
// r = (tile token t, head g of the group):
//
//   context:  [ blk b0 | blk b1 | ... | blk b_last ]      b_last may be partial
//   per block, for the positions j of the block that row r may see (j <= its own position and,
//   with a sliding window W, j > its own position - W; blocks wholly before it are not read):
//     s[r][j]  = scale * q_r . k_j
//     m_r'     = max(m_r, max_j s[r][j]);   acc_r, l_r *= e^(m_r - m_r')
//     acc_r   += sum_j e^(s[r][j] - m_r') v_j;   l_r += sum_j e^(s[r][j] - m_r')
//   out_r = acc_r / l_r
//
// Parts of one context are merged afterwards: out_r = sum_p e^(m_p - m) acc_p / sum_p e^(m_p - m)
// l_p with m = max_p m_p.
//
// q_r . k_j runs eight keys at a time (one load of q per eight FMAs, one transposing reduction
// per eight logits); the value pass keeps up to 64 floats of acc_r in registers. Two rows that
// see the same positions of a block (other heads of the token, or later tokens past the
// diagonal) go through it together, each load of a key or a value serving both; each row's
// arithmetic is the same as alone, so its result does not depend on its partner.
//
// That is the row path, which decode (one new token per sequence) takes. A prompt of two tokens
// or more takes the tile path instead: the item's rows (tokens x group heads of one kv head) lie
// in vector lanes, row r in lane r % L of vector r / L, and a block is two small matrix products
// with no horizontal sums:
//
//   logits   s[j][r]   = sum_d qt[d][r] k[j][d]     k[j][d] broadcast against L rows' queries
//   softmax  lane-wise, position by position: the block's max, the exponentials, their sums
//   values   acc[r][:] += sum_j s[j][r] v[j][:]     s[j][r] broadcast against a row of values
//
// The transposed queries qt are built once per item; each row's sums run in position and
// head-dimension order whichever rows share its tile, so a token's result does not depend on how
// its prompt was cut into chunks of two tokens or more (a chunk of one takes the row path, equal
// to rounding). Where the CPU has AVX-512 and the head size is a multiple of 16, the tile path
// runs on 16-float vectors.
//
// Items are sorted by cost (rows x positions seen) and handed out one at a time from a shared
// counter, so the threads stay busy when sequences differ in length.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

// Query rows (tokens x group heads) per work item in prefill: enough to reuse each K/V row
// from L1 many times, few enough that the rows' queries and accumulators (32 KiB at head size
// 64) stay in L1 too. 64 took 10-18 % less time than 32 on long prompts (bench/RESULTS.md).
constexpr int64_t kTileRows = 64;

// Multiply-adds a thread takes at least: smaller calls stay on one thread, where a fork/join
// would cost more than it saves; low enough that a one-sequence decode step over a long context
// forks.
constexpr int64_t kMinWorkPerThread = 1 << 17;

// Work items per thread below which decode cuts sequences into parts of their context, to
// balance the load.
constexpr int64_t kMinItemsPerThread = 4;

// Context positions a part reads at least: its unnormalised result costs a merge.
constexpr int64_t kMinPartPositions = 64;

// Lanes of the widest vector: a tile's rows are padded to a multiple of it.
constexpr int64_t kMaxLanes = 16;

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

struct WorkItem {
  int64_t seq;
  int64_t first_kv_head;
  int64_t num_kv_heads;
  int64_t first_token;  // row of the tile's first token in query and out
  int64_t num_tokens;   // new tokens in the tile
  int64_t first_pos;    // position of the tile's first token in its sequence
  int64_t begin;        // context positions [begin, end) read; begin on a block boundary
  int64_t end;
  int64_t part;  // decode only: slot of its unnormalised result among the partials; -1: none
  bool tile;     // of a prompt of two tokens or more (one kv head): the tile path

  int64_t cost() const { return num_kv_heads * num_tokens * (end - begin); }
};

// A decode sequence whose context was cut into parts (partials slots [first_part, +num_parts)).
struct Split {
  int64_t seq;
  int64_t first_part;
  int64_t num_parts;
};

struct Plan {
  std::vector<WorkItem> items;  // costliest first
  std::vector<Split> splits;
  int64_t num_parts = 0;
};

// Floats of one part's result: every head's accumulator, then the heads' max and sum.
int64_t part_floats(const AttentionParams& p) { return p.num_heads * (p.head_dim + 2); }

// One thread's fp32 working set for items of up to max_rows query rows (the tile path pads them
// to whole vectors).
class Scratch {
 public:
  Scratch(const AttentionParams& p, int64_t max_rows) {
    const int64_t rows = round_up(max_rows, kMaxLanes);
    buffer_.resize(rows * (2 * p.head_dim + 3) + (rows + 2 * p.head_dim) * p.block_size);
    float* next = buffer_.data();
    auto take = [&next](int64_t n) { return std::exchange(next, next + n); };
    q = take(rows * p.head_dim);
    acc = take(rows * p.head_dim);
    max = take(rows);
    sum = take(rows);
    pos = take(rows);
    logits = take(rows * p.block_size);
    keys = take(p.block_size * p.head_dim);
    values = take(p.block_size * p.head_dim);
  }

  float* q;       // [rows, head_dim], scaled queries; the tile path's [head_dim, rows]
  float* acc;     // [rows, head_dim], unnormalised outputs
  float* max;     // [rows], running max logit
  float* sum;     // [rows], running sum of exponentials
  float* pos;     // [rows], the tile path's row positions (-1: padding)
  float* logits;  // row path: [2, block_size], two rows' logits in one block, then their
                  // exponentials; tile path: [block_size, rows], likewise
  float* keys;    // [block_size, head_dim], one block's keys as fp32 (non-fp32 caches only)
  float* values;  // [block_size, head_dim], likewise for values

 private:
  std::vector<float> buffer_;
};

// Pulls the next block's K and V rows toward L2 a slice at a time, one slice before each of a
// row's two passes (keys, values) over the current block: spread out, the prefetches overlap
// with the arithmetic, where asked for all at once they would fill the miss queue and stall the
// core.
template <typename T>
class NextBlockPrefetch {
 public:
  NextBlockPrefetch() = default;
  // `rows` rows of `width` elements at `stride`, in both caches; `slices` calls to take them.
  NextBlockPrefetch(const T* keys, const T* values, int64_t stride, int64_t rows, int64_t width,
                    int64_t slices)
      : keys_(keys),
        values_(values),
        stride_(stride),
        rows_(width == stride ? 1 : rows),  // rows back to back: one long row
        lines_per_row_((width * rows / rows_ + kLine - 1) / kLine),
        slice_((rows_ * lines_per_row_ + slices - 1) / slices) {}

  // Row by row, line by line, on counters: no division per line (the line's row and column)
  // in this hot loop.
  PAGEDSERVE_INLINE void next_slice() {
    for (int64_t i = 0; i < slice_ && row_ < rows_; ++i) {
      const int64_t offset = row_ * stride_ + line_ * kLine;
      __builtin_prefetch(keys_ + offset, 0, 2);  // 2: into L2, where a block fits
      __builtin_prefetch(values_ + offset, 0, 2);
      if (++line_ == lines_per_row_) {
        line_ = 0;
        ++row_;
      }
    }
  }

 private:
  static constexpr int64_t kLine = 64 / sizeof(T);  // elements per cache line
  const T* keys_ = nullptr;
  const T* values_ = nullptr;
  int64_t stride_ = 0, rows_ = 0, lines_per_row_ = 0, slice_ = 0, row_ = 0, line_ = 0;
};

// logits[j] = q . keys[j] for j < n. Eight keys at a time share each load of q and end in one
// transposing reduction.
PAGEDSERVE_INLINE void dot_keys(const float* q, Rows keys, int64_t n, int64_t dim, float* logits) {
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    vfloat acc[kWidth] = {};
    for (int64_t d = 0; d < dim; d += kWidth) {
      const vfloat qd = load(q + d);
      for (int t = 0; t < kWidth; ++t) acc[t] += qd * load(keys[j + t] + d);
    }
    store(logits + j, transpose_sums(acc));
  }
  for (; j < n; ++j) {
    vfloat acc = {};
    for (int64_t d = 0; d < dim; d += kWidth) acc += load(q + d) * load(keys[j] + d);
    logits[j] = hsum(acc);
  }
}

// dot_keys for two rows that see the same keys: each load of a key serves both. Each row's
// arithmetic is dot_keys' to the bit, so a row's result does not depend on its partner.
PAGEDSERVE_INLINE void dot_keys2(const float* q0, const float* q1, Rows keys, int64_t n,
                                 int64_t dim, float* logits0, float* logits1) {
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) {
    vfloat acc0[kWidth] = {}, acc1[kWidth] = {};
    for (int64_t d = 0; d < dim; d += kWidth) {
      const vfloat a = load(q0 + d), b = load(q1 + d);
      for (int t = 0; t < kWidth; ++t) {
        const vfloat k = load(keys[j + t] + d);
        acc0[t] += a * k;
        acc1[t] += b * k;
      }
    }
    store(logits0 + j, transpose_sums(acc0));
    store(logits1 + j, transpose_sums(acc1));
  }
  for (; j < n; ++j) {
    vfloat acc0 = {}, acc1 = {};
    for (int64_t d = 0; d < dim; d += kWidth) {
      const vfloat k = load(keys[j] + d);
      acc0 += load(q0 + d) * k;
      acc1 += load(q1 + d) * k;
    }
    logits0[j] = hsum(acc0);
    logits1[j] = hsum(acc1);
  }
}

// acc[d0, d0 + C * kWidth) += sum_j p[j] * values[j][same range], held in C registers.
template <int C>
PAGEDSERVE_INLINE void accumulate_chunk(const float* p, Rows values, int64_t n, int64_t d0,
                                        float* acc) {
  vfloat a[C];
  for (int c = 0; c < C; ++c) a[c] = load(acc + d0 + c * kWidth);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values[j] + d0;
    for (int c = 0; c < C; ++c) a[c] += load(v + c * kWidth) * p[j];
  }
  for (int c = 0; c < C; ++c) store(acc + d0 + c * kWidth, a[c]);
}

// acc += sum_j p[j] * values[j] for j < n, in register-sized chunks of the head.
PAGEDSERVE_INLINE void accumulate(const float* p, Rows values, int64_t n, int64_t dim,
                                  float* acc) {
  int64_t d = 0;
  for (; d + 8 * kWidth <= dim; d += 8 * kWidth) accumulate_chunk<8>(p, values, n, d, acc);
  if (d + 4 * kWidth <= dim) {
    accumulate_chunk<4>(p, values, n, d, acc);
    d += 4 * kWidth;
  }
  if (d + 2 * kWidth <= dim) {
    accumulate_chunk<2>(p, values, n, d, acc);
    d += 2 * kWidth;
  }
  if (d < dim) accumulate_chunk<1>(p, values, n, d, acc);
}

// accumulate_chunk for two rows: each load of a value serves both, each row's sums as alone.
template <int C>
PAGEDSERVE_INLINE void accumulate_chunk2(const float* p0, const float* p1, Rows values, int64_t n,
                                         int64_t d0, float* acc0, float* acc1) {
  vfloat a[C], b[C];
  for (int c = 0; c < C; ++c) a[c] = load(acc0 + d0 + c * kWidth);
  for (int c = 0; c < C; ++c) b[c] = load(acc1 + d0 + c * kWidth);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values[j] + d0;
    for (int c = 0; c < C; ++c) {
      const vfloat x = load(v + c * kWidth);
      a[c] += x * p0[j];
      b[c] += x * p1[j];
    }
  }
  for (int c = 0; c < C; ++c) store(acc0 + d0 + c * kWidth, a[c]);
  for (int c = 0; c < C; ++c) store(acc1 + d0 + c * kWidth, b[c]);
}

// accumulate for two rows, in chunks of at most four vectors a row (both rows' accumulators
// in registers).
PAGEDSERVE_INLINE void accumulate2(const float* p0, const float* p1, Rows values, int64_t n,
                                   int64_t dim, float* acc0, float* acc1) {
  int64_t d = 0;
  for (; d + 4 * kWidth <= dim; d += 4 * kWidth) {
    accumulate_chunk2<4>(p0, p1, values, n, d, acc0, acc1);
  }
  if (d + 2 * kWidth <= dim) {
    accumulate_chunk2<2>(p0, p1, values, n, d, acc0, acc1);
    d += 2 * kWidth;
  }
  if (d < dim) accumulate_chunk2<1>(p0, p1, values, n, d, acc0, acc1);
}

// Folds one row's logits[0, n) into its running max and sum and rescales its accumulator;
// leaves the exponentials in logits for the value pass.
PAGEDSERVE_INLINE void update_softmax(float* logits, int64_t n, int64_t dim, float& max,
                                      float& sum, float* acc) {
  vfloat vmaxes = splat(logits[0]);
  int64_t j = 0;
  for (; j + kWidth <= n; j += kWidth) vmaxes = vmax(vmaxes, load(logits + j));
  float block_max = hmax(vmaxes);
  for (; j < n; ++j) block_max = block_max > logits[j] ? block_max : logits[j];
  const float new_max = std::max(max, block_max);
  // 0 on the first block (-inf); libm's expf is costly and runs only when the max moves (rarely).
  const float correction = new_max == max ? 1.0f : std::exp(max - new_max);
  vfloat vsum = {};
  for (j = 0; j + kWidth <= n; j += kWidth) {
    const vfloat e = exp_nonpositive(load(logits + j) - new_max);
    store(logits + j, e);
    vsum += e;
  }
  float block_sum = hsum(vsum);
  for (; j < n; ++j) {
    logits[j] = exp_nonpositive(splat(logits[j] - new_max))[0];
    block_sum += logits[j];
  }
  sum = sum * correction + block_sum;
  if (correction != 1.0f) {
    for (int64_t d = 0; d < dim; d += kWidth) store(acc + d, load(acc + d) * correction);
  }
  max = new_max;
}

// Elements from a cache's start to block `index` of the item's sequence, at its first kv head.
PAGEDSERVE_INLINE int64_t block_offset(const AttentionParams& p, const WorkItem& item,
                                       int64_t index) {
  const int64_t block = p.block_tables[item.seq * p.max_num_blocks_per_seq + index];
  return (block * p.block_size * p.num_kv_heads + item.first_kv_head) * p.head_dim;
}

// Positions at the start of the block at `start` that lie before the sliding window of the
// token at `pos` (its window: [pos - sliding_window + 1, pos]).
PAGEDSERVE_INLINE int64_t window_skip(const AttentionParams& p, int64_t pos, int64_t start) {
  return p.sliding_window > 0 ? std::max<int64_t>(0, pos - p.sliding_window + 1 - start) : 0;
}

// First block boundary at or before the window of the token at `pos`.
int64_t window_begin(const AttentionParams& p, int64_t pos) {
  if (p.sliding_window <= 0) return 0;
  return std::max<int64_t>(0, pos - p.sliding_window + 1) / p.block_size * p.block_size;
}

// Block `index` of the item's sequence, the item's kv heads, `slices` calls to take it.
template <typename T>
PAGEDSERVE_INLINE NextBlockPrefetch<T> block_prefetch(const AttentionParams& p,
                                                      const WorkItem& item, int64_t index,
                                                      int64_t slices) {
  const int64_t offset = block_offset(p, item, index);
  return NextBlockPrefetch<T>(static_cast<const T*>(p.key_cache) + offset,
                              static_cast<const T*>(p.value_cache) + offset,
                              p.num_kv_heads * p.head_dim, p.block_size,
                              item.num_kv_heads * p.head_dim, slices);
}

// The row path. `following`: the item a thread is likely to take next (its first block is
// prefetched during this item's last), or nullptr. Q: the query's and output's type, T: the
// caches'.
template <typename Q, typename T>
PAGEDSERVE_INLINE void attend_rows(const AttentionParams& p, const WorkItem& item,
                                   const Scratch& s, float* partials, const WorkItem* following) {
  const int64_t dim = p.head_dim, block_size = p.block_size;
  const int64_t group = p.num_heads / p.num_kv_heads, rows = item.num_tokens * group;
  const int64_t kv_token_stride = p.num_kv_heads * dim;
  const Q* query = static_cast<const Q*>(p.query);
  // Scratch row h * rows + t * group + g: kv head h of the item, tile token t, group head g.
  for (int64_t h = 0; h < item.num_kv_heads; ++h) {
    const int64_t head_offset = (item.first_kv_head + h) * group * dim;
    for (int64_t t = 0; t < item.num_tokens; ++t) {
      const Q* src = query + (item.first_token + t) * p.query_token_stride + head_offset;
      load_scaled(src, p.scale, s.q + (h * rows + t * group) * dim, group * dim);
    }
  }
  const int64_t all_rows = item.num_kv_heads * rows;
  std::fill(s.acc, s.acc + all_rows * dim, 0.0f);
  std::fill(s.max, s.max + all_rows, -std::numeric_limits<float>::infinity());
  std::fill(s.sum, s.sum + all_rows, 0.0f);

  for (int64_t start = item.begin; start < item.end; start += block_size) {
    const int64_t len = std::min(block_size, item.end - start);
    const int64_t first_row_offset = block_offset(p, item, start / block_size);
    NextBlockPrefetch<T> prefetch;
    if (start + block_size < item.end) {
      prefetch = block_prefetch<T>(p, item, start / block_size + 1, 2 * all_rows);
    } else if (following != nullptr) {  // the item some thread takes next: its first block
      prefetch = block_prefetch<T>(p, *following, following->begin / block_size, 2 * all_rows);
    }
    // Token t of the tile sees positions <= first_pos + t: rows before first_row see none here.
    const int64_t first_row = std::max<int64_t>(0, start - item.first_pos) * group;
    for (int64_t h = 0; h < item.num_kv_heads; ++h) {
      const int64_t offset = first_row_offset + h * dim;
      const Rows keys = as_float_rows(static_cast<const T*>(p.key_cache) + offset,
                                      kv_token_stride, len, dim, s.keys);
      const Rows values = as_float_rows(static_cast<const T*>(p.value_cache) + offset,
                                        kv_token_stride, len, dim, s.values);
      // The row sees the block's positions [start + skip, start + seen).
      auto seen_of = [&](int64_t r) {
        const int64_t pos = item.first_pos + r / group;
        return std::pair{window_skip(p, pos, start), std::min(len, pos + 1 - start)};
      };
      for (int64_t r = first_row; r < rows;) {
        const auto [skip, seen] = seen_of(r);
        if (skip >= seen) {
          ++r;
          continue;
        }
        const int64_t row = h * rows + r, n = seen - skip;
        float* acc = s.acc + row * dim;
        if (r + 1 < rows && seen_of(r + 1) == std::pair{skip, seen}) {  // two rows at once
          float* logits1 = s.logits + block_size;
          prefetch.next_slice();
          prefetch.next_slice();
          dot_keys2(s.q + row * dim, s.q + (row + 1) * dim, keys.from(skip), n, dim, s.logits,
                    logits1);
          update_softmax(s.logits, n, dim, s.max[row], s.sum[row], acc);
          update_softmax(logits1, n, dim, s.max[row + 1], s.sum[row + 1], acc + dim);
          prefetch.next_slice();
          prefetch.next_slice();
          accumulate2(s.logits, logits1, values.from(skip), n, dim, acc, acc + dim);
          r += 2;
          continue;
        }
        prefetch.next_slice();
        dot_keys(s.q + row * dim, keys.from(skip), n, dim, s.logits);
        update_softmax(s.logits, n, dim, s.max[row], s.sum[row], acc);
        prefetch.next_slice();
        accumulate(s.logits, values.from(skip), n, dim, acc);
        ++r;
      }
    }
  }

  if (item.part >= 0) {  // a decode item over every kv head: scratch row = query head
    float* result = partials + item.part * part_floats(p);
    std::copy(s.acc, s.acc + all_rows * dim, result);
    std::copy(s.max, s.max + all_rows, result + all_rows * dim);
    std::copy(s.sum, s.sum + all_rows, result + all_rows * (dim + 1));
    return;
  }
  for (int64_t h = 0; h < item.num_kv_heads; ++h) {
    const int64_t head_offset = (item.first_kv_head + h) * group * dim;
    Q* out = static_cast<Q*>(p.out) + item.first_token * p.num_heads * dim + head_offset;
    for (int64_t r = 0; r < rows; ++r) {
      Q* dst = out + (r / group) * p.num_heads * dim + (r % group) * dim;
      const int64_t row = h * rows + r;
      store_scaled(s.acc + row * dim, 1.0f / s.sum[row], dst, dim);
    }
  }
}

// Register blocks of the tile path: row vectors x keys for the logits, rows x up to four vectors
// of the head for the values (AVX2 has 16 vector registers, AVX-512 32).
template <typename V>
struct TileBlocks;
template <>
struct TileBlocks<vfloat> {
  static constexpr int kKeys = 4, kValueRows = 2;
};
template <>
struct TileBlocks<vfloat16> {
  static constexpr int kKeys = 8, kValueRows = 4;
};

// logits[j][lanes of vectors v0 .. v0 + NV) = q . k_j for j in [j0, j0 + NJ); qt: [dim, padded].
template <typename V, int NV, int NJ>
PAGEDSERVE_INLINE void tile_logits_block(const float* qt, int64_t padded, Rows keys, int64_t j0,
                                         int64_t v0, int64_t dim, float* logits) {
  constexpr int64_t L = kLanes<V>;
  V acc[NJ][NV] = {};
  for (int64_t d = 0; d < dim; ++d) {
    V q[NV];
    for (int n = 0; n < NV; ++n) q[n] = load_as<V>(qt + d * padded + (v0 + n) * L);
    for (int k = 0; k < NJ; ++k) {
      const float key = keys[j0 + k][d];
      for (int n = 0; n < NV; ++n) acc[k][n] += q[n] * key;
    }
  }
  for (int k = 0; k < NJ; ++k) {
    for (int n = 0; n < NV; ++n) store_as(logits + (j0 + k) * padded + (v0 + n) * L, acc[k][n]);
  }
}

// logits[j][r] for j < len and the rows of vectors [first_vector, padded / L), two vectors at a
// time; a slice of the next block's prefetch per block of keys.
template <typename V, typename T>
PAGEDSERVE_INLINE void tile_logits(const float* qt, int64_t padded, int64_t first_vector,
                                   Rows keys, int64_t len, int64_t dim, float* logits,
                                   NextBlockPrefetch<T>& prefetch) {
  constexpr int64_t L = kLanes<V>;
  constexpr int NJ = TileBlocks<V>::kKeys;
  const int64_t vectors = padded / L;
  for (int64_t v = first_vector; v < vectors; v += 2) {
    const bool pair = v + 1 < vectors;
    int64_t j = 0;
    for (; j + NJ <= len; j += NJ) {
      prefetch.next_slice();
      if (pair) {
        tile_logits_block<V, 2, NJ>(qt, padded, keys, j, v, dim, logits);
      } else {
        tile_logits_block<V, 1, NJ>(qt, padded, keys, j, v, dim, logits);
      }
    }
    for (; j < len; ++j) {
      if (pair) {
        tile_logits_block<V, 2, 1>(qt, padded, keys, j, v, dim, logits);
      } else {
        tile_logits_block<V, 1, 1>(qt, padded, keys, j, v, dim, logits);
      }
    }
  }
}

// Folds the block's logits (positions start + j, j < len) into each row's running max and sum,
// rescales the accumulators of rows whose max moved, and leaves in logits the weights of the
// value pass. Masked: a row's weight is 0 where it may not see the position (after its own, or
// before its sliding window of `window` positions; pos: the rows' positions).
template <typename V, bool kMasked>
PAGEDSERVE_INLINE void tile_softmax(float* logits, int64_t padded, int64_t first_vector,
                                    int64_t len, int64_t start, int64_t window, const Scratch& s,
                                    int64_t dim) {
  constexpr int64_t L = kLanes<V>;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t v = first_vector; v < padded / L; ++v) {
    float* column = logits + v * L;
    const V row_pos = load_as<V>(s.pos + v * L);
    V block_max = V{} - kInf;
    for (int64_t j = 0; j < len; ++j) {
      V x = load_as<V>(column + j * padded);
      if constexpr (kMasked) {
        const float at = static_cast<float>(start + j);
        auto visible = row_pos >= at;
        if (window > 0) visible &= row_pos < at + static_cast<float>(window);
        x = visible ? x : V{} - kInf;
        store_as(column + j * padded, x);
      }
      block_max = vmax(block_max, x);
    }
    const V old_max = load_as<V>(s.max + v * L);
    const V new_max = vmax(old_max, block_max);
    // Lanes with nothing seen yet have both at -inf: their difference is NaN, selected away.
    const V correction = new_max == old_max ? V{} + 1.0f : exp_nonpositive(old_max - new_max);
    V block_sum = {};
    for (int64_t j = 0; j < len; ++j) {
      const V x = load_as<V>(column + j * padded);
      V e = exp_nonpositive(x - new_max);
      if constexpr (kMasked) e = x == V{} - kInf ? V{} : e;
      store_as(column + j * padded, e);
      block_sum += e;
    }
    store_as(s.sum + v * L, load_as<V>(s.sum + v * L) * correction + block_sum);
    store_as(s.max + v * L, new_max);
    float factors[L];
    store_as(factors, correction);
    for (int64_t l = 0; l < L; ++l) {
      if (factors[l] == 1.0f) continue;
      float* acc = s.acc + (v * L + l) * dim;
      for (int64_t d = 0; d < dim; d += L) store_as(acc + d, load_as<V>(acc + d) * factors[l]);
    }
  }
}

// acc[r][d0, d0 + C * L) += sum_j weights[j][r] values[j][same range] for rows [r0, r0 + NR).
template <typename V, int NR, int C>
PAGEDSERVE_INLINE void tile_values_block(const float* weights, int64_t padded, Rows values,
                                         int64_t len, int64_t r0, int64_t d0, int64_t dim,
                                         float* acc) {
  constexpr int64_t L = kLanes<V>;
  V a[NR][C];
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < C; ++c) a[i][c] = load_as<V>(acc + (r0 + i) * dim + d0 + c * L);
  }
  for (int64_t j = 0; j < len; ++j) {
    const float* v = values[j] + d0;
    const float* w = weights + j * padded + r0;
    for (int c = 0; c < C; ++c) {
      const V x = load_as<V>(v + c * L);
      for (int i = 0; i < NR; ++i) a[i][c] += x * w[i];
    }
  }
  for (int i = 0; i < NR; ++i) {
    for (int c = 0; c < C; ++c) store_as(acc + (r0 + i) * dim + d0 + c * L, a[i][c]);
  }
}

// acc[r] += sum_j weights[j][r] values[j] for rows [first_row, padded), in register blocks.
template <typename V>
PAGEDSERVE_INLINE void tile_values(const float* weights, int64_t padded, int64_t first_row,
                                   Rows values, int64_t len, int64_t dim, float* acc) {
  constexpr int64_t L = kLanes<V>;
  constexpr int NR = TileBlocks<V>::kValueRows;  // divides L, and so padded
  for (int64_t r = first_row / NR * NR; r < padded; r += NR) {
    int64_t d = 0;
    for (; d + 4 * L <= dim; d += 4 * L) {
      tile_values_block<V, NR, 4>(weights, padded, values, len, r, d, dim, acc);
    }
    if (d + 2 * L <= dim) {
      tile_values_block<V, NR, 2>(weights, padded, values, len, r, d, dim, acc);
      d += 2 * L;
    }
    if (d < dim) tile_values_block<V, NR, 1>(weights, padded, values, len, r, d, dim, acc);
  }
}

// The tile path, for an item of one kv head (head_dim a multiple of V's lanes).
template <typename V, typename Q, typename T>
PAGEDSERVE_INLINE void attend_tile(const AttentionParams& p, const WorkItem& item,
                                   const Scratch& s, const WorkItem* following) {
  constexpr int64_t L = kLanes<V>;
  const int64_t dim = p.head_dim, block_size = p.block_size;
  const int64_t group = p.num_heads / p.num_kv_heads, rows = item.num_tokens * group;
  const int64_t padded = round_up(rows, L);
  const int64_t head_offset = item.first_kv_head * group * dim;
  const Q* query = static_cast<const Q*>(p.query);
  // Row r = t * group + g: tile token t, group head g; qt[d][r].
  for (int64_t r = 0; r < padded; ++r) {
    if (r >= rows) {
      for (int64_t d = 0; d < dim; ++d) s.q[d * padded + r] = 0.0f;
      s.pos[r] = -1.0f;
      continue;
    }
    const Q* src = query + (item.first_token + r / group) * p.query_token_stride + head_offset +
                   r % group * dim;
    for (int64_t d = 0; d < dim; ++d) s.q[d * padded + r] = static_cast<float>(src[d]) * p.scale;
    s.pos[r] = static_cast<float>(item.first_pos + r / group);
  }
  std::fill(s.acc, s.acc + padded * dim, 0.0f);
  std::fill(s.max, s.max + padded, -std::numeric_limits<float>::infinity());
  std::fill(s.sum, s.sum + padded, 0.0f);

  constexpr int NJ = TileBlocks<V>::kKeys;
  const int64_t slices = (padded / L + 1) / 2 * ((block_size + NJ - 1) / NJ);
  const int64_t last_pos = item.first_pos + item.num_tokens - 1;
  for (int64_t start = item.begin; start < item.end; start += block_size) {
    const int64_t len = std::min(block_size, item.end - start);
    NextBlockPrefetch<T> prefetch;
    if (start + block_size < item.end) {
      prefetch = block_prefetch<T>(p, item, start / block_size + 1, slices);
    } else if (following != nullptr) {
      prefetch = block_prefetch<T>(p, *following, following->begin / block_size, slices);
    }
    const int64_t offset = block_offset(p, item, start / block_size);
    const int64_t stride = p.num_kv_heads * dim;
    const Rows keys =
        as_float_rows(static_cast<const T*>(p.key_cache) + offset, stride, len, dim, s.keys);
    const Rows values =
        as_float_rows(static_cast<const T*>(p.value_cache) + offset, stride, len, dim, s.values);
    // Rows before first_row see none of the block; with every row seeing all of it, no mask.
    const int64_t first_row = std::max<int64_t>(0, start - item.first_pos) * group;
    const bool masked = start + len - 1 > item.first_pos || window_skip(p, last_pos, start) > 0;
    tile_logits<V>(s.q, padded, first_row / L, keys, len, dim, s.logits, prefetch);
    if (masked) {
      tile_softmax<V, true>(s.logits, padded, first_row / L, len, start, p.sliding_window, s,
                            dim);
    } else {
      tile_softmax<V, false>(s.logits, padded, 0, len, start, 0, s, dim);
    }
    tile_values<V>(s.logits, padded, first_row, values, len, dim, s.acc);
  }

  Q* out = static_cast<Q*>(p.out) + item.first_token * p.num_heads * dim + head_offset;
  for (int64_t r = 0; r < rows; ++r) {
    Q* dst = out + r / group * p.num_heads * dim + r % group * dim;
    store_scaled(s.acc + r * dim, 1.0f / s.sum[r], dst, dim);
  }
}

// V: the tile path's vectors.
template <typename V, typename Q, typename T>
PAGEDSERVE_INLINE void attend(const AttentionParams& p, const WorkItem& item, const Scratch& s,
                              float* partials, const WorkItem* following) {
  if (item.tile) {
    attend_tile<V, Q, T>(p, item, s, following);
  } else {
    attend_rows<Q, T>(p, item, s, partials, following);
  }
}

// One clone set per (query, cache) dtype pair: the loader picks the widest instruction set the
// machine has; AVX-512 machines run the _wide variants where the head size allows.
PAGEDSERVE_CPU_CLONES void attend_float(const AttentionParams& p, const WorkItem& item,
                                        const Scratch& s, float* partials,
                                        const WorkItem* following) {
  attend<vfloat, float, float>(p, item, s, partials, following);
}
PAGEDSERVE_CPU_CLONES void attend_bfloat16(const AttentionParams& p, const WorkItem& item,
                                           const Scratch& s, float* partials,
                                           const WorkItem* following) {
  attend<vfloat, c10::BFloat16, c10::BFloat16>(p, item, s, partials, following);
}
PAGEDSERVE_CPU_CLONES void attend_half(const AttentionParams& p, const WorkItem& item,
                                       const Scratch& s, float* partials,
                                       const WorkItem* following) {
  attend<vfloat, c10::Half, c10::Half>(p, item, s, partials, following);
}
PAGEDSERVE_CPU_CLONES void attend_float_bfloat16(const AttentionParams& p, const WorkItem& item,
                                                 const Scratch& s, float* partials,
                                                 const WorkItem* following) {
  attend<vfloat, float, c10::BFloat16>(p, item, s, partials, following);
}
PAGEDSERVE_CPU_CLONES void attend_float_half(const AttentionParams& p, const WorkItem& item,
                                             const Scratch& s, float* partials,
                                             const WorkItem* following) {
  attend<vfloat, float, c10::Half>(p, item, s, partials, following);
}

#ifdef PAGEDSERVE_X86_64_V4
PAGEDSERVE_X86_64_V4 void attend_float_wide(const AttentionParams& p, const WorkItem& item,
                                            const Scratch& s, float* partials,
                                            const WorkItem* following) {
  attend<vfloat16, float, float>(p, item, s, partials, following);
}
PAGEDSERVE_X86_64_V4 void attend_bfloat16_wide(const AttentionParams& p, const WorkItem& item,
                                               const Scratch& s, float* partials,
                                               const WorkItem* following) {
  attend<vfloat16, c10::BFloat16, c10::BFloat16>(p, item, s, partials, following);
}
PAGEDSERVE_X86_64_V4 void attend_half_wide(const AttentionParams& p, const WorkItem& item,
                                           const Scratch& s, float* partials,
                                           const WorkItem* following) {
  attend<vfloat16, c10::Half, c10::Half>(p, item, s, partials, following);
}
PAGEDSERVE_X86_64_V4 void attend_float_bfloat16_wide(const AttentionParams& p, const WorkItem& item,
                                                     const Scratch& s, float* partials,
                                                     const WorkItem* following) {
  attend<vfloat16, float, c10::BFloat16>(p, item, s, partials, following);
}
PAGEDSERVE_X86_64_V4 void attend_float_half_wide(const AttentionParams& p, const WorkItem& item,
                                                 const Scratch& s, float* partials,
                                                 const WorkItem* following) {
  attend<vfloat16, float, c10::Half>(p, item, s, partials, following);
}
#endif

// out = the parts' accumulators at their common max over their sums at that max.
template <typename T>
void merge_parts(const AttentionParams& p, const Split& split, const float* partials) {
  const int64_t dim = p.head_dim, heads = p.num_heads, size = part_floats(p);
  const float* first = partials + split.first_part * size;
  std::vector<float> acc(dim);
  T* out = static_cast<T*>(p.out) + split.seq * heads * dim;
  for (int64_t h = 0; h < heads; ++h) {
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < split.num_parts; ++i) {
      max = std::max(max, first[i * size + heads * dim + h]);
    }
    float sum = 0.0f;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t i = 0; i < split.num_parts; ++i) {
      const float* part = first + i * size;
      const float weight = std::exp(part[heads * dim + h] - max);
      sum += weight * part[heads * (dim + 1) + h];
      for (int64_t d = 0; d < dim; ++d) acc[d] += weight * part[h * dim + d];
    }
    store_scaled(acc.data(), 1.0f / sum, out + h * dim, dim);
  }
}

// Every sequence's new tokens cut into tiles of up to tile_tokens, for each run of heads_per_item
// kv heads; a decode sequence's context cut into up to max_parts parts of kMinPartPositions or
// more. Raises on offsets and lengths that do not fit the block table.
Plan plan(const AttentionParams& p, int64_t tile_tokens, int64_t heads_per_item,
          int64_t max_parts) {
  Plan out;
  const int64_t capacity = p.max_num_blocks_per_seq * p.block_size;
  for (int64_t seq = 0; seq < p.num_seqs; ++seq) {
    const int64_t begin = p.query_start_loc ? p.query_start_loc[seq] : seq;
    const int64_t q_len = p.query_start_loc ? p.query_start_loc[seq + 1] - begin : 1;
    const int64_t context_len = p.context_lens[seq];
    TORCH_CHECK(q_len >= 0 && q_len <= context_len && context_len <= capacity, "sequence ", seq,
                ": ", q_len, " new tokens, context_len ", context_len, ", table capacity ",
                capacity);
    // Checked here, not while attending: GCC treats a target_clones dispatcher as nothrow.
    // Only the blocks from the first new token's window on are read: entries wholly before
    // it may be -1 (blocks the scheduler freed).
    const int32_t* table = p.block_tables + seq * p.max_num_blocks_per_seq;
    const int64_t num_blocks = (context_len + p.block_size - 1) / p.block_size;
    for (int64_t b = window_begin(p, context_len - q_len) / p.block_size; b < num_blocks; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < p.num_blocks, "sequence ", seq, ": block id ",
                  table[b], " is not in the cache");
    }
    // A decode token reads [base, context_len): its whole context, or from its window's block.
    const int64_t base = q_len == 1 ? window_begin(p, context_len - 1) : 0;
    const int64_t seen_blocks = num_blocks - base / p.block_size;
    const int64_t parts =
        std::clamp<int64_t>((context_len - base) / kMinPartPositions, 1, max_parts);
    const int64_t part_blocks = (seen_blocks + parts - 1) / parts;
    if (q_len == 1 && part_blocks < seen_blocks) {
      const int64_t part_len = part_blocks * p.block_size;
      const Split split{seq, out.num_parts, (context_len - base + part_len - 1) / part_len};
      for (int64_t i = 0; i < split.num_parts; ++i) {
        out.items.push_back({seq, 0, p.num_kv_heads, begin, 1, context_len - 1,
                             base + i * part_len, std::min(context_len, base + (i + 1) * part_len),
                             out.num_parts++, false});
      }
      out.splits.push_back(split);
      continue;
    }
    for (int64_t t = 0; t < q_len; t += tile_tokens) {
      for (int64_t kv_head = 0; kv_head < p.num_kv_heads; kv_head += heads_per_item) {
        const int64_t tokens = std::min(tile_tokens, q_len - t);
        const int64_t first_pos = context_len - q_len + t;
        out.items.push_back({seq, kv_head, std::min(heads_per_item, p.num_kv_heads - kv_head),
                             begin + t, tokens, first_pos, window_begin(p, first_pos),
                             first_pos + tokens, -1, q_len > 1});
      }
    }
  }
  std::stable_sort(out.items.begin(), out.items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost() > b.cost(); });
  return out;
}

}  // namespace

void paged_attention(c10::ScalarType query_dtype, c10::ScalarType cache_dtype,
                     const AttentionParams& params, int64_t vector_floats) {
  using AttendFn =
      void (*)(const AttentionParams&, const WorkItem&, const Scratch&, float*, const WorkItem*);
  using MergeFn = void (*)(const AttentionParams&, const Split&, const float*);
  using c10::ScalarType;
  struct Variants {
    AttendFn narrow, wide;
  };
  Variants variants{nullptr, nullptr};
  MergeFn merge = nullptr;
#ifdef PAGEDSERVE_X86_64_V4
#define PAGEDSERVE_VARIANTS(name) Variants{attend_##name, attend_##name##_wide}
#else
#define PAGEDSERVE_VARIANTS(name) Variants{attend_##name, attend_##name}
#endif
  if (query_dtype == ScalarType::Float) {
    merge = merge_parts<float>;
    variants = cache_dtype == ScalarType::BFloat16 ? PAGEDSERVE_VARIANTS(float_bfloat16)
               : cache_dtype == ScalarType::Half   ? PAGEDSERVE_VARIANTS(float_half)
               : cache_dtype == ScalarType::Float  ? PAGEDSERVE_VARIANTS(float)
                                                   : variants;
  } else if (query_dtype == cache_dtype && query_dtype == ScalarType::BFloat16) {
    variants = PAGEDSERVE_VARIANTS(bfloat16);
    merge = merge_parts<c10::BFloat16>;
  } else if (query_dtype == cache_dtype && query_dtype == ScalarType::Half) {
    variants = PAGEDSERVE_VARIANTS(half);
    merge = merge_parts<c10::Half>;
  }
#undef PAGEDSERVE_VARIANTS
  TORCH_CHECK(variants.narrow != nullptr,
              "paged attention takes float32, float16 or bfloat16 caches, with queries of the "
              "caches' dtype or float32; got ", query_dtype, " queries, ", cache_dtype, " caches");
  const bool wide = cpu_has_avx512() && vector_floats != 8 && params.head_dim % 16 == 0;
  const AttendFn attend_item = wide ? variants.wide : variants.narrow;
  const int64_t group = params.num_heads / params.num_kv_heads;
  const int64_t threads = at::get_num_threads();
  const bool decode = !params.query_start_loc;
  const int64_t tile_tokens = decode ? 1 : std::max<int64_t>(1, kTileRows / group);
  // A decode item reads whole blocks, every kv head of its sequence. While the batch has too
  // few sequences to keep every thread busy, their contexts are cut into parts, whose results
  // are merged afterwards (one kv head's strided rows alone stream poorly).
  // Prefill tiles reuse each row many times and stay one kv head each.
  const int64_t heads_per_item = decode ? params.num_kv_heads : 1;
  const int64_t wanted_items = kMinItemsPerThread * threads;
  const int64_t max_parts = decode && params.num_seqs < wanted_items
                                ? (wanted_items + params.num_seqs - 1) / params.num_seqs
                                : 1;
  const Plan work_plan = plan(params, tile_tokens, heads_per_item, max_parts);
  const std::vector<WorkItem>& items = work_plan.items;
  const int64_t num_items = static_cast<int64_t>(items.size());
  int64_t work = 0;  // multiply-adds: q.k and p.v per (row, position)
  for (const WorkItem& item : items) work += 2 * item.cost() * group * params.head_dim;
  const int64_t workers =
      std::min({threads, num_items, std::max<int64_t>(1, work / kMinWorkPerThread)});
  std::vector<float> partials(work_plan.num_parts * part_floats(params));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const Scratch scratch(params, heads_per_item * tile_tokens * group);
    for (int64_t i = next++; i < num_items; i = next++) {
      const int64_t following = next.load(std::memory_order_relaxed);
      attend_item(params, items[i], scratch, partials.data(),
                  following < num_items ? &items[following] : nullptr);
    }
  });
  for (const Split& split : work_plan.splits) merge(params, split, partials.data());
}

}  // namespace pagedserve::cpu
