// The native submission path of one small engine copy: a Python call straight into C++ (no torch dispatcher,
// no torch tensors or events per call).
//
// Per pair of pools (and tokens, and path) the engine makes a plan once, through the op
// tiered_kv::copy_plan (geometry checked and bases resolved from the pool tensors, as copy_blocks does).
// Per call, `submit(plan, src, dst, stream, sem, signal_stream=0)` -- a function of this library's Python
// module, reached by importing the library as an extension module -- checks the indices, issues the DMA or the
// kernel on `stream`, records a pooled CUDA event after it and, when `sem` is non-zero, enqueues a host function
// that posts that POSIX semaphore (the stream's waiter thread sleeps on it), on `stream` or on `signal_stream`
// (signal_after). It returns the event as a `DeviceEvent`:
// query(), synchronize() (GIL released), wait(stream) (stream-side), spin(budget_ns) (looks until done, the GIL
// kept: the engine's in-place await), recycled when the last reference goes. Fences, index lists and every other
// decision about a copy stay in Python (tiered_kv.engine, tiered_kv.fences): this file only launches.
//
// Errors raise RuntimeError (IndexError for an index out of range) before anything is enqueued where they can
// be found before, and carry the CUDA error otherwise.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <semaphore.h>
#include <sys/prctl.h>
#include <time.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "copy_blocks.h"
#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace py = pybind11;

namespace tiered_kv {
namespace {

struct FastPlan {
  BlockCopyGeometry g{};         // num_pairs is set per call
  std::vector<char*> sbase;      // host addresses (DMA)
  std::vector<char*> dbase;
  std::vector<int64_t> kbases;   // device-readable bases, src then dst (kernel)
  int64_t src_blocks = 0;        // pool sizes, for the index check
  int64_t dst_blocks = 0;
  int device = 0;
  int64_t method = 0;            // 0 kernel, 1 DMA
};

// Plans live until copy_plan_free (the copier frees a plan when its pair of pools goes away).
std::mutex g_plans_mutex;
std::map<int64_t, std::unique_ptr<FastPlan>> g_plans;

int64_t copy_plan(at::TensorList dst, at::TensorList src, int64_t num_tokens, int64_t method) {
  TORCH_CHECK(method == 0 || method == 1, msg("copy_plan: method must be 0 (kernel) or 1 (DMA), got ", method));
  auto plan = std::make_unique<FastPlan>();
  plan->g = geometry_of(dst, src, 0, num_tokens);
  const at::Device device = run_device(dst, src);
  const c10::cuda::CUDAGuard guard(device);
  plan->sbase = host_bases(src);
  plan->dbase = host_bases(dst);
  plan->kbases = kernel_bases(dst, src, 0);
  plan->src_blocks = src[0].size(0);
  plan->dst_blocks = dst[0].size(0);
  plan->device = device.index();
  plan->method = method;
  const int64_t id = reinterpret_cast<int64_t>(plan.get());
  const std::lock_guard<std::mutex> lock(g_plans_mutex);
  g_plans.emplace(id, std::move(plan));
  return id;
}

int64_t copy_plan_free(int64_t id) {
  const std::lock_guard<std::mutex> lock(g_plans_mutex);
  return static_cast<int64_t>(g_plans.erase(id));
}

FastPlan& plan_of(int64_t id) {
  const std::lock_guard<std::mutex> lock(g_plans_mutex);
  const auto it = g_plans.find(id);
  if (it == g_plans.end()) throw std::runtime_error("tiered_kv fast path: unknown copy plan " + std::to_string(id));
  return *it->second;
}

// ------------------------------------------------------------------------------------------ events

std::mutex g_events_mutex;
std::map<int, std::vector<cudaEvent_t>> g_free_events;  // device -> recycled events

int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

cudaEvent_t take_event(int device) {
  {
    const std::lock_guard<std::mutex> lock(g_events_mutex);
    std::vector<cudaEvent_t>& free = g_free_events[device];
    if (!free.empty()) {
      cudaEvent_t ev = free.back();
      free.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev = nullptr;
  // blocking sync: a waiter that must synchronize (no host-function signal) sleeps instead of spinning
  const cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("cudaEventCreateWithFlags failed: ") + cudaGetErrorString(err));
  }
  return ev;
}

class DeviceEvent {
 public:
  DeviceEvent(cudaEvent_t ev, int device) : ev_(ev), device_(device) {}
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  ~DeviceEvent() {
    // recycled, not destroyed: re-recording a pooled event is how CUDA events are meant to be reused; a stream
    // still waiting on an earlier record of it is not affected by a later record (cudaStreamWaitEvent copies the
    // event's state at the call)
    const std::lock_guard<std::mutex> lock(g_events_mutex);
    g_free_events[device_].push_back(ev_);
  }

