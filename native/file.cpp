#include "file.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/stat.h>
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

namespace {

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
int open_maybe_direct(const std::string& path, int flags, bool want_direct, bool* direct,
                      bool* refused) {
  *direct = false;
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

std::shared_ptr<File> File::open(const std::string& path, OpenMode mode, int64_t offset,
                                 int64_t nbytes, bool want_direct, bool need_buffered) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->write_ = mode == OpenMode::kWrite;
  if (mode == OpenMode::kRead) {
    f->direct_fd_ = open_maybe_direct(path, O_RDONLY, want_direct, &f->direct_, &f->refused_direct_);
    if (f->direct_fd_ < 0) throw make_io_error(errno, path, offset, nbytes, "open for reading");
    struct stat st;
    if (::fstat(f->direct_fd_, &st) != 0) throw make_io_error(errno, path, offset, nbytes, "fstat");
    if (S_ISDIR(st.st_mode)) throw make_io_error(EISDIR, path, offset, nbytes, "open for reading");
    // An empty read asks for no byte, so it cannot be short (as pread(2) of 0 bytes).
    if (S_ISREG(st.st_mode) && nbytes > 0 && offset + nbytes > st.st_size) {
      std::string what = "short read: the file holds " + std::to_string(st.st_size) +
                         " bytes, but reading " + std::to_string(nbytes) + " bytes at offset " +
                         std::to_string(offset) + " needs " + std::to_string(offset + nbytes);
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
      throw make_io_error(err, path, offset, nbytes, "open for writing");
    }
  }
  if (mode == OpenMode::kWrite) f->preallocate(offset, nbytes);
  if (need_buffered && f->direct_) {
    f->buffered_fd_ = ::open(path.c_str(), (f->write_ ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
    if (f->buffered_fd_ < 0) {
      int err = errno;
      f->discard_created();
      throw make_io_error(err, path, offset, nbytes, "open (buffered)");
    }
  }
  return f;
}

std::shared_ptr<File> File::from_fd(int fd, OpenMode mode) {
  std::shared_ptr<File> f(new File());
  f->path_ = "<fd " + std::to_string(fd) + ">";
  f->write_ = mode == OpenMode::kWrite;
  int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw make_io_error(errno, f->path_, 0, 0, "fcntl(F_GETFL)");
  f->direct_fd_ = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (f->direct_fd_ < 0) throw make_io_error(errno, f->path_, 0, 0, "dup");
  f->direct_ = (flags & O_DIRECT) != 0;
  if (f->direct_) {
    // Reopen the same file without O_DIRECT for the unaligned parts.
    std::string proc = "/proc/self/fd/" + std::to_string(f->direct_fd_);
    f->buffered_fd_ = ::open(proc.c_str(), (f->write_ ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
    if (f->buffered_fd_ < 0) throw make_io_error(errno, f->path_, 0, 0, "reopen (buffered)");
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
  // Character devices, pipes and sockets have nothing to sync (EINVAL, or
  // EROFS for some): the data went through when write(2) returned.
  struct stat st;
  if ((err == EINVAL || err == EROFS) && ::fstat(buffered_fd(), &st) == 0 && !S_ISREG(st.st_mode) &&
      !S_ISBLK(st.st_mode))
    return;
  throw make_io_error(err, path_, offset, length, "fdatasync");
}

File::~File() {
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

}  // namespace nvmeio
