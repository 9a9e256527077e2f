// Splitting [0, n) over helper threads for the host loops (host_sum, dequantize).
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace nvmeio {

constexpr int64_t kMinPerThread = 1 << 16;  // below this a thread costs more than it saves

// fn(a, b) over consecutive ranges of [0, n), each starting on a multiple of `align`, on up to
// `threads` threads (the caller runs the first range).
template <typename Fn>
void parallel_ranges(int64_t n, int threads, int64_t align, Fn fn) {
  int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n / kMinPerThread));
  if (parts == 1) {
    fn(int64_t{0}, n);
    return;
  }
  int64_t per = ((n + parts - 1) / parts + align - 1) / align * align;
  std::vector<std::thread> helpers;
  for (int64_t t = 1; t < parts; ++t) {
    int64_t a = t * per, b = std::min(n, a + per);
    if (a < b) helpers.emplace_back(fn, a, b);
  }
  fn(int64_t{0}, std::min(n, per));
  for (std::thread& h : helpers) h.join();
}

}  // namespace nvmeio
