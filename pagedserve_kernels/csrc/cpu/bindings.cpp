// Python bindings of the pagedserve CPU kernels: tensor checks and allocation.
//
// Shapes:
//   query                     [num_tokens, num_heads, head_dim], heads contiguous
//   key / value               [num_tokens, num_kv_heads, head_dim], rows contiguous
//   key_cache / value_cache   [num_blocks, block_size, num_kv_heads, head_dim], contiguous
//   block_tables              [num_seqs, max_num_blocks_per_seq] int32
//   context_lens              [num_seqs] int32
//   query_start_loc           [num_seqs + 1] int32, cumulative offsets into query
//   slot_mapping              [num_tokens] int64, -1 = skip
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "../tensor_checks.h"
#include "cpu_kernels.h"

namespace pagedserve::cpu {
namespace {

void check_attention_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens,
                            const std::optional<at::Tensor>& query_start_loc) {
  check_cache_pair(key_cache, value_cache, at::kCPU);
  TORCH_CHECK(query.dim() == 3 && query.device().is_cpu() &&
                  (query.scalar_type() == key_cache.scalar_type() ||
                   query.scalar_type() == at::kFloat),
              "query must be a [num_tokens, num_heads, head_dim] CPU tensor of the caches' dtype "
              "or float32");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == query.size(2), "cache head_dim differs from the query's");
  TORCH_CHECK(query.size(2) % 8 == 0, "head_dim must be a multiple of 8, got ", query.size(2));
  TORCH_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0,
              "num_heads must be a multiple of num_kv_heads");
  check_int_tensor(block_tables, at::kInt, 2, "block_tables", at::kCPU);
  check_int_tensor(context_lens, at::kInt, 1, "context_lens", at::kCPU);
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables needs one row per sequence");
  if (query_start_loc) {
    check_int_tensor(*query_start_loc, at::kInt, 1, "query_start_loc", at::kCPU);
    TORCH_CHECK(query_start_loc->size(0) == num_seqs + 1, "query_start_loc needs num_seqs + 1");
    const int32_t* loc = query_start_loc->data_ptr<int32_t>();
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      TORCH_CHECK(loc[seq] <= loc[seq + 1], "query_start_loc must not decrease");
    }
    TORCH_CHECK(loc[0] == 0 && loc[num_seqs] == query.size(0),
                "query_start_loc must run from 0 to the number of query tokens");
  } else {
    TORCH_CHECK(query.size(0) == num_seqs, "decode takes one query token per sequence");
  }
}

at::Tensor paged_attention_op(const at::Tensor& query_in, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& context_lens,
                           const std::optional<at::Tensor>& query_start_loc, double scale,
                           int64_t sliding_window, int64_t vector_floats = 0) {
  check_attention_inputs(query_in, key_cache, value_cache, block_tables, context_lens,
                         query_start_loc);
  const at::Tensor query = rows_contiguous(query_in) ? query_in : query_in.contiguous();
  at::Tensor out = at::empty(query.sizes(), query.options());
  AttentionParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc ? query_start_loc->data_ptr<int32_t>() : nullptr;
  p.query_token_stride = query.stride(0);
  p.num_seqs = context_lens.size(0);
  p.num_heads = query.size(1);
  p.num_kv_heads = key_cache.size(2);
  p.head_dim = query.size(2);
  p.block_size = key_cache.size(1);
  p.num_blocks = key_cache.size(0);
  p.max_num_blocks_per_seq = block_tables.size(1);
  p.sliding_window = sliding_window;
  p.scale = static_cast<float>(scale);
  cpu::paged_attention(query.scalar_type(), key_cache.scalar_type(), p, vector_floats);
  return out;
}

