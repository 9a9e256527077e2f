// io_uring engine (built when CMake finds liburing; probed at run time).
#pragma once
#include "engines/engine.h"

namespace nvmeio {
// Throws std::runtime_error when this build has no io_uring or the kernel
// refuses it.
std::unique_ptr<Engine> make_uring_engine(int depth, bool single_submit);
// True when this build has io_uring and the kernel (and any seccomp policy)
// allows a ring with the read/write opcodes.
bool uring_available();
}  // namespace nvmeio
