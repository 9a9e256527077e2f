// Handle: the native side of nvmeio.aio_handle.
//
// Owns intra_op_parallelism workers. submit() opens the file, splits the op
// into alignment-respecting slices and hands them to workers; wait() blocks
// until every submitted op is done and reports the first error.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "engines/engine.h"
#include "op.h"
#include "worker.h"

namespace nvmeio {

// Largest block_size accepted (nvmeio.aio_handle.MAX_BLOCK_SIZE says the same).
constexpr int64_t kMaxBlockSize = int64_t(256) << 20;

struct HandleConfig {
  int64_t block_size = 1 << 20;
  int queue_depth = 128;
  bool single_submit = false;
  bool overlap_events = false;
  int intra_op_parallelism = 1;
  EngineKind engine = EngineKind::kAio;
  bool direct_io = true;  // false: buffered I/O everywhere (NVMEIO_DIRECT_IO=0)
};

struct WaitResult {
  int64_t completed = 0;
  std::optional<IoError> error;
};

class Handle final : public OpSink {
 public:
  explicit Handle(const HandleConfig& cfg);
  ~Handle() override;  // waits for ops in flight (their buffers are the caller's)

  // Starts one op. Errors found before any I/O (bad path, file too short)
  // are thrown here and the op is not counted. Returns true when this op's
  // file is read or written without O_DIRECT (refused, or turned off).
  bool submit(bool write, char* buf, int64_t nbytes, const std::string& path, int64_t offset);
  void submit_fd(bool write, char* buf, int64_t nbytes, int fd, int64_t offset);
  WaitResult wait();
  // Like wait(), but gives up after `ms` milliseconds (nullopt) so that the
  // caller can check for signals in between.
  std::optional<WaitResult> wait_for(int ms);
  // Waits for ops in flight, then stops the workers and frees their engines
  // (kernel AIO contexts are a system-wide resource). Later submits throw.
  void close();
  bool closed();
  // Host memory that many ops will use (locked tensors): registered with
  // engines that have fixed buffers. remove_region before the memory goes.
  void add_region(char* p, int64_t len);
  void remove_region(char* p);

  const HandleConfig& config() const { return cfg_; }
  int64_t pending();
  // True once an op used buffered I/O instead of O_DIRECT (refused by the
  // file system, or turned off by NVMEIO_DIRECT_IO=0).
  bool refused_direct();
  std::vector<WorkerStats> stats();

  void op_done(const std::shared_ptr<Op>& op) override;

 private:
  void start(std::shared_ptr<Op> op);
  WaitResult take_result();

  HandleConfig cfg_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t pending_ = 0;      // guarded by mu_
  int64_t completed_ = 0;    // guarded by mu_, since the last wait()
  std::optional<IoError> first_error_;  // guarded by mu_
  bool refused_direct_ = false;         // guarded by mu_
  unsigned next_worker_ = 0;            // guarded by mu_
  bool closed_ = false;                 // guarded by mu_
  // [Note: handles and fork]
  // A forked child inherits this object but none of its worker threads, and
  // possibly a mutex a worker held at the fork. In the child the handle is
  // dead: I/O calls raise, and destruction leaks the workers instead of
  // joining threads that do not exist there (which would hang forever, e.g.
  // a DataLoader worker or a test rank collecting a parent's handle).
  const pid_t owner_pid_;
  bool forked() const;
  void check_not_forked() const;
  // Last member: destroyed (threads joined) before the mutex and condition
  // variable the workers report to.
  std::vector<std::unique_ptr<Worker>> workers_;
};

}  // namespace nvmeio
