#include "worker.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>
#include <stdexcept>

#include "faults.h"

namespace nvmeio {

// Progress of one slice on this worker.
struct Worker::SliceState {
  Slice slice;
  int64_t pos = 0;      // next op-buffer byte to request from the engine
  int64_t mid_end = 0;  // end of what goes through the engine
  int outstanding = 0;  // requests in flight
  bool finished = false;
  int fixed_fd = -1;    // descriptor registered with the engine for this slice
};

// Context of one request in flight; its address is the request tag.
struct Worker::Inflight {
  SliceState* s = nullptr;
  int64_t pos = 0;           // op-buffer offset of the request
  int64_t len = 0;
  char* bounce = nullptr;    // staging buffer, or null when on user memory
  faults::Decision fault;    // injected outcome (see faults.h), decided when issued
};

Worker::Worker(const WorkerConfig& cfg, OpSink* sink)
    : cfg_(cfg), sink_(sink), slots_(static_cast<size_t>(cfg.queue_depth)) {
  for (auto& s : slots_) free_slots_.push_back(&s);
  // Bounce memory is capped at ~16 MiB a worker: enough to keep the queue
  // busy for unaligned buffers without pinning queue_depth x block_size.
  int64_t cap = (16 << 20) / cfg.block_size;
  bounce_limit_ = static_cast<int>(std::clamp<int64_t>(cap, 2, cfg.queue_depth));
  // The engine is made on the worker thread (io_uring's SINGLE_ISSUER binds a
  // ring to its creator); a failure is rethrown here.
  std::promise<void> ready;
  std::future<void> made = ready.get_future();
  thread_ = std::thread([this, &ready] {
    // Signals (Ctrl-C, SIGTERM) belong to the application's threads: a worker
    // never takes one, so Python's handler runs where Python can act on it.
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, nullptr);
    try {
      engine_ = make_engine(cfg_.engine, cfg_.queue_depth, cfg_.single_submit);
    } catch (...) {
      ready.set_exception(std::current_exception());
      return;
    }
    ready.set_value();
    run();
  });
  try {
    made.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

void Worker::request_stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
}

Worker::~Worker() {
  request_stop();
  thread_.join();
}

void Worker::enqueue(Slice s) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake = queue_.empty();
    queue_.push_back(std::move(s));
  }
  // The worker only sleeps when its queue is empty, so only the first
  // enqueue after that needs a wake-up.
  if (wake) cv_.notify_one();
}

// Caller holds mu_.
void Worker::publish_stats() {
  if (engine_) {
    local_.submit_calls = retired_.submit_calls + engine_->submit_calls();
    local_.fixed_buffers = retired_.fixed_buffers + engine_->fixed_buffer_requests();
    local_.fixed_files = retired_.fixed_files + engine_->fixed_file_requests();
  }
  stats_ = local_;
}

void Worker::add_region(char* p, int64_t len) {
  std::lock_guard<std::mutex> lock(mu_);
  region_commands_.push_back({p, len});
}

void Worker::remove_region(char* p) {
  std::lock_guard<std::mutex> lock(mu_);
  region_commands_.push_back({p, 0});
}

WorkerStats Worker::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

char* Worker::take_bounce() {
  if (free_bounce_.empty()) {
    if (static_cast<int>(bounce_mem_.size()) >= bounce_limit_) return nullptr;
    bounce_mem_.push_back(aligned_alloc_bytes(cfg_.block_size, kDirectAlign));
    // (engine_ is set: no request is issued while the worker has no engine)
    free_bounce_.push_back(bounce_mem_.back().get());
    engine_->add_buffer(bounce_mem_.back().get(), cfg_.block_size);
  }
  char* b = free_bounce_.back();
  free_bounce_.pop_back();
  return b;
}

// Byte-exact blocking I/O on the buffered descriptor: unaligned heads and
// tails, and the rest of a partial transfer.
void Worker::run_sync(SliceState* s, int fd, int64_t pos, int64_t len, char* mem) {
  Op& op = *s->slice.op;
  ++local_.buffered;
  while (len > 0) {
    int64_t off = op.offset + pos;
    faults::Decision fault = faults::on_request(op.file->path(), op.write, len);
    if (fault.delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(fault.delay_us));
    size_t want = static_cast<size_t>(fault.short_len >= 0 ? fault.short_len : len);
    ssize_t r;
    if (fault.err != 0) {
      r = -1;
      errno = fault.err;
    } else {
      r = op.write ? ::pwrite(fd, mem, want, off) : ::pread(fd, mem, want, off);
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      op.fail(make_io_error(errno, op.file->path(), off, len, op.write ? "write" : "read"));
      return;
    }
    if (r == 0) {
      op.fail(op.write ? make_io_error(EIO, op.file->path(), off, len, "write (no progress)")
                       : IoError(kShortReadErrno, op.file->path(), off, len,
                                 op.file->short_read_message(off)));
      return;
    }
    pos += r;
    mem += r;
    len -= r;
  }
}

