// psync engine: each request is a blocking pread/pwrite run at submit time.
// Parallelism comes from the handle's worker threads, not from a queue.
#include "engines/psync.h"

#include "faults.h"

#include <unistd.h>

#include <cerrno>
#include <deque>

namespace nvmeio {
namespace {

class PsyncEngine final : public Engine {
 public:
  int submit(const Request* reqs, int n) override {
    for (int i = 0; i < n; ++i) {
      const Request& r = reqs[i];
      if (int injected = faults::take_submit_refusal()) {
        if (injected == EAGAIN) return i;  // refused, as a kernel queue would
        done_.push_back({r.tag, -static_cast<int64_t>(injected)});  // as io_submit's error
        continue;
      }
      ++submit_calls_;
      ssize_t res;
      do {
        res = r.write ? ::pwrite(r.fd, r.buf, static_cast<size_t>(r.len), r.offset)
                      : ::pread(r.fd, r.buf, static_cast<size_t>(r.len), r.offset);
      } while (res < 0 && errno == EINTR);
      done_.push_back({r.tag, res < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(res)});
    }
    return n;
  }

  int reap(Completion* out, int /*min_nr*/, int max_nr) override {
    int got = 0;
    while (got < max_nr && !done_.empty()) {
      out[got++] = done_.front();
      done_.pop_front();
    }
    return got;
  }

 private:
  std::deque<Completion> done_;
};

}  // namespace

// No queue, so no depth: each request completes inside submit().
std::unique_ptr<Engine> make_psync_engine(int /*depth*/) { return std::make_unique<PsyncEngine>(); }

}  // namespace nvmeio
