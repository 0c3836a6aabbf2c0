// PagedAttention decode: one query token per sequence attends to its KV blocks in place.
//
// Grid (num_kv_heads, num_seqs, num_partitions); one thread block owns one kv head of one
// sequence and serves every query head of that kv head (grouped-query attention reads each K/V
// row once). Sequences of different lengths share a launch: each block stops at its own
// context_len. Each warp reads whole KV blocks through the block table:
//
//   partition p of a sequence:   [ blk b0 | blk b1 | blk b2 | blk b3 | blk b4 | ...
//   warp owning the block:          w0       w1       w2       w3       w0     ...
//
// Pass 1: logits = scale * q.K for the partition (8 lanes per token, 4 tokens per warp step);
// -inf before a sliding window (a partition wholly before it ends with sum 0, weight 0). Blocks
// wholly before the window are not read in either pass: their table entries may be -1 (freed).
// Softmax: one warp per query head, over shared memory.
// Pass 2: out = softmax . V (a lane owns head_dim / 32 output dims of up to 8 query heads).
// With one partition (v1) the block writes the output; with several (v2, long contexts) it
// writes a partial output and its (max logit, exp sum), and a reduce kernel rescales them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"

namespace pagedserve {
namespace {

constexpr int kWarpSize = 32;
constexpr int kNumWarps = kAttentionThreads / kWarpSize;
constexpr int kLanesPerToken = 8;                            // pass 1: lanes sharing one q.k
constexpr int kTokensPerStep = kWarpSize / kLanesPerToken;   // pass 1: tokens per warp step
constexpr int kHeadChunk = 8;                                // pass 2: query heads in registers
constexpr int kReduceThreads = 128;
constexpr size_t kDefaultSmemLimit = 48 * 1024;

template <typename T>
struct Convert;
template <>
struct Convert<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
};
template <>
struct Convert<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};
template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
};

// N elements loaded or stored as one aligned vector access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* src, float* dst) {
  const Vec<T, N> x = *reinterpret_cast<const Vec<T, N>*>(src);
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = Convert<T>::to_float(x.v[i]);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, mask));
  }
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask /= 2) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

__host__ __device__ __forceinline__ int div_up(int a, int b) { return (a + b - 1) / b; }

// Pass 1: logits[h][t - start] = q_h . k_t for the partition's tokens [start, end); -inf for
// tokens before window_start. Blocks are read from `first` on (the partition's first block
// that the window reaches); the tokens before it get -inf unread.
template <typename T, int HEAD_DIM>
__device__ void compute_logits(const PagedAttentionParams& p, const float* q_s, float* logits,
                               int kv_head, const int32_t* table, int start, int first, int end,
                               int window_start) {
  constexpr int kVec = 16 / sizeof(T);                          // elements per 16-byte load
  constexpr int kChunks = HEAD_DIM / (kVec * kLanesPerToken);   // 16-byte loads per lane
  static_assert(kChunks >= 1 && HEAD_DIM % (kVec * kLanesPerToken) == 0, "head_dim");
  const int group = p.num_heads / p.num_kv_heads;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int slot_in_step = lane / kLanesPerToken, sub_lane = lane % kLanesPerToken;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const T* keys = static_cast<const T*>(p.key_cache) + kv_head * HEAD_DIM;
  const int num_unread = min(first, end) - start;
  for (int i = threadIdx.x; i < group * num_unread; i += kAttentionThreads) {
    logits[(i / num_unread) * p.partition_size + i % num_unread] = -INFINITY;
  }
  const int last_block = div_up(end, p.block_size);
  for (int b = first / p.block_size + warp; b < last_block; b += kNumWarps) {
    const T* block = keys + static_cast<int64_t>(table[b]) * p.block_size * token_stride;
    for (int step = 0; step < p.block_size; step += kTokensPerStep) {
      const int offset = step + slot_in_step;
      const int token = b * p.block_size + offset;
      const bool valid = offset < p.block_size && token < end;
      float k[kChunks * kVec];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int elem = (c * kLanesPerToken + sub_lane) * kVec;   // coalesced across sub-lanes
        if (valid) {
          load_floats<T, kVec>(block + offset * token_stride + elem, k + c * kVec);
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i) k[c * kVec + i] = 0.f;
        }
      }
      for (int h = 0; h < group; ++h) {
        const float* q = q_s + h * HEAD_DIM;
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int elem = (c * kLanesPerToken + sub_lane) * kVec;
#pragma unroll
          for (int i = 0; i < kVec; i += 4) {
            const float4 qv = *reinterpret_cast<const float4*>(q + elem + i);
            const float* kv = k + c * kVec + i;
            dot += qv.x * kv[0] + qv.y * kv[1] + qv.z * kv[2] + qv.w * kv[3];
          }
        }
#pragma unroll
        for (int mask = kLanesPerToken / 2; mask > 0; mask /= 2) {
          dot += __shfl_xor_sync(0xffffffffu, dot, mask);
        }
        if (valid && sub_lane == 0) {
          logits[h * p.partition_size + token - start] = token >= window_start ? dot : -INFINITY;
        }
      }
    }
  }
}

