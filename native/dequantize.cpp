#include "dequantize.h"

#include <cstring>

#include "parallel.h"

namespace nvmeio {
namespace {

inline uint16_t to_bf16(float f) {  // round to nearest even, as torch's float-to-bfloat16
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// [a, b) with a on a group boundary: one scale per inner loop, which the compiler vectorises.
void dequantize_range(void* dst, bool bf16, const int8_t* codes, const float* scales, int64_t group_size,
                      int64_t a, int64_t b) {
  for (int64_t start = a; start < b; start += group_size) {
    const int64_t stop = std::min(b, start + group_size);
    const float s = scales[start / group_size];
    if (bf16) {
      auto* out = static_cast<uint16_t*>(dst);
      for (int64_t i = start; i < stop; ++i) out[i] = to_bf16(float(codes[i]) * s);
    } else {
      auto* out = static_cast<float*>(dst);
      for (int64_t i = start; i < stop; ++i) out[i] = float(codes[i]) * s;
    }
  }
}

}  // namespace

void dequantize_int8(void* dst, bool bf16, const int8_t* codes, const float* scales, int64_t n,
                     int64_t group_size, int threads) {
  // Thread ranges start on a group and a 4 KiB page of the widest output.
  const int64_t align = group_size * 1024;
  parallel_ranges(n, threads, align, [&](int64_t a, int64_t b) {
    dequantize_range(dst, bf16, codes, scales, group_size, a, b);
  });
}

}  // namespace nvmeio
