// How finely the row-wise CPU kernels split their rows over torch's threads.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedserve::cpu {

// Elements a thread takes at least (about 1 MB): a decode step's few rows stay on one thread,
// where a fork/join would cost more than the work, and wait on a preempted peer besides.
constexpr int64_t kGrainElements = 1 << 18;

// The at::parallel_for grain, in rows, for rows of row_elements elements each.
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

}  // namespace pagedserve::cpu