// Softmax numerators in place; head_max / head_sum keep what the reduce kernel needs.
__device__ void softmax_rows(float* logits, float* head_max, float* head_sum, int group,
                             int row_stride, int num_tokens) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int h = warp; h < group; h += kNumWarps) {
    float* row = logits + h * row_stride;
    float m = -INFINITY;
    for (int t = lane; t < num_tokens; t += kWarpSize) m = fmaxf(m, row[t]);
    m = warp_max(m);
    const float shift = m == -INFINITY ? 0.f : m;   // every token masked: all numerators 0
    float s = 0.f;
    for (int t = lane; t < num_tokens; t += kWarpSize) {
      const float e = expf(row[t] - shift);
      row[t] = e;
      s += e;
    }
    s = warp_sum(s);
    if (lane == 0) {
      head_max[h] = m;
      head_sum[h] = s;
    }
  }
}

// Pass 2 for query heads [h0, h0 + kHeadChunk): this warp's share of sum_t p[h][t] * v_t, over
// the blocks from `first` on (the tokens before it have probability 0).
template <typename T, int HEAD_DIM>
__device__ void accumulate_values(const PagedAttentionParams& p, const float* probs, float* red,
                                  int kv_head, const int32_t* table, int start, int first,
                                  int end, int h0) {
  constexpr int kDims = HEAD_DIM / kWarpSize;
  const int group = p.num_heads / p.num_kv_heads;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int64_t token_stride = static_cast<int64_t>(p.num_kv_heads) * HEAD_DIM;
  const T* values = static_cast<const T*>(p.value_cache) + kv_head * HEAD_DIM + lane * kDims;
  float acc[kHeadChunk][kDims] = {};
  const int last_block = div_up(end, p.block_size);
  for (int b = first / p.block_size + warp; b < last_block; b += kNumWarps) {
    const T* block = values + static_cast<int64_t>(table[b]) * p.block_size * token_stride;
    const int num_tokens = min(p.block_size, end - b * p.block_size);
    const float* prob = probs + (b * p.block_size - start);
    for (int offset = 0; offset < num_tokens; ++offset) {
      float v[kDims];
      load_floats<T, kDims>(block + offset * token_stride, v);
#pragma unroll
      for (int hh = 0; hh < kHeadChunk; ++hh) {
        if (h0 + hh < group) {
          const float w = prob[(h0 + hh) * p.partition_size + offset];
#pragma unroll
          for (int d = 0; d < kDims; ++d) acc[hh][d] += w * v[d];
        }
      }
    }
  }
#pragma unroll
  for (int hh = 0; hh < kHeadChunk; ++hh) {
#pragma unroll
    for (int d = 0; d < kDims; ++d) red[(warp * kHeadChunk + hh) * HEAD_DIM + lane * kDims + d] =
        acc[hh][d];
  }
}

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kAttentionThreads)
    paged_attention_kernel(const PagedAttentionParams p) {
  const int kv_head = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int context_len = p.context_lens[seq];
  const int start = part * p.partition_size;
  if (start >= context_len) return;   // this sequence is shorter than the longest one
  const int end = min(context_len, start + p.partition_size);
  const int group = p.num_heads / p.num_kv_heads;
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_num_blocks_per_seq;

  extern __shared__ float4 smem_raw[];
  float* q_s = reinterpret_cast<float*>(smem_raw);    // [group, HEAD_DIM], pre-scaled
  float* logits = q_s + group * HEAD_DIM;             // [group, partition_size]
  float* head_max = logits + group * p.partition_size;   // [group]
  float* head_sum = head_max + group;                 // [group]
  float* red = head_sum + group;                      // [kNumWarps, kHeadChunk, HEAD_DIM]

  const T* query = static_cast<const T*>(p.query) + seq * p.query_seq_stride +
                   static_cast<int64_t>(kv_head) * group * HEAD_DIM;
  for (int i = threadIdx.x; i < group * HEAD_DIM; i += kAttentionThreads) {
    q_s[i] = Convert<T>::to_float(query[i]) * p.scale;
  }
  __syncthreads();
  const int window_start = p.sliding_window > 0 ? max(0, context_len - p.sliding_window) : 0;
  // The partition's first token whose block the window reaches (partitions hold whole blocks).
  const int first = max(start, window_start / p.block_size * p.block_size);
  compute_logits<T, HEAD_DIM>(p, q_s, logits, kv_head, table, start, first, end, window_start);
  __syncthreads();
  softmax_rows(logits, head_max, head_sum, group, p.partition_size, end - start);
  __syncthreads();

  const bool single_pass = div_up(context_len, p.partition_size) == 1;
  for (int h0 = 0; h0 < group; h0 += kHeadChunk) {
    accumulate_values<T, HEAD_DIM>(p, logits, red, kv_head, table, start, first, end, h0);
    __syncthreads();
    const int num_chunk_heads = min(kHeadChunk, group - h0);
    for (int i = threadIdx.x; i < num_chunk_heads * HEAD_DIM; i += kAttentionThreads) {
      const int hh = i / HEAD_DIM, d = i % HEAD_DIM, h = h0 + hh;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kNumWarps; ++w) sum += red[(w * kHeadChunk + hh) * HEAD_DIM + d];
      const int64_t row = static_cast<int64_t>(seq) * p.num_heads + kv_head * group + h;
      if (single_pass) {
        static_cast<T*>(p.out)[row * HEAD_DIM + d] = Convert<T>::from_float(sum / head_sum[h]);
      } else {
        const int64_t slot = row * p.max_num_partitions + part;
        p.tmp_out[slot * HEAD_DIM + d] = head_sum[h] > 0.f ? sum / head_sum[h] : 0.f;
        if (d == 0) {
          p.max_logits[slot] = head_max[h];
          p.exp_sums[slot] = head_sum[h];
        }
      }
    }
    __syncthreads();   // red is rewritten by the next chunk of heads
  }
}

