// jaxddp's XLA FFI handler for the jitted allreduce: MPI_Iallreduce, then a wait that spins
// while the collective is young and then sleeps in short, growing naps, so that a rank whose
// core is shared with the Python thread gives that core back instead of yielding it for a
// whole time slice per protocol step (what MPICH's blocking wait does under
// MPI_THREAD_MULTIPLE: sched_yield between polls).
//
// No MPI header: the two MPI entry points come from the library mpi4py loaded (set once by
// jaxddp_native_configure), and MPI handles travel as integers wide enough for both ABIs
// (MPICH's int handles, Open MPI's pointers). jaxddp/_native/__init__.py builds and loads it.

#include <sys/prctl.h>

#include <climits>
#include <cstdint>
#include <ctime>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using IallreduceFn = int (*)(const void*, void*, int, intptr_t, intptr_t, intptr_t, void*);
using TestFn = int (*)(void*, int*, void*);

IallreduceFn iallreduce = nullptr;
TestFn test = nullptr;

// The wait: poll for kSpinNs (a collective whose ranks are all there ends within it), then
// nap, from kNapMinNs doubling up to kNapMaxNs, polling for kPollNs after each nap: a wait
// for a rank still computing costs a few wake-ups (each one preempts the Python thread),
// and the collective resumes at most kNapMaxNs after the last rank arrives. Chosen with
// benchmarks/bench_nnx_handlers.py; to try others, build with e.g.
// CXX="c++ -DJAXDDP_NAP_MAX_NS=2000000" (the flags are part of the cache key).
#ifndef JAXDDP_SPIN_NS
#define JAXDDP_SPIN_NS 200000
#endif
#ifndef JAXDDP_POLL_NS
#define JAXDDP_POLL_NS 0
#endif
#ifndef JAXDDP_NAP_MIN_NS
#define JAXDDP_NAP_MIN_NS 20000
#endif
#ifndef JAXDDP_NAP_MAX_NS
#define JAXDDP_NAP_MAX_NS 500000
#endif
constexpr int64_t kSpinNs = JAXDDP_SPIN_NS;
constexpr int64_t kPollNs = JAXDDP_POLL_NS;
constexpr int64_t kNapMinNs = JAXDDP_NAP_MIN_NS;
constexpr int64_t kNapMaxNs = JAXDDP_NAP_MAX_NS;

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

ffi::Error mpi_error(const char* what, int code) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(what) + " returned MPI error code " + std::to_string(code));
}

// Waits for one request as above; while it naps, this thread's timer slack is 1 ns (a nap
// as short as asked, not the default 50 us later), restored before it returns.
ffi::Error wait(intptr_t* request) {
  alignas(16) char status[256];  // larger than any MPI_Status
  int done = 0;
  int64_t until = now_ns() + kSpinNs;  // poll until then
  int64_t nap = kNapMinNs;
  long slack = -1;
  ffi::Error result = ffi::Error::Success();
  while (true) {
    int rc = test(request, &done, status);
    if (rc != 0) {
      result = mpi_error("MPI_Test", rc);
      break;
    }
    if (done) break;
    if (now_ns() < until) continue;
    if (slack < 0) {
      slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
      prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    }
    timespec t{0, static_cast<long>(nap)};
    nanosleep(&t, nullptr);
    nap = nap * 2 < kNapMaxNs ? nap * 2 : kNapMaxNs;
    until = now_ns() + kPollNs;
  }
  if (slack > 0) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack), 0, 0, 0);
  return result;
}

ffi::Error allreduce(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t comm, int64_t op, int64_t dtype,
                     int64_t nitems) {
  if (iallreduce == nullptr || test == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxddp's native allreduce was called before jaxddp configured it");
  }
  if (nitems == 0) return ffi::Error::Success();
  const size_t width = x.size_bytes() / x.element_count();
  const char* in = static_cast<const char*>(x.untyped_data());
  char* out = static_cast<char*>(y->untyped_data());
  constexpr int64_t kChunk = int64_t{1} << 30;  // MPI counts are ints
  for (int64_t first = 0; first < nitems; first += kChunk) {
    const int64_t count = nitems - first < kChunk ? nitems - first : kChunk;
    intptr_t request = 0;
    int rc = iallreduce(in + first * width, out + first * width, static_cast<int>(count),
                        static_cast<intptr_t>(dtype), static_cast<intptr_t>(op),
                        static_cast<intptr_t>(comm), &request);
    if (rc != 0) return mpi_error("MPI_Iallreduce", rc);
    ffi::Error waited = wait(&request);
    if (waited.failure()) return waited;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxddp_allreduce, allreduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("nitems"));

extern "C" __attribute__((visibility("default"))) void jaxddp_native_configure(
    void* iallreduce_fn, void* test_fn) {
  iallreduce = reinterpret_cast<IallreduceFn>(iallreduce_fn);
  test = reinterpret_cast<TestFn>(test_fn);
}
