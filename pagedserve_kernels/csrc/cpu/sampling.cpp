// Greedy decoding on CPU, fp32: each row's most likely token and its log-probability.
//
// torch needs a log_softmax (which writes a copy of the logits) and an argmax for this, each a
// full pass over the logits of its own. Two read-only passes per row instead, parallel over
// rows: the max and its first index, then sum(e^(x - max)), so that
// logprob = x[argmax] - max - log(sum) = -log(sum).
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "cpu_kernels.h"
#include "grain.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

// The row's max and the first index holding it (torch.argmax's tie rule). NaNs never win.
PAGEDSERVE_INLINE void row_argmax(const float* x, int64_t n, float& max, int64_t& index) {
  vfloat best = splat(-std::numeric_limits<float>::infinity());
  vint best_at = {}, at = {0, 1, 2, 3, 4, 5, 6, 7};
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const vfloat v = load(x + i);
    const vint better = v > best;  // strictly greater: a lane keeps its first maximum
    best = better ? v : best;
    best_at = better ? at : best_at;
    at += static_cast<int32_t>(kWidth);
  }
  max = -std::numeric_limits<float>::infinity();
  index = 0;
  for (int l = 0; l < kWidth; ++l) {  // lanes never loaded hold -inf and lose
    if (best[l] > max || (best[l] == max && best_at[l] < index)) {
      max = best[l];
      index = best_at[l];
    }
  }
  for (; i < n; ++i) {
    if (x[i] > max) {
      max = x[i];
      index = i;
    }
  }
}

PAGEDSERVE_CPU_CLONES void greedy_rows(const GreedyParams& p, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    const float* x = p.logits + r * p.row_stride;
    float max;
    int64_t index;
    row_argmax(x, p.vocab_size, max, index);
    vfloat acc = {};
    int64_t i = 0;
    for (; i + kWidth <= p.vocab_size; i += kWidth) acc += exp_nonpositive(load(x + i) - max);
    float sum = hsum(acc);
    for (; i < p.vocab_size; ++i) sum += std::exp(x[i] - max);
    p.token_ids[r] = index;
    p.logprobs[r] = -std::log(sum);
  }
}

}  // namespace

void greedy(const GreedyParams& params) {
  at::parallel_for(0, params.num_rows, grain_rows(params.vocab_size),
                   [&](int64_t begin, int64_t end) { greedy_rows(params, begin, end); });
}

}  // namespace pagedserve::cpu
