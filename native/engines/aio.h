// Kernel AIO through the raw syscalls (no libaio needed).
#pragma once
#include "engines/engine.h"

namespace nvmeio {
std::unique_ptr<Engine> make_aio_engine(int depth);
// True when io_setup works here (seccomp or aio-max-nr may refuse it).
bool aio_available();
}  // namespace nvmeio
