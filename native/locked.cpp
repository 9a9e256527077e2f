#include "locked.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "aligned.h"

namespace nvmeio {

namespace {
constexpr int64_t kHugePage = int64_t(2) << 20;
}

LockedBuffer::LockedBuffer(int64_t nbytes, bool try_lock) : nbytes_(nbytes) {
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  // Whole pages, at least one, so mlock covers exactly our memory.
  alloc_bytes_ = std::max<int64_t>(align_up(nbytes, page), page);
  // [Note: huge pages for I/O buffers]
  // A direct request is built from the physical segments of its memory; with
  // 4 KiB pages a 1 MiB request has 256 of them, more than many devices take
  // in one command (virtio-blk here: 254), so it is split, and pinning it
  // walks 256 pages. Buffers of 2 MiB or more are therefore placed on 2 MiB
  // boundaries and asked for transparent huge pages (MADV_HUGEPAGE works in
  // the common "madvise" THP mode); where the kernel has none the buffer is
  // simply made of small pages.
  int64_t map_bytes = alloc_bytes_;
  if (alloc_bytes_ >= kHugePage) {
    alloc_bytes_ = align_up(alloc_bytes_, kHugePage);
    map_bytes = alloc_bytes_ + kHugePage;  // slack to move the start onto a boundary
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(map_bytes), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  char* base = static_cast<char*>(p);
  data_ = base;
  if (map_bytes > alloc_bytes_) {
    data_ = base + (align_up(reinterpret_cast<int64_t>(base), kHugePage) - reinterpret_cast<int64_t>(base));
    // Give back the slack on both sides.
    if (data_ > base) ::munmap(base, static_cast<size_t>(data_ - base));
    char* end = data_ + alloc_bytes_;
    char* map_end = base + map_bytes;
    if (map_end > end) ::munmap(end, static_cast<size_t>(map_end - end));
    ::madvise(data_, static_cast<size_t>(alloc_bytes_), MADV_HUGEPAGE);
  }
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
