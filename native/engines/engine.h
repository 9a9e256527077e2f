// Engine: one submission/completion queue, used by exactly one worker thread.
//
// An engine only moves bytes: it knows nothing of ops, bounce buffers or
// retries. Requests carry an opaque tag that comes back with the completion.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace nvmeio {

struct Request {
  int fd;
  bool write;
  char* buf;
  int64_t len;
  int64_t offset;
  void* tag;
};

struct Completion {
  void* tag;
  int64_t result;  // bytes transferred, or -errno
};

enum class EngineKind { kUring, kAio, kPsync };

class Engine {
 public:
  virtual ~Engine() = default;
  // Starts `n` requests; returns how many were accepted (0..n). May accept
  // fewer than n when the queue is full; never blocks for completions.
  virtual int submit(const Request* reqs, int n) = 0;
  // Collects between `min_nr` and `max_nr` completions, blocking until at
  // least `min_nr` are there. Returns the number stored in `out`.
  virtual int reap(Completion* out, int min_nr, int max_nr) = 0;
  // Submission syscalls made so far, and requests that used a registered
  // buffer / file (for stats and tests).
  uint64_t submit_calls() const { return submit_calls_; }
  uint64_t fixed_buffer_requests() const { return fixed_buffer_requests_; }
  uint64_t fixed_file_requests() const { return fixed_file_requests_; }

  // False when requests on buffered (non-O_DIRECT) descriptors gain nothing
  // here or may be refused: kernel AIO blocks in io_submit on them and
  // returns EINVAL for some file types. The worker then runs them itself.
  virtual bool async_buffered() const { return true; }

  // Optional registrations (io_uring's fixed buffers and files); engines
  // without them ignore the calls. A request whose memory lies inside a
  // registered buffer, or whose fd is registered, uses the fixed form.
  // Both are called from the worker thread only.
  virtual void add_buffer(char* /*p*/, int64_t /*len*/) {}
  virtual void remove_buffer(char* /*p*/) {}
  virtual void add_file(int /*fd*/) {}
  virtual void remove_file(int /*fd*/) {}

 protected:
  uint64_t submit_calls_ = 0;
  uint64_t fixed_buffer_requests_ = 0;
  uint64_t fixed_file_requests_ = 0;
};

// Creates an engine of `kind` with room for `depth` requests in flight;
// `single_submit`: every submit() call enters the kernel at once (otherwise
// an engine may defer it to the next reap()). Call it from the thread that
// will use the engine. Throws std::runtime_error when the kernel refuses.
std::unique_ptr<Engine> make_engine(EngineKind kind, int depth, bool single_submit);

// Names as the Python API spells them ("io_uring", "aio", "psync").

const char* engine_name(EngineKind kind);
EngineKind engine_from_name(const std::string& name);
// Engines this build compiled and this kernel accepts (io_uring, aio, psync
// order; which is fastest is measured by the Python layer).
std::vector<EngineKind> available_engines();

}  // namespace nvmeio
