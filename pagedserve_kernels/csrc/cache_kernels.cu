// KV-cache writes and block copies: reshape_and_cache (new tokens into their slots) and
// copy_blocks (copy-on-write copies of every layer in one launch).
//
// Both move raw bytes in the widest word that every pointer, stride and size allows, so they
// serve any cache dtype without a dtype dispatch.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.h"

namespace pagedserve {
namespace {

constexpr int kCopyThreads = 256;

// One block per token. A cache [num_blocks, block_size, num_kv_heads, head_dim] is contiguous,
// so slot = block_id * block_size + offset is also the token's row in the flattened cache.
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads)
    reshape_and_cache_kernel(const char* __restrict__ key, const char* __restrict__ value,
                             char* __restrict__ key_cache, char* __restrict__ value_cache,
                             const int64_t* __restrict__ slot_mapping, int64_t key_token_stride,
                             int64_t value_token_stride, int64_t row_bytes) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;   // padding token: nothing to store
  const int64_t num_words = row_bytes / static_cast<int64_t>(sizeof(Word));
  const Word* k_src = reinterpret_cast<const Word*>(key + token * key_token_stride);
  const Word* v_src = reinterpret_cast<const Word*>(value + token * value_token_stride);
  Word* k_dst = reinterpret_cast<Word*>(key_cache + slot * row_bytes);
  Word* v_dst = reinterpret_cast<Word*>(value_cache + slot * row_bytes);
  for (int64_t i = threadIdx.x; i < num_words; i += kCopyThreads) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

// Grid (num_pairs, num_caches): block (i, c) copies pair i inside cache c.
// A block is never both a source and a destination of the same mapping (the block manager
// copies from a shared block to a freshly allocated one), so the copies do not race.
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads)
    copy_blocks_kernel(const int64_t* __restrict__ cache_ptrs,
                       const int64_t* __restrict__ block_mapping, int64_t block_bytes) {
  Word* cache = reinterpret_cast<Word*>(cache_ptrs[blockIdx.y]);
  const int64_t src = block_mapping[2 * static_cast<int64_t>(blockIdx.x)];
  const int64_t dst = block_mapping[2 * static_cast<int64_t>(blockIdx.x) + 1];
  const int64_t num_words = block_bytes / static_cast<int64_t>(sizeof(Word));
  const Word* from = cache + src * num_words;
  Word* to = cache + dst * num_words;
  for (int64_t i = threadIdx.x; i < num_words; i += kCopyThreads) to[i] = from[i];
}

template <typename Word>
cudaError_t reshape_and_cache_typed(const void* key, const void* value, void* key_cache,
                                    void* value_cache, const int64_t* slot_mapping,
                                    int64_t num_tokens, int64_t key_token_stride,
                                    int64_t value_token_stride, int64_t row_bytes,
                                    cudaStream_t stream) {
  reshape_and_cache_kernel<Word><<<num_tokens, kCopyThreads, 0, stream>>>(
      static_cast<const char*>(key), static_cast<const char*>(value),
      static_cast<char*>(key_cache), static_cast<char*>(value_cache), slot_mapping,
      key_token_stride, value_token_stride, row_bytes);
  return cudaGetLastError();
}

template <typename Word>
cudaError_t copy_blocks_typed(const int64_t* cache_ptrs, int num_caches,
                              const int64_t* block_mapping, int64_t num_pairs,
                              int64_t block_bytes, cudaStream_t stream) {
  const dim3 grid(num_pairs, num_caches);
  copy_blocks_kernel<Word><<<grid, kCopyThreads, 0, stream>>>(cache_ptrs, block_mapping,
                                                              block_bytes);
  return cudaGetLastError();
}

}  // namespace

cudaError_t reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int64_t num_tokens, int64_t key_token_stride,
                                     int64_t value_token_stride, int64_t row_bytes, int alignment,
                                     cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  if (alignment % 16 == 0) {
    return reshape_and_cache_typed<uint4>(key, value, key_cache, value_cache, slot_mapping,
                                          num_tokens, key_token_stride, value_token_stride,
                                          row_bytes, stream);
  }
  if (alignment % 4 == 0) {
    return reshape_and_cache_typed<uint32_t>(key, value, key_cache, value_cache, slot_mapping,
                                             num_tokens, key_token_stride, value_token_stride,
                                             row_bytes, stream);
  }
  return reshape_and_cache_typed<uint8_t>(key, value, key_cache, value_cache, slot_mapping,
                                          num_tokens, key_token_stride, value_token_stride,
                                          row_bytes, stream);
}

cudaError_t copy_blocks_launch(const int64_t* cache_ptrs, int num_caches,
                               const int64_t* block_mapping, int64_t num_pairs,
                               int64_t block_bytes, int alignment, cudaStream_t stream) {
  if (num_caches == 0 || num_pairs == 0) return cudaSuccess;
  if (alignment % 16 == 0) {
    return copy_blocks_typed<uint4>(cache_ptrs, num_caches, block_mapping, num_pairs,
                                    block_bytes, stream);
  }
  if (alignment % 4 == 0) {
    return copy_blocks_typed<uint32_t>(cache_ptrs, num_caches, block_mapping, num_pairs,
                                       block_bytes, stream);
  }
  return copy_blocks_typed<uint8_t>(cache_ptrs, num_caches, block_mapping, num_pairs,
                                    block_bytes, stream);
}

}  // namespace pagedserve
