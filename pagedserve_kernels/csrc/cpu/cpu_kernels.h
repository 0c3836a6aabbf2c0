// pagedserve's CPU kernels on raw pointers; bindings.cpp owns every at::Tensor check.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace pagedserve::cpu {

struct AttentionParams {
  void* out;                       // [num_tokens, num_heads, head_dim], contiguous, query's dtype
  const void* query;               // [num_tokens, num_heads, head_dim], heads contiguous
  const void* key_cache;           // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const void* value_cache;         // [num_blocks, block_size, num_kv_heads, head_dim], contiguous
  const int32_t* block_tables;     // [num_seqs, max_num_blocks_per_seq]
  const int32_t* context_lens;     // [num_seqs], cached prefix + new tokens
  const int32_t* query_start_loc;  // [num_seqs + 1]; nullptr: one new token per sequence
  int64_t query_token_stride;      // elements between two tokens' queries
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_num_blocks_per_seq;
  int64_t sliding_window;  // positions a token sees, itself included; 0: its whole context
  float scale;
};

// Causal attention of each sequence's new tokens over its context, read in place through the
// block table; parallel over (sequence, kv head, tile of new tokens) on torch's intra-op threads.
// out has query's dtype: the caches' or float32 (fp32 activations over a 16-bit cache).
// vector_floats 8 keeps prompts on 8-float vectors where the CPU has 16 (tests, benchmarks);
// anything else, the widest the head size allows.
void paged_attention(c10::ScalarType query_dtype, c10::ScalarType cache_dtype,
                     const AttentionParams& params, int64_t vector_floats = 0);

// Output features per panel of a packed linear weight (layer_ops.LINEAR_PANEL).
constexpr int64_t kLinearPanel = 32;

struct LinearParams {
  float* y;              // [rows, out_features], contiguous
  const float* x;        // [rows, in_features], elements contiguous within a row
  const void* weight;    // packed: [ceil(out_features / 32), in_features, 32], zero-padded
  c10::ScalarType weight_dtype;  // Float, BFloat16 or Half
  const float* bias;     // [out_features] or nullptr
  int64_t x_row_stride;  // elements between two rows of x
  int64_t rows;
  int64_t in_features;
  int64_t out_features;
};

// y = x W^T + b in fp32 (16-bit weights widened exactly); parallel over panels of rows and runs
// of weight panels. vector_floats 8 picks 8-float vectors even where the CPU has 16 (tests,
// benchmarks); anything else, the widest.
void linear(const LinearParams& params, int64_t vector_floats);

struct RmsNormParams {
  float* out;            // [num_tokens, hidden_size], contiguous
  const float* x;        // [num_tokens, hidden_size], rows contiguous
  const float* weight;   // [hidden_size]
  int64_t x_row_stride;  // elements between two rows of x
  int64_t num_tokens;
  int64_t hidden_size;
  float eps;
};

// out = weight * x / sqrt(mean(x^2) + eps), row by row.
void rms_norm(const RmsNormParams& params);

struct SiluAndMulParams {
  float* out;                  // [num_tokens, width], contiguous
  const float* gate_up;        // [num_tokens, 2 * width]: gate, then up; rows contiguous
  int64_t gate_up_row_stride;  // elements between two rows of gate_up
  int64_t num_tokens;
  int64_t width;
};

// out = silu(gate) * up (SwiGLU).
void silu_and_mul(const SiluAndMulParams& params);

struct GreedyParams {
  int64_t* token_ids;    // [num_rows]
  float* logprobs;       // [num_rows]: log_softmax of the row at its token
  const float* logits;   // [num_rows, vocab_size], rows contiguous
  int64_t row_stride;    // elements between two rows of logits
  int64_t num_rows;
  int64_t vocab_size;
};

// Each row's argmax (first of equal maxima) and its log-probability under softmax.
void greedy(const GreedyParams& params);

struct RotaryParams {
  float* query;                // [num_tokens, num_query_heads, head_dim], heads contiguous
  float* key;                  // [num_tokens, num_key_heads, head_dim], heads contiguous
  const int64_t* positions;    // [num_tokens]
  const float* cos;            // [max_positions, >= head_dim / 2] (first half used)
  const float* sin;            // [max_positions, >= head_dim / 2]
  int64_t query_token_stride;  // elements between two tokens' query heads
  int64_t key_token_stride;
  int64_t table_row_stride;
  int64_t num_tokens;
  int64_t num_query_heads;
  int64_t num_key_heads;
  int64_t head_dim;
  int64_t max_positions;
};

// Rotates each head of query and key in place by its token's position (rotate-half layout).
void rotary_embedding(const RotaryParams& params);

// Copies each token's K and V rows into its slot; a negative slot skips the token.
// Every row is row_bytes long; strides are in bytes.
void reshape_and_cache(const char* key, const char* value, char* key_cache, char* value_cache,
                       const int64_t* slot_mapping, int64_t num_tokens, int64_t num_slots,
                       int64_t key_token_stride, int64_t value_token_stride, int64_t row_bytes);

}  // namespace pagedserve::cpu
