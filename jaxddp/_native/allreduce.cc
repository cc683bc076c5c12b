// jaxddp's XLA FFI handler for the jitted allreduce. Where every rank of the communicator is
// on this node (jaxddp_native_share), an allreduce of a sum, max or min goes through memory
// the ranks share, without MPI: each rank copies its part into its own slot, waits (asleep
// on a futex, woken by the last rank to arrive) until every rank has copied, and reduces
// every rank's slot in rank order, so every rank holds the same bits. Elsewhere it posts
// MPI_Iallreduce, then waits in a way that spins while the collective is young and then
// sleeps in short, growing naps, so that a rank whose core is shared with the Python thread
// gives that core back instead of yielding it for a whole time slice per protocol step
// (what MPICH's blocking wait does under MPI_THREAD_MULTIPLE: sched_yield between polls).
//
// No MPI header: the MPI entry points come from the library mpi4py loaded (set once by
// jaxddp_native_configure), and MPI handles travel as integers wide enough for both ABIs
// (MPICH's int handles, Open MPI's pointers). staged.cc holds the handlers of device
// buffers, which reduce through host_allreduce below; native.h what the two share.
// jaxddp/_native/__init__.py builds and loads the library.

#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <limits>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>

#include "native.h"

namespace jaxddp {

Mpi mpi;

ffi::Error mpi_error(const char* what, int code) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string(what) + " returned MPI error code " + std::to_string(code));
}

}  // namespace jaxddp

namespace {

using jaxddp::mpi;
using jaxddp::mpi_error;
namespace ffi = xla::ffi;

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
// A message of this many bytes or more moves while the wait polls: over TCP (UCX's tcp
// transport between nodes) each MPI_Test pushes what the sockets take, so naps that grow to
// kNapMaxNs starve the transfer (a 100 MB allreduce took 3.3 s at any link speed, 20x
// mpi4py's blocking call). Its naps stay at kNapMinNs.
#ifndef JAXDDP_STREAM_BYTES
#define JAXDDP_STREAM_BYTES 1048576
#endif
constexpr int64_t kSpinNs = JAXDDP_SPIN_NS;
constexpr int64_t kPollNs = JAXDDP_POLL_NS;
constexpr int64_t kNapMinNs = JAXDDP_NAP_MIN_NS;
constexpr int64_t kNapMaxNs = JAXDDP_NAP_MAX_NS;
constexpr int64_t kStreamBytes = JAXDDP_STREAM_BYTES;

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

}  // namespace

// Waits for one request as above; while it naps, this thread's timer slack is 1 ns (a nap
// as short as asked, not the default 50 us later), restored before it returns.
ffi::Error jaxddp::wait(intptr_t* request, int64_t bytes) {
  alignas(16) char status[256];  // larger than any MPI_Status
  int done = 0;
  int64_t until = now_ns() + kSpinNs;  // poll until then
  int64_t nap = kNapMinNs;
  const int64_t nap_max = bytes >= kStreamBytes ? kNapMinNs : kNapMaxNs;
  long slack = -1;
  ffi::Error result = ffi::Error::Success();
  while (true) {
    int rc = mpi.test(request, &done, status);
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
    nap = nap * 2 < nap_max ? nap * 2 : nap_max;
    until = now_ns() + kPollNs;
  }
  if (slack > 0) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(slack), 0, 0, 0);
  return result;
}