// v2: out = sum_p w_p * partial_p / sum_p w_p, with w_p = exp_sum_p * exp(max_p - max).
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    paged_attention_reduce_kernel(const PagedAttentionParams p) {
  const int head = blockIdx.x, seq = blockIdx.y;
  const int num_parts = div_up(p.context_lens[seq], p.partition_size);
  if (num_parts == 1) return;   // the attention kernel wrote this sequence's output itself
  extern __shared__ float4 smem_raw[];
  float* weights = reinterpret_cast<float*>(smem_raw);   // [num_parts]
  const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
  const float* max_logits = p.max_logits + row * p.max_num_partitions;
  const float* exp_sums = p.exp_sums + row * p.max_num_partitions;
  float global_max = -INFINITY;
  for (int i = 0; i < num_parts; ++i) global_max = fmaxf(global_max, max_logits[i]);
  for (int i = threadIdx.x; i < num_parts; i += kReduceThreads) {
    weights[i] = exp_sums[i] * expf(max_logits[i] - global_max);
  }
  __syncthreads();
  float total = 0.f;
  for (int i = 0; i < num_parts; ++i) total += weights[i];
  const float* partial = p.tmp_out + row * p.max_num_partitions * p.head_dim;
  T* out = static_cast<T*>(p.out) + row * p.head_dim;
  for (int d = threadIdx.x; d < p.head_dim; d += kReduceThreads) {
    float acc = 0.f;
    for (int i = 0; i < num_parts; ++i) acc += weights[i] * partial[i * p.head_dim + d];
    out[d] = Convert<T>::from_float(acc / total);
  }
}

