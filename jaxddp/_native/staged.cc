// jaxddp's XLA FFI handlers for the collectives of a program compiled for a GPU, one per
// kind (allreduce, bcast, reduce, allgather, alltoall), with the attributes of the CPU
// targets. MPI cannot read GPU memory unless it was built for it, so by default each call
// is staged through pinned host memory on XLA's own stream: copy the input to the host,
// wait for the stream, run the collective on host memory (an allreduce through
// host_allreduce: the node's shared memory or MPI, as on a CPU), copy the result back. An
// allreduce, broadcast or reduce goes in chunks of kStageBytes, two buffers each way, so
// that the copy of the next chunk runs while this one is reduced. Where the MPI library is
// CUDA-aware (jaxddp_native_staged_configure's `aware`), the stream is synchronized and MPI
// gets the device buffers themselves.
//
// No CUDA header and no link to CUDA: the CUDA driver's entry points (libcuda, present
// wherever a GPU driver is) are handed over by jaxddp/_native/staged.py, the stream is
// XLA's (a CUstream), and the calls run in the stream's own context. The same handlers are
// also bound without a stream for the CPU (the jaxddp_staged_host_* symbols): the test
// suite runs them there against a stand-in driver (tests/native/driver.c) whose copies
// happen only at a synchronization, as a GPU's may, so that a read of staged memory before
// the wait for its copy shows as a wrong result.

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>

#include "native.h"

namespace {

using jaxddp::mpi;
using jaxddp::mpi_error;
namespace ffi = xla::ffi;

#ifndef JAXDDP_STAGE_BYTES
#define JAXDDP_STAGE_BYTES (8 << 20)
#endif
constexpr int64_t kStageBytes = JAXDDP_STAGE_BYTES;

// The driver's entry points (CUresult is an int, CUdeviceptr a 64-bit integer).
struct Driver {
  int (*stream_ctx)(void* stream, void** ctx) = nullptr;       // cuStreamGetCtx
  int (*push)(void* ctx) = nullptr;                            // cuCtxPushCurrent_v2
  int (*pop)(void** ctx) = nullptr;                            // cuCtxPopCurrent_v2
  int (*copy)(uint64_t dst, uint64_t src, size_t n, void* stream) = nullptr;  // cuMemcpyAsync
  int (*sync)(void* stream) = nullptr;                         // cuStreamSynchronize
  int (*host_alloc)(void** p, size_t n, unsigned flags) = nullptr;  // cuMemHostAlloc
  int (*host_free)(void* p) = nullptr;                         // cuMemFreeHost
  int (*error_name)(int code, const char** name) = nullptr;    // cuGetErrorName
};
Driver driver;
bool aware = false;  // the MPI library takes device buffers
bool configured = false;

ffi::Error cuda_error(const char* what, int code) {
  const char* name = nullptr;
  if (driver.error_name == nullptr || driver.error_name(code, &name) != 0) name = nullptr;
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jaxddp: ") + what +
                                                   " failed with CUDA error " +
                                                   std::to_string(code) +
                                                   (name ? std::string(" (") + name + ")" : ""));
}

#define JAXDDP_CUDA(call, what)                       \
  do {                                                \
    if (int rc_ = (call); rc_ != 0) return cuda_error(what, rc_); \
  } while (0)

// Pinned host memory, grown (to whole MiB) when a call needs more; kept for the next call. One staged
// call at a time per process (`lock`), as MPI requires per communicator.
struct Pinned {
  char* data = nullptr;
  size_t bytes = 0;
};
Pinned sends[2], receives[2];
std::mutex lock;

ffi::Error ensure(Pinned& p, size_t bytes) {
  if (p.bytes >= bytes) return ffi::Error::Success();
  if (p.data != nullptr) JAXDDP_CUDA(driver.host_free(p.data), "cuMemFreeHost");
  p.data = nullptr;
  p.bytes = 0;
  const size_t size = (bytes + (size_t{1} << 20) - 1) / (size_t{1} << 20) * (size_t{1} << 20);
  void* memory = nullptr;
  JAXDDP_CUDA(driver.host_alloc(&memory, size, 1 /* CU_MEMHOSTALLOC_PORTABLE */),
              "cuMemHostAlloc");
  p.data = static_cast<char*>(memory);
  p.bytes = size;
  return ffi::Error::Success();
}

uint64_t address(const void* p) { return reinterpret_cast<uint64_t>(p); }

