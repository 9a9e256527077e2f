// Built when liburing was not found: io_uring is simply not offered.
#include <stdexcept>

#include "engines/uring.h"

namespace nvmeio {
std::unique_ptr<Engine> make_uring_engine(int, bool) {
  throw std::runtime_error("this build of nvmeio has no io_uring (install liburing-dev and rebuild)");
}
bool uring_available() { return false; }
}  // namespace nvmeio
