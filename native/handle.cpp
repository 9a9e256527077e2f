#include "handle.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "aligned.h"

namespace nvmeio {

Handle::Handle(const HandleConfig& cfg) : cfg_(cfg), owner_pid_(::getpid()) {
  if (cfg_.block_size <= 0) throw std::invalid_argument("block_size must be positive");
  // Each worker may hold two bounce buffers of block_size (see Worker).
  if (cfg_.block_size > kMaxBlockSize)
    throw std::invalid_argument("block_size must be at most " + std::to_string(kMaxBlockSize));
  if (cfg_.queue_depth <= 0) throw std::invalid_argument("queue_depth must be positive");
  if (cfg_.intra_op_parallelism <= 0)
    throw std::invalid_argument("intra_op_parallelism must be positive");
  // Direct requests must be whole alignment units.
  cfg_.block_size = align_up(cfg_.block_size, kDirectAlign);
  WorkerConfig wc{cfg_.engine, cfg_.block_size, cfg_.queue_depth, cfg_.single_submit,
                  cfg_.overlap_events};
  for (int i = 0; i < cfg_.intra_op_parallelism; ++i)
    workers_.push_back(std::make_unique<Worker>(wc, this));
}

Handle::~Handle() {
  if (forked()) {
    // See [Note: handles and fork]: the threads behind these objects live
    // only in the parent.
    for (auto& w : workers_) w.release();
    return;
  }
  close();
}

bool Handle::forked() const { return ::getpid() != owner_pid_; }

void Handle::check_not_forked() const {
  if (forked())
    throw std::runtime_error("this aio_handle was created in another process (before a fork); "
                             "create a new handle in this process");
}

void Handle::close() {
  if (forked()) return;
  std::vector<std::unique_ptr<Worker>> workers;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return pending_ == 0; });
    closed_ = true;
    workers.swap(workers_);
  }
  for (auto& w : workers) w->request_stop();  // all stop at once ...
  workers.clear();  // ... then join, outside the lock they report to
}

bool Handle::closed() {
  if (forked()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

bool Handle::submit(bool write, char* buf, int64_t nbytes, const std::string& path, int64_t offset) {
  check_not_forked();
  if (offset < 0) throw IoError(EINVAL, path, offset, nbytes, "negative file offset");
  // A NUL would end the C string early and name another file.
  if (path.find('\0') != std::string::npos)
    throw std::invalid_argument("path contains a NUL byte, which would cut it short");
  // The buffered descriptor is needed only for parts that are not aligned.
  int64_t end = offset + nbytes;
  bool need_buffered = offset % kDirectAlign != 0 || end % kDirectAlign != 0;
  auto op = std::make_shared<Op>();
  op->file = File::open(path, write ? OpenMode::kWrite : OpenMode::kRead, offset, nbytes,
                        cfg_.direct_io, need_buffered);
  op->write = write;
  op->buf = buf;
  op->nbytes = nbytes;
  op->offset = offset;
  bool refused = op->file->refused_direct();
  start(std::move(op));
  return refused;
}

void Handle::submit_fd(bool write, char* buf, int64_t nbytes, int fd, int64_t offset) {
  check_not_forked();
  if (offset < 0) throw IoError(EINVAL, "<fd>", offset, nbytes, "negative file offset");
  auto op = std::make_shared<Op>();
  op->file = File::from_fd(fd, write ? OpenMode::kWrite : OpenMode::kRead, offset, nbytes);
  op->write = write;
  op->buf = buf;
  op->nbytes = nbytes;
  op->offset = offset;
  start(std::move(op));
}

void Handle::start(std::shared_ptr<Op> op) {
  // Split into at most intra_op_parallelism slices, never smaller than one
  // block, with boundaries on aligned file offsets so that only the op's
  // first and last slice can have unaligned parts.
  const int64_t a = align_up(op->offset, kDirectAlign);
  const int64_t b = align_down(op->offset + op->nbytes, kDirectAlign);
  int64_t units = a < b ? (b - a) / kDirectAlign : 0;
  int64_t blocks = a < b ? (b - a + cfg_.block_size - 1) / cfg_.block_size : 0;
  int n = static_cast<int>(std::clamp<int64_t>(blocks, 1, cfg_.intra_op_parallelism));
  std::vector<Slice> slices;
  int64_t begin = 0;
  for (int i = 0; i < n; ++i) {
    int64_t end = op->nbytes;
    if (i + 1 < n) end = a + (units * (i + 1) / n) * kDirectAlign - op->offset;
    slices.push_back(Slice{op, begin, end});
    begin = end;
  }
  op->slices_left.store(n, std::memory_order_relaxed);
  unsigned first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) {
      op->file->discard_created();
      throw std::invalid_argument("I/O on a closed aio_handle");
    }
    ++pending_;
    if (op->file->refused_direct()) refused_direct_ = true;
    // Rotate the starting worker so one-slice ops spread over all workers.
    first = next_worker_;
    next_worker_ = (next_worker_ + static_cast<unsigned>(n)) % workers_.size();
  }
  if (op->nbytes == 0) {
    op->slices_left.store(0, std::memory_order_relaxed);
    op_done(op);
    return;
  }
  for (int i = 0; i < n; ++i) workers_[(first + i) % workers_.size()]->enqueue(std::move(slices[i]));
}

void Handle::op_done(const std::shared_ptr<Op>& op) {
  if (op->write && !op->failed.load() && !op->file->direct()) {
    // Buffered fallback: make the data as durable as a direct write would be.
    try {
      op->file->sync(op->offset, op->nbytes);
    } catch (const IoError& e) {
      op->fail(e);
    }
  }
  std::optional<IoError> err;
  if (op->failed.load()) {
    err = op->take_error();
    if (op->write) op->file->discard_created();
  }
  // Close the file before the op counts as done, so a caller that waits and
  // then removes or renames it sees no descriptor left open.
  op->file.reset();
  // Notify under the lock: once pending_ reaches 0 the destructor may run,
  // and it cannot get past its wait until this lock is released.
  std::lock_guard<std::mutex> lock(mu_);
  ++completed_;
  if (err && !first_error_) first_error_ = std::move(err);
  --pending_;
  cv_.notify_all();
}

WaitResult Handle::wait() {
  check_not_forked();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return pending_ == 0; });
  return take_result();
}

// Caller holds mu_ and has seen pending_ == 0.
WaitResult Handle::take_result() {
  WaitResult r;
  r.completed = completed_;
  r.error = std::move(first_error_);
  completed_ = 0;
  first_error_.reset();
  return r;
}

void Handle::add_region(char* p, int64_t len) {
  if (len <= 0 || forked()) return;
  for (auto& w : workers_) w->add_region(p, len);
}

void Handle::remove_region(char* p) {
  if (forked()) return;
  for (auto& w : workers_) w->remove_region(p);
}

std::optional<WaitResult> Handle::wait_for(int ms) {
  check_not_forked();
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, std::chrono::milliseconds(ms), [&] { return pending_ == 0; }))
    return std::nullopt;
  return take_result();
}

int64_t Handle::pending() {
  if (forked()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  return pending_;
}

bool Handle::refused_direct() {
  if (forked()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return refused_direct_;
}

std::vector<WorkerStats> Handle::stats() {
  if (forked()) return {};
  std::vector<WorkerStats> out;
  for (auto& w : workers_) out.push_back(w->stats());
  return out;
}

}  // namespace nvmeio