// The stream's context made current for the call, and the previous one restored after.
class InContext {
 public:
  explicit InContext(void* stream) {
    void* ctx = nullptr;
    status_ = driver.stream_ctx(stream, &ctx);
    if (status_ == 0) status_ = driver.push(ctx);
    pushed_ = status_ == 0;
  }
  ~InContext() {
    void* ctx = nullptr;
    if (pushed_) driver.pop(&ctx);
  }
  int status() const { return status_; }

 private:
  int status_ = 0;
  bool pushed_ = false;
};

ffi::Error not_configured() {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "jaxddp's GPU collectives were called before jaxddp configured them");
}

// A collective that goes in chunks (allreduce, broadcast, reduce): `total` bytes of input
// at `in` (nullptr: this rank sends nothing) and of output at `out` (nullptr: it gets
// nothing back), `width` bytes an element. `host(k, first, count, send, receive)` runs the
// collective on chunk k: `count` elements from element `first`, in pinned memory.
template <typename Host>
ffi::Error chunked(void* stream, const char* in, char* out, int64_t nitems, int64_t width,
                   Host host) {
  const int64_t per = kStageBytes / width > 0 ? kStageBytes / width : 1;
  const int64_t chunks = nitems > 0 ? (nitems + per - 1) / per : 1;  // an empty call takes part
  const size_t bytes = static_cast<size_t>((nitems < per ? nitems : per) * width);
  for (int b = 0; b < 2 && b < chunks; ++b) {
    if (ffi::Error e = ensure(sends[b], bytes); e.failure()) return e;
    if (ffi::Error e = ensure(receives[b], bytes); e.failure()) return e;
  }
  auto count_of = [&](int64_t k) { return k * per + per <= nitems ? per : nitems - k * per; };
  if (in != nullptr && nitems > 0) {
    JAXDDP_CUDA(driver.copy(address(sends[0].data), address(in), count_of(0) * width, stream),
                "cuMemcpyAsync (device to host)");
  }
  JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t first = k * per, count = count_of(k);
    if (in != nullptr && k + 1 < chunks) {  // the next chunk's copy runs meanwhile
      JAXDDP_CUDA(driver.copy(address(sends[(k + 1) % 2].data), address(in + (first + per) * width),
                              count_of(k + 1) * width, stream),
                  "cuMemcpyAsync (device to host)");
    }
    if (ffi::Error e = host(k, first, count, sends[k % 2].data, receives[k % 2].data);
        e.failure()) {
      driver.sync(stream);  // leave no copy in flight into memory a later call reuses
      return e;
    }
    if (out != nullptr && count > 0) {
      JAXDDP_CUDA(driver.copy(address(out + first * width), address(receives[k % 2].data),
                              count * width, stream),
                  "cuMemcpyAsync (host to device)");
    }
    // Before buffer k % 2 is written again (chunk k + 2, or the next call): the copies
    // out of it, and the next chunk's copy in, are done.
    JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");
  }
  return ffi::Error::Success();
}

// A collective staged whole (allgather, alltoall): `sent` bytes in, `got` bytes out.
template <typename Host>
ffi::Error whole(void* stream, const char* in, size_t sent, char* out, size_t got, Host host) {
  if (ffi::Error e = ensure(sends[0], sent); e.failure()) return e;
  if (ffi::Error e = ensure(receives[0], got); e.failure()) return e;
  if (sent > 0) {
    JAXDDP_CUDA(driver.copy(address(sends[0].data), address(in), sent, stream),
                "cuMemcpyAsync (device to host)");
  }
  JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");
  if (ffi::Error e = host(sends[0].data, receives[0].data); e.failure()) return e;
  if (got > 0) {
    JAXDDP_CUDA(driver.copy(address(out), address(receives[0].data), got, stream),
                "cuMemcpyAsync (host to device)");
  }
  JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");  // before receives[0] is reused
  return ffi::Error::Success();
}

ffi::Error waited(int rc, const char* what, intptr_t* request, int64_t bytes = 0) {
  if (rc != 0) return mpi_error(what, rc);
  return jaxddp::wait(request, bytes);
}

int64_t width_of(const ffi::AnyBuffer& x) {
  return x.element_count() ? static_cast<int64_t>(x.size_bytes() / x.element_count()) : 1;
}

// Every handler: the context of the stream, one call at a time, then the kind's own body.
template <typename Body>
ffi::Error staged(void* stream, Body body) {
  if (!configured) return not_configured();
  std::lock_guard<std::mutex> hold(lock);
  InContext context(stream);
  if (context.status() != 0) return cuda_error("making the stream's context current", context.status());
  return body();
}