namespace {

using jaxddp::wait;

// The shared-memory allreduce. The memory: a 64-byte line holding the bell (a futex word
// bumped when the last rank of a call arrives) and the count of ranks asleep on it, then a
// 64-byte Record per rank, then per rank and slot kTextBytes of the call's description (for
// the error message), then (from `data`, past the header) per rank two slots of slot_bytes. Call (or chunk) k of a rank uses its slot k % 2: it
// writes that slot again at call k + 2, which it reaches only when every rank has arrived
// at k + 1, i.e. has finished reading the slots of k.
enum Kind : int32_t { kF32, kF64, kI8, kI16, kI32, kI64, kU8, kU16, kU32, kU64, kKinds };
enum Op : int32_t { kSum, kMax, kMin, kOps };
constexpr const char* kKindNames[kKinds] = {"float32", "float64", "int8",   "int16",  "int32",
                                            "int64",   "uint8",   "uint16", "uint32", "uint64"};
constexpr const char* kOpNames[kOps] = {"sum", "max", "min"};
constexpr int kMaxTypes = 16;
constexpr int64_t kTextBytes = 192;

// A call, as every rank must make it: what travels (kind, op, count, which chunk) and what
// the call is to its caller (`call`: a hash of jaxddp's description of it, the op as the
// caller asked, mean included, and the dtype and shape of every leaf packed in the buffer),
// so that a bfloat16 leaf against a float32 one, a mean against a sum, or a complex64[5]
// against a float32[10] differ although the same bytes of the same MPI type would travel.
struct What {
  int16_t kind, op;
  uint32_t chunk;
  int64_t nitems;
  uint64_t call;
  bool operator!=(const What& o) const {
    return kind != o.kind || op != o.op || chunk != o.chunk || nitems != o.nitems ||
           call != o.call;
  }
};

uint64_t fnv1a(std::string_view text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

struct alignas(64) Record {  // one per rank, a cache line each
  std::atomic<uint32_t> arrival;  // the chunks this rank has copied its part of
  uint32_t unused;
  What what[2];  // per slot: the call it holds
};
static_assert(sizeof(Record) == 64, "a record is a cache line");

struct Shared {
  std::atomic<uint32_t>* bell = nullptr;
  std::atomic<uint32_t>* sleepers = nullptr;
  Record* records = nullptr;
  char* texts = nullptr;  // per rank and slot, kTextBytes: the call's description
  char* data = nullptr;
  int64_t slot_bytes = 0;
  intptr_t comm = 0;
  uint32_t ranks = 0, rank = 0;
  uint32_t arrivals = 0;  // this rank's, under `lock`
  std::mutex lock;  // one allreduce at a time per process, as MPI requires per communicator
  intptr_t types[kMaxTypes] = {};  // an MPI datatype handle, its Kind, and how many of
  int32_t kinds[kMaxTypes] = {};   // that kind one element holds (2 for a complex number)
  int32_t factors[kMaxTypes] = {};
  int ntypes = 0;
  intptr_t ops[kOps] = {};
  std::atomic<bool> on{false};
};
Shared shared;

#ifndef JAXDDP_SHARED_SPIN_NS
#define JAXDDP_SHARED_SPIN_NS 50000
#endif
constexpr int64_t kSharedSpinNs = JAXDDP_SHARED_SPIN_NS;  // a wait spins this long, then sleeps

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

bool all_arrived(uint32_t arrival) {
  for (uint32_t r = 0; r < shared.ranks; ++r) {
    const uint32_t seen = shared.records[r].arrival.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - arrival) < 0) return false;
  }
  return true;
}

