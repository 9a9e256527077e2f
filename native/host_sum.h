// Sums of host arrays in a given order: gradient accumulation over micro-batches.
//
// dst (fp32) = first (if given), then dst += each source in turn, every element
// getting the same IEEE single-precision additions in the same order as
// torch's dst.add_(src) one source after another, so results are bit-identical.
// A bf16 source is widened on the fly (exact: bf16 is the top half of an fp32).
// Why native: torch's mixed-dtype add on the CPU first widens the whole source
// into a temporary, and on threads other than the main one (a window's micro-
// batch threads) its OpenMP team sleeps between operations; see
// nvmeio/host_sum.py, [Note: why the sum is native].
#pragma once

#include <cstdint>
#include <vector>

namespace nvmeio {

struct SumSource {
  const void* data;
  bool bf16;  // else fp32
};

// first.data may be null (dst keeps its value). Splits [0, n) over `threads`
// threads (1: the caller's only).
void sum_series(float* dst, SumSource first, const std::vector<SumSource>& sources, int64_t n, int threads);

}  // namespace nvmeio