// The element counts of one MPI call, in chunks MPI's int counts can hold.
ffi::Error too_large(const char* what, int64_t n) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("jaxddp: ") + what + " of " + std::to_string(n) +
                        " elements per rank is more than one MPI call takes (2**31 - 1)");
}

ffi::Error allreduce(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     int64_t comm, int64_t op, int64_t dtype, int64_t nitems,
                     std::string_view call) {
  return staged(stream, [&]() -> ffi::Error {
    const int64_t width = width_of(x);
    const char* in = static_cast<const char*>(x.untyped_data());
    char* out = static_cast<char*>(y->untyped_data());
    if (aware) {
      JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");
      for (int64_t first = 0; first < nitems; first += int64_t{1} << 30) {
        const int64_t count = nitems - first < (int64_t{1} << 30) ? nitems - first : int64_t{1} << 30;
        intptr_t request = 0;
        int rc = mpi.iallreduce(in + first * width, out + first * width, static_cast<int>(count),
                                dtype, op, comm, &request);
        if (ffi::Error e = waited(rc, "MPI_Iallreduce", &request, count * width); e.failure()) {
          return e;
        }
      }
      return ffi::Error::Success();
    }
    return chunked(stream, in, out, nitems, width,
                   [&](int64_t, int64_t, int64_t count, char* send, char* receive) {
                     return jaxddp::host_allreduce(send, receive, comm, op, dtype, count, width,
                                                   call);
                   });
  });
}

// A broadcast's root gets nothing back (its output has no element); the others' input is
// ignored, as mpi4jax's.
ffi::Error bcast(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                 int64_t dtype, int64_t nitems, int64_t root) {
  return staged(stream, [&]() -> ffi::Error {
    const int64_t width = width_of(x);
    const bool is_root = y->element_count() == 0 && nitems > 0;
    if (nitems > (int64_t{1} << 31) - 1 && aware) return too_large("a broadcast", nitems);
    if (aware) {
      JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");
      void* buffer = is_root ? x.untyped_data() : y->untyped_data();
      if (nitems == 0) return ffi::Error::Success();
      intptr_t request = 0;
      int rc = mpi.ibcast(buffer, static_cast<int>(nitems), dtype, static_cast<int>(root), comm,
                          &request);
      return waited(rc, "MPI_Ibcast", &request, nitems * width);
    }
    const char* in = is_root ? static_cast<const char*>(x.untyped_data()) : nullptr;
    char* out = is_root ? nullptr : static_cast<char*>(y->untyped_data());
    return chunked(stream, in, out, nitems, width,
                   [&](int64_t, int64_t, int64_t count, char* send, char* receive) {
                     if (count == 0) return ffi::Error::Success();
                     char* buffer = is_root ? send : receive;
                     intptr_t request = 0;
                     int rc = mpi.ibcast(buffer, static_cast<int>(count), dtype,
                                         static_cast<int>(root), comm, &request);
                     return waited(rc, "MPI_Ibcast", &request, count * width);
                   });
  });
}

// A reduce's non-roots get nothing back.
ffi::Error reduce(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                  int64_t dtype, int64_t nitems, int64_t op, int64_t root) {
  return staged(stream, [&]() -> ffi::Error {
    const int64_t width = width_of(x);
    const bool is_root = y->element_count() > 0 || nitems == 0;
    if (aware) {
      if (nitems > (int64_t{1} << 31) - 1) return too_large("a reduce", nitems);
      JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");
      if (nitems == 0) return ffi::Error::Success();
      intptr_t request = 0;
      int rc = mpi.ireduce(x.untyped_data(), is_root ? y->untyped_data() : nullptr,
                           static_cast<int>(nitems), dtype, op, static_cast<int>(root), comm,
                           &request);
      return waited(rc, "MPI_Ireduce", &request, nitems * width);
    }
    char* out = is_root && y->element_count() > 0 ? static_cast<char*>(y->untyped_data()) : nullptr;
    return chunked(stream, static_cast<const char*>(x.untyped_data()), out, nitems, width,
                   [&](int64_t, int64_t, int64_t count, char* send, char* receive) {
                     if (count == 0) return ffi::Error::Success();
                     intptr_t request = 0;
                     int rc = mpi.ireduce(send, receive, static_cast<int>(count), dtype, op,
                                          static_cast<int>(root), comm, &request);
                     return waited(rc, "MPI_Ireduce", &request, count * width);
                   });
  });
}

