// Fault injection: make the core fail the way disks and kernels do, on purpose.
//
// Compiled in, off unless armed (nvmeio.faults from Python, or the
// NVMEIO_FAULTS environment variable read at import). While disarmed every
// hook is one relaxed atomic load. A plan is process-wide: it reaches the
// requests of every handle, which is what a test of the layers above
// (swapper, engine) needs.
//
// Requests are counted in the order workers issue them, among those that
// match the plan's filter (path substring, direction). "Requests" are the
// engine's block_size requests and the byte-exact pread/pwrite calls a worker
// makes itself (unaligned heads and tails, buffered files).
#pragma once

#include <cstdint>
#include <string>

namespace nvmeio {
namespace faults {

struct Plan {
  int64_t fail_nth = 0;        // 1-based index of the first matching request that fails (0: none)
  int64_t fail_count = 1;      // how many consecutive matching requests fail; <= 0: all from fail_nth on
  int fail_errno = 5;          // EIO
  int64_t short_nth = 0;       // this matching request transfers only short_bytes (0: none)
  int64_t short_bytes = -1;    // bytes the short transfer reports; < 0: half the request
  int64_t delay_us = 0;        // every matching request completes this much later
  int64_t submit_refusals = 0; // the next N submission calls fail with submit_errno; < 0: all
  int submit_errno = 11;       // EAGAIN
  int64_t engine_failure_nth = 0;  // the Nth completion-collecting call fails: the engine breaks
  int engine_failure_errno = 5;
  int64_t engine_create_failures = 0;  // the next N engines fail to start (engine_failure_errno)
  std::string path_contains;   // only requests on paths containing this count (empty: all)
  int direction = 0;           // 0: reads and writes, 1: reads only, 2: writes only
};

// What the armed plan has done so far.
struct Fired {
  int64_t requests = 0;         // matching requests seen
  int64_t failed = 0;
  int64_t shortened = 0;
  int64_t delayed = 0;
  int64_t submit_refusals = 0;  // submission calls refused
  int64_t engine_create_failures = 0;
  int64_t engine_failures = 0;
};

void arm(const Plan& plan);  // replaces any armed plan and resets the counts
void disarm();               // the counts stay readable
Fired fired();

// What happens to one request; looked up once, when it is issued.
struct Decision {
  int err = 0;              // != 0: the request fails with this errno
  int64_t short_len = -1;   // >= 0: the request transfers only this many bytes
  int64_t delay_us = 0;     // its completion is delayed this long
};

namespace detail {
bool armed();
Decision on_request(const std::string& path, bool write, int64_t len);
int take_submit_refusal();
int take_engine_failure();
int take_engine_create_failure();
}  // namespace detail

// The hooks the core calls (cheap when disarmed).
inline Decision on_request(const std::string& path, bool write, int64_t len) {
  return detail::armed() ? detail::on_request(path, write, len) : Decision{};
}
// An errno when this submission call must fail as if the kernel said so, else 0.
inline int take_submit_refusal() { return detail::armed() ? detail::take_submit_refusal() : 0; }
// An errno when this completion-collecting call must fail (the engine is broken), else 0.
inline int take_engine_failure() { return detail::armed() ? detail::take_engine_failure() : 0; }
// An errno when the engine being made must fail to start, else 0.
inline int take_engine_create_failure() {
  return detail::armed() ? detail::take_engine_create_failure() : 0;
}

}  // namespace faults
}  // namespace nvmeio
