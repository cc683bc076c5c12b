/* A stand-in for the CUDA driver (libcuda.so.1), for the test suite on machines without a
 * GPU: the entry points jaxddp calls, on host memory. jaxddp/_base/cuda.py opens it in
 * place of the driver where JAXDDP_TEST_CUDA_DRIVER names it.
 *
 * - The GPUs this process sees: JAXDDP_TEST_GPUS, their PCI bus ids separated by commas
 *   (default: one, "0000:01:00.0").
 * - A copy (cuMemcpyAsync) happens only when its stream is synchronized, reading its source
 *   then, as a GPU may run it any time before: a handler that reads pinned memory before
 *   waiting for the copy into it, or writes memory a copy out of it has not read yet, gets
 *   a wrong result.
 * - Pinned memory (cuMemHostAlloc) is filled with 0xA5 bytes, and a context must be current
 *   (pushed) around every copy and wait.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

enum { kMaxPending = 64, kInvalidValue = 1, kInvalidContext = 201 };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct { uint64_t dst, src; size_t n; } pending[kMaxPending];
static int npending = 0;
static int depth = 0;  /* contexts pushed and not popped */
static int context;    /* the one context: its address */
static long copies = 0, syncs = 0;

static const char* gpus(void) {
  const char* value = getenv("JAXDDP_TEST_GPUS");
  return value && *value ? value : "0000:01:00.0";
}

int cuInit(unsigned flags) { (void)flags; return 0; }

int cuDeviceGetCount(int* count) {
  int n = 1;
  for (const char* c = gpus(); *c; ++c) n += *c == ',';
  *count = n;
  return 0;
}

int cuDeviceGet(int* device, int ordinal) {
  int count;
  cuDeviceGetCount(&count);
  if (ordinal < 0 || ordinal >= count) return kInvalidValue;
  *device = ordinal;
  return 0;
}

int cuDeviceGetPCIBusId(char* name, int len, int device) {
  const char* c = gpus();
  for (int i = 0; i < device; ++i) {
    c = strchr(c, ',');
    if (!c) return kInvalidValue;
    ++c;
  }
  const char* end = strchr(c, ',');
  int n = end ? (int)(end - c) : (int)strlen(c);
  if (n >= len) return kInvalidValue;
  memcpy(name, c, n);
  name[n] = 0;
  return 0;
}

int cuGetErrorName(int code, const char** name) {
  *name = code == kInvalidContext ? "CUDA_ERROR_INVALID_CONTEXT" : "CUDA_ERROR_INVALID_VALUE";
  return 0;
}

int cuStreamGetCtx(void* stream, void** ctx) { (void)stream; *ctx = &context; return 0; }

int cuCtxPushCurrent_v2(void* ctx) {
  if (ctx != &context) return kInvalidContext;
  pthread_mutex_lock(&lock);
  ++depth;
  pthread_mutex_unlock(&lock);
  return 0;
}

int cuCtxPopCurrent_v2(void** ctx) {
  pthread_mutex_lock(&lock);
  int rc = depth > 0 ? 0 : kInvalidContext;
  if (rc == 0) --depth;
  pthread_mutex_unlock(&lock);
  if (ctx) *ctx = &context;
  return rc;
}

int cuMemcpyAsync(uint64_t dst, uint64_t src, size_t n, void* stream) {
  (void)stream;
  pthread_mutex_lock(&lock);
  int rc = depth > 0 && npending < kMaxPending ? 0 : depth > 0 ? kInvalidValue : kInvalidContext;
  if (rc == 0) {
    pending[npending].dst = dst;
    pending[npending].src = src;
    pending[npending].n = n;
    ++npending;
    ++copies;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

int cuStreamSynchronize(void* stream) {
  (void)stream;
  pthread_mutex_lock(&lock);
  int rc = depth > 0 ? 0 : kInvalidContext;
  if (rc == 0) {
    for (int i = 0; i < npending; ++i) {
      memcpy((void*)(uintptr_t)pending[i].dst, (const void*)(uintptr_t)pending[i].src,
             pending[i].n);
    }
    npending = 0;
    ++syncs;
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

int cuMemHostAlloc(void** p, size_t n, unsigned flags) {
  (void)flags;
  *p = malloc(n);
  if (!*p) return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
  memset(*p, 0xA5, n);
  return 0;
}

int cuMemFreeHost(void* p) { free(p); return 0; }

/* For the tests: copies made, waits, copies not yet made, contexts still pushed. */
long jaxddp_standin_copies(void) { return copies; }
long jaxddp_standin_syncs(void) { return syncs; }
int jaxddp_standin_pending(void) { return npending; }
int jaxddp_standin_depth(void) { return depth; }
