#include "host_sum.h"

#include <cstring>

#include "parallel.h"

namespace nvmeio {
namespace {

inline float widen(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One pass per source over [a, b): the sum and one source stream through memory
// together (a pass over all sources per cache-sized block measured slower: many
// short streams defeat the hardware prefetcher).
void sum_range(float* dst, SumSource first, const std::vector<SumSource>& sources, int64_t a, int64_t b) {
  if (first.data != nullptr) {
    if (first.bf16) {
      const auto* s = static_cast<const uint16_t*>(first.data);
      for (int64_t i = a; i < b; ++i) dst[i] = widen(s[i]);
    } else {
      std::memcpy(dst + a, static_cast<const float*>(first.data) + a, sizeof(float) * (b - a));
    }
  }
  for (const SumSource& src : sources) {
    if (src.bf16) {
      const auto* s = static_cast<const uint16_t*>(src.data);
      for (int64_t i = a; i < b; ++i) dst[i] += widen(s[i]);
    } else {
      const auto* s = static_cast<const float*>(src.data);
      for (int64_t i = a; i < b; ++i) dst[i] += s[i];
    }
  }
}

constexpr int64_t kAlign = 1024;  // thread ranges start on whole cache lines of both types

}  // namespace

void sum_series(float* dst, SumSource first, const std::vector<SumSource>& sources, int64_t n, int threads) {
  parallel_ranges(n, threads, kAlign, [&](int64_t a, int64_t b) { sum_range(dst, first, sources, a, b); });
}

}  // namespace nvmeio
