// PagedAttention on CPU: each new token attends to its sequence's KV blocks, read in place.
//
// A work item is (sequence, run of kv heads, tile of new tokens). It serves every query head of
// its kv heads: a block's K/V rows come from memory once (converted to fp32 once for bf16 / fp16)
// and are reused from L1 by all the group's query rows (grouped-query attention). A block holds
// [block_size, num_kv_heads, head_dim]: one kv head's rows are strided, and read alone they ran
// at a third of the memory bandwidth here (the hardware prefetchers follow whole lines), so a
// decode item takes all kv heads of its sequence and reads each block as one run. It walks the
// sequence's blocks through the block table, prefetching the next one as it goes, with an online
// softmax over rows r = (tile token t, head g of the group):
//
//   context:  [ blk b0 | blk b1 | ... | blk b_last ]      b_last may be partial
//   per block, for the positions j of the block that row r may see (j <= its own position):
//     s[r][j]  = scale * q_r . k_j
//     m_r'     = max(m_r, max_j s[r][j]);   acc_r, l_r *= e^(m_r - m_r')
//     acc_r   += sum_j e^(s[r][j] - m_r') v_j;   l_r += sum_j e^(s[r][j] - m_r')
//   out_r = acc_r / l_r
//
// q_r . k_j runs eight keys at a time (one load of q per eight FMAs, one transposing reduction
// per eight logits); the value pass keeps up to 64 floats of acc_r in registers.
//
// Items are sorted by cost (rows x positions seen) and handed out one at a time from a shared
// counter, so the threads stay busy when sequences differ in length. Decode is the case of one
// new token per sequence.
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
// from L1 many times, few enough that the rows' accumulators stay in L1 too.
constexpr int64_t kTileRows = 32;

// Multiply-adds a thread takes at least (about 20 us): smaller calls stay on one thread, where
// a fork/join would cost more than it saves. At 1 << 20 a decode step of one sequence ran on one
// thread up to about 1,800 positions. `bench/kernels.py --batch 1 --context 512 1024 2048`, two
// threads, alternating the two bounds twice: 0.075-0.076 / 0.123-0.153 ms at 512 / 1,024
// positions with 1 << 20, 0.045-0.050 / 0.086-0.087 ms with 1 << 17 (1.6-1.85x torch's SDPA;
// its three kv heads still split unevenly over two threads); at 2,048 both fork.
constexpr int64_t kMinWorkPerThread = 1 << 17;

// Work items per thread below which decode splits sequences by kv head, to balance the load.
constexpr int64_t kMinItemsPerThread = 4;

struct WorkItem {
  int64_t seq;
  int64_t first_kv_head;
  int64_t num_kv_heads;
  int64_t first_token;  // row of the tile's first token in query and out
  int64_t num_tokens;   // new tokens in the tile
  int64_t first_pos;    // position of the tile's first token in its sequence

  int64_t cost() const { return num_kv_heads * num_tokens * (first_pos + num_tokens); }
};

// One thread's fp32 working set for items of up to max_rows query rows.
class Scratch {
 public:
  Scratch(const AttentionParams& p, int64_t max_rows)
      : buffer_(static_cast<size_t>(max_rows * (2 * p.head_dim + 2) +
                                    (2 * p.head_dim + 1) * p.block_size)) {
    float* next = buffer_.data();
    auto take = [&next](int64_t n) { return std::exchange(next, next + n); };
    q = take(max_rows * p.head_dim);
    acc = take(max_rows * p.head_dim);
    max = take(max_rows);
    sum = take(max_rows);
    logits = take(p.block_size);
    keys = take(p.block_size * p.head_dim);
    values = take(p.block_size * p.head_dim);
  }

  float* q;       // [rows, head_dim], scaled queries
  float* acc;     // [rows, head_dim], unnormalised outputs
  float* max;     // [rows], running max logit
  float* sum;     // [rows], running sum of exponentials
  float* logits;  // [block_size], one row's logits in one block, then their exponentials
  float* keys;    // [block_size, head_dim], one block's keys as fp32 (non-fp32 caches only)
  float* values;  // [block_size, head_dim], likewise for values

 private:
  std::vector<float> buffer_;
};

// Pulls the next block's K and V rows toward L2 a slice at a time, one slice before each row's
// pass over the current block. Asked for all at once, the prefetches filled the miss queue and
// stalled the core (a quarter of the kernel's samples sat on them) rather than overlapping with
// the arithmetic; spread out, decode attention ran 1.4-2x faster here.
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

  // Row by row, line by line, on counters: a division per line (the line's row and column)
  // cost 5 % of a 256-sequence decode step's attention here.
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

