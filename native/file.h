// File: the open file behind one op (RAII for its descriptors).
//
// [Note: two descriptors per file]
// The aligned middle of an op goes through an O_DIRECT descriptor; the
// unaligned head and tail (at most one alignment unit each) go through a
// second, buffered descriptor, byte-exact. Padding the tail to a full block
// instead would write past offset+nbytes, racing with a neighbouring op on
// the same file and leaving the file too long. The kernel keeps the two views
// coherent: direct reads write back dirty cached pages of their range first,
// direct writes invalidate them.
//
// [Note: preallocating extending writes]
// ext4 (and XFS) run a direct write that extends the file synchronously under
// the inode lock, so a fresh file is written one request at a time. A write
// op that ends past EOF therefore fallocates its range first: the requests
// then overwrite allocated (unwritten) blocks and run in parallel (measured
// here: a fresh 1 GiB file 2.1 -> 2.9 GiB/s, 10,000 x 64 KiB ops into one
// new file 0.5 -> 1.5 GiB/s). It also turns a full disk into an error before
// any byte is written. A failed op restores the old size.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace nvmeio {

// O_DIRECT alignment for file offsets, lengths and memory. 4096 is safe for
// both 512-byte and 4Kn devices on every Linux file system.
constexpr int64_t kDirectAlign = 4096;

enum class OpenMode { kRead, kWrite };

// What a file is, in the words of an error message: "a FIFO (named pipe)".
std::string file_kind(mode_t mode);
// True for a file of /proc, /sys and the like, which report a size of 0 whatever they hold.
bool in_pseudo_file_system(const std::string& path);
// Throws IoError(ESPIPE) naming the file type for a FIFO or a socket: `step` ("open
// for reading") refused, with path, offset and length.
void refuse_without_offsets(mode_t mode, const std::string& path, int64_t offset, int64_t nbytes,
                            const std::string& step);

class File {
 public:
  // Opens `path` for one op covering [offset, offset + nbytes).
  //  - FIFOs and sockets are refused (ESPIPE) before they are opened.
  //  - reads: the file must exist and hold the whole range, where it has a size
  //    to check (a regular file, a block device; see short_read_message).
  //  - writes: created with mode 0600 if missing (and removed again if the op
  //    fails, so a failed write never leaves a half-written new file).
  // `want_direct`: try O_DIRECT; a file system that refuses it (EINVAL) gives
  // a buffered file (direct() == false) and the op fdatasyncs at the end.
  // `need_buffered`: also open the buffered descriptor for unaligned parts.
  static std::shared_ptr<File> open(const std::string& path, OpenMode mode, int64_t offset,
                                    int64_t nbytes, bool want_direct, bool need_buffered);
  // Wraps a caller's open descriptor (dup'ed, so the caller may close theirs);
  // a FIFO or socket is refused (ESPIPE).
  static std::shared_ptr<File> from_fd(int fd, OpenMode mode, int64_t offset, int64_t nbytes);

  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  bool refused_direct() const { return refused_direct_; }
  // Descriptor for aligned requests (O_DIRECT when direct()).
  int direct_fd() const { return direct_fd_; }
  // Descriptor for byte-exact requests (buffered).
  int buffered_fd() const { return buffered_fd_ >= 0 ? buffered_fd_ : direct_fd_; }
  bool created() const { return created_; }
  // What a read that found no more bytes at `offset` says (see File::open).
  std::string short_read_message(int64_t offset) const;

  // Called once when the op that opened the file failed: removes a file the
  // op created, or gives an existing file back its old size.
  void discard_created();
  // fdatasync, for writes that went through the page cache.
  void sync(int64_t offset, int64_t length);

 private:
  File() = default;
  struct stat opened(int fd, const std::string& step, int64_t offset, int64_t nbytes);
  void preallocate(int64_t offset, int64_t nbytes);
  std::string path_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  bool direct_ = false;
  bool refused_direct_ = false;
  bool created_ = false;
  bool write_ = false;
  mode_t type_ = 0;           // S_IFREG, S_IFCHR, ... of the open file
  bool pseudo_ = false;       // in a pseudo file system (reported size 0)
  bool size_checked_ = false; // a read was checked against the size before it started
  int64_t old_size_ = -1;  // size before an extending write, to restore on failure
};

}  // namespace nvmeio