template <typename T, int HEAD_DIM>
cudaError_t launch(const PagedAttentionParams& p, cudaStream_t stream) {
  const int group = p.num_heads / p.num_kv_heads;
  const size_t smem = paged_attention_smem_bytes(HEAD_DIM, group, p.partition_size);
  if (smem > kDefaultSmemLimit) {
    const cudaError_t err = cudaFuncSetAttribute(paged_attention_kernel<T, HEAD_DIM>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(p.num_kv_heads, p.num_seqs, p.max_num_partitions);
  paged_attention_kernel<T, HEAD_DIM><<<grid, kAttentionThreads, smem, stream>>>(p);
  if (p.max_num_partitions > 1) {
    const dim3 reduce_grid(p.num_heads, p.num_seqs);
    const size_t reduce_smem = p.max_num_partitions * sizeof(float);
    paged_attention_reduce_kernel<T><<<reduce_grid, kReduceThreads, reduce_smem, stream>>>(p);
  }
  return cudaGetLastError();
}

template <int HEAD_DIM>
cudaError_t launch_for_dtype(DType dtype, const PagedAttentionParams& p, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32: return launch<float, HEAD_DIM>(p, stream);
    case DType::kFloat16: return launch<__half, HEAD_DIM>(p, stream);
    case DType::kBFloat16: return launch<__nv_bfloat16, HEAD_DIM>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

size_t paged_attention_smem_bytes(int head_dim, int group_size, int partition_size) {
  const size_t floats = static_cast<size_t>(group_size) * head_dim +   // scaled queries
                        static_cast<size_t>(group_size) * partition_size +   // logits
                        2 * static_cast<size_t>(group_size) +   // max, sum per head
                        static_cast<size_t>(kNumWarps) * kHeadChunk * head_dim;   // warp sums
  return floats * sizeof(float);
}

int paged_attention_partition_size(int requested, int num_seqs, int num_kv_heads, int group_size,
                                   int head_dim, int block_size, int max_num_blocks_per_seq,
                                   int device) {
  const int capacity = max_num_blocks_per_seq * block_size;   // bounds every context_len
  if (requested > 0) return std::min(requested, capacity);
  const int partition = std::max(block_size, kDefaultPartitionSize / block_size * block_size);
  if (capacity <= partition) return capacity;
  // One pass is cheapest when the batch alone fills the GPU and the logits fit in shared memory;
  // otherwise splitting the context gives the SMs more blocks to run.
  int num_sms = 0;
  if (cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    num_sms = 1;
  }
  const bool fills_gpu = static_cast<int64_t>(num_seqs) * num_kv_heads >= 2 * num_sms;
  const bool fits = paged_attention_smem_bytes(head_dim, group_size, capacity) <= kDefaultSmemLimit;
  return fills_gpu && fits ? capacity : partition;
}

cudaError_t paged_attention_decode_launch(DType dtype, const PagedAttentionParams& params,
                                          cudaStream_t stream) {
  switch (params.head_dim) {
    case 64: return launch_for_dtype<64>(dtype, params, stream);
    case 128: return launch_for_dtype<128>(dtype, params, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace pagedserve