bool Worker::next_request(Request* out) {
  for (auto& sp : active_) {
    SliceState* s = sp.get();
    Op& op = *s->slice.op;
    if (s->pos >= s->mid_end || op.failed.load(std::memory_order_acquire)) continue;
    int64_t len = std::min(cfg_.block_size, s->mid_end - s->pos);
    char* mem = op.buf + s->pos;
    char* bounce = nullptr;
    bool direct = op.file->direct();
    if (direct && !is_aligned(mem, kDirectAlign)) {
      bounce = take_bounce();
      if (!bounce) return false;  // wait for a completion to free one
      if (op.write) std::memcpy(bounce, mem, static_cast<size_t>(len));
      ++local_.bounced;
    }
    Inflight* f = free_slots_.back();
    free_slots_.pop_back();
    *f = Inflight{s, s->pos, len, bounce, faults::on_request(op.file->path(), op.write, len)};
    *out = Request{direct ? op.file->direct_fd() : op.file->buffered_fd(), op.write,
                   bounce ? bounce : mem, len, op.offset + s->pos, f};
    s->pos += len;
    ++s->outstanding;
    return true;
  }
  return false;
}

void Worker::complete(Inflight* f, int64_t result) {
  SliceState* s = f->s;
  Op& op = *s->slice.op;
  char* mem = op.buf + f->pos;
  char* data = f->bounce ? f->bounce : mem;
  int64_t off = op.offset + f->pos;
  if (f->fault.delay_us > 0)
    std::this_thread::sleep_for(std::chrono::microseconds(f->fault.delay_us));
  if (f->fault.err != 0)
    result = -f->fault.err;
  else if (f->fault.short_len >= 0 && result > f->fault.short_len)
    result = f->fault.short_len;  // the rest is redone byte-exact below, as for a real one
  if (result < 0) {
    op.fail(make_io_error(static_cast<int>(-result), op.file->path(), off, f->len,
                          op.write ? "write" : "read"));
  } else {
    if (result < f->len && !op.failed.load(std::memory_order_acquire)) {
      // A partial transfer (rare on regular files): finish it byte-exact.
      run_sync(s, op.file->buffered_fd(), f->pos + result, f->len - result, data + result);
    }
    if (!op.write && f->bounce && !op.failed.load(std::memory_order_acquire))
      std::memcpy(mem, f->bounce, static_cast<size_t>(f->len));
    ++local_.requests;
    local_.bytes += static_cast<uint64_t>(f->len);
  }
  if (f->bounce) free_bounce_.push_back(f->bounce);
  free_slots_.push_back(f);
  --s->outstanding;
  --inflight_;
}

void Worker::finish_slice_if_done(SliceState* s) {
  Op& op = *s->slice.op;
  bool issuing = s->pos < s->mid_end && !op.failed.load(std::memory_order_acquire);
  if (s->finished || issuing || s->outstanding > 0) return;
  s->finished = true;
  ++local_.slices;
  if (s->fixed_fd >= 0 && engine_) engine_->remove_file(s->fixed_fd);
  {
    // Publish stats before the op can count as done, so a caller that has
    // waited for it sees this slice's requests.
    std::lock_guard<std::mutex> lock(mu_);
    publish_stats();
  }
  if (op.slices_left.fetch_sub(1, std::memory_order_acq_rel) == 1) sink_->op_done(s->slice.op);
}

