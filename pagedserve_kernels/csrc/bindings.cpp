// Python bindings of the pagedserve CUDA kernels: tensor checks, allocation, stream and device.
//
// Shapes:
//   query                     [num_seqs, num_heads, head_dim]
//   key / value               [num_tokens, num_kv_heads, head_dim]
//   key_cache / value_cache   [num_blocks, block_size, num_kv_heads, head_dim], contiguous
//   block_tables              [num_seqs, max_num_blocks_per_seq] int32
//   context_lens              [num_seqs] int32
//   slot_mapping              [num_tokens] int64, -1 = skip
//   block_mapping             [num_pairs, 2] int64 (src, dst)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "kernels.h"
#include "tensor_checks.h"

namespace pagedserve {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: break;
  }
  TORCH_CHECK(false, "paged attention supports float32, float16 and bfloat16, got ",
              t.scalar_type());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// Largest power of two <= 16 dividing every value: the widest word a byte copy may use.
int alignment_of(const std::vector<int64_t>& values) {
  int64_t a = 16;
  for (int64_t v : values) a = std::gcd(a, v);
  return static_cast<int>(a);
}

int64_t address(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

void check_decode_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t partition_size) {
  check_cache_pair(key_cache, value_cache, at::kCUDA);
  const at::Device device = key_cache.device();
  TORCH_CHECK(query.dim() == 3 && query.device() == device &&
                  query.scalar_type() == key_cache.scalar_type(),
              "query must be [num_seqs, num_heads, head_dim] on the caches' device and dtype");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128,
              "head_dim must be 64 or 128, got " + std::to_string(head_dim));
  TORCH_CHECK(key_cache.size(3) == head_dim, "cache head_dim differs from the query's");
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_size >= 8 && block_size <= 128, "block_size must be in [8, 128]");
  TORCH_CHECK(address(key_cache) % 16 == 0 && address(value_cache) % 16 == 0,
              "caches must be 16-byte aligned");
  check_int_tensor(block_tables, at::kInt, 2, "block_tables", device);
  check_int_tensor(context_lens, at::kInt, 1, "context_lens", device);
  TORCH_CHECK(block_tables.size(0) == num_seqs && context_lens.size(0) == num_seqs &&
                  block_tables.size(1) >= 1,
              "block_tables and context_lens need one row per sequence");
  TORCH_CHECK(num_seqs <= 65535 && num_heads <= 65535, "at most 65535 sequences and heads");
  TORCH_CHECK(partition_size >= 0 && partition_size % block_size == 0,
              "partition_size must be 0 (auto) or a multiple of block_size");
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cache_pair(key_cache, value_cache, at::kCUDA);
  check_cache_write(key, value, key_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  const int64_t elem = key.element_size();
  const int64_t row_bytes = key.size(1) * key.size(2) * elem;
  const int alignment =
      alignment_of({row_bytes, key.stride(0) * elem, value.stride(0) * elem, address(key),
                    address(value), address(key_cache), address(value_cache)});
  check_launch(reshape_and_cache_launch(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(),
                                        value_cache.data_ptr(), slot_mapping.data_ptr<int64_t>(),
                                        key.size(0), key.stride(0) * elem, value.stride(0) * elem,
                                        row_bytes, alignment,
                                        c10::cuda::getCurrentCUDAStream().stream()),
               "reshape_and_cache");
}

