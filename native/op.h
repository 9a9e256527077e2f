// Op: one user request (one buffer, one file range) and its slices.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "error.h"
#include "file.h"

namespace nvmeio {

struct Op {
  std::shared_ptr<File> file;
  bool write = false;
  char* buf = nullptr;
  int64_t nbytes = 0;
  int64_t offset = 0;  // file offset of buf[0]
  std::atomic<int> slices_left{0};
  std::atomic<bool> failed{false};

  // Records the first error; later ones of the same op are dropped.
  void fail(IoError e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = std::move(e);
    failed.store(true, std::memory_order_release);
  }
  std::optional<IoError> take_error() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(error_);
  }

 private:
  std::mutex mu_;
  std::optional<IoError> error_;
};

// A contiguous part of an op handled by one worker: bytes [begin, end) of
// the op's buffer. Slice boundaries fall on kDirectAlign file offsets, except
// the op's own first and last byte.
struct Slice {
  std::shared_ptr<Op> op;
  int64_t begin;
  int64_t end;
};

// Told by a worker when the last slice of an op is done.
class OpSink {
 public:
  virtual ~OpSink() = default;
  virtual void op_done(const std::shared_ptr<Op>& op) = 0;
};

}  // namespace nvmeio