void Worker::activate(Slice sl) {
  // The unaligned head and tail go byte-exact through the buffered
  // descriptor now; the aligned middle is left for the engine.
  auto st = std::make_unique<SliceState>();
  Op& op = *sl.op;
  st->slice = std::move(sl);
  int64_t begin = st->slice.begin, end = st->slice.end;
  if (op.file->direct()) {
    int64_t a = align_up(op.offset + begin, kDirectAlign) - op.offset;
    int64_t b = align_down(op.offset + end, kDirectAlign) - op.offset;
    if (a >= b) {
      a = b = end;
      run_sync(st.get(), op.file->buffered_fd(), begin, end - begin, op.buf + begin);
    } else {
      if (a > begin) run_sync(st.get(), op.file->buffered_fd(), begin, a - begin, op.buf + begin);
      if (end > b) run_sync(st.get(), op.file->buffered_fd(), b, end - b, op.buf + b);
    }
    st->pos = a;
    st->mid_end = b;
  } else if (!engine_->async_buffered()) {
    run_sync(st.get(), op.file->buffered_fd(), begin, end - begin, op.buf + begin);
    st->pos = st->mid_end = end;
  } else {
    st->pos = begin;
    st->mid_end = end;
  }
  // A descriptor used by many requests is worth registering (one syscall
  // now saves a file reference per request).
  if (st->mid_end - st->pos >= 8 * cfg_.block_size) {
    st->fixed_fd = op.file->direct() ? op.file->direct_fd() : op.file->buffered_fd();
    engine_->add_file(st->fixed_fd);
  }
  active_.push_back(std::move(st));
}

void Worker::run() {
  std::vector<Completion> events(static_cast<size_t>(cfg_.queue_depth));
  std::vector<Request> batch;
  batch.reserve(static_cast<size_t>(cfg_.queue_depth));
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      publish_stats();
      if (active_.empty() && inflight_ == 0 && unsubmitted_.empty()) {
        cv_.wait(lock, [&] { return stop_ || !queue_.empty() || !region_commands_.empty(); });
        if (queue_.empty() && region_commands_.empty()) {
          // stop_, nothing left. The engine goes here, on this thread:
          // io_destroy waits tens of milliseconds for in-kernel teardown,
          // which the workers of a handle then spend side by side.
          lock.unlock();
          engine_.reset();
          return;
        }
      }
      incoming_.swap(queue_);
      commands_.swap(region_commands_);
    }
    try {
      round(events, batch);
    } catch (const std::exception& e) {
      fail_everything(e.what());
    }
  }
}

// [Note: an engine that breaks]
// io_getevents or io_uring_enter failing for a reason other than a request's
// own error means the engine can no longer be trusted to report what it
// holds. Every op this worker holds fails (none may hang wait()), but none
// may count as done while the kernel could still touch its buffer: the
// requests in flight are drained if the engine still answers, and the engine
// is then destroyed (io_destroy waits for what is left in the kernel; a ring
// cancels it). A fresh engine takes its place, with the worker's registered
// memory, so the handle stays usable; if none can be made, every later slice
// fails at once with the reason.
void Worker::fail_everything(const std::string& why) {
  for (auto& sp : active_) {
    Op& op = *sp->slice.op;
    op.fail(IoError(EIO, op.file ? op.file->path() : "", op.offset, op.nbytes,
                    "I/O engine failure: " + why));
    sp->fixed_fd = -1;  // registrations die with the engine
  }
  std::vector<Completion> events(static_cast<size_t>(cfg_.queue_depth));
  for (int tries = 0; engine_ && inflight_ > 0 && tries < 8; ++tries) {
    try {
      int got = engine_->reap(events.data(), 1, cfg_.queue_depth);
      for (int i = 0; i < got; ++i) complete(static_cast<Inflight*>(events[i].tag), events[i].result);
    } catch (const std::exception&) {
      break;
    }
  }
  if (engine_) {
    retired_.submit_calls += engine_->submit_calls();
    retired_.fixed_buffers += engine_->fixed_buffer_requests();
    retired_.fixed_files += engine_->fixed_file_requests();
  }
  engine_.reset();
  // Nothing is in flight any more: every slot and bounce buffer is free.
  unsubmitted_.clear();
  inflight_ = 0;
  free_slots_.clear();
  for (auto& s : slots_) free_slots_.push_back(&s);
  free_bounce_.clear();
  for (auto& b : bounce_mem_) free_bounce_.push_back(b.get());
  for (auto& sp : active_) {
    sp->outstanding = 0;
    sp->pos = sp->mid_end;
    finish_slice_if_done(sp.get());
  }
  active_.clear();
  // Slices not yet activated when the round broke (moved-from ones have no op).
  for (Slice& sl : incoming_)
    if (sl.op) refuse(sl, why);
  incoming_.clear();
  try {
    engine_ = make_engine(cfg_.engine, cfg_.queue_depth, cfg_.single_submit);
    for (auto& r : regions_) engine_->add_buffer(r.p, r.len);
    for (auto& b : bounce_mem_) engine_->add_buffer(b.get(), cfg_.block_size);
  } catch (const std::exception& e) {
    engine_.reset();
    broken_ = why + "; a new engine could not be made: " + e.what();
  }
}

