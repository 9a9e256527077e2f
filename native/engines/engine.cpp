#include "engines/engine.h"

#include <cstring>
#include <stdexcept>

#include "engines/aio.h"
#include "engines/psync.h"
#include "engines/uring.h"
#include "faults.h"

namespace nvmeio {

std::unique_ptr<Engine> make_engine(EngineKind kind, int depth, bool single_submit) {
  if (int injected = faults::take_engine_create_failure())
    throw std::runtime_error(std::string(engine_name(kind)) + " engine could not be made (injected): " +
                             std::strerror(injected));
  switch (kind) {
    case EngineKind::kUring: return make_uring_engine(depth, single_submit);
    case EngineKind::kAio: return make_aio_engine(depth);  // io_submit is one syscall per call anyway
    case EngineKind::kPsync: return make_psync_engine(depth);
  }
  throw std::invalid_argument("unknown engine kind");
}

const char* engine_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::kUring: return "io_uring";
    case EngineKind::kAio: return "aio";
    case EngineKind::kPsync: return "psync";
  }
  return "?";
}

EngineKind engine_from_name(const std::string& name) {
  for (EngineKind k : {EngineKind::kUring, EngineKind::kAio, EngineKind::kPsync})
    if (name == engine_name(k)) return k;
  throw std::invalid_argument("unknown backend '" + name + "'");
}

std::vector<EngineKind> available_engines() {
  std::vector<EngineKind> out;
  if (uring_available()) out.push_back(EngineKind::kUring);
  if (aio_available()) out.push_back(EngineKind::kAio);
  out.push_back(EngineKind::kPsync);
  return out;
}

}  // namespace nvmeio
