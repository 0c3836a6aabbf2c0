// Argument checks shared by the CPU and CUDA bindings: the paged caches, int index tensors and
// the key/value rows written into the caches. Each raises a Python error naming the argument.
// Numbers in these messages and the CUDA bindings' go through std::to_string, never an
// ostream: on an H200 machine (torch 2.11+cu130, g++ 13.3) an extension that streamed an
// integer into a TORCH_CHECK message crashed inside the stream instead of raising; strings
// raised as they should. The CPU kernels' own messages still stream theirs.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace pagedserve {

// The two caches: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, on `device`.
inline void check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache,
                             at::DeviceType device) {
  TORCH_CHECK(key_cache.device().type() == device && key_cache.dim() == 4 &&
                  key_cache.is_contiguous(),
              "key_cache must be a contiguous ", device,
              " tensor [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == key_cache.scalar_type() &&
                  value_cache.device() == key_cache.device(),
              "value_cache must match key_cache in shape, dtype, device and be contiguous");
}

inline void check_int_tensor(const at::Tensor& t, at::ScalarType dtype, int64_t dim,
                             const char* name, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous(), name,
              " must be a contiguous " + std::to_string(dim) + "-d ", dtype, " tensor");
  TORCH_CHECK(t.device() == device, name, " must be on ", device);
}

// Row i of a [n, a, b] tensor is a*b contiguous elements.
inline bool rows_contiguous(const at::Tensor& t) {
  return t.stride(2) == 1 && t.stride(1) == t.size(2);
}

// key / value [num_tokens, num_kv_heads, head_dim] going into the caches, and their slots.
inline void check_cache_write(const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& key_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be "
              "[num_tokens, num_kv_heads, head_dim] of the same shape");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "key rows do not match the cache's [num_kv_heads, head_dim]");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type(),
              "key, value and caches must share a dtype");
  TORCH_CHECK(key.device() == key_cache.device() && value.device() == key_cache.device(),
              "key, value and caches must be on one device");
  TORCH_CHECK(rows_contiguous(key) && rows_contiguous(value),
              "key and value must be contiguous within a token");
  check_int_tensor(slot_mapping, at::kLong, 1, "slot_mapping", key_cache.device());
  TORCH_CHECK(slot_mapping.size(0) == key.size(0), "slot_mapping must have one slot per token");
}

}  // namespace pagedserve
