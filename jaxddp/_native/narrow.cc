// jaxddp's XLA FFI handler for the narrow allreduce of gradient compression
// (allreduce_gradients(compression="bf16" or "fp16")) on CPU: float32 leaves travel as
// bfloat16 or float16, and what the two roundings lose comes back as this rank's error.
//
// The arithmetic is that of the composition jaxddp runs elsewhere
// (jaxddp/_collectives/_jax/narrow.py), on the leaves seen as one vector (their
// concatenation, plus this rank's residual with error feedback): the vector, cut into `size`
// blocks, block r owned by rank r; every rank rounds its vector to the narrow dtype (a finite
// value beyond its range saturates) and sends block r to rank r (an alltoall of the narrow
// bits); rank r adds the blocks it got in float32, in rank order, multiplies by 1/size for
// a mean, rounds the result once and sends it to every rank (an allgather of the narrow bits).
// The error: the vector minus its rounding, plus on the owner's block what the second
// rounding lost (times `size` for a mean); an error that is not finite is 0 (an infinity or a
// NaN is the step's result, not a debt to carry).
//
// What differs is the schedule: the blocks go in chunks of about kChunkBytes, and while
// chunk j's alltoall and chunk j - 1's allgather move, this thread rounds chunk j + 1, sums
// chunk j - 1 and widens chunk j - 2, polling MPI between pieces of that work; and it reads
// and writes the leaves where XLA keeps them (no concatenation, no slicing back). Where the
// link is slow the arithmetic is off the critical path. The nonblocking collectives are
// posted in one order on every rank (alltoall j, then allgather j - 1), whatever finishes
// first.
//
// The call: the leaves (float32), then with feedback the residual (their total length), then
// the token; it returns the reduced leaves, then with feedback the error, then the token.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "native.h"

