#include "locked.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "aligned.h"

namespace nvmeio {

LockedBuffer::LockedBuffer(int64_t nbytes, bool try_lock) : nbytes_(nbytes) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  // Whole pages, at least one, so mlock covers exactly our memory.
  alloc_bytes_ = std::max<int64_t>(align_up(nbytes, page), page);
  void* p = ::mmap(nullptr, static_cast<size_t>(alloc_bytes_), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  data_ = static_cast<char*>(p);
  if (try_lock) {
    if (::mlock(data_, static_cast<size_t>(alloc_bytes_)) == 0)
      locked_ = true;
    else
      lock_error_ = std::strerror(errno);
  }
}

void LockedBuffer::unlock() {
  if (locked_) {
    ::munlock(data_, static_cast<size_t>(alloc_bytes_));
    locked_ = false;
  }
}

LockedBuffer::~LockedBuffer() {
  unlock();
  ::munmap(data_, static_cast<size_t>(alloc_bytes_));
}

}  // namespace nvmeio