at::Tensor paged_attention_decode(const at::Tensor& query_in, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  int64_t partition_size, int64_t sliding_window) {
  check_decode_inputs(query_in, key_cache, value_cache, block_tables, context_lens,
                      partition_size);
  const at::Device device = key_cache.device();
  const at::Tensor query =
      query_in.stride(2) == 1 && query_in.stride(1) == query_in.size(2) ? query_in
                                                                         : query_in.contiguous();
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  at::Tensor out = at::empty({num_seqs, num_heads, head_dim}, query.options());
  if (num_seqs == 0) return out;

  const c10::cuda::CUDAGuard guard(device);
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int max_blocks = static_cast<int>(block_tables.size(1));
  const int partition = paged_attention_partition_size(
      static_cast<int>(partition_size), num_seqs, num_kv_heads, group, head_dim, block_size,
      max_blocks, device.index());
  int smem_limit = 0;
  cudaDeviceGetAttribute(&smem_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device.index());
  TORCH_CHECK(paged_attention_smem_bytes(head_dim, group, partition) <= size_t(smem_limit),
              "partition of " + std::to_string(partition) +
                  " tokens needs more shared memory than the device has");
  const int max_parts = (max_blocks * static_cast<int>(block_size) + partition - 1) / partition;
  const auto f32 = query.options().dtype(at::kFloat);
  at::Tensor exp_sums, max_logits, tmp_out;
  if (max_parts > 1) {
    exp_sums = at::empty({num_seqs, num_heads, max_parts}, f32);
    max_logits = at::empty({num_seqs, num_heads, max_parts}, f32);
    tmp_out = at::empty({num_seqs, num_heads, max_parts, head_dim}, f32);
  }
  PagedAttentionParams p{};
  p.out = out.data_ptr();
  p.exp_sums = max_parts > 1 ? exp_sums.data_ptr<float>() : nullptr;
  p.max_logits = max_parts > 1 ? max_logits.data_ptr<float>() : nullptr;
  p.tmp_out = max_parts > 1 ? tmp_out.data_ptr<float>() : nullptr;
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.query_seq_stride = query.stride(0);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.head_dim = static_cast<int>(head_dim);
  p.block_size = static_cast<int>(block_size);
  p.max_num_blocks_per_seq = max_blocks;
  p.partition_size = partition;
  p.max_num_partitions = max_parts;
  p.sliding_window = static_cast<int>(sliding_window);
  p.scale = static_cast<float>(scale);
  check_launch(paged_attention_decode_launch(dtype_of(query), p,
                                             c10::cuda::getCurrentCUDAStream().stream()),
               "paged_attention_decode");
  return out;
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "one key and one value cache per layer");
  if (key_caches.empty() || block_mapping.numel() == 0) return;
  std::vector<at::Tensor> caches(key_caches);
  caches.insert(caches.end(), value_caches.begin(), value_caches.end());
  const at::Tensor& first = caches.front();
  std::vector<int64_t> ptrs;
  for (const at::Tensor& cache : caches) {
    TORCH_CHECK(cache.is_cuda() && cache.is_contiguous() && cache.device() == first.device() &&
                    cache.scalar_type() == first.scalar_type() &&
                    cache.sizes() == first.sizes(),
                "caches must be contiguous CUDA tensors of one shape, dtype and device");
    ptrs.push_back(address(cache));
  }
  check_int_tensor(block_mapping, at::kLong, 2, "block_mapping", first.device());
  TORCH_CHECK(block_mapping.size(1) == 2, "block_mapping must be [num_pairs, 2]");
  const c10::cuda::CUDAGuard guard(first.device());
  const int64_t block_bytes = first.stride(0) * first.element_size();
  std::vector<int64_t> aligned(ptrs);
  aligned.push_back(block_bytes);
  const at::Tensor ptr_tensor =
      at::from_blob(ptrs.data(), {static_cast<int64_t>(ptrs.size())}, at::kLong)
          .to(first.device());
  check_launch(copy_blocks_launch(ptr_tensor.data_ptr<int64_t>(), static_cast<int>(ptrs.size()),
                                  block_mapping.data_ptr<int64_t>(), block_mapping.size(0),
                                  block_bytes, alignment_of(aligned),
                                  c10::cuda::getCurrentCUDAStream().stream()),
               "copy_blocks");
}

}  // namespace pagedserve

// Every op runs without the GIL: pybind11 converts its arguments to C++ values first and
// its result after, and nothing in between touches a Python object. Other Python threads
// (the executor's gRPC loop: health checks, GetStats, the registry heartbeat) then run
// during a step.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve CUDA kernels: paged decode attention and KV-cache block operations";
  m.def("reshape_and_cache", &pagedserve::reshape_and_cache, NoGil(), py::arg("key"),
        py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("paged_attention_decode", &pagedserve::paged_attention_decode, NoGil(),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("partition_size") = 0,
        py::arg("sliding_window") = 0,
        "partition_size: 0 picks one; >= the table's capacity forces a single pass; "
        "sliding_window > 0: the token sees that many positions, itself included");
  m.def("copy_blocks", &pagedserve::copy_blocks, NoGil(), py::arg("key_caches"),
        py::arg("value_caches"), py::arg("block_mapping"));
}
