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

enum class EngineKind { kAio, kPsync };

class Engine {
 public:
  virtual ~Engine() = default;
  // Starts `n` requests; returns how many were accepted (0..n). May accept
  // fewer than n when the queue is full; never blocks for completions.
  virtual int submit(const Request* reqs, int n) = 0;
  // Collects between `min_nr` and `max_nr` completions, blocking until at
  // least `min_nr` are there. Returns the number stored in `out`.
  virtual int reap(Completion* out, int min_nr, int max_nr) = 0;
  // Submission syscalls made so far (for stats and tests).
  uint64_t submit_calls() const { return submit_calls_; }

 protected:
  uint64_t submit_calls_ = 0;
};

// Creates an engine of `kind` with room for `depth` requests in flight.
// Throws std::runtime_error when the kernel refuses (e.g. io_setup EAGAIN).
std::unique_ptr<Engine> make_engine(EngineKind kind, int depth);

// Names as the Python API spells them ("aio", "psync").
const char* engine_name(EngineKind kind);
EngineKind engine_from_name(const std::string& name);
// Engines this build compiled and this kernel accepts, fastest first.
std::vector<EngineKind> available_engines();

}  // namespace nvmeio
