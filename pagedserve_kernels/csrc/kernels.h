// Launchers of pagedserve's CUDA kernels, callable from host code that knows nothing of CUDA C++.
//
// The .cu files include only the CUDA runtime and fp16/bf16 headers, so they compile in seconds
// and do not depend on PyTorch; bindings.cpp owns every at::Tensor check and allocation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pagedserve {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Threads per attention thread block; a block handles every query head of one kv head.
constexpr int kAttentionThreads = 128;
// Tokens per context partition of the split-context (v2) path; rounded down to a block multiple.
constexpr int kDefaultPartitionSize = 512;

struct PagedAttentionParams {
  void* out;                    // [num_seqs, num_heads, head_dim], contiguous
  float* exp_sums;              // [num_seqs, num_heads, max_num_partitions] (v2 only)
  float* max_logits;            // [num_seqs, num_heads, max_num_partitions] (v2 only)
  float* tmp_out;               // [num_seqs, num_heads, max_num_partitions, head_dim] (v2 only)
  const void* query;            // [num_seqs, num_heads, head_dim], heads contiguous
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_dim]
  const int32_t* block_tables;  // [num_seqs, max_num_blocks_per_seq]
  const int32_t* context_lens;  // [num_seqs]
  int64_t query_seq_stride;     // elements between two sequences' queries
  int num_seqs;
  int num_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int max_num_blocks_per_seq;
  int partition_size;           // tokens per partition, a multiple of block_size
  int max_num_partitions;       // 1 selects the single-pass (v1) path
  int sliding_window;           // positions the token sees, itself included; 0: all of them
  float scale;
};

// Bytes of dynamic shared memory the attention kernel needs for one partition.
size_t paged_attention_smem_bytes(int head_dim, int group_size, int partition_size);

// Picks the partition size for a launch: requested > 0 forces it (>= the table's capacity means
// a single pass); 0 lets the launcher choose from the batch's parallelism and shared memory.
int paged_attention_partition_size(int requested, int num_seqs, int num_kv_heads, int group_size,
                                   int head_dim, int block_size, int max_num_blocks_per_seq,
                                   int device);

cudaError_t paged_attention_decode_launch(DType dtype, const PagedAttentionParams& params,
                                          cudaStream_t stream);

// Copies each token's K and V rows into its slot; a negative slot skips the token.
// Strides and row sizes are in bytes; `alignment` divides every pointer, stride and row size.
cudaError_t reshape_and_cache_launch(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int64_t num_tokens, int64_t key_token_stride,
                                     int64_t value_token_stride, int64_t row_bytes, int alignment,
                                     cudaStream_t stream);

// Copies block src -> dst for every (src, dst) pair in every cache, in one launch.
// cache_ptrs holds the device addresses of the caches as int64; block_bytes is one block's size.
cudaError_t copy_blocks_launch(const int64_t* cache_ptrs, int num_caches,
                               const int64_t* block_mapping, int64_t num_pairs,
                               int64_t block_bytes, int alignment, cudaStream_t stream);

}  // namespace pagedserve
