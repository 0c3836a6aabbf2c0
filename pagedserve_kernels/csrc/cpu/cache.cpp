// Writes new tokens' K/V rows into their cache slots on CPU.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "cpu_kernels.h"

namespace pagedserve::cpu {

// Tokens a thread copies at least: below this a copy is too short to be worth a fork/join.
constexpr int64_t kTokensPerChunk = 1024;

void reshape_and_cache(const char* key, const char* value, char* key_cache, char* value_cache,
                       const int64_t* slot_mapping, int64_t num_tokens, int64_t num_slots,
                       int64_t key_token_stride, int64_t value_token_stride, int64_t row_bytes) {
  // The cache is contiguous, so slot s (block s / block_size, offset s % block_size) is row s
  // of a [num_slots, num_kv_heads * head_dim] view.
  at::parallel_for(0, num_tokens, kTokensPerChunk, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slot_mapping[i];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "slot ", slot, " is not in the cache of ", num_slots);
      std::memcpy(key_cache + slot * row_bytes, key + i * key_token_stride, row_bytes);
      std::memcpy(value_cache + slot * row_bytes, value + i * value_token_stride, row_bytes);
    }
  });
}

}  // namespace pagedserve::cpu