namespace {

using jaxddp::mpi;
using jaxddp::mpi_error;
namespace ffi = xla::ffi;

#ifndef JAXDDP_NARROW_CHUNK_BYTES
#define JAXDDP_NARROW_CHUNK_BYTES 1048576
#endif
constexpr int64_t kChunkBytes = JAXDDP_NARROW_CHUNK_BYTES;  // narrow bytes per chunk, all ranks
constexpr int64_t kPokeElements = 32768;  // arithmetic between two polls of MPI

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// bfloat16: the upper half of a float32, rounded to nearest, ties to even; a NaN stays one.
inline uint16_t to_bf16(float x) {
  uint32_t b = bits_of(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

inline float from_bf16(uint16_t h) { return float_of(uint32_t{h} << 16); }

// float16, rounded to nearest, ties to even (a finite value here is within its range: the
// caller saturates first).
inline uint16_t to_fp16(float x) {
  const uint32_t b = bits_of(x);
  const auto sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN, inf
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and beyond round to inf
  if (a < 0x38800000u) {  // below 2**-14: a subnormal float16 (or the smallest normal)
    const float scaled = float_of(a) * 16777216.0f;  // in units of 2**-24, exact
    volatile float shifted = scaled + 8388608.0f;  // rounds to an integer, ties to even
    return sign | static_cast<uint16_t>(shifted - 8388608.0f);
  }
  const uint32_t rounded = a + 0xfffu + ((a >> 13) & 1u) - (112u << 23);  // exponent 127 -> 15
  return sign | static_cast<uint16_t>(rounded >> 13);
}

inline float from_fp16(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) return float_of(sign | bits_of(static_cast<float>(m) * 5.9604644775390625e-8f));
  if (e == 31) return float_of(sign | 0x7f800000u | (m << 13));
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

// The two narrow dtypes, as template arguments: their conversions inline into the loops.
struct Bf16 {
  static constexpr float kLargest = 3.38953139e38f;
  static uint16_t to(float x) { return to_bf16(x); }
  static float from(uint16_t h) { return from_bf16(h); }
};
struct Fp16 {
  static constexpr float kLargest = 65504.0f;
  static uint16_t to(float x) { return to_fp16(x); }
  static float from(uint16_t h) { return from_fp16(h); }
};

// `x` in the narrow dtype N: a finite value beyond its range saturates to its largest, an
// infinity or a NaN stays what it is.
template <class N>
inline uint16_t round_to(float x) {
  const float a = std::fabs(x);
  if (a > N::kLargest && a != std::numeric_limits<float>::infinity()) {
    x = std::copysign(N::kLargest, x);
  }
  return N::to(x);
}

inline float finite_or_zero(float x) { return std::isfinite(x) ? x : 0.0f; }

// The leaves as one vector: where each starts in it, and their buffers.
struct Leaves {
  std::vector<int64_t> starts;  // starts[i]: where leaf i starts; the last: the total
  std::vector<const float*> in;
  std::vector<float*> out;

  // f(x, y, v, k) over the pieces of [first, first + n) of the vector, one per leaf it
  // crosses: x and y that leaf's input and output from the piece's start, v where the piece
  // starts in the vector, k its length.
  template <class F>
  void each(int64_t first, int64_t n, F f) const {
    const int64_t stop = first + n;
    size_t i = 0, hi = in.size();
    while (i + 1 < hi) {  // the leaf holding `first`: the last start at or before it
      const size_t mid = (i + hi) / 2;
      if (starts[mid] <= first) i = mid; else hi = mid;
    }
    for (; i < in.size() && starts[i] < stop; ++i) {
      const int64_t a = first > starts[i] ? first : starts[i];
      const int64_t b = stop < starts[i + 1] ? stop : starts[i + 1];
      if (a < b) f(in[i] + (a - starts[i]), out[i] + (a - starts[i]), a, b - a);
    }
  }
};

// One call, for the narrow dtype N.
template <class N>
struct Call {
  Leaves leaves;
  const float* residual = nullptr;  // with feedback, else null
  float* err = nullptr;             // with feedback, else null
  int64_t nitems = 0, size = 1, rank = 0, block = 0, chunk = 0, chunks = 0;
  intptr_t comm = 0, wire = 0;
  bool mean = false;
  std::vector<uint16_t> send, recv, mine, all;  // two slots each, chunk j in slot j % 2
  intptr_t requests[4] = {};  // the alltoall and allgather of the chunks in flight
  bool pending[4] = {};

  int64_t length(int64_t j) const {  // elements of chunk j per rank
    const int64_t first = j * chunk;
    return block - first < chunk ? block - first : chunk;
  }

  int64_t real(int64_t first, int64_t n) const {  // of n elements from `first`, those < nitems
    const int64_t left = nitems - first;
    return left <= 0 ? 0 : (left < n ? left : n);
  }

  // Polls every request in flight once, so that MPI moves what it can (over TCP each test
  // pushes what the sockets take).
  ffi::Error poke() {
    alignas(16) char status[256];
    for (int i = 0; i < 4; ++i) {
      if (!pending[i]) continue;
      int done = 0;
      if (int rc = mpi.test(&requests[i], &done, status); rc != 0) return mpi_error("MPI_Test", rc);
      if (done) pending[i] = false;
    }
    return ffi::Error::Success();
  }

  // f(a, b) over [first, stop) in pieces of kPokeElements, polling MPI after each.
  template <class F>
  ffi::Error in_pieces(int64_t first, int64_t stop, F f) {
    for (int64_t a = first; a < stop; a += kPokeElements) {
      f(a, a + kPokeElements < stop ? a + kPokeElements : stop);
      if (ffi::Error failed = poke(); failed.failure()) return failed;
    }
    return ffi::Error::Success();
  }

  ffi::Error finish(int slot) {  // waits for request `slot` (an earlier poke may have)
    if (!pending[slot]) return ffi::Error::Success();
    // short naps whatever the chunk's size: over TCP the pipeline moves only while it polls
    ffi::Error waited = jaxddp::wait(&requests[slot], std::numeric_limits<int64_t>::max());
    if (waited.success()) pending[slot] = false;  // else it may still be in flight
    return waited;
  }

  // Rounds chunk j of every block into its send slot (row d for rank d) and writes the
  // first rounding's error (this rank's own block's is completed in reduce); then posts
  // the chunk's alltoall.
  ffi::Error scatter(int64_t j) {
    const int64_t n = length(j);
    uint16_t* rows = send.data() + (j % 2) * size * chunk;
    for (int64_t d = 0; d < size; ++d) {
      const int64_t first = d * block + j * chunk;
      const int64_t valid = real(first, n);
      uint16_t* row = rows + d * n;
      const bool own = d == rank;
      ffi::Error rounded = in_pieces(first, first + valid, [&](int64_t a, int64_t b) {
        leaves.each(a, b - a, [&](const float* x, float*, int64_t v, int64_t k) {
          uint16_t* h = row + (v - first);
          if (residual == nullptr) {
            for (int64_t i = 0; i < k; ++i) h[i] = round_to<N>(x[i]);
            return;
          }
          const float* r = residual + v;
          float* e = err + v;
          for (int64_t i = 0; i < k; ++i) {
            const float value = x[i] + r[i];
            h[i] = round_to<N>(value);
            const float lost = value - N::from(h[i]);
            e[i] = own ? lost : finite_or_zero(lost);
          }
        });
      });
      if (rounded.failure()) return rounded;
      for (int64_t i = valid; i < n; ++i) row[i] = 0;  // past the vector's end
    }
    uint16_t* got = recv.data() + (j % 2) * size * chunk;
    const int slot = static_cast<int>(j % 2);
    int rc = mpi.ialltoall(rows, static_cast<int>(n), wire, got, static_cast<int>(n), wire, comm,
                           &requests[slot]);
    if (rc != 0) return mpi_error("MPI_Ialltoall", rc);
    pending[slot] = true;
    return ffi::Error::Success();
  }

  // Adds the blocks of chunk j that every rank sent here, in rank order, rounds the sum
  // once, adds what that lost to this rank's error; then posts the chunk's allgather.
  ffi::Error reduce(int64_t j) {
    if (ffi::Error failed = finish(static_cast<int>(j % 2)); failed.failure()) return failed;
    const int64_t n = length(j);
    const uint16_t* got = recv.data() + (j % 2) * size * chunk;
    uint16_t* sum = mine.data() + (j % 2) * chunk;
    const float scale = mean ? static_cast<float>(size) : 1.0f;
    const float inverse = 1.0f / static_cast<float>(size);  // a mean: times 1/size (narrow.py)
    const int64_t first = rank * block + j * chunk;
    const int64_t valid = err == nullptr ? 0 : real(first, n);
    float* e = err == nullptr ? nullptr : err + first;
    ffi::Error summed = in_pieces(0, n, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) {
        float total = N::from(got[i]);
        for (int64_t d = 1; d < size; ++d) total = total + N::from(got[d * n + i]);
        if (mean) total = total * inverse;
        const uint16_t h = round_to<N>(total);
        sum[i] = h;
        if (i < valid) e[i] = finite_or_zero(e[i] + (total - N::from(h)) * scale);
      }
    });
    if (summed.failure()) return summed;
    uint16_t* every = all.data() + (j % 2) * size * chunk;
    const int slot = 2 + static_cast<int>(j % 2);
    int rc = mpi.iallgather(sum, static_cast<int>(n), wire, every, static_cast<int>(n), wire,
                            comm, &requests[slot]);
    if (rc != 0) return mpi_error("MPI_Iallgather", rc);
    pending[slot] = true;
    return ffi::Error::Success();
  }

  // Widens every rank's reduced chunk j into the leaves' results.
  ffi::Error gather(int64_t j) {
    if (ffi::Error failed = finish(2 + static_cast<int>(j % 2)); failed.failure()) return failed;
    const int64_t n = length(j);
    const uint16_t* every = all.data() + (j % 2) * size * chunk;
    for (int64_t d = 0; d < size; ++d) {
      const int64_t first = d * block + j * chunk;
      const int64_t valid = real(first, n);
      const uint16_t* row = every + d * n;
      ffi::Error widened = in_pieces(first, first + valid, [&](int64_t a, int64_t b) {
        leaves.each(a, b - a, [&](const float*, float* y, int64_t v, int64_t k) {
          const uint16_t* h = row + (v - first);
          for (int64_t i = 0; i < k; ++i) y[i] = N::from(h[i]);
        });
      });
      if (widened.failure()) return widened;
    }
    return ffi::Error::Success();
  }

  ffi::Error run() {
    // step s: round and post chunk s, sum and post chunk s - 1, widen chunk s - 2
    for (int64_t s = 0; s < chunks + 2; ++s) {
      if (s < chunks) {
        if (ffi::Error failed = scatter(s); failed.failure()) return failed;
      }
      if (s >= 1 && s - 1 < chunks) {
        if (ffi::Error failed = reduce(s - 1); failed.failure()) return failed;
      }
      if (s >= 2) {
        if (ffi::Error failed = gather(s - 2); failed.failure()) return failed;
      }
    }
    return ffi::Error::Success();
  }

  ffi::Error operator()() {
    block = (nitems + size - 1) / size;
    chunk = kChunkBytes / 2 / size;  // elements of a chunk per rank
    chunk = chunk < 4096 ? 4096 : chunk;
    chunk = chunk < block ? chunk : block;
    chunks = (block + chunk - 1) / chunk;
    send.resize(2 * size * chunk);
    recv.resize(2 * size * chunk);
    mine.resize(2 * chunk);
    all.resize(2 * size * chunk);
    ffi::Error result = run();
    if (result.failure()) {  // leave nothing in flight that would write into freed memory
      for (int i = 0; i < 4; ++i) {
        if (pending[i]) (void)jaxddp::wait(&requests[i]);
      }
    }
    return result;
  }
};

ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxddp_narrow_allreduce: " + what);
}