// Publishes this rank's arrival; the rank that finds every rank arrived rings the bell. Of
// two ranks arriving at once, at least one sees the other (each stores, then loads, all
// seq_cst), so the last arrival is never missed; the waiters wake once per call, not once
// per rank. A rank about to sleep counts itself first and looks again, so one that the
// sleepers load misses sees the bell moved, and its futex wait returns at once.
void publish(uint32_t arrival) {
  shared.records[shared.rank].arrival.store(arrival, std::memory_order_seq_cst);
  if (!all_arrived(arrival)) return;
  shared.bell->fetch_add(1, std::memory_order_seq_cst);
  if (shared.sleepers->load(std::memory_order_seq_cst) != 0) {
    futex(shared.bell, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

// Waits until every rank has arrived at `arrival`, for as long as it takes (as a blocking
// MPI collective does): a rank that never comes is the stall inspector's to report. Asleep,
// it wakes only when the last rank arrives (no timeout): the inspector counts a main thread's
// wakes as progress (jaxddp/_runtime/watchdog/sleeps.py), and XLA may run a step on the main
// thread.
void await_all(uint32_t arrival) {
  const int64_t start = now_ns();
  while (true) {
    const uint32_t bell = shared.bell->load(std::memory_order_seq_cst);
    if (all_arrived(arrival)) return;
    if (now_ns() - start < kSharedSpinNs) continue;
    shared.sleepers->fetch_add(1, std::memory_order_seq_cst);
    if (!all_arrived(arrival)) futex(shared.bell, FUTEX_WAIT, bell, nullptr);
    shared.sleepers->fetch_sub(1, std::memory_order_seq_cst);
  }
}

// A maximum or minimum of floats compares them as integers of the same width that order as
// the floats do: a negative float's bits below its sign flipped (so -0.0 < +0.0), a NaN as the
// largest integer for a maximum and the smallest for a minimum (so a NaN on any rank is the
// result), and the winner's key turned back into its float. These are the keys that the
// lowering sends through MPI (lowering.py, order.py) and that the xla path reduces: a maximum
// or minimum has the same bits in shared memory, through MPI and on the xla path, whichever
// rank holds which value.
template <typename T, typename I>
void combine_ordered(T* __restrict out, const T* __restrict in, int64_t n, bool largest) {
  static_assert(sizeof(T) == sizeof(I));
  constexpr I kFlip = std::numeric_limits<I>::max();
  const I nan_key = largest ? std::numeric_limits<I>::max() : std::numeric_limits<I>::min();
  auto key = [&](T v) {
    I bits;
    std::memcpy(&bits, &v, sizeof bits);
    return v != v ? nan_key : bits < 0 ? static_cast<I>(bits ^ kFlip) : bits;
  };
  for (int64_t i = 0; i < n; ++i) {
    const I a = key(out[i]);
    const I b = key(in[i]);
    I k = largest ? (b > a ? b : a) : (b < a ? b : a);
    k = k < 0 ? static_cast<I>(k ^ kFlip) : k;
    std::memcpy(&out[i], &k, sizeof k);
  }
}

template <typename T>
void combine(T* __restrict out, const T* __restrict in, int64_t n, int32_t op) {
  if constexpr (std::is_floating_point_v<T>) {
    using I = std::conditional_t<sizeof(T) == 4, int32_t, int64_t>;
    if (op != kSum) return combine_ordered<T, I>(out, in, n, op == kMax);
  }
  if (op == kSum) {
    if constexpr (std::is_integral_v<T>) {  // wraps around, as MPI's does
      using U = std::make_unsigned_t<T>;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(U(out[i]) + U(in[i]));
    } else {
      for (int64_t i = 0; i < n; ++i) out[i] += in[i];
    }
  } else if (op == kMax) {  // integers (floats are above)
    for (int64_t i = 0; i < n; ++i) out[i] = in[i] > out[i] ? in[i] : out[i];
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = in[i] < out[i] ? in[i] : out[i];
  }
}

void combine(int32_t kind, int32_t op, char* out, const char* in, int64_t n) {
  switch (kind) {
    case kF32: return combine(reinterpret_cast<float*>(out), reinterpret_cast<const float*>(in), n, op);
    case kF64: return combine(reinterpret_cast<double*>(out), reinterpret_cast<const double*>(in), n, op);
    case kI8: return combine(reinterpret_cast<int8_t*>(out), reinterpret_cast<const int8_t*>(in), n, op);
    case kI16: return combine(reinterpret_cast<int16_t*>(out), reinterpret_cast<const int16_t*>(in), n, op);
    case kI32: return combine(reinterpret_cast<int32_t*>(out), reinterpret_cast<const int32_t*>(in), n, op);
    case kI64: return combine(reinterpret_cast<int64_t*>(out), reinterpret_cast<const int64_t*>(in), n, op);
    case kU8: return combine(reinterpret_cast<uint8_t*>(out), reinterpret_cast<const uint8_t*>(in), n, op);
    case kU16: return combine(reinterpret_cast<uint16_t*>(out), reinterpret_cast<const uint16_t*>(in), n, op);
    case kU32: return combine(reinterpret_cast<uint32_t*>(out), reinterpret_cast<const uint32_t*>(in), n, op);
    case kU64: return combine(reinterpret_cast<uint64_t*>(out), reinterpret_cast<const uint64_t*>(in), n, op);
    default: return;
  }
}

constexpr int64_t kWidths[kKinds] = {4, 8, 1, 2, 4, 8, 1, 2, 4, 8};

std::string describe(const What& w, const char* text) {
  std::string out = std::to_string(w.nitems) + " " + kKindNames[w.kind] + " (" + kOpNames[w.op];
  if (w.chunk != 0) out += ", part " + std::to_string(w.chunk + 1);
  out += ")";
  if (text[0] != 0) out += std::string(": ") + text;
  return out;
}

// The call as the shared-memory allreduce takes it (kind, op, items of that kind), or false
// where it does not (another communicator, an op or datatype it lacks): then MPI's. Decided
// from the call's attributes alone, so every rank decides the same.
bool eligible(intptr_t comm, intptr_t op, intptr_t dtype, int64_t nitems, What* what) {
  if (!shared.on.load(std::memory_order_acquire) || comm != shared.comm) return false;
  int32_t o = 0;
  while (o < kOps && shared.ops[o] != op) ++o;
  if (o == kOps) return false;
  for (int t = 0; t < shared.ntypes; ++t) {
    if (shared.types[t] != dtype) continue;
    if (shared.factors[t] != 1 && o != kSum) return false;  // complex: a sum only
    *what = What{static_cast<int16_t>(shared.kinds[t]), static_cast<int16_t>(o), 0,
                 nitems * shared.factors[t], 0};
    return true;
  }
  return false;
}

// A call of no element takes part too (one empty chunk), so that it meets the other ranks'
// call at the same point: against a call of some elements it is an error on every rank.
ffi::Error shared_allreduce(const char* in, char* out, What what, std::string_view call) {
  std::lock_guard<std::mutex> hold(shared.lock);
  const int64_t width = kWidths[what.kind];
  const int64_t per_slot = shared.slot_bytes / width;
  what.call = fnv1a(call);
  const size_t shown = call.size() < kTextBytes - 1 ? call.size() : kTextBytes - 1;
  int64_t first = 0;
  do {
    const int64_t count = what.nitems - first < per_slot ? what.nitems - first : per_slot;
    const uint32_t arrival = ++shared.arrivals;
    const int parity = arrival & 1;
    auto slot = [&](uint32_t r) {
      return shared.data + (int64_t{r} * 2 + parity) * shared.slot_bytes;
    };
    auto text = [&](uint32_t r) { return shared.texts + (int64_t{r} * 2 + parity) * kTextBytes; };
    Record& mine = shared.records[shared.rank];
    what.chunk = static_cast<uint32_t>(first / per_slot);
    mine.what[parity] = what;
    std::memcpy(text(shared.rank), call.data(), shown);
    text(shared.rank)[shown] = 0;
    if (count > 0) std::memcpy(slot(shared.rank), in + first * width, count * width);
    publish(arrival);
    await_all(arrival);
    for (uint32_t r = 0; r < shared.ranks; ++r) {
      const What& theirs = shared.records[r].what[parity];
      if (theirs != what) {
        return ffi::Error(
            ffi::ErrorCode::kFailedPrecondition,
            "jaxddp: the ranks called different allreduces at the same point: rank " +
                std::to_string(shared.rank) + " reduces " + describe(what, text(shared.rank)) +
                ", rank " + std::to_string(r) + " reduces " + describe(theirs, text(r)) +
                ". Every rank must run the same collectives, with the same shapes and dtypes, "
                "in the same order");
      }
    }
    if (count > 0) {
      char* to = out + first * width;
      std::memcpy(to, slot(0), count * width);
      for (uint32_t r = 1; r < shared.ranks; ++r) combine(what.kind, what.op, to, slot(r), count);
    }
    first += per_slot;
  } while (first < what.nitems);
  return ffi::Error::Success();
}

ffi::Error allreduce(ffi::AnyBuffer x, ffi::Token, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, int64_t comm, int64_t op, int64_t dtype,
                     int64_t nitems, std::string_view call) {
  if (mpi.iallreduce == nullptr || mpi.test == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jaxddp's native allreduce was called before jaxddp configured it");
  }
  const int64_t width = x.element_count() ? x.size_bytes() / x.element_count() : 1;
  return jaxddp::host_allreduce(static_cast<const char*>(x.untyped_data()),
                                static_cast<char*>(y->untyped_data()), comm, op, dtype, nitems,
                                width, call);
}

}  // namespace

ffi::Error jaxddp::host_allreduce(const char* in, char* out, int64_t comm, int64_t op,
                                  int64_t dtype, int64_t nitems, int64_t width,
                                  std::string_view call) {
  What what;
  if (eligible(static_cast<intptr_t>(comm), static_cast<intptr_t>(op),
               static_cast<intptr_t>(dtype), nitems, &what)) {
    return shared_allreduce(in, out, what, call);
  }
  if (nitems == 0) return ffi::Error::Success();  // through MPI: nothing compared, as MPI's
  constexpr int64_t kChunk = int64_t{1} << 30;  // MPI counts are ints
  for (int64_t first = 0; first < nitems; first += kChunk) {
    const int64_t count = nitems - first < kChunk ? nitems - first : kChunk;
    intptr_t request = 0;
    int rc = mpi.iallreduce(in + first * width, out + first * width, static_cast<int>(count),
                            static_cast<intptr_t>(dtype), static_cast<intptr_t>(op),
                            static_cast<intptr_t>(comm), &request);
    if (rc != 0) return mpi_error("MPI_Iallreduce", rc);
    ffi::Error waited = wait(&request, count * width);
    if (waited.failure()) return waited;
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxddp_allreduce, allreduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("dtype")
                                  .Attr<int64_t>("nitems")
                                  .Attr<std::string_view>("call"));

// The MPI functions the handlers call, from the library mpi4py loaded, by name (native.h's
// JAXDDP_MPI_FUNCTIONS); 0 for a name it does not know.
extern "C" __attribute__((visibility("default"))) int64_t jaxddp_native_configure(
    const char* name, void* function) {
  const std::string_view n(name);
  auto set = [&](auto& slot) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(function);
    return int64_t{1};
  };
#define JAXDDP_MPI_SET(slot, text, type) \
  if (n == text) return set(mpi.slot);
  JAXDDP_MPI_FUNCTIONS(JAXDDP_MPI_SET)
#undef JAXDDP_MPI_SET
  return 0;
}

// The shared-memory allreduce's memory (laid out as above: the header, all zero at first,
// then from `data` the slots), the communicator it serves, its size and this rank, the size
// of a slot, and the datatypes
// and ops it takes: `types[i]` is an MPI datatype of Kind `kinds[i]` (`factors[i]` of them
// an element), `ops` MPI's sum, max and min. It starts off (jaxddp_native_share_on).
extern "C" __attribute__((visibility("default"))) void jaxddp_native_share(
    void* memory, void* data, int64_t comm, int64_t ranks, int64_t rank, int64_t slot_bytes,
    const int64_t* types, const int64_t* kinds, const int64_t* factors, int64_t ntypes,
    const int64_t* ops) {
  auto* base = static_cast<char*>(memory);
  shared.bell = reinterpret_cast<std::atomic<uint32_t>*>(base);
  shared.sleepers = reinterpret_cast<std::atomic<uint32_t>*>(base + 4);
  shared.records = reinterpret_cast<Record*>(base + 64);
  shared.texts = base + 64 + 64 * ranks;
  shared.data = static_cast<char*>(data);
  shared.slot_bytes = slot_bytes;
  shared.comm = static_cast<intptr_t>(comm);
  shared.ranks = static_cast<uint32_t>(ranks);
  shared.rank = static_cast<uint32_t>(rank);
  shared.arrivals = shared.records[rank].arrival.load();
  shared.ntypes = ntypes < kMaxTypes ? static_cast<int>(ntypes) : kMaxTypes;
  for (int t = 0; t < shared.ntypes; ++t) {
    shared.types[t] = static_cast<intptr_t>(types[t]);
    shared.kinds[t] = static_cast<int32_t>(kinds[t]);
    shared.factors[t] = static_cast<int32_t>(factors[t]);
  }
  for (int o = 0; o < kOps; ++o) shared.ops[o] = static_cast<intptr_t>(ops[o]);
}

// What the Python side needs of the layout above, asked of this library so that it is
// defined once: the bytes of the header for `ranks` ranks (rounded up to a page; the slots
// follow), and the Kind of a dtype named as NumPy names it (-1 for none).
extern "C" __attribute__((visibility("default"))) int64_t jaxddp_native_header_bytes(
    int64_t ranks) {
  const int64_t header = 64 + 64 * ranks + 2 * kTextBytes * ranks;
  return (header + 4095) / 4096 * 4096;
}

extern "C" __attribute__((visibility("default"))) int64_t jaxddp_native_kind(const char* name) {
  for (int k = 0; k < kKinds; ++k) {
    if (std::strcmp(kKindNames[k], name) == 0) return k;
  }
  return -1;
}

// Every rank must turn it on or off at the same point, with no allreduce in flight.
extern "C" __attribute__((visibility("default"))) void jaxddp_native_share_on(int64_t on) {
  shared.on.store(on != 0 && shared.bell != nullptr, std::memory_order_release);
}

// How many chunks rank `rank` has put through the shared memory (modulo 2**32).
extern "C" __attribute__((visibility("default"))) int64_t jaxddp_native_shared_arrivals(
    int64_t rank) {
  return shared.records[rank].arrival.load();
}
