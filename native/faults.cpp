#include "faults.h"

#include <algorithm>
#include <atomic>
#include <mutex>

namespace nvmeio {
namespace faults {
namespace {

std::atomic<bool> g_armed{false};
std::mutex g_mu;
Plan g_plan;               // guarded by g_mu
Fired g_fired;             // guarded by g_mu
int64_t g_refusals_left = 0;  // guarded by g_mu
int64_t g_create_failures_left = 0;  // guarded by g_mu
int64_t g_reaps = 0;       // guarded by g_mu

bool matches(const Plan& p, const std::string& path, bool write) {
  if (p.direction == 1 && write) return false;
  if (p.direction == 2 && !write) return false;
  return p.path_contains.empty() || path.find(p.path_contains) != std::string::npos;
}

}  // namespace

void arm(const Plan& plan) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_plan = plan;
  g_fired = Fired{};
  g_refusals_left = plan.submit_refusals;
  g_create_failures_left = plan.engine_create_failures;
  g_reaps = 0;
  g_armed.store(true, std::memory_order_release);
}

void disarm() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_armed.store(false, std::memory_order_release);
}

Fired fired() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_fired;
}

namespace detail {

bool armed() { return g_armed.load(std::memory_order_relaxed); }

Decision on_request(const std::string& path, bool write, int64_t len) {
  std::lock_guard<std::mutex> lock(g_mu);
  Decision d;
  if (!g_armed.load(std::memory_order_relaxed) || !matches(g_plan, path, write)) return d;
  int64_t n = ++g_fired.requests;
  const Plan& p = g_plan;
  if (p.fail_nth > 0 && n >= p.fail_nth && (p.fail_count <= 0 || n < p.fail_nth + p.fail_count)) {
    d.err = p.fail_errno;
    ++g_fired.failed;
  } else if (p.short_nth > 0 && n == p.short_nth && len > 0) {
    d.short_len = p.short_bytes >= 0 ? std::min(p.short_bytes, len - 1) : len / 2;
    ++g_fired.shortened;
  }
  if (p.delay_us > 0) {
    d.delay_us = p.delay_us;
    ++g_fired.delayed;
  }
  return d;
}

int take_submit_refusal() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_armed.load(std::memory_order_relaxed) || g_refusals_left == 0) return 0;
  if (g_refusals_left > 0) --g_refusals_left;
  ++g_fired.submit_refusals;
  return g_plan.submit_errno;
}

int take_engine_create_failure() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_armed.load(std::memory_order_relaxed) || g_create_failures_left <= 0) return 0;
  --g_create_failures_left;
  ++g_fired.engine_create_failures;
  return g_plan.engine_failure_errno;
}

int take_engine_failure() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_armed.load(std::memory_order_relaxed) || g_plan.engine_failure_nth <= 0) return 0;
  if (++g_reaps != g_plan.engine_failure_nth) return 0;
  ++g_fired.engine_failures;
  return g_plan.engine_failure_errno;
}

}  // namespace detail
}  // namespace faults
}  // namespace nvmeio