  bool query() const {
    const cudaError_t err = cudaEventQuery(ev_);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    cudaGetLastError();
    throw std::runtime_error(std::string("cudaEventQuery failed: ") + cudaGetErrorString(err));
  }

  // Look at the event without yielding (the GIL kept: no Python thread can delay the caller's resume) until it is
  // done or `budget_ns` has passed: 1 once done, 0 when the budget is spent, -1 on a CUDA error (the caller's
  // query() then reports it).
  int spin(int64_t budget_ns) const {
    const int64_t until = now_ns() + budget_ns;
    for (;;) {
      const cudaError_t err = cudaEventQuery(ev_);
      if (err == cudaSuccess) return 1;
      if (err != cudaErrorNotReady) return -1;
      cudaGetLastError();
      if (now_ns() >= until) return 0;
    }
  }

  void synchronize() const {
    cudaError_t err;
    {
      const py::gil_scoped_release release;
      err = cudaEventSynchronize(ev_);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("cudaEventSynchronize failed: ") + cudaGetErrorString(err));
    }
  }

  // Make work queued on `stream` from now on wait for this event (stream-side).
  void wait(int64_t stream) const {
    const cudaError_t err = cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), ev_, 0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("cudaStreamWaitEvent failed: ") + cudaGetErrorString(err));
    }
  }

  int64_t handle() const { return reinterpret_cast<int64_t>(ev_); }

 private:
  cudaEvent_t ev_;
  int device_;
};

// ------------------------------------------------------------------------------------------ submit

void post_semaphore(void* sem) { sem_post(static_cast<sem_t*>(sem)); }

constexpr size_t kMaxPairs = 256;  // the engine's small calls (tiered_kv.pools.SMALL_CALL_BLOCKS)

size_t read_indices(py::handle seq, int64_t* out, int64_t limit, const char* what) {
  PyObject* obj = seq.ptr();
  if (!PyList_Check(obj)) throw py::type_error(std::string(what) + " must be a list of ints");
  const Py_ssize_t n = PyList_GET_SIZE(obj);
  if (n < 0 || static_cast<size_t>(n) > kMaxPairs) {
    throw py::value_error(std::string(what) + ": at most " + std::to_string(kMaxPairs) + " blocks per call");
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int64_t v = PyLong_AsLongLong(PyList_GET_ITEM(obj, i));
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (v < 0 || v >= limit) {
      throw py::index_error(std::string(what) + " holds " + std::to_string(v) + ", out of range for a pool of " +
                            std::to_string(limit) + " blocks");
    }
    out[i] = v;
  }
  return static_cast<size_t>(n);
}

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      cudaSetDevice(device);
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

// The host function that posts `sem` goes on `stream` itself, or, when `signal_stream` is not 0, on that stream
// behind a stream-side wait for the event: a host function holds up the stream it is on until it has run, and the
// copies queued next on `stream` (the layer groups of one load) must not wait for it.
cudaError_t signal_after(cudaEvent_t ev, cudaStream_t stream, int64_t sem, int64_t signal_stream) {
  if (sem == 0) return cudaSuccess;
  cudaStream_t target = stream;
  if (signal_stream != 0) {
    target = reinterpret_cast<cudaStream_t>(signal_stream);
    const cudaError_t err = cudaStreamWaitEvent(target, ev, 0);
    if (err != cudaSuccess) return err;
  }
  return cudaLaunchHostFunc(target, post_semaphore, reinterpret_cast<void*>(sem));
}

// Enqueue plan's copy of pairs (sb[i], db[i]), i < n, on `stream`, an event after it and the completion signal
// (signal_after). If it throws before the copy was enqueued, nothing was.
std::unique_ptr<DeviceEvent> issue(FastPlan& plan, const int64_t* sb, const int64_t* db, size_t n, int64_t stream_handle,
                                   int64_t sem, int64_t signal_stream) {
  const DeviceGuard guard(plan.device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  BlockCopyGeometry g = plan.g;
  g.num_pairs = static_cast<int64_t>(n);
  if (n > 0) {
    try {
      if (plan.method == 1) {
        issue_dma(g, plan.dbase, plan.sbase, sb, db, stream);
      } else {
        issue_kernel_host_indices(g, plan.kbases, sb, db, at::Device(at::kCUDA, plan.device), stream);
      }
    } catch (const c10::Error& e) {
      throw std::runtime_error(e.what_without_backtrace());
    }
  }
  cudaEvent_t ev = take_event(plan.device);
  auto event = std::make_unique<DeviceEvent>(ev, plan.device);  // returns ev to the pool on any exit
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err == cudaSuccess) err = signal_after(ev, stream, sem, signal_stream);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("tiered_kv fast path: ") + cudaGetErrorString(err));
  }
  return event;
}

