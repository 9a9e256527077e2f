// Frozen weights stored int8 with one fp32 scale per group (zero/stores/quantized.py) back to
// the compute dtype on the host.
//
// dst[i] = float(codes[i]) * scales[i / group_size]: one IEEE single-precision multiply, then,
// for bf16, one rounding to nearest even: bit-identical to torch's
// codes.to(float32).view(-1, group).mul_(scales[:, None]).to(bfloat16).
// Why native: torch's int8-to-float conversion on the CPU is a scalar loop (about 3 ns an
// element here against a vectorised loop's fraction of one), and every fetch of a frozen unit
// pays it; see zero/stores/quantized.py, [Note: dequantizing on the host].
#pragma once

#include <cstdint>

namespace nvmeio {

void dequantize_int8(void* dst, bool bf16, const int8_t* codes, const float* scales, int64_t n,
                     int64_t group_size, int threads);

}  // namespace nvmeio