// An allgather or alltoall: `move` is MPI_Iallgather or MPI_Ialltoall.
template <typename Move>
ffi::Error moved(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t comm,
                 int64_t sendcount, int64_t sendtype, int64_t recvcount, int64_t recvtype,
                 Move move, const char* name) {
  return staged(stream, [&]() -> ffi::Error {
    if (move == nullptr) return not_configured();
    if (sendcount > (int64_t{1} << 31) - 1) return too_large(name, sendcount);
    if (aware) {
      JAXDDP_CUDA(driver.sync(stream), "cuStreamSynchronize");
      intptr_t request = 0;
      int rc = move(x.untyped_data(), static_cast<int>(sendcount), sendtype, y->untyped_data(),
                    static_cast<int>(recvcount), recvtype, comm, &request);
      return waited(rc, name, &request, static_cast<int64_t>(y->size_bytes()));
    }
    return whole(stream, static_cast<const char*>(x.untyped_data()), x.size_bytes(),
                 static_cast<char*>(y->untyped_data()), y->size_bytes(),
                 [&](char* send, char* receive) {
                   intptr_t request = 0;
                   int rc = move(send, static_cast<int>(sendcount), sendtype, receive,
                                 static_cast<int>(recvcount), recvtype, comm, &request);
                   return waited(rc, name, &request, static_cast<int64_t>(y->size_bytes()));
                 });
  });
}

// The handlers' signatures without the stream: the GPU's take it first, the CPU's pass
// nullptr (the stand-in driver's stream). Every body waits for its last copy before it
// returns, so the CPU's output is whole when XLA reads it.
using Token = ffi::Token;
using Out = ffi::Result<ffi::AnyBuffer>;
using TokenOut = ffi::Result<ffi::Token>;

}  // namespace

// Each kind's binding, with or without the stream (S: `.Ctx<ffi::PlatformStream<void*>>()`
// or nothing), so that the GPU's and the CPU's take the very same buffers and attributes.
#define JAXDDP_ALLREDUCE_BIND(S)                                                              \
  ffi::Ffi::Bind() S.Arg<ffi::AnyBuffer>().Arg<Token>().Ret<ffi::AnyBuffer>().Ret<Token>()   \
      .Attr<int64_t>("comm").Attr<int64_t>("op").Attr<int64_t>("dtype")                       \
      .Attr<int64_t>("nitems").Attr<std::string_view>("call")
#define JAXDDP_BCAST_BIND(S)                                                                  \
  ffi::Ffi::Bind() S.Arg<ffi::AnyBuffer>().Arg<Token>().Ret<ffi::AnyBuffer>().Ret<Token>()   \
      .Attr<int64_t>("comm").Attr<int64_t>("dtype").Attr<int64_t>("nitems")                   \
      .Attr<int64_t>("root")
#define JAXDDP_REDUCE_BIND(S)                                                                 \
  ffi::Ffi::Bind() S.Arg<ffi::AnyBuffer>().Arg<Token>().Ret<ffi::AnyBuffer>().Ret<Token>()   \
      .Attr<int64_t>("comm").Attr<int64_t>("dtype").Attr<int64_t>("nitems")                   \
      .Attr<int64_t>("op").Attr<int64_t>("root")
#define JAXDDP_MOVE_BIND(S)                                                                   \
  ffi::Ffi::Bind() S.Arg<ffi::AnyBuffer>().Arg<Token>().Ret<ffi::AnyBuffer>().Ret<Token>()   \
      .Attr<int64_t>("comm").Attr<int64_t>("sendcount").Attr<int64_t>("sendtype")             \
      .Attr<int64_t>("recvcount").Attr<int64_t>("recvtype")
#define JAXDDP_STREAM .Ctx<ffi::PlatformStream<void*>>()
#define JAXDDP_NO_STREAM

