// Portable fallback: blocking pread/pwrite in the worker thread.
#pragma once
#include "engines/engine.h"

namespace nvmeio {
std::unique_ptr<Engine> make_psync_engine(int depth);
}  // namespace nvmeio
