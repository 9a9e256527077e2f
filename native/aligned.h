// Small helpers for alignment arithmetic and aligned heap memory.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace nvmeio {

inline int64_t align_down(int64_t x, int64_t a) { return x - (x % a); }
inline int64_t align_up(int64_t x, int64_t a) { return align_down(x + a - 1, a); }
inline bool is_aligned(const void* p, int64_t a) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(a) == 0;
}

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using AlignedPtr = std::unique_ptr<char, FreeDeleter>;

inline AlignedPtr aligned_alloc_bytes(int64_t nbytes, int64_t alignment) {
  void* p = nullptr;
  if (posix_memalign(&p, static_cast<size_t>(alignment), static_cast<size_t>(nbytes)) != 0)
    throw std::bad_alloc();
  return AlignedPtr(static_cast<char*>(p));
}

}  // namespace nvmeio