void reshape_and_cache_op(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_cache_pair(key_cache, value_cache, at::kCPU);
  check_cache_write(key, value, key_cache, slot_mapping);
  const int64_t elem = key.element_size();
  cpu::reshape_and_cache(static_cast<const char*>(key.data_ptr()),
                         static_cast<const char*>(value.data_ptr()),
                         static_cast<char*>(key_cache.data_ptr()),
                         static_cast<char*>(value_cache.data_ptr()),
                         slot_mapping.data_ptr<int64_t>(), key.size(0),
                         key_cache.size(0) * key_cache.size(1), key.stride(0) * elem,
                         value.stride(0) * elem, key.size(1) * key.size(2) * elem);
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, int64_t out_features,
                     int64_t vector_floats) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat &&
                  x.stride(1) == 1,
              "x must be a [rows, in_features] float32 CPU tensor with contiguous rows");
  TORCH_CHECK(out_features >= 0, "out_features must be >= 0, got ", out_features);
  const int64_t panels = (out_features + cpu::kLinearPanel - 1) / cpu::kLinearPanel;
  const at::ScalarType weight_dtype = weight.scalar_type();
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.device().is_cpu() &&
                  (weight_dtype == at::kFloat || weight_dtype == at::kBFloat16 ||
                   weight_dtype == at::kHalf) &&
                  weight.size(0) == panels && weight.size(1) == x.size(1) &&
                  weight.size(2) == cpu::kLinearPanel,
              "weight must be packed by layer_ops.pack_linear_weight: a contiguous [", panels,
              ", ", x.size(1), ", ", cpu::kLinearPanel,
              "] float32, bfloat16 or float16 CPU tensor, got ", weight.sizes(), " ",
              weight_dtype);
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == out_features &&
                    bias->scalar_type() == at::kFloat && bias->device().is_cpu(),
                "bias must be a contiguous [out_features] float32 CPU tensor");
  }
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  LinearParams p{};
  p.y = y.data_ptr<float>();
  p.x = x.data_ptr<float>();
  p.weight = weight.data_ptr();
  p.weight_dtype = weight_dtype;
  p.bias = bias ? bias->data_ptr<float>() : nullptr;
  p.x_row_stride = x.stride(0);
  p.rows = x.size(0);
  p.in_features = x.size(1);
  p.out_features = out_features;
  cpu::linear(p, vector_floats);
  return y;
}

void check_float_rows(const at::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim && t.device().is_cpu() && t.scalar_type() == at::kFloat &&
                  t.stride(dim - 1) == 1,
              name, " must be a ", dim, "-d float32 CPU tensor with contiguous rows");
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float_rows(x, 2, "x");
  check_float_rows(weight, 1, "weight");
  TORCH_CHECK(weight.size(0) == x.size(1), "weight must have one entry per hidden unit");
  at::Tensor out = at::empty(x.sizes(), x.options());
  RmsNormParams p{};
  p.out = out.data_ptr<float>();
  p.x = x.data_ptr<float>();
  p.weight = weight.data_ptr<float>();
  p.x_row_stride = x.stride(0);
  p.num_tokens = x.size(0);
  p.hidden_size = x.size(1);
  p.eps = static_cast<float>(eps);
  cpu::rms_norm(p);
  return out;
}

at::Tensor silu_and_mul_op(const at::Tensor& gate_up) {
  check_float_rows(gate_up, 2, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must hold gate and up halves");
  const int64_t width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  SiluAndMulParams p{};
  p.out = out.data_ptr<float>();
  p.gate_up = gate_up.data_ptr<float>();
  p.gate_up_row_stride = gate_up.stride(0);
  p.num_tokens = gate_up.size(0);
  p.width = width;
  cpu::silu_and_mul(p);
  return out;
}

std::tuple<at::Tensor, at::Tensor> greedy_op(const at::Tensor& logits) {
  check_float_rows(logits, 2, "logits");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31),
              "logits need between 1 and 2^31 - 1 columns");
  at::Tensor token_ids = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  at::Tensor logprobs = at::empty({logits.size(0)}, logits.options());
  GreedyParams p{};
  p.token_ids = token_ids.data_ptr<int64_t>();
  p.logprobs = logprobs.data_ptr<float>();
  p.logits = logits.data_ptr<float>();
  p.row_stride = logits.stride(0);
  p.num_rows = logits.size(0);
  p.vocab_size = logits.size(1);
  cpu::greedy(p);
  return {token_ids, logprobs};
}

