// LockedBuffer: page-aligned host memory, mlock'ed when the limit allows.
//
// Locked pages cannot be swapped out, so DMA from the device never waits for
// a page-in. When mlock is refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK, or
// NVMEIO_MLOCK=0) the memory is still aligned and usable; locked() says so
// and the Python layer warns once.
#pragma once

#include <cstdint>
#include <string>

namespace nvmeio {

class LockedBuffer {
 public:
  explicit LockedBuffer(int64_t nbytes, bool try_lock);
  ~LockedBuffer();
  LockedBuffer(const LockedBuffer&) = delete;
  LockedBuffer& operator=(const LockedBuffer&) = delete;

  char* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  bool locked() const { return locked_; }
  // Why locking failed (strerror of mlock), empty when locked or not tried.
  const std::string& lock_error() const { return lock_error_; }
  // Gives up the lock early (free_cpu_locked_tensor); the memory stays
  // valid until the last tensor viewing it is gone.
  void unlock();

 private:
  char* data_ = nullptr;
  int64_t nbytes_ = 0;
  int64_t alloc_bytes_ = 0;
  bool locked_ = false;
  std::string lock_error_;
};

}  // namespace nvmeio