// Fails a slice that never reached the engine (see [Note: an engine that breaks]).
void Worker::refuse(Slice& sl, const std::string& why) {
  Op& op = *sl.op;
  op.fail(IoError(EIO, op.file ? op.file->path() : "", op.offset, op.nbytes,
                  "I/O engine failure: " + why));
  ++local_.slices;
  if (op.slices_left.fetch_sub(1, std::memory_order_acq_rel) == 1) sink_->op_done(sl.op);
}

// [Note: EAGAIN back-off]
// A kernel that refuses new requests (io_submit EAGAIN: short of memory)
// while others are in flight is waited out by reaping those. With nothing in
// flight there is nothing to wait for: the worker sleeps, doubling from
// 100 us to 10 ms, and after kRefusedLimit of refusals in a row fails the
// refused requests with EAGAIN rather than spin (or hang wait()) forever.
constexpr auto kRefusedLimit = std::chrono::seconds(1);

void Worker::back_off() {
  auto now = std::chrono::steady_clock::now();
  if (backoff_us_ == 0) {
    refused_since_ = now;
    backoff_us_ = 100;
  } else {
    backoff_us_ = std::min<int64_t>(backoff_us_ * 2, 10000);
  }
  ++local_.backoffs;
  if (now - refused_since_ >= kRefusedLimit) {
    // complete() reports each as a failed request in flight.
    inflight_ += static_cast<int>(unsubmitted_.size());
    for (const Request& r : unsubmitted_) complete(static_cast<Inflight*>(r.tag), -EAGAIN);
    unsubmitted_.clear();
    backoff_us_ = 0;
    return;
  }
  std::this_thread::sleep_for(std::chrono::microseconds(backoff_us_));
}

void Worker::round(std::vector<Completion>& events, std::vector<Request>& batch) {
  for (const RegionCommand& c : commands_) {
    if (c.len > 0) {
      regions_.push_back(c);
      if (engine_) engine_->add_buffer(c.p, c.len);
    } else {
      regions_.erase(std::remove_if(regions_.begin(), regions_.end(),
                                    [&](const RegionCommand& r) { return r.p == c.p; }),
                     regions_.end());
      if (engine_) engine_->remove_buffer(c.p);
    }
  }
  commands_.clear();
  if (!engine_) {
    for (Slice& sl : incoming_) refuse(sl, broken_);
    incoming_.clear();
    return;
  }
  for (Slice& sl : incoming_) activate(std::move(sl));
  incoming_.clear();

  // Fill the queue: first what the kernel refused last time, then new requests.
  batch.clear();
  while (!unsubmitted_.empty() && inflight_ + static_cast<int>(batch.size()) < cfg_.queue_depth) {
    batch.push_back(unsubmitted_.front());
    unsubmitted_.pop_front();
  }
  Request r;
  while (inflight_ + static_cast<int>(batch.size()) < cfg_.queue_depth && next_request(&r))
    batch.push_back(r);

  if (!batch.empty()) {
    int n = static_cast<int>(batch.size());
    int accepted = 0;
    if (cfg_.single_submit) {
      while (accepted < n && engine_->submit(&batch[accepted], 1) == 1) ++accepted;
    } else {
      accepted = engine_->submit(batch.data(), n);
    }
    inflight_ += accepted;
    local_.max_inflight = std::max(local_.max_inflight, inflight_);
    for (int i = n - 1; i >= accepted; --i) unsubmitted_.push_front(batch[i]);
    if (accepted > 0) backoff_us_ = 0;
  }

  if (inflight_ > 0) {
    if (int err = faults::take_engine_failure())
      throw std::runtime_error(std::string("completion wait failed (injected): ") +
                               std::strerror(err));
    // overlap_events: take whatever has finished and refill at once;
    // otherwise wait for the whole batch (DeepSpeed's two modes).
    int min_nr = cfg_.overlap_events ? 1 : inflight_;
    int got = engine_->reap(events.data(), min_nr, cfg_.queue_depth);
    ++local_.reap_calls;
    for (int i = 0; i < got; ++i) complete(static_cast<Inflight*>(events[i].tag), events[i].result);
  } else if (!unsubmitted_.empty()) {
    back_off();  // see [Note: EAGAIN back-off]
  }

  for (auto& sp : active_) finish_slice_if_done(sp.get());
  while (!active_.empty() && active_.front()->finished) active_.pop_front();
  if (active_.size() > 64) {
    active_.erase(std::remove_if(active_.begin(), active_.end(),
                                 [](const std::unique_ptr<SliceState>& s) { return s->finished; }),
                  active_.end());
  }
}

}  // namespace nvmeio
