// Kernel AIO engine.
//
// We call io_setup/io_submit/io_getevents directly through syscall(2):
// <linux/aio_abi.h> is part of the kernel UAPI headers every compiler has,
// so no libaio-dev is needed. With O_DIRECT these calls are truly
// asynchronous; on a buffered descriptor io_submit would block, which is why
// the worker only hands this engine direct-I/O requests in direct mode.
#include "engines/aio.h"

#include "faults.h"

#include <linux/aio_abi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace nvmeio {
namespace {

std::string read_proc(const char* name) {
  std::string path = std::string("/proc/sys/fs/") + name;
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return "?";
  char buf[32] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' ')) buf[--n] = 0;
  return buf;
}

long sys_io_setup(unsigned nr, aio_context_t* ctx) { return syscall(SYS_io_setup, nr, ctx); }
long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
long sys_io_submit(aio_context_t ctx, long n, struct iocb** iocbs) {
  return syscall(SYS_io_submit, ctx, n, iocbs);
}
long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event* events) {
  return syscall(SYS_io_getevents, ctx, min_nr, nr, events, nullptr);
}

class AioEngine final : public Engine {
 public:
  explicit AioEngine(int depth) : depth_(depth), iocbs_(depth), ptrs_(depth), events_(depth) {
    if (sys_io_setup(static_cast<unsigned>(depth), &ctx_) != 0) {
      int err = errno;
      std::string what = std::string("io_setup(") + std::to_string(depth) + ") failed: " + std::strerror(err);
      if (err == EAGAIN)
        what += " -- the system-wide kernel AIO limit is used up (fs.aio-nr " + read_proc("aio-nr") +
                " of fs.aio-max-nr " + read_proc("aio-max-nr") +
                "): close handles you no longer need (h.close()), lower queue_depth or "
                "intra_op_parallelism, raise the limit (sysctl -w fs.aio-max-nr=1048576), or use "
                "backend='io_uring'";
      throw std::runtime_error(what);
    }
  }
  ~AioEngine() override { sys_io_destroy(ctx_); }

  bool async_buffered() const override { return false; }

  // io_submit copies each iocb before it returns, so one array reused for
  // every batch is enough.
  int submit(const Request* reqs, int n) override {
    if (n > depth_) n = depth_;
    for (int i = 0; i < n; ++i) {
      struct iocb& cb = iocbs_[i];
      std::memset(&cb, 0, sizeof(cb));
      cb.aio_fildes = static_cast<uint32_t>(reqs[i].fd);
      cb.aio_lio_opcode = reqs[i].write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
      cb.aio_buf = reinterpret_cast<uint64_t>(reqs[i].buf);
      cb.aio_nbytes = static_cast<uint64_t>(reqs[i].len);
      cb.aio_offset = reqs[i].offset;
      cb.aio_data = reinterpret_cast<uint64_t>(reqs[i].tag);
      ptrs_[i] = &cb;
    }
    int done = 0;
    while (done < n) {
      ++submit_calls_;
      long r;
      if (int injected = faults::take_submit_refusal()) {
        r = -1;
        errno = injected;
      } else {
        r = sys_io_submit(ctx_, n - done, ptrs_.data() + done);
      }
      if (r > 0) {
        done += static_cast<int>(r);
        continue;
      }
      // EAGAIN: the kernel ran short of resources; the caller reaps and retries.
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && errno == EAGAIN) break;
      if (r == 0) break;
      // Any other error is about the first iocb: complete it with that error
      // so the op fails cleanly instead of hanging.
      pending_errors_.push_back({reqs[done].tag, -static_cast<int64_t>(errno)});
      ++done;
    }
    return done;
  }

  int reap(Completion* out, int min_nr, int max_nr) override {
    int got = 0;
    while (got < max_nr && !pending_errors_.empty()) {
      out[got++] = pending_errors_.back();
      pending_errors_.pop_back();
    }
    if (got >= min_nr && got > 0) return got;
    int want_min = min_nr - got;
    if (want_min < 0) want_min = 0;
    int want_max = max_nr - got;
    if (want_max > depth_) want_max = depth_;
    for (;;) {
      long r = sys_io_getevents(ctx_, want_min, want_max, events_.data());
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw std::runtime_error(std::string("io_getevents failed: ") + std::strerror(errno));
      for (long i = 0; i < r; ++i) {
        // res is the byte count or -errno (signed, in an unsigned field).
        out[got++] = {reinterpret_cast<void*>(events_[i].data), static_cast<int64_t>(events_[i].res)};
      }
      return got;
    }
  }

 private:
  int depth_;
  aio_context_t ctx_ = 0;
  std::vector<struct iocb> iocbs_;
  std::vector<struct iocb*> ptrs_;
  std::vector<struct io_event> events_;
  std::vector<Completion> pending_errors_;
};

}  // namespace

std::unique_ptr<Engine> make_aio_engine(int depth) { return std::make_unique<AioEngine>(depth); }

bool aio_available() {
  aio_context_t ctx = 0;
  if (sys_io_setup(1, &ctx) != 0) return false;
  sys_io_destroy(ctx);
  return true;
}

}  // namespace nvmeio