void rotary_embedding_op(const at::Tensor& positions, at::Tensor& query, at::Tensor& key,
                         const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* t : {&query, &key}) {
    check_float_rows(*t, 3, "query and key");
    TORCH_CHECK(rows_contiguous(*t), "query and key heads must be contiguous within a token");
  }
  const int64_t head_dim = query.size(2);
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(2) == head_dim && head_dim % 2 == 0,
              "query and key need the same tokens and an even head_dim");
  check_int_tensor(positions, at::kLong, 1, "positions", at::kCPU);
  TORCH_CHECK(positions.size(0) == query.size(0), "positions needs one entry per token");
  check_float_rows(cos, 2, "cos");
  TORCH_CHECK(sin.sizes() == cos.sizes() && sin.strides() == cos.strides() &&
                  sin.scalar_type() == at::kFloat && cos.size(1) >= head_dim / 2,
              "cos and sin must be [max_positions, >= head_dim / 2] tables of one layout");
  RotaryParams p{};
  p.query = query.data_ptr<float>();
  p.key = key.data_ptr<float>();
  p.positions = positions.data_ptr<int64_t>();
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.query_token_stride = query.stride(0);
  p.key_token_stride = key.stride(0);
  p.table_row_stride = cos.stride(0);
  p.num_tokens = query.size(0);
  p.num_query_heads = query.size(1);
  p.num_key_heads = key.size(1);
  p.head_dim = head_dim;
  p.max_positions = cos.size(0);
  cpu::rotary_embedding(p);
}

// A decoder layer's parameters, in order: input norm, q/k/v projection and its bias, output
// projection, post-attention norm, gate/up projection and its bias, down projection and its
// bias, output projection's bias, per-head q norm and k norm (biases and q/k norms None when
// absent; projections packed by layer_ops.pack_linear_weight).
using LayerWeights = std::vector<std::optional<at::Tensor>>;
constexpr size_t kLayerWeights = 12;

// RMSNorm over each head of [num_tokens, num_heads, head_dim] (Qwen3's q and k norms), into a
// contiguous copy.
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_op(x.reshape({-1, x.size(2)}), weight, eps).view(x.sizes());
}

// executor_svc.attention.AttentionMetadata: the prefill tokens first, then one per decode.
struct StepAttention {
  at::Tensor slot_mapping;
  int64_t num_prefill_tokens;
  at::Tensor prefill_query_start_loc, prefill_context_lens, prefill_block_tables;
  at::Tensor decode_context_lens, decode_block_tables;
};

at::Tensor attend(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const StepAttention& step, double scale,
                  int64_t sliding_window) {
  const int64_t split = step.num_prefill_tokens, num_tokens = query.size(0);
  at::Tensor prefill, decode;
  if (split > 0) {
    prefill = paged_attention_op(query.narrow(0, 0, split), key_cache, value_cache,
                                 step.prefill_block_tables, step.prefill_context_lens,
                                 step.prefill_query_start_loc, scale, sliding_window);
  }
  if (split < num_tokens) {
    decode = paged_attention_op(query.narrow(0, split, num_tokens - split), key_cache,
                                value_cache, step.decode_block_tables, step.decode_context_lens,
                                std::nullopt, scale, sliding_window);
  }
  if (!decode.defined()) return prefill;
  return prefill.defined() ? at::cat({prefill, decode}) : decode;
}

