// io_uring engine (liburing).
//
// [Note: one syscall per round]
// submit() only fills SQEs (shared memory, no syscall) unless single_submit
// asks for a syscall per call; reap() then submits everything queued and
// waits for completions in one io_uring_enter (io_uring_submit_and_wait), and
// completions already in the CQ ring are taken without entering the kernel.
// A worker round is thus one syscall however many requests it moves.
//
// The ring is created with SINGLE_ISSUER | DEFER_TASKRUN where the kernel has
// them (6.1+): only the worker thread ever touches it, and completion work
// runs when that thread asks for events instead of interrupting it. This is
// why the engine must be created on the worker thread itself.
//
// Fixed buffers (bounce buffers and the handle's locked tensors) skip the
// per-request page pinning of O_DIRECT; fixed files skip the per-request file
// reference for descriptors used by many requests.
#include "engines/uring.h"

#include <liburing.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "faults.h"

namespace nvmeio {
namespace {

constexpr unsigned kBufferSlots = 256;
constexpr unsigned kFileSlots = 64;
constexpr int64_t kMaxFixedBuffer = int64_t(1) << 30;  // the kernel's per-buffer limit

std::string errstr(int neg) { return std::strerror(-neg); }

int init_ring(struct io_uring* ring, int depth) {
  const unsigned flag_sets[] = {IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN,
                                IORING_SETUP_COOP_TASKRUN, 0};
  int r = -EINVAL;
  for (unsigned flags : flag_sets) {
    struct io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    p.flags = flags;
    r = io_uring_queue_init_params(static_cast<unsigned>(depth), ring, &p);
    if (r != -EINVAL) break;  // EINVAL: an older kernel without these flags
  }
  return r;
}

class UringEngine final : public Engine {
 public:
  UringEngine(int depth, bool single_submit) : single_submit_(single_submit) {
    int r = init_ring(&ring_, depth);
    if (r < 0) throw std::runtime_error("io_uring_queue_init(" + std::to_string(depth) + ") failed: " + errstr(r));
    // Sparse tables: slots are filled and emptied as buffers and files come
    // and go. A kernel or memlock limit that refuses them only costs the
    // fixed forms.
    buffers_ok_ = io_uring_register_buffers_sparse(&ring_, kBufferSlots) == 0;
    files_ok_ = io_uring_register_files_sparse(&ring_, kFileSlots) == 0;
    buffer_slot_used_.assign(kBufferSlots, false);
    file_slots_.assign(kFileSlots, FileSlot{});
  }
  ~UringEngine() override { io_uring_queue_exit(&ring_); }

  int submit(const Request* reqs, int n) override {
    int i = 0;
    for (; i < n; ++i) {
      struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (!sqe) break;  // SQ full: the caller keeps the rest for later
      prep(sqe, reqs[i]);
    }
    queued_ += i;
    outstanding_ += i;
    if (single_submit_ && queued_ > 0) flush(0);
    return i;
  }

  int reap(Completion* out, int min_nr, int max_nr) override {
    int got = take(out, max_nr);
    while (queued_ > 0 || got < min_nr) {
      flush(got < min_nr ? static_cast<unsigned>(min_nr - got) : 0);
      got += take(out + got, max_nr - got);
    }
    return got;
  }

  void add_buffer(char* p, int64_t len) override {
    if (!buffers_ok_) return;
    for (int64_t off = 0; off < len; off += kMaxFixedBuffer) {
      auto it = std::find(buffer_slot_used_.begin(), buffer_slot_used_.end(), false);
      if (it == buffer_slot_used_.end()) return;  // table full: the rest stays non-fixed
      unsigned slot = static_cast<unsigned>(it - buffer_slot_used_.begin());
      struct iovec iov{p + off, static_cast<size_t>(std::min(kMaxFixedBuffer, len - off))};
      __u64 tag = 0;
      if (io_uring_register_buffers_update_tag(&ring_, slot, &iov, &tag, 1) < 1) return;
      *it = true;
      buffers_.push_back({p, p + off, static_cast<int64_t>(iov.iov_len), slot});
    }
  }

  void remove_buffer(char* p) override {
    for (auto it = buffers_.begin(); it != buffers_.end();) {
      if (it->owner != p) {
        ++it;
        continue;
      }
      // An empty iovec clears the slot; requests still in flight keep the old
      // buffer referenced inside the kernel until they complete.
      struct iovec iov{nullptr, 0};
      __u64 tag = 0;
      io_uring_register_buffers_update_tag(&ring_, it->slot, &iov, &tag, 1);
      buffer_slot_used_[it->slot] = false;
      it = buffers_.erase(it);
    }
  }

  void add_file(int fd) override {
    if (!files_ok_) return;
    for (auto& s : file_slots_)
      if (s.refs > 0 && s.fd == fd) {
        ++s.refs;
        return;
      }
    for (unsigned i = 0; i < kFileSlots; ++i) {
      FileSlot& s = file_slots_[i];
      if (s.refs > 0) continue;
      if (io_uring_register_files_update(&ring_, i, &fd, 1) < 1) return;
      s = FileSlot{fd, 1};
      return;
    }
  }