std::unique_ptr<DeviceEvent> submit(int64_t plan_id, py::handle src, py::handle dst, int64_t stream_handle,
                                    int64_t sem, int64_t signal_stream) {
  FastPlan& plan = plan_of(plan_id);
  std::array<int64_t, kMaxPairs> sb{}, db{};
  const size_t ns = read_indices(src, sb.data(), plan.src_blocks, "src_blocks");
  const size_t nd = read_indices(dst, db.data(), plan.dst_blocks, "dst_blocks");
  if (ns != nd) {
    throw py::value_error("got " + std::to_string(ns) + " source and " + std::to_string(nd) +
                          " destination blocks; they must pair up");
  }
  return issue(plan, sb.data(), db.data(), ns, stream_handle, sem, signal_stream);
}

// An event after the work queued so far on `stream` (and the host-function post, as submit does).
std::unique_ptr<DeviceEvent> record(int device, int64_t stream_handle, int64_t sem) {
  const DeviceGuard guard(device);
  const cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaEvent_t ev = take_event(device);
  auto event = std::make_unique<DeviceEvent>(ev, device);
  cudaError_t err = cudaEventRecord(ev, stream);
  if (err == cudaSuccess && sem != 0) err = cudaLaunchHostFunc(stream, post_semaphore, reinterpret_cast<void*>(sem));
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("tiered_kv fast path: ") + cudaGetErrorString(err));
  }
  return event;
}

// ------------------------------------------------------------------------------------------ completion wait

void sleep_ns(int64_t ns) {
  const timespec ts{static_cast<time_t>(ns / 1000000000LL), static_cast<long>(ns % 1000000000LL)};
  nanosleep(&ts, nullptr);
}

timespec at_ns(int64_t ns) { return timespec{static_cast<time_t>(ns / 1000000000LL), static_cast<long>(ns % 1000000000LL)}; }

// cudaSuccess: done; cudaErrorNotReady: not yet; anything else: a CUDA error (thrown).
bool event_done(cudaEvent_t ev) {
  const cudaError_t err = cudaEventQuery(ev);
  if (err == cudaSuccess) return true;
  cudaGetLastError();
  if (err == cudaErrorNotReady) return false;
  throw std::runtime_error(std::string("cudaEventQuery failed: ") + cudaGetErrorString(err));
}

constexpr int64_t kPollNs = 20000;        // the poll period near the expected end
constexpr int64_t kMaxPollNs = 1000000;   // the longest poll period, far past the expected end

