#include "file.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "error.h"

namespace nvmeio {

IoError make_io_error(int err, const std::string& path, int64_t offset, int64_t length,
                      const std::string& step) {
  std::string what = step + " failed: " + std::strerror(err);
  return IoError(err, path, offset, length, what);
}

std::string file_kind(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFIFO: return "a FIFO (named pipe)";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: return "a symbolic link";
  }
  return "a file of unknown type";
}

namespace {

// File systems whose files are made when read: they report a size of 0.
bool pseudo_file_system_type(long type) {
  switch (type) {
    case PROC_SUPER_MAGIC: case SYSFS_MAGIC: case DEBUGFS_MAGIC: case TRACEFS_MAGIC:
    case SECURITYFS_MAGIC: case CGROUP_SUPER_MAGIC: case CGROUP2_SUPER_MAGIC:
      return true;
  }
  return false;
}

bool pseudo_fd(int fd) {
  struct statfs s;
  return ::fstatfs(fd, &s) == 0 && pseudo_file_system_type(s.f_type);
}

std::string parent_dir(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Opens with O_DIRECT when asked; EINVAL means the file system refuses direct
// I/O (tmpfs on old kernels, some FUSE and network file systems): retry
// buffered and tell the caller. Direct I/O turned off (NVMEIO_DIRECT_IO=0)
// takes the very same buffered path and is reported the same way.
// O_NONBLOCK: should the path have become a FIFO since File::open checked it,
// the open returns at once instead of waiting for a peer (File::opened checks
// what was opened and clears the flag).
int open_maybe_direct(const std::string& path, int flags, bool want_direct, bool* direct,
                      bool* refused) {
  *direct = false;
  flags |= O_NONBLOCK;
  if (!want_direct) *refused = true;
  if (want_direct) {
    int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0600);
    if (fd >= 0) {
      *direct = true;
      return fd;
    }
    if (errno != EINVAL) return -1;
    *refused = true;
  }
  return ::open(path.c_str(), flags | O_CLOEXEC, 0600);
}

}  // namespace

// FIFOs and sockets have no file offsets, and opening a FIFO waits until a peer
// opens its other end (for ever, if none comes): positional I/O is refused.
void refuse_without_offsets(mode_t mode, const std::string& path, int64_t offset,
                            int64_t nbytes, const std::string& step) {
  if (S_ISFIFO(mode) || S_ISSOCK(mode))
    throw IoError(ESPIPE, path, offset, nbytes,
                  step + " refused: " + file_kind(mode) + " has no file offsets, and nvmeio "
                  "reads and writes at offsets (regular files, block and character devices)");
}

bool in_pseudo_file_system(const std::string& path) {
  struct statfs s;
  return ::statfs(path.c_str(), &s) == 0 && pseudo_file_system_type(s.f_type);
}

// Checks what was opened (the path may have changed since it was looked at)
// and makes the descriptor blocking again.
struct stat File::opened(int fd, const std::string& step, int64_t offset, int64_t nbytes) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw make_io_error(errno, path_, offset, nbytes, "fstat");
  refuse_without_offsets(st.st_mode, path_, offset, nbytes, step);
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0)
    throw make_io_error(errno, path_, offset, nbytes, "fcntl(F_SETFL)");
  type_ = st.st_mode & S_IFMT;
  return st;
}