// The attribute names each binding takes, for the test that checks a lowering against them.
extern "C" __attribute__((visibility("default"))) const char* jaxddp_native_staged_attributes(
    const char* kind) {
  const std::string_view k(kind);
  if (k == "allreduce") return "comm,op,dtype,nitems,call";
  if (k == "bcast") return "comm,dtype,nitems,root";
  if (k == "reduce") return "comm,dtype,nitems,op,root";
  if (k == "allgather" || k == "alltoall") return "comm,sendcount,sendtype,recvcount,recvtype";
  return "";
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxddp_staged_allreduce,
    [](void* s, ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t op,
       int64_t dtype, int64_t nitems, std::string_view call) {
      return allreduce(s, x, y, comm, op, dtype, nitems, call);
    },
    JAXDDP_ALLREDUCE_BIND(JAXDDP_STREAM));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxddp_staged_host_allreduce,
    [](ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t op, int64_t dtype,
       int64_t nitems, std::string_view call) {
      return allreduce(nullptr, x, y, comm, op, dtype, nitems, call);
    },
    JAXDDP_ALLREDUCE_BIND(JAXDDP_NO_STREAM));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxddp_staged_bcast,
    [](void* s, ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t dtype,
       int64_t nitems, int64_t root) { return bcast(s, x, y, comm, dtype, nitems, root); },
    JAXDDP_BCAST_BIND(JAXDDP_STREAM));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxddp_staged_host_bcast,
    [](ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t dtype, int64_t nitems,
       int64_t root) { return bcast(nullptr, x, y, comm, dtype, nitems, root); },
    JAXDDP_BCAST_BIND(JAXDDP_NO_STREAM));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxddp_staged_reduce,
    [](void* s, ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t dtype,
       int64_t nitems, int64_t op, int64_t root) {
      return reduce(s, x, y, comm, dtype, nitems, op, root);
    },
    JAXDDP_REDUCE_BIND(JAXDDP_STREAM));
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxddp_staged_host_reduce,
    [](ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t dtype, int64_t nitems,
       int64_t op, int64_t root) {
      return reduce(nullptr, x, y, comm, dtype, nitems, op, root);
    },
    JAXDDP_REDUCE_BIND(JAXDDP_NO_STREAM));

#define JAXDDP_MOVE_HANDLERS(kind, function, name)                                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      jaxddp_staged_##kind,                                                                   \
      [](void* s, ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t sc,         \
         int64_t st, int64_t rc, int64_t rt) {                                                \
        return moved(s, x, y, comm, sc, st, rc, rt, mpi.function, name);                      \
      },                                                                                      \
      JAXDDP_MOVE_BIND(JAXDDP_STREAM));                                                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                              \
      jaxddp_staged_host_##kind,                                                              \
      [](ffi::AnyBuffer x, Token, Out y, TokenOut, int64_t comm, int64_t sc, int64_t st,      \
         int64_t rc, int64_t rt) {                                                            \
        return moved(nullptr, x, y, comm, sc, st, rc, rt, mpi.function, name);                \
      },                                                                                      \
      JAXDDP_MOVE_BIND(JAXDDP_NO_STREAM));

JAXDDP_MOVE_HANDLERS(allgather, iallgather, "MPI_Iallgather")
JAXDDP_MOVE_HANDLERS(alltoall, ialltoall, "MPI_Ialltoall")

// The driver's entry points by their names (as in the list above), 0 for an unknown name;
// then whether MPI takes device buffers, which readies the handlers where every entry point
// (the driver's and MPI's) is set: 1, else 0 (and they refuse to run).
extern "C" __attribute__((visibility("default"))) int64_t jaxddp_native_staged_driver(
    const char* name, void* function) {
  const std::string_view n(name);
  auto set = [&](auto& slot) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(function);
    return int64_t{1};
  };
  if (n == "cuStreamGetCtx") return set(driver.stream_ctx);
  if (n == "cuCtxPushCurrent_v2") return set(driver.push);
  if (n == "cuCtxPopCurrent_v2") return set(driver.pop);
  if (n == "cuMemcpyAsync") return set(driver.copy);
  if (n == "cuStreamSynchronize") return set(driver.sync);
  if (n == "cuMemHostAlloc") return set(driver.host_alloc);
  if (n == "cuMemFreeHost") return set(driver.host_free);
  if (n == "cuGetErrorName") return set(driver.error_name);
  return 0;
}

extern "C" __attribute__((visibility("default"))) int64_t jaxddp_native_staged_ready(
    int64_t cuda_aware) {
  aware = cuda_aware != 0;
  configured = driver.stream_ctx && driver.push && driver.pop && driver.copy && driver.sync &&
               driver.host_alloc && driver.host_free;
#define JAXDDP_MPI_READY(slot, name, type) configured = configured && mpi.slot != nullptr;
  JAXDDP_MPI_FUNCTIONS(JAXDDP_MPI_READY)
#undef JAXDDP_MPI_READY
  return configured ? 1 : 0;
}

// The bytes of pinned memory the staged handlers hold now.
extern "C" __attribute__((visibility("default"))) int64_t jaxddp_native_staged_pinned() {
  int64_t total = 0;
  for (const Pinned* p : {&sends[0], &sends[1], &receives[0], &receives[1]}) total += p->bytes;
  return total;
}
