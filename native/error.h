// IoError: one failed I/O, with everything a user needs to find it.
//
// Every failure that leaves the native core is one of these; the binding
// turns it into a Python OSError subclass (nvmeio.AioError) carrying errno,
// path, file offset and length.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace nvmeio {

class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string path, int64_t offset, int64_t length, const std::string& what)
      : std::runtime_error(what), err_(err), path_(std::move(path)), offset_(offset), length_(length) {}

  int err() const { return err_; }
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }
  int64_t length() const { return length_; }

 private:
  int err_;
  std::string path_;
  int64_t offset_;
  int64_t length_;
};

// An error with a short description of the failed step ("open for writing",
// "read") followed by strerror(err).
IoError make_io_error(int err, const std::string& path, int64_t offset, int64_t length,
                      const std::string& step);

// errno value used for "file is shorter than the buffer": a short read is an
// error, never zero-filled data.
constexpr int kShortReadErrno = 61;  // ENODATA on Linux

}  // namespace nvmeio
