// Worker: one thread, one engine, its own bounce buffers.
//
// A worker turns the slices it is given into block_size requests and keeps
// up to queue_depth of them in flight. It drains every slice queued to it
// before blocking, so many small ops submitted back to back share io_submit
// and io_getevents calls instead of paying one hand-off each.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "aligned.h"
#include "engines/engine.h"
#include "op.h"

namespace nvmeio {

struct WorkerConfig {
  EngineKind engine;
  int64_t block_size;  // bytes per request (a multiple of kDirectAlign)
  int queue_depth;
  bool single_submit;   // one request per submission syscall
  bool overlap_events;  // reap completions while there is more to submit
};

struct WorkerStats {
  uint64_t requests = 0;       // requests completed through the engine
  uint64_t bytes = 0;          // bytes moved through the engine
  uint64_t bounced = 0;        // requests staged through a bounce buffer
  uint64_t buffered = 0;       // byte-exact head/tail requests (no O_DIRECT)
  uint64_t submit_calls = 0;   // submission syscalls (or pread/pwrite calls for psync)
  uint64_t reap_calls = 0;     // completion-collecting calls
  uint64_t slices = 0;         // slices finished
  uint64_t fixed_buffers = 0;  // requests on registered (io_uring fixed) buffers
  uint64_t fixed_files = 0;    // requests on registered (io_uring fixed) files
  uint64_t backoffs = 0;       // rounds slept because the kernel refused every request
  int max_inflight = 0;        // most requests in flight at once
};

class Worker {
 public:
  Worker(const WorkerConfig& cfg, OpSink* sink);
  ~Worker();  // stops the thread after the queued work is done, and joins it
  // Asks the thread to stop once its queue is done, without waiting: a handle
  // stops all its workers first, so their engines are torn down in parallel.
  void request_stop();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void enqueue(Slice s);
  // Registers / forgets host memory for fixed-buffer I/O (engines that have
  // it); applied by the worker thread before any slice queued after the call.
  void add_region(char* p, int64_t len);
  void remove_region(char* p);
  WorkerStats stats();

 private:
  struct SliceState;
  struct Inflight;

  void run();
  void round(std::vector<Completion>& events, std::vector<Request>& batch);
  void activate(Slice sl);
  void fail_everything(const std::string& why);
  void refuse(Slice& sl, const std::string& why);
  void back_off();
  void publish_stats();
  bool next_request(Request* out);
  void complete(Inflight* f, int64_t result);
  void finish_slice_if_done(SliceState* s);
  void run_sync(SliceState* s, int fd, int64_t pos, int64_t len, char* mem);
  char* take_bounce();

  WorkerConfig cfg_;
  OpSink* sink_;
  std::unique_ptr<Engine> engine_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Slice> queue_;  // guarded by mu_
  struct RegionCommand {
    char* p;
    int64_t len;  // 0: remove
  };
  std::vector<RegionCommand> region_commands_;  // guarded by mu_
  bool stop_ = false;        // guarded by mu_
  WorkerStats stats_;        // guarded by mu_ (copied from local_ under mu_)

  // Owned by the worker thread only.
  std::deque<Slice> incoming_;
  std::vector<RegionCommand> commands_;
  std::deque<std::unique_ptr<SliceState>> active_;
  std::vector<Inflight> slots_;
  std::vector<Inflight*> free_slots_;
  std::vector<AlignedPtr> bounce_mem_;
  std::vector<char*> free_bounce_;
  int bounce_limit_ = 0;
  std::deque<Request> unsubmitted_;
  int inflight_ = 0;
  std::vector<RegionCommand> regions_;  // registered memory, re-registered with a new engine
  std::string broken_;                  // why there is no engine (see fail_everything)
  int64_t backoff_us_ = 0;              // 0: the last submission was accepted
  std::chrono::steady_clock::time_point refused_since_;
  WorkerStats local_;
  WorkerStats retired_;  // engine counters of engines replaced after a failure

  std::thread thread_;
};

}  // namespace nvmeio