  void remove_file(int fd) override {
    for (unsigned i = 0; i < kFileSlots; ++i) {
      FileSlot& s = file_slots_[i];
      if (s.refs > 0 && s.fd == fd && --s.refs == 0) {
        int none = -1;
        io_uring_register_files_update(&ring_, i, &none, 1);
      }
    }
  }

 private:
  struct Buffer {
    char* owner;  // address passed to add_buffer
    char* start;
    int64_t len;
    unsigned slot;
  };
  struct FileSlot {
    int fd = -1;
    int refs = 0;
  };

  void prep(struct io_uring_sqe* sqe, const Request& r) {
    int fd = r.fd;
    bool fixed_file = false;
    for (unsigned i = 0; i < kFileSlots; ++i)
      if (file_slots_[i].refs > 0 && file_slots_[i].fd == r.fd) {
        fd = static_cast<int>(i);
        fixed_file = true;
        break;
      }
    const Buffer* fixed = nullptr;
    for (const Buffer& b : buffers_)
      if (b.start <= r.buf && r.buf + r.len <= b.start + b.len) {
        fixed = &b;
        break;
      }
    unsigned len = static_cast<unsigned>(r.len);
    if (fixed && r.write)
      io_uring_prep_write_fixed(sqe, fd, r.buf, len, static_cast<__u64>(r.offset), static_cast<int>(fixed->slot));
    else if (fixed)
      io_uring_prep_read_fixed(sqe, fd, r.buf, len, static_cast<__u64>(r.offset), static_cast<int>(fixed->slot));
    else if (r.write)
      io_uring_prep_write(sqe, fd, r.buf, len, static_cast<__u64>(r.offset));
    else
      io_uring_prep_read(sqe, fd, r.buf, len, static_cast<__u64>(r.offset));
    if (fixed_file) {
      sqe->flags |= IOSQE_FIXED_FILE;
      ++fixed_file_requests_;
    }
    if (fixed) ++fixed_buffer_requests_;
    io_uring_sqe_set_data(sqe, r.tag);
  }

  // Submits whatever is queued and waits for `wait_nr` completions, in one syscall.
  void flush(unsigned wait_nr) {
    if (queued_ > 0) ++submit_calls_;
    int64_t backoff_us = 0;
    auto refused_since = std::chrono::steady_clock::now();
    for (;;) {
      int injected = faults::take_submit_refusal();
      int r = injected ? -injected : io_uring_submit_and_wait(&ring_, wait_nr);
      if (r >= 0) {
        queued_ = 0;
        return;
      }
      if (r == -EINTR) continue;
      if (r != -EAGAIN && r != -EBUSY) throw std::runtime_error("io_uring_enter failed: " + errstr(r));
      // EAGAIN/EBUSY: the kernel is short of resources or the CQ is full;
      // SQEs stay queued and go with the next call once completions are taken.
      if (io_uring_cq_ready(&ring_) > 0) return;
      if (outstanding_ > queued_) {
        // Requests are in the kernel: wait for one to complete, without submitting.
        struct io_uring_cqe* cqe;
        int w;
        do {
          w = io_uring_wait_cqe(&ring_, &cqe);
        } while (w == -EINTR);
        if (w < 0) throw std::runtime_error("io_uring_enter (waiting) failed: " + errstr(w));
        return;
      }
      // Nothing to wait for: back off, and give up rather than spin forever
      // (the worker then fails what this ring holds; see [Note: an engine that breaks]).
      if (std::chrono::steady_clock::now() - refused_since >= std::chrono::seconds(1))
        throw std::runtime_error("io_uring_enter kept refusing requests for 1 s: " + errstr(r));
      backoff_us = backoff_us == 0 ? 100 : std::min<int64_t>(backoff_us * 2, 10000);
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
    }
  }

  int take(Completion* out, int max_nr) {
    int got = 0;
    struct io_uring_cqe* cqe;
    while (got < max_nr && io_uring_peek_cqe(&ring_, &cqe) == 0) {
      out[got++] = {io_uring_cqe_get_data(cqe), static_cast<int64_t>(cqe->res)};
      io_uring_cqe_seen(&ring_, cqe);
    }
    outstanding_ -= got;
    return got;
  }

  struct io_uring ring_;
  bool single_submit_;
  int queued_ = 0;       // SQEs filled but not yet submitted
  int outstanding_ = 0;  // SQEs filled whose completion has not been taken
  bool buffers_ok_ = false;
  bool files_ok_ = false;
  std::vector<bool> buffer_slot_used_;
  std::vector<Buffer> buffers_;
  std::vector<FileSlot> file_slots_;
};

}  // namespace

std::unique_ptr<Engine> make_uring_engine(int depth, bool single_submit) {
  return std::make_unique<UringEngine>(depth, single_submit);
}

bool uring_available() {
  struct io_uring ring;
  if (io_uring_queue_init(2, &ring, 0) != 0) return false;
  bool ok = false;
  if (struct io_uring_probe* probe = io_uring_get_probe_ring(&ring)) {
    ok = io_uring_opcode_supported(probe, IORING_OP_READ) &&
         io_uring_opcode_supported(probe, IORING_OP_WRITE);
    io_uring_free_probe(probe);
  }
  io_uring_queue_exit(&ring);
  return ok;
}

}  // namespace nvmeio