// executor_svc.models.llama's decoder layers in one call: the same kernels in the same order,
// without the Python around each.
at::Tensor decoder_layers_op(at::Tensor hidden, const at::Tensor& positions,
                             const std::vector<LayerWeights>& layers,
                             std::vector<std::tuple<at::Tensor, at::Tensor>> kv_caches,
                             const at::Tensor& slot_mapping, int64_t num_prefill_tokens,
                             const at::Tensor& prefill_query_start_loc,
                             const at::Tensor& prefill_context_lens,
                             const at::Tensor& prefill_block_tables,
                             const at::Tensor& decode_context_lens,
                             const at::Tensor& decode_block_tables, const at::Tensor& cos,
                             const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t intermediate_size, double eps,
                             double scale, const std::vector<int64_t>& sliding_windows) {
  check_float_rows(hidden, 2, "hidden");
  TORCH_CHECK(kv_caches.size() == layers.size() && sliding_windows.size() == layers.size(),
              "one (key, value) cache pair and one sliding window per layer");
  const StepAttention step{slot_mapping,           num_prefill_tokens,  prefill_query_start_loc,
                           prefill_context_lens,   prefill_block_tables, decode_context_lens,
                           decode_block_tables};
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& w = layers[i];
    TORCH_CHECK(w.size() == kLayerWeights && w[0] && w[1] && w[3] && w[4] && w[5] && w[7],
                "layer ", i, " needs its ", kLayerWeights, " parameters (only biases None)");
    auto& [key_cache, value_cache] = kv_caches[i];
    at::Tensor qkv = linear_op(rms_norm_op(hidden, *w[0], eps), *w[1], w[2],
                               q_size + 2 * kv_size, 0);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    at::Tensor v =
        qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
    if (w[10]) q = head_rms_norm(q, *w[10], eps);
    if (w[11]) k = head_rms_norm(k, *w[11], eps);
    rotary_embedding_op(positions, q, k, cos, sin);
    const at::ScalarType cache_dtype = key_cache.scalar_type();  // fp32, or 16 bits to halve it
    reshape_and_cache_op(k.to(cache_dtype), v.to(cache_dtype), key_cache, value_cache,
                         slot_mapping);
    at::Tensor attn = attend(q, key_cache, value_cache, step, scale, sliding_windows[i]);
    at::Tensor out = linear_op(attn.view({num_tokens, q_size}), *w[3], w[9], hidden_size, 0);
    hidden = out.add_(hidden);  // the residual, into the fresh projection
    at::Tensor gate_up = linear_op(rms_norm_op(hidden, *w[4], eps), *w[5], w[6],
                                   2 * intermediate_size, 0);
    out = linear_op(silu_and_mul_op(gate_up), *w[7], w[8], hidden_size, 0);
    hidden = out.add_(hidden);
  }
  return hidden;
}

}  // namespace
}  // namespace pagedserve::cpu

// Every op runs without the GIL: pybind11 converts its arguments to C++ values first and
// its result after, and nothing in between touches a Python object. Other Python threads
// (the executor's gRPC loop: health checks, GetStats, the registry heartbeat) then run
// during a step.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve CPU kernels: paged attention over the block pool and KV-cache writes";
  m.def("paged_attention", &pagedserve::cpu::paged_attention_op, NoGil(), py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("query_start_loc"), py::arg("scale"),
        py::arg("sliding_window") = 0, py::arg("vector_floats") = 0,
        "query_start_loc None: one query token per sequence (decode); sliding_window > 0: "
        "each token sees that many positions, itself included; vector_floats 8 keeps prompts on "
        "8-float vectors where the CPU has 16 (tests)");
  m.def("linear", &pagedserve::cpu::linear_op, NoGil(), py::arg("x"), py::arg("weight"),
        py::arg("bias"), py::arg("out_features"), py::arg("vector_floats") = 0,
        "x W^T + b with W packed in panels (layer_ops.pack_linear_weight); vector_floats 8 "
        "forces 8-float vectors");
  m.def("rms_norm", &pagedserve::cpu::rms_norm_op, NoGil(), py::arg("x"), py::arg("weight"),
        py::arg("eps"));
  m.def("silu_and_mul", &pagedserve::cpu::silu_and_mul_op, NoGil(), py::arg("gate_up"));
  m.def("greedy", &pagedserve::cpu::greedy_op, NoGil(), py::arg("logits"),
        "(argmax, log_softmax at the argmax) of each row");
  m.def("rotary_embedding", &pagedserve::cpu::rotary_embedding_op, NoGil(),
        py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos"), py::arg("sin"),
        "rotates query and key in place");
  m.def("decoder_layers", &pagedserve::cpu::decoder_layers_op, NoGil(), py::arg("hidden"),
        py::arg("positions"), py::arg("layers"), py::arg("kv_caches"), py::arg("slot_mapping"),
        py::arg("num_prefill_tokens"), py::arg("prefill_query_start_loc"),
        py::arg("prefill_context_lens"), py::arg("prefill_block_tables"),
        py::arg("decode_context_lens"), py::arg("decode_block_tables"), py::arg("cos"),
        py::arg("sin"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("intermediate_size"), py::arg("eps"), py::arg("scale"),
        py::arg("sliding_windows"),
        "a Llama decoder's layers on fp32 CPU activations with packed projections (fp32, bf16 "
        "or fp16) and caches of any of those dtypes");
  m.def("reshape_and_cache", &pagedserve::cpu::reshape_and_cache_op, NoGil(), py::arg("key"),
        py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"));
}