template <class N>
ffi::Error narrow_allreduce(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm,
                            int64_t wire, int64_t mean, int64_t rank, int64_t size,
                            int64_t feedback) {
  // the buffers but the token (the last argument and the last result)
  if (args.size() != rets.size() || args.size() < 1 + (feedback != 0)) {
    return invalid("expected as many results as arguments, the token last");
  }
  const size_t count = args.size() - 1 - (feedback != 0);  // the leaves
  Call<N> call;
  call.leaves.starts.push_back(0);
  for (size_t i = 0; i < count; ++i) {
    auto x = args.get<ffi::Buffer<ffi::F32>>(i);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (x.has_error() || y.has_error()) return invalid("a leaf that is not float32");
    const auto n = static_cast<int64_t>(x.value().element_count());
    if (static_cast<int64_t>((*y)->element_count()) != n) return invalid("a result's shape");
    call.leaves.in.push_back(x.value().typed_data());
    call.leaves.out.push_back((*y)->typed_data());
    call.leaves.starts.push_back(call.leaves.starts.back() + n);
  }
  call.nitems = call.leaves.starts.back();
  if (feedback != 0) {
    auto r = args.get<ffi::Buffer<ffi::F32>>(count);
    auto e = rets.get<ffi::Buffer<ffi::F32>>(count);
    if (r.has_error() || e.has_error() ||
        static_cast<int64_t>(r.value().element_count()) != call.nitems ||
        static_cast<int64_t>((*e)->element_count()) != call.nitems) {
      return invalid("the residual and the error must be float32 of the leaves' length");
    }
    call.residual = r.value().typed_data();
    call.err = (*e)->typed_data();
  }
  if (size < 1 || rank < 0 || rank >= size) return invalid("a rank outside the world's size");
  if (call.nitems == 0) return ffi::Error::Success();
  call.size = size;
  call.rank = rank;
  call.comm = static_cast<intptr_t>(comm);
  call.wire = static_cast<intptr_t>(wire);
  call.mean = mean != 0;
  return call();
}

ffi::Error narrow_allreduce_any(ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm,
                                int64_t wire, int64_t narrow, int64_t mean, int64_t rank,
                                int64_t size, int64_t feedback) {
  if (narrow == 0) return narrow_allreduce<Bf16>(args, rets, comm, wire, mean, rank, size, feedback);
  if (narrow == 1) return narrow_allreduce<Fp16>(args, rets, comm, wire, mean, rank, size, feedback);
  return invalid("narrow must be 0 (bfloat16) or 1 (float16), got " + std::to_string(narrow));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxddp_narrow_allreduce, narrow_allreduce_any,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("wire")
                                  .Attr<int64_t>("narrow")
                                  .Attr<int64_t>("mean")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("size")
                                  .Attr<int64_t>("feedback"));