std::shared_ptr<File> File::open(const std::string& path, OpenMode mode, int64_t offset,
                                 int64_t nbytes, bool want_direct, bool need_buffered) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->write_ = mode == OpenMode::kWrite;
  const std::string step = mode == OpenMode::kRead ? "open for reading" : "open for writing";
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) refuse_without_offsets(st.st_mode, path, offset, nbytes, step);
  if (mode == OpenMode::kRead) {
    f->direct_fd_ = open_maybe_direct(path, O_RDONLY, want_direct, &f->direct_, &f->refused_direct_);
    if (f->direct_fd_ < 0) throw make_io_error(errno, path, offset, nbytes, step);
    st = f->opened(f->direct_fd_, step, offset, nbytes);
    if (S_ISDIR(st.st_mode)) throw make_io_error(EISDIR, path, offset, nbytes, step);
    // A read is checked before it starts against the size of a regular file or a
    // block device. A character device has no size, and a file of a pseudo file
    // system reports 0 whatever it holds: those are read as far as they go.
    int64_t size = -1;
    f->pseudo_ = S_ISREG(st.st_mode) && st.st_size == 0 && pseudo_fd(f->direct_fd_);
    if (S_ISREG(st.st_mode) && !f->pseudo_) size = st.st_size;
    if (S_ISBLK(st.st_mode)) size = ::lseek(f->direct_fd_, 0, SEEK_END);
    f->size_checked_ = size >= 0;
    // An empty read asks for no byte, so it cannot be short (as pread(2) of 0 bytes).
    if (size >= 0 && nbytes > 0 && offset + nbytes > size) {
      std::string what = std::string("short read: ") +
                         (S_ISBLK(st.st_mode) ? "the block device" : "the file") + " holds " +
                         std::to_string(size) + " bytes, but reading " + std::to_string(nbytes) +
                         " bytes at offset " + std::to_string(offset) + " needs " +
                         std::to_string(offset + nbytes);
      throw IoError(kShortReadErrno, path, offset, nbytes, what);
    }
  } else {
    // Try the existing file first so that we know whether this op created it.
    for (;;) {
      f->direct_fd_ = open_maybe_direct(path, O_WRONLY, want_direct, &f->direct_, &f->refused_direct_);
      if (f->direct_fd_ >= 0 || errno != ENOENT) break;
      f->refused_direct_ = false;
      f->direct_fd_ = open_maybe_direct(path, O_WRONLY | O_CREAT | O_EXCL, want_direct, &f->direct_,
                                        &f->refused_direct_);
      if (f->direct_fd_ >= 0) {
        f->created_ = true;
        break;
      }
      if (errno != EEXIST) break;  // EEXIST: someone created it meanwhile; open it.
    }
    if (f->direct_fd_ < 0) {
      int err = errno;
      if (err == ENOENT) {
        std::string dir = parent_dir(path);
        struct stat st;
        if (::stat(dir.c_str(), &st) != 0)
          throw IoError(err, path, offset, nbytes,
                        "open for writing failed: directory '" + dir + "' does not exist");
      }
      throw make_io_error(err, path, offset, nbytes, step);
    }
    f->opened(f->direct_fd_, step, offset, nbytes);
  }
  if (mode == OpenMode::kWrite) f->preallocate(offset, nbytes);
  if (need_buffered && f->direct_) {
    // The very file opened above (the path may name another one by now).
    std::string proc = "/proc/self/fd/" + std::to_string(f->direct_fd_);
    f->buffered_fd_ = ::open(proc.c_str(), (f->write_ ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
    if (f->buffered_fd_ < 0) {
      int err = errno;
      f->discard_created();
      throw make_io_error(err, path, offset, nbytes, "open (buffered)");
    }
  }
  return f;
}

std::shared_ptr<File> File::from_fd(int fd, OpenMode mode, int64_t offset, int64_t nbytes) {
  std::shared_ptr<File> f(new File());
  f->path_ = "<fd " + std::to_string(fd) + ">";
  f->write_ = mode == OpenMode::kWrite;
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw make_io_error(errno, f->path_, offset, nbytes, "fcntl(F_GETFL)");
  struct stat st;
  if (::fstat(fd, &st) != 0) throw make_io_error(errno, f->path_, offset, nbytes, "fstat");
  refuse_without_offsets(st.st_mode, f->path_, offset, nbytes, f->write_ ? "writing" : "reading");
  f->type_ = st.st_mode & S_IFMT;
  f->pseudo_ = S_ISREG(st.st_mode) && st.st_size == 0 && pseudo_fd(fd);
  f->direct_fd_ = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (f->direct_fd_ < 0) throw make_io_error(errno, f->path_, offset, nbytes, "dup");
  f->direct_ = (flags & O_DIRECT) != 0;
  if (f->direct_) {
    // Reopen the same file without O_DIRECT for the unaligned parts.
    std::string proc = "/proc/self/fd/" + std::to_string(f->direct_fd_);
    f->buffered_fd_ = ::open(proc.c_str(), (f->write_ ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
    if (f->buffered_fd_ < 0) throw make_io_error(errno, f->path_, offset, nbytes, "reopen (buffered)");
  }
  return f;
}

// See [Note: preallocating extending writes].
void File::preallocate(int64_t offset, int64_t nbytes) {
  struct stat st;
  if (::fstat(direct_fd_, &st) != 0 || !S_ISREG(st.st_mode) || offset + nbytes <= st.st_size) return;
  // An empty write moves no byte, so it never changes the size (as pwrite(2)
  // of 0 bytes does not); it only creates a missing file.
  if (nbytes == 0) return;
  if (::fallocate(direct_fd_, 0, offset, nbytes) == 0) {
    old_size_ = st.st_size;
    return;
  }
  int err = errno;
  if (err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) return;  // not supported here: write as is
  // ENOSPC, EFBIG, EDQUOT, ...: nothing was written; leave no trace.
  ::ftruncate(direct_fd_, st.st_size);
  discard_created();
  throw make_io_error(err, path_, offset, nbytes, "preallocating the file range");
}

void File::discard_created() {
  if (created_) {
    ::unlink(path_.c_str());
    created_ = false;
  } else if (old_size_ >= 0) {
    ::ftruncate(direct_fd_, old_size_);
    old_size_ = -1;
  }
}

void File::sync(int64_t offset, int64_t length) {
  if (::fdatasync(buffered_fd()) == 0) return;
  int err = errno;
  // EINVAL is the kernel's answer for a file that cannot be synced at all (a
  // character device, a /proc or /sys file): its bytes went through when
  // write(2) returned and nothing more can make them durable, so the op
  // succeeded. Some character devices answer EROFS instead.
  if (err == EINVAL || (err == EROFS && S_ISCHR(type_))) return;
  throw make_io_error(err, path_, offset, length, "fdatasync");
}

std::string File::short_read_message(int64_t offset) const {
  std::string what = std::string("short read: ") +
                     (S_ISCHR(type_) ? "the character device" : S_ISBLK(type_) ? "the block device"
                                                                                 : "the file") +
                     " ended at offset " + std::to_string(offset);
  if (S_ISCHR(type_))
    return what + " (a character device has no size to check a read against before it starts)";
  if (pseudo_)
    return what + " (it reports a size of 0, as files of /proc, /sys and other pseudo file "
                  "systems do, so its size could not be checked before reading)";
  if (size_checked_) return what + " (it was shortened while being read)";
  return what;
}

File::~File() {
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

}  // namespace nvmeio