// The stream waiter's wait for one completion (GIL released). Every notify enqueues one semaphore post (when
// `sem` is not 0), but an item may be found done by polling before its post arrives: `owed` counts those posts
// still to come, and a post taken while any is owed pays one of them. Until `wake_ns` (CLOCK_MONOTONIC; -1: no
// estimate) it sleeps on the semaphore; from then it polls the event, every 20 us until `due_ns` (the expected
// end) and then at a period that grows with the overrun (1/16 of it, at most 1 ms), sleeping on the semaphore
// between polls (so the wait never ends later than the post would have ended it). A host function runs on
// CUDA's callback thread and, measured on an H100 host, posts 0.1-0.5 ms after a copy ends; a poll started just
// before the expected end sees it within tens of microseconds. Returns (posts still owed, done, seen_ns, misses):
// seen_ns is when a check first found the event done (CLOCK_MONOTONIC, taken before the GIL is back: the end as
// this thread saw it), misses how many checks found it not done yet (0: done at the first look, so it ended some
// time before seen_ns; the caller's rate estimate must not take seen_ns for its end).
//
// `stop_ns` (>= 0): return at that time even if the event is not done yet, with done = false (the waiter wakes the
// event loop ahead of the completion, then waits again); a post this item took before stopping is handed to the
// next call as a credit, owed = -1.
std::tuple<int64_t, bool, int64_t, int64_t> wait_done(int64_t event, int device, int64_t sem_address, int64_t wake_ns,
                                                       int64_t due_ns, int64_t owed, int64_t stop_ns) {
  const py::gil_scoped_release release;
  static thread_local bool slack_set = false;
  if (!slack_set) {  // short sleeps wake within ~1 us of their time instead of the default 50 us slack
    prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    slack_set = true;
  }
  const DeviceGuard guard(device);
  const cudaEvent_t ev = reinterpret_cast<cudaEvent_t>(event);
  sem_t* sem = reinterpret_cast<sem_t*>(sem_address);
  bool consumed = false;
  int64_t seen = 0;
  int64_t misses = 0;
  auto done_now = [&]() -> bool {  // one look at the event, counted
    if (event_done(ev)) {
      seen = now_ns();
      return true;
    }
    ++misses;
    return false;
  };
  if (owed < 0) {  // a credit: this item's post was taken by the call that stopped early
    consumed = true;
    owed = 0;
  }
  if (sem != nullptr) {
    while (owed > 0 && sem_trywait(sem) == 0) --owed;
  }
  const bool stops = stop_ns >= 0;
  auto stopped = [&]() -> std::tuple<int64_t, bool, int64_t, int64_t> {
    return {consumed ? -1 : owed, false, 0, misses};
  };
  if (wake_ns < 0) {  // no estimate: the host-function post (or, in event mode, a blocking-sync wait)
    if (sem == nullptr) {
      const cudaError_t err = cudaEventSynchronize(ev);
      if (err != cudaSuccess) {
        cudaGetLastError();
        throw std::runtime_error(std::string("cudaEventSynchronize failed: ") + cudaGetErrorString(err));
      }
      return {owed, true, now_ns(), 1};
    }
    for (;;) {
      if (sem_wait(sem) != 0) continue;  // EINTR
      if (owed > 0) {
        --owed;
        continue;
      }
      consumed = true;
      break;
    }
    if (done_now()) return {owed, true, seen, misses};
    due_ns = now_ns();  // a post of a later notify (signalled beside its stream) came first: poll from here
  } else if (sem != nullptr) {
    const int64_t first = stops ? std::min(wake_ns, stop_ns) : wake_ns;
    const timespec until = at_ns(first);
    while (now_ns() < first) {
      if (sem_clockwait(sem, CLOCK_MONOTONIC, &until) != 0) {
        if (errno == EINTR) continue;
        break;  // ETIMEDOUT: poll from here
      }
      if (owed > 0) {
        --owed;
        continue;
      }
      consumed = true;
      if (done_now()) return {owed, true, seen, misses};
      break;
    }
    if (stops && now_ns() >= stop_ns && !done_now()) return stopped();
  } else {  // event mode (no post to fall back on): sleep in slices of at most 1 ms, checking between them
    for (int64_t left = wake_ns - now_ns(); left > 0; left = wake_ns - now_ns()) {
      if (done_now()) return {owed, true, seen, misses};
      if (stops && now_ns() >= stop_ns) return stopped();
      sleep_ns(std::min(left, stops ? std::min(kMaxPollNs, std::max<int64_t>(stop_ns - now_ns(), 1000)) : kMaxPollNs));
    }
  }
  while (!done_now()) {
    if (stops && now_ns() >= stop_ns) return stopped();
    const int64_t over = now_ns() - due_ns;
    const int64_t period = over <= 16 * kPollNs ? kPollNs : std::min(over / 16, kMaxPollNs);
    if (sem == nullptr || consumed) {
      sleep_ns(period);
      continue;
    }
    // between polls, sleep on the semaphore: a copy far slower than expected still ends at its post
    const timespec until = at_ns(now_ns() + period);
    if (sem_clockwait(sem, CLOCK_MONOTONIC, &until) == 0) {
      if (owed > 0) {
        --owed;
      } else {
        consumed = true;
      }
    }
  }
  return {(consumed || sem == nullptr) ? owed : owed + 1, true, seen, misses};
}

}  // namespace

// Schemas in tiered_kv/opdefs.py, as every op's; one kernel for every device (copy_plan_free has no tensor argument)
TORCH_LIBRARY_IMPL(tiered_kv, CompositeExplicitAutograd, m) {
  m.impl("copy_plan", &copy_plan);
  m.impl("copy_plan_free", &copy_plan_free);
}

}  // namespace tiered_kv

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using tiered_kv::DeviceEvent;
  m.doc() = "tiered_kv native submission path (see kernels/fast_path.cpp)";
  py::class_<DeviceEvent>(m, "DeviceEvent")
      .def("query", &DeviceEvent::query)
      .def("synchronize", &DeviceEvent::synchronize)
      .def("wait", &DeviceEvent::wait, py::arg("stream"))
      .def("spin", &DeviceEvent::spin, py::arg("budget_ns"))
      .def_property_readonly("handle", &DeviceEvent::handle)
      .def("__repr__", [](const DeviceEvent& e) {
        return "<DeviceEvent " + std::string(e.query() ? "done" : "pending") + ">";
      });
  m.def("submit", &tiered_kv::submit, py::arg("plan"), py::arg("src"), py::arg("dst"), py::arg("stream"),
        py::arg("sem"), py::arg("signal_stream") = 0);
  m.def("record", &tiered_kv::record, py::arg("device"), py::arg("stream"), py::arg("sem"));
  m.def("wait_done", &tiered_kv::wait_done, py::arg("event"), py::arg("device"), py::arg("sem"), py::arg("wake_ns"),
        py::arg("due_ns"), py::arg("owed"), py::arg("stop_ns") = -1);
}