// acc[d0, d0 + C * kWidth) += sum_j p[j] * values[j][same range], held in C registers.
template <int C>
PAGEDSERVE_INLINE void accumulate_chunk(const float* p, Rows values, int64_t n, int64_t d0,
                                        float* acc) {
  vfloat a[C];
  for (int c = 0; c < C; ++c) a[c] = load(acc + d0 + c * kWidth);
  for (int64_t j = 0; j < n; ++j) {
    const vfloat pj = splat(p[j]);
    const float* v = values[j] + d0;
    for (int c = 0; c < C; ++c) a[c] += pj * load(v + c * kWidth);
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
  const float correction = std::exp(max - new_max);  // 0 on the first block (-inf)
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

template <typename T>
PAGEDSERVE_INLINE void attend(const AttentionParams& p, const WorkItem& item, const Scratch& s) {
  const int64_t dim = p.head_dim, block_size = p.block_size;
  const int64_t group = p.num_heads / p.num_kv_heads, rows = item.num_tokens * group;
  const int64_t kv_token_stride = p.num_kv_heads * dim;
  const T* query = static_cast<const T*>(p.query);
  // Scratch row h * rows + t * group + g: kv head h of the item, tile token t, group head g.
  for (int64_t h = 0; h < item.num_kv_heads; ++h) {
    const int64_t head_offset = (item.first_kv_head + h) * group * dim;
    for (int64_t t = 0; t < item.num_tokens; ++t) {
      const T* src = query + (item.first_token + t) * p.query_token_stride + head_offset;
      load_scaled(src, p.scale, s.q + (h * rows + t * group) * dim, group * dim);
    }
  }
  const int64_t all_rows = item.num_kv_heads * rows;
  std::fill(s.acc, s.acc + all_rows * dim, 0.0f);
  std::fill(s.max, s.max + all_rows, -std::numeric_limits<float>::infinity());
  std::fill(s.sum, s.sum + all_rows, 0.0f);

  const int64_t last_pos = item.first_pos + item.num_tokens - 1;
  const int32_t* table = p.block_tables + item.seq * p.max_num_blocks_per_seq;
  const int64_t run = item.num_kv_heads * dim;  // elements of the item's heads in one token row
  for (int64_t start = 0; start <= last_pos; start += block_size) {
    const int64_t block = table[start / block_size];
    const int64_t len = std::min(block_size, last_pos + 1 - start);
    const int64_t block_offset = (block * block_size * p.num_kv_heads + item.first_kv_head) * dim;
    NextBlockPrefetch<T> prefetch;
    if (start + block_size <= last_pos) {
      const int64_t next = table[start / block_size + 1];
      const int64_t next_offset = (next * block_size * p.num_kv_heads + item.first_kv_head) * dim;
      prefetch = NextBlockPrefetch<T>(static_cast<const T*>(p.key_cache) + next_offset,
                                      static_cast<const T*>(p.value_cache) + next_offset,
                                      kv_token_stride, block_size, run, all_rows);
    }
    // Token t of the tile sees positions <= first_pos + t: rows before first_row see none here.
    const int64_t first_row = std::max<int64_t>(0, start - item.first_pos) * group;
    for (int64_t h = 0; h < item.num_kv_heads; ++h) {
      const int64_t offset = block_offset + h * dim;
      const Rows keys = as_float_rows(static_cast<const T*>(p.key_cache) + offset,
                                      kv_token_stride, len, dim, s.keys);
      const Rows values = as_float_rows(static_cast<const T*>(p.value_cache) + offset,
                                        kv_token_stride, len, dim, s.values);
      for (int64_t r = first_row; r < rows; ++r) {
        const int64_t seen = std::min(len, item.first_pos + r / group + 1 - start);
        const int64_t row = h * rows + r;
        float* acc = s.acc + row * dim;
        prefetch.next_slice();
        dot_keys(s.q + row * dim, keys, seen, dim, s.logits);
        update_softmax(s.logits, seen, dim, s.max[row], s.sum[row], acc);
        accumulate(s.logits, values, seen, dim, acc);
      }
    }
  }

  for (int64_t h = 0; h < item.num_kv_heads; ++h) {
    const int64_t head_offset = (item.first_kv_head + h) * group * dim;
    T* out = static_cast<T*>(p.out) + item.first_token * p.num_heads * dim + head_offset;
    for (int64_t r = 0; r < rows; ++r) {
      T* dst = out + (r / group) * p.num_heads * dim + (r % group) * dim;
      const int64_t row = h * rows + r;
      store_scaled(s.acc + row * dim, 1.0f / s.sum[row], dst, dim);
    }
  }
}

// One clone set per dtype: the loader picks the widest instruction set the machine has.
PAGEDSERVE_CPU_CLONES void attend_float(const AttentionParams& p, const WorkItem& item,
                                        const Scratch& s) {
  attend<float>(p, item, s);
}
PAGEDSERVE_CPU_CLONES void attend_bfloat16(const AttentionParams& p, const WorkItem& item,
                                           const Scratch& s) {
  attend<c10::BFloat16>(p, item, s);
}
PAGEDSERVE_CPU_CLONES void attend_half(const AttentionParams& p, const WorkItem& item,
                                       const Scratch& s) {
  attend<c10::Half>(p, item, s);
}

// Every sequence's new tokens cut into tiles of up to tile_tokens, for each run of heads_per_item
// kv heads; costliest first. Raises on offsets and lengths that do not fit the block table.
std::vector<WorkItem> plan(const AttentionParams& p, int64_t tile_tokens, int64_t heads_per_item) {
  std::vector<WorkItem> items;
  const int64_t capacity = p.max_num_blocks_per_seq * p.block_size;
  for (int64_t seq = 0; seq < p.num_seqs; ++seq) {
    const int64_t begin = p.query_start_loc ? p.query_start_loc[seq] : seq;
    const int64_t q_len = p.query_start_loc ? p.query_start_loc[seq + 1] - begin : 1;
    const int64_t context_len = p.context_lens[seq];
    TORCH_CHECK(q_len >= 0 && q_len <= context_len && context_len <= capacity, "sequence ", seq,
                ": ", q_len, " new tokens, context_len ", context_len, ", table capacity ",
                capacity);
    // Checked here, not while attending: GCC treats a target_clones dispatcher as nothrow.
    const int32_t* table = p.block_tables + seq * p.max_num_blocks_per_seq;
    for (int64_t b = 0; b * p.block_size < context_len; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < p.num_blocks, "sequence ", seq, ": block id ",
                  table[b], " is not in the cache");
    }
    for (int64_t t = 0; t < q_len; t += tile_tokens) {
      for (int64_t kv_head = 0; kv_head < p.num_kv_heads; kv_head += heads_per_item) {
        items.push_back({seq, kv_head, std::min(heads_per_item, p.num_kv_heads - kv_head),
                         begin + t, std::min(tile_tokens, q_len - t), context_len - q_len + t});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost() > b.cost(); });
  return items;
}

}  // namespace

void paged_attention(c10::ScalarType dtype, const AttentionParams& params) {
  using AttendFn = void (*)(const AttentionParams&, const WorkItem&, const Scratch&);
  AttendFn attend_item = nullptr;
  switch (dtype) {
    case c10::ScalarType::Float: attend_item = attend_float; break;
    case c10::ScalarType::BFloat16: attend_item = attend_bfloat16; break;
    case c10::ScalarType::Half: attend_item = attend_half; break;
    default: TORCH_CHECK(false, "paged attention supports float32, float16 and bfloat16");
  }
  const int64_t group = params.num_heads / params.num_kv_heads;
  const int64_t tile_tokens = params.query_start_loc ? std::max<int64_t>(1, kTileRows / group) : 1;
  // Whole blocks per decode item once there are enough sequences to keep every thread busy;
  // prefill tiles reuse each row many times and stay one kv head each, as do small batches.
  const bool whole_blocks = !params.query_start_loc &&
                            params.num_seqs >= kMinItemsPerThread * at::get_num_threads();
  const int64_t heads_per_item = whole_blocks ? params.num_kv_heads : 1;
  const std::vector<WorkItem> items = plan(params, tile_tokens, heads_per_item);
  const int64_t num_items = static_cast<int64_t>(items.size());
  int64_t work = 0;  // multiply-adds: q.k and p.v per (row, position)
  for (const WorkItem& item : items) work += 2 * item.cost() * group * params.head_dim;
  const int64_t workers = std::min({static_cast<int64_t>(at::get_num_threads()), num_items,
                                    std::max<int64_t>(1, work / kMinWorkPerThread)});
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    const Scratch scratch(params, heads_per_item * tile_tokens * group);
    for (int64_t i = next++; i < num_items; i = next++) attend_item(params, items[i], scratch);
  });
}

}  // namespace pagedserve::cpu
