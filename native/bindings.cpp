// pybind11 module nvmeio._native: raw pointers and paths in, no torch.
//
// Every call that can touch a file releases the GIL. Native IoErrors become
// nvmeio.errors exceptions (OSError subclasses) built by Python code, so the
// error classes are defined in one place.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

#include "engines/engine.h"
#include "faults.h"
#include "file.h"
#include "handle.h"
#include "dequantize.h"
#include "host_sum.h"
#include "locked.h"

namespace py = pybind11;
using namespace nvmeio;

namespace {

char* as_ptr(uintptr_t p) { return reinterpret_cast<char*>(p); }

// [Note: paths cross the binding as bytes]
// The kernel takes any bytes but NUL as a file name, and a name that is not
// UTF-8 reaches Python as a str with surrogate escapes (os.fsdecode). pybind11
// converts a str to std::string as strict UTF-8, which fails for such a name,
// so the Python side passes every path as os.fsencode(path): bytes, which
// pybind11 copies into the std::string unchanged. The way back (an IoError's
// path, and its message, which may quote a directory) is fs_str: os.fsdecode's
// decoding, so the exception names the very str the caller passed.
py::str fs_str(const std::string& s) {
  PyObject* o = PyUnicode_DecodeFSDefaultAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// Address and size of a C-contiguous buffer-protocol object. The caller keeps
// the object (a memoryview) alive while the I/O runs.
py::tuple buffer_address(py::handle obj, bool writable) {
  Py_buffer view;
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) throw py::error_already_set();
  py::tuple out = py::make_tuple(reinterpret_cast<uintptr_t>(view.buf), view.len);
  PyBuffer_Release(&view);
  return out;
}

py::dict stats_dict(const WorkerStats& s) {
  py::dict d;
  d["requests"] = s.requests;
  d["bytes"] = s.bytes;
  d["bounced"] = s.bounced;
  d["buffered"] = s.buffered;
  d["submit_calls"] = s.submit_calls;
  d["reap_calls"] = s.reap_calls;
  d["slices"] = s.slices;
  d["max_inflight"] = s.max_inflight;
  d["fixed_buffers"] = s.fixed_buffers;
  d["fixed_files"] = s.fixed_files;
  d["backoffs"] = s.backoffs;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "nvmeio native I/O core (io_uring, kernel AIO by syscall, psync fallback)";
  m.attr("DIRECT_ALIGNMENT") = kDirectAlign;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      py::object make = py::module_::import("nvmeio.errors").attr("make_error");
      py::object exc = make(e.err(), fs_str(e.what()), fs_str(e.path()), e.offset(), e.length());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.attr("HAVE_IO_URING") =
#ifdef NVMEIO_HAVE_URING
      true;
#else
      false;
#endif
  m.def("available_backends", [] {
    std::vector<std::string> out;
    for (EngineKind k : available_engines()) out.push_back(engine_name(k));
    return out;
  }, "Backends this build compiled and this kernel accepts, fastest first.");
  m.def("buffer_address", &buffer_address, py::arg("obj"), py::arg("writable"));
  // Every path argument below is bytes (os.fsencode): see [Note: paths cross the binding as bytes].
  m.def("in_pseudo_file_system", &in_pseudo_file_system, py::arg("path"),
        "True for a file of /proc, /sys and the like (they report a size of 0).");
  m.def("file_kind", [](unsigned mode) { return file_kind(static_cast<mode_t>(mode)); },
        py::arg("mode"), "What st_mode is, in words: 'a FIFO (named pipe)', ...");
  m.def("refuse_without_offsets", &refuse_without_offsets, py::arg("mode"), py::arg("path"),
        py::arg("offset"), py::arg("length"), py::arg("step"),
        "Raises AioError (ESPIPE) naming the file type when st_mode is a FIFO's or a socket's.");

  m.def("sum_series",
        [](uintptr_t dst, uintptr_t first, bool first_bf16, const std::vector<uintptr_t>& sources,
           const std::vector<bool>& bf16, int64_t n, int threads) {
          if (sources.size() != bf16.size()) throw std::invalid_argument("sum_series: one dtype flag per source");
          std::vector<SumSource> srcs;
          for (size_t i = 0; i < sources.size(); ++i) srcs.push_back({reinterpret_cast<const void*>(sources[i]), bf16[i]});
          py::gil_scoped_release nogil;
          sum_series(reinterpret_cast<float*>(dst), {reinterpret_cast<const void*>(first), first_bf16}, srcs, n,
                     threads);
        },
        py::arg("dst"), py::arg("first"), py::arg("first_bf16"), py::arg("sources"), py::arg("bf16"),
        py::arg("n"), py::arg("threads"),
        "fp32 dst[:n] = first (0: keep), then += each source in order (bf16 or fp32): see native/host_sum.h.");

  m.def("dequantize_int8",
        [](uintptr_t dst, bool bf16, uintptr_t codes, uintptr_t scales, int64_t n, int64_t group_size,
           int threads) {
          if (group_size <= 0) throw std::invalid_argument("dequantize_int8: group_size must be positive");
          py::gil_scoped_release nogil;
          dequantize_int8(reinterpret_cast<void*>(dst), bf16, reinterpret_cast<const int8_t*>(codes),
                          reinterpret_cast<const float*>(scales), n, group_size, threads);
        },
        py::arg("dst"), py::arg("bf16"), py::arg("codes"), py::arg("scales"), py::arg("n"), py::arg("group_size"),
        py::arg("threads"),
        "dst[:n] (fp32 or bf16) = int8 codes * their group's fp32 scale: see native/dequantize.h.");

  // Fault injection (nvmeio.faults is the API): see native/faults.h.
  py::module_ fm = m.def_submodule("faults", "fault injection for tests (see nvmeio.faults)");
  fm.def("arm",
         [](int64_t fail_nth, int64_t fail_count, int fail_errno, int64_t short_nth,
            int64_t short_bytes, int64_t delay_us, int64_t submit_refusals, int submit_errno,
            int64_t engine_failure_nth, int engine_failure_errno, int64_t engine_create_failures,
            const std::string& path_contains, int direction) {
           faults::Plan p;
           p.fail_nth = fail_nth;
           p.fail_count = fail_count;
           p.fail_errno = fail_errno;
           p.short_nth = short_nth;
           p.short_bytes = short_bytes;
           p.delay_us = delay_us;
           p.submit_refusals = submit_refusals;
           p.submit_errno = submit_errno;
           p.engine_failure_nth = engine_failure_nth;
           p.engine_failure_errno = engine_failure_errno;
           p.engine_create_failures = engine_create_failures;
           p.path_contains = path_contains;
           p.direction = direction;
           faults::arm(p);
         },
         py::arg("fail_nth"), py::arg("fail_count"), py::arg("fail_errno"), py::arg("short_nth"),
         py::arg("short_bytes"), py::arg("delay_us"), py::arg("submit_refusals"),
         py::arg("submit_errno"), py::arg("engine_failure_nth"), py::arg("engine_failure_errno"),
         py::arg("engine_create_failures"), py::arg("path_contains"), py::arg("direction"));
  fm.def("disarm", &faults::disarm);
  fm.def("fired", [] {
    faults::Fired f = faults::fired();
    py::dict d;
    d["requests"] = f.requests;
    d["failed"] = f.failed;
    d["shortened"] = f.shortened;
    d["delayed"] = f.delayed;
    d["submit_refusals"] = f.submit_refusals;
    d["engine_failures"] = f.engine_failures;
    d["engine_create_failures"] = f.engine_create_failures;
    return d;
  });

  py::class_<Handle>(m, "Handle")
      .def(py::init([](int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
                       int intra_op_parallelism, const std::string& backend, bool direct_io) {
             HandleConfig c;
             c.block_size = block_size;
             c.queue_depth = queue_depth;
             c.single_submit = single_submit;
             c.overlap_events = overlap_events;
             c.intra_op_parallelism = intra_op_parallelism;
             c.engine = engine_from_name(backend);
             c.direct_io = direct_io;
             return std::make_unique<Handle>(c);
           }),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("single_submit"),
           py::arg("overlap_events"), py::arg("intra_op_parallelism"), py::arg("backend"),
           py::arg("direct_io"))
      .def("submit",
           [](Handle& h, bool write, uintptr_t ptr, int64_t nbytes, const std::string& path,
              int64_t offset) { return h.submit(write, as_ptr(ptr), nbytes, path, offset); },
           py::call_guard<py::gil_scoped_release>())
      .def("submit_fd",
           [](Handle& h, bool write, uintptr_t ptr, int64_t nbytes, int fd, int64_t offset) {
             h.submit_fd(write, as_ptr(ptr), nbytes, fd, offset);
           },
           py::call_guard<py::gil_scoped_release>())
      .def("wait",
           [](Handle& h) {
             // Wake every 50 ms to let Python run signal handlers: Ctrl-C
             // during a long wait raises KeyboardInterrupt (the ops go on;
             // a later wait() collects them).
             std::optional<WaitResult> r;
             for (;;) {
               {
                 py::gil_scoped_release release;
                 r = h.wait_for(50);
               }
               if (r) break;
               if (PyErr_CheckSignals() != 0) throw py::error_already_set();
             }
             if (r->error) throw *r->error;
             return r->completed;
           })
      .def("add_region", [](Handle& h, uintptr_t p, int64_t len) { h.add_region(as_ptr(p), len); })
      .def("remove_region", [](Handle& h, uintptr_t p) { h.remove_region(as_ptr(p)); })
      .def("close", &Handle::close, py::call_guard<py::gil_scoped_release>())
      .def("closed", &Handle::closed)
      .def("pending", &Handle::pending)
      .def("refused_direct", &Handle::refused_direct)
      .def_property_readonly("block_size", [](Handle& h) { return h.config().block_size; })
      .def("stats", [](Handle& h) {
        py::list out;
        for (const WorkerStats& s : h.stats()) out.append(stats_dict(s));
        return out;
      });

  py::class_<LockedBuffer>(m, "LockedBuffer", py::buffer_protocol())
      .def(py::init<int64_t, bool>(), py::arg("nbytes"), py::arg("try_lock"))
      .def_property_readonly("ptr", [](LockedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &LockedBuffer::nbytes)
      .def_property_readonly("locked", &LockedBuffer::locked)
      .def_property_readonly("lock_error", &LockedBuffer::lock_error)
      .def("unlock", &LockedBuffer::unlock)
      .def_buffer([](LockedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {b.nbytes()}, {1}, /*readonly=*/false);
      });
}
