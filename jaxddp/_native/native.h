// What jaxddp's two handler sources share: the MPI entry points (taken from the library
// mpi4py loaded, set once by jaxddp_native_configure), the wait for a request, and the
// allreduce of host memory (the shared-memory path or MPI's) that the CPU handler
// (allreduce.cc) and the staged handlers of device buffers (staged.cc) both run.
//
// No MPI header: MPI handles travel as integers wide enough for both ABIs (MPICH's int
// handles, Open MPI's pointers), and an MPI_Request is held in an intptr_t.

#ifndef JAXDDP_NATIVE_H_
#define JAXDDP_NATIVE_H_

#include <cstdint>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jaxddp {

namespace ffi = xla::ffi;

// The MPI functions the handlers call, with every handle as an intptr_t: one line each in
// JAXDDP_MPI_FUNCTIONS (its slot in Mpi, its name, its type), from which the struct below,
// jaxddp_native_configure (allreduce.cc, by name) and the staged handlers' readiness
// (staged.cc: every one set) come. jaxddp/_native/kinds.py names each kind's function.
using MpiIallreduce = int (*)(const void*, void*, int, intptr_t, intptr_t, intptr_t, intptr_t*);
using MpiTest = int (*)(intptr_t*, int*, void*);
using MpiIbcast = int (*)(void*, int, intptr_t, int, intptr_t, intptr_t*);
using MpiIreduce = int (*)(const void*, void*, int, intptr_t, intptr_t, int, intptr_t, intptr_t*);
using MpiMove = int (*)(const void*, int, intptr_t, void*, int, intptr_t, intptr_t, intptr_t*);
#define JAXDDP_MPI_FUNCTIONS(X)                \
  X(iallreduce, "MPI_Iallreduce", MpiIallreduce) \
  X(test, "MPI_Test", MpiTest)                 \
  X(ibcast, "MPI_Ibcast", MpiIbcast)           \
  X(ireduce, "MPI_Ireduce", MpiIreduce)        \
  X(iallgather, "MPI_Iallgather", MpiMove)     \
  X(ialltoall, "MPI_Ialltoall", MpiMove)

struct Mpi {
#define JAXDDP_MPI_SLOT(slot, name, type) type slot = nullptr;
  JAXDDP_MPI_FUNCTIONS(JAXDDP_MPI_SLOT)
#undef JAXDDP_MPI_SLOT
};
extern Mpi mpi;

ffi::Error mpi_error(const char* what, int code);

// Waits for one request of `bytes` per rank: polls while it is young, then naps, briefly
// where the message is large (allreduce.cc says why).
ffi::Error wait(intptr_t* request, int64_t bytes = 0);

// The allreduce of `nitems` elements of MPI datatype `dtype` from host memory `in` into
// host memory `out`: in memory the node's ranks share where the call is eligible (the
// communicator, op and datatype the shared path serves), else MPI_Iallreduce and wait.
// `call` describes the call as its caller made it (compared across ranks on the shared path).
ffi::Error host_allreduce(const char* in, char* out, int64_t comm, int64_t op, int64_t dtype,
                          int64_t nitems, int64_t width, std::string_view call);

}  // namespace jaxddp

#endif  // JAXDDP_NATIVE_H_
