/*
 * A stand-in for the CUDA driver library (libcuda.so), for tests on machines without
 * a GPU. It exports the driver calls mooncake-rs loads, with the driver's rules that
 * matter to a caller:
 *
 *  - "device memory" (cuMemAlloc_v2) is an address range reserved PROT_NONE in the
 *    process, so any CPU access to it crashes, exactly as on a GPU whose memory the CPU
 *    cannot reach; the bytes live in a memfd mapped elsewhere (the shadow);
 *  - cuInit must come first; copies, streams and IPC need a current context (set, or
 *    pushed and popped: a caller's own current context must survive our calls);
 *  - copies on a stream other than the default one run only at cuStreamSynchronize
 *    (or cuStreamDestroy), so a caller that reads before synchronizing sees stale bytes;
 *  - an IPC handle names the allocation's memfd (pid and fd), opened by another process
 *    through /proc/<pid>/fd; opening the same handle twice in one process, or in the
 *    exporting process, fails; closing needs the opened pointer;
 *  - pinned host ranges (cuMemHostRegister_v2) may not overlap and must be unregistered
 *    by their start address.
 *
 * Every call can be made to fail with CUDA_ERROR_UNKNOWN: name it in the environment
 * variable FAKE_CUDA_FAIL (comma separated) or with fake_cuda_fail(). Counters for
 * tests: fake_cuda_open_ipc_handles(), fake_cuda_pinned_bytes(), fake_cuda_allocations().
 *
 * Built by the tests with: cc -shared -fPIC -Wl,-soname,libcuda.so -o libcuda.so
 * (the soname makes a later dlopen("libcuda.so") find this library once it is loaded).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_ALREADY_MAPPED = 208,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
  CUDA_ERROR_UNKNOWN = 999,
};

#define DEVICES 2
#define MAX_ALLOCS 1024
#define MAX_PINNED 256
#define MAX_OPS 4096
#define MAGIC "FAKECUDA"

struct alloc {
  int used;
  int device;
  int ipc; /* opened from another process's handle */
  int fd;
  CUdeviceptr base;
  size_t size;
  unsigned char *shadow;
  pid_t owner_pid; /* for handles opened here: the exporter */
  int owner_fd;
};

struct handle {
  char magic[8];
  int32_t pid;
  int32_t fd;
  uint64_t size;
  int32_t device;
};

struct op {
  unsigned char *dst;
  const unsigned char *src;
  size_t len;
};

struct stream {
  int device;
  size_t count;
  struct op ops[MAX_OPS];
};

struct pinned {
  unsigned char *start;
  size_t size;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static struct alloc allocs[MAX_ALLOCS];
static struct pinned pinned[MAX_PINNED];
static int contexts[DEVICES]; /* the primary context of device i is &contexts[i] */
static __thread int *current;
static char fail_list[1024];

static int fails(const char *name) {
  const char *list = fail_list[0] ? fail_list : getenv("FAKE_CUDA_FAIL");
  if (!list) return 0;
  size_t n = strlen(name);
  for (const char *p = list; (p = strstr(p, name)) != NULL; p += n) {
    int starts = p == list || p[-1] == ',';
    int ends = p[n] == '\0' || p[n] == ',';
    if (starts && ends) return 1;
  }
  return 0;
}

#define ENTER(name)                                                \
  do {                                                             \
    if (fails(name)) return CUDA_ERROR_UNKNOWN;                    \
  } while (0)
#define NEED_INIT()                                                \
  do {                                                             \
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;           \
  } while (0)
#define NEED_CONTEXT()                                             \
  do {                                                             \
    NEED_INIT();                                                   \
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;               \
  } while (0)

/* The allocation holding [ptr, ptr+len), or NULL. Caller holds the lock. */
static struct alloc *find(CUdeviceptr ptr, size_t len) {
  for (int i = 0; i < MAX_ALLOCS; i++) {
    struct alloc *a = &allocs[i];
    if (a->used && ptr >= a->base && ptr - a->base <= a->size && len <= a->size - (ptr - a->base))
      return a;
  }
  return NULL;
}

static struct alloc *slot(void) {
  for (int i = 0; i < MAX_ALLOCS; i++)
    if (!allocs[i].used) return &allocs[i];
  return NULL;
}

/* Maps `fd` as a new allocation: a PROT_NONE reservation plus the shadow. */
static CUresult map_alloc(struct alloc *a, int fd, size_t size, int device) {
  void *base = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return CUDA_ERROR_UNKNOWN;
  void *shadow = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (shadow == MAP_FAILED) {
    munmap(base, size);
    return CUDA_ERROR_UNKNOWN;
  }
  memset(a, 0, sizeof *a);
  a->used = 1;
  a->device = device;
  a->fd = fd;
  a->base = (CUdeviceptr)(uintptr_t)base;
  a->size = size;
  a->shadow = shadow;
  return CUDA_SUCCESS;
}

static void unmap_alloc(struct alloc *a) {
  munmap((void *)(uintptr_t)a->base, a->size);
  munmap(a->shadow, a->size);
  close(a->fd);
  a->used = 0;
}

CUresult cuInit(unsigned int flags) {
  ENTER("cuInit");
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  initialized = 1;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  ENTER("cuDeviceGetCount");
  NEED_INIT();
  *count = DEVICES;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  ENTER("cuDeviceGet");
  NEED_INIT();
  if (ordinal < 0 || ordinal >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice device) {
  ENTER("cuDevicePrimaryCtxRetain");
  NEED_INIT();
  if (device < 0 || device >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  *ctx = &contexts[device];
  return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(void *ctx) {
  ENTER("cuCtxSetCurrent");
  NEED_INIT();
  if (ctx != NULL && (ctx < (void *)&contexts[0] || ctx > (void *)&contexts[DEVICES - 1]))
    return CUDA_ERROR_INVALID_CONTEXT;
  current = ctx;
  return CUDA_SUCCESS;
}

static int current_device(void) { return (int)(current - contexts); }

#define STACK 16
static __thread int *stack[STACK];
static __thread int depth;

CUresult cuCtxPushCurrent_v2(void *ctx) {
  ENTER("cuCtxPushCurrent_v2");
  NEED_INIT();
  if (ctx < (void *)&contexts[0] || ctx > (void *)&contexts[DEVICES - 1]) return CUDA_ERROR_INVALID_CONTEXT;
  if (depth == STACK) return CUDA_ERROR_UNKNOWN;
  stack[depth++] = current;
  current = ctx;
  return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(void **ctx) {
  ENTER("cuCtxPopCurrent_v2");
  NEED_INIT();
  if (depth == 0 || !current) return CUDA_ERROR_INVALID_CONTEXT;
  if (ctx) *ctx = current;
  current = stack[--depth];
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
  switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_ALREADY_MAPPED: *name = "CUDA_ERROR_ALREADY_MAPPED"; break;
    case CUDA_ERROR_INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_UNKNOWN: *name = "CUDA_ERROR_UNKNOWN"; break;
    default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
  ENTER("cuMemAlloc_v2");
  NEED_CONTEXT();
  if (size == 0) return CUDA_ERROR_INVALID_VALUE;
  int fd = memfd_create("fake_cuda", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_UNKNOWN;
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    return CUDA_ERROR_UNKNOWN;
  }
  pthread_mutex_lock(&lock);
  struct alloc *a = slot();
  CUresult r = a ? map_alloc(a, fd, size, current_device()) : CUDA_ERROR_UNKNOWN;
  if (r == CUDA_SUCCESS) *ptr = a->base;
  else close(fd);
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
  ENTER("cuMemFree_v2");
  NEED_CONTEXT();
  pthread_mutex_lock(&lock);
  struct alloc *a = find(ptr, 0);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  if (a && a->base == ptr && !a->ipc) {
    unmap_alloc(a);
    r = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

/* CU_POINTER_ATTRIBUTE_*: CONTEXT 1, MEMORY_TYPE 2, DEVICE_ORDINAL 9, RANGE_START_ADDR 11,
 * RANGE_SIZE 12. CU_MEMORYTYPE_HOST 1, CU_MEMORYTYPE_DEVICE 2. */
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  ENTER("cuPointerGetAttribute");
  NEED_INIT();
  pthread_mutex_lock(&lock);
  struct alloc *a = find(ptr, 1);
  struct alloc found = a ? *a : (struct alloc){0};
  int host = 0;
  for (int i = 0; !a && i < MAX_PINNED; i++) {
    unsigned char *p = (unsigned char *)(uintptr_t)ptr;
    if (pinned[i].start && p >= pinned[i].start && p < pinned[i].start + pinned[i].size) host = 1;
  }
  pthread_mutex_unlock(&lock);
  if (!a && !host) return CUDA_ERROR_INVALID_VALUE;
  switch (attribute) {
    case 1: *(void **)data = a ? (void *)&contexts[found.device] : NULL; return CUDA_SUCCESS;
    case 2: *(unsigned int *)data = a ? 2 : 1; return CUDA_SUCCESS;
    case 9: *(int *)data = a ? found.device : 0; return CUDA_SUCCESS;
    case 11: *(CUdeviceptr *)data = found.base; return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    case 12: *(size_t *)data = found.size; return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    default: return CUDA_ERROR_INVALID_VALUE;
  }
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
  ENTER("cuMemGetAddressRange_v2");
  NEED_CONTEXT();
  pthread_mutex_lock(&lock);
  struct alloc *a = find(ptr, 1);
  if (a) {
    if (base) *base = a->base;
    if (size) *size = a->size;
  }
  pthread_mutex_unlock(&lock);
  return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuStreamCreate(void **stream, unsigned int flags) {
  ENTER("cuStreamCreate");
  NEED_CONTEXT();
  (void)flags;
  struct stream *s = calloc(1, sizeof *s);
  if (!s) return CUDA_ERROR_UNKNOWN;
  s->device = current_device();
  *stream = s;
  return CUDA_SUCCESS;
}

static void run(struct stream *s) {
  for (size_t i = 0; i < s->count; i++) memcpy(s->ops[i].dst, s->ops[i].src, s->ops[i].len);
  s->count = 0;
}

CUresult cuStreamSynchronize(void *stream) {
  ENTER("cuStreamSynchronize");
  NEED_CONTEXT();
  if (stream) {
    pthread_mutex_lock(&lock);
    run(stream);
    pthread_mutex_unlock(&lock);
  }
  return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(void *stream) {
  ENTER("cuStreamDestroy_v2");
  NEED_CONTEXT();
  if (!stream) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&lock);
  run(stream);
  pthread_mutex_unlock(&lock);
  free(stream);
  return CUDA_SUCCESS;
}

/* Queues (or, on the default stream, runs) a copy. Caller holds the lock. */
static CUresult enqueue(struct stream *s, unsigned char *dst, const unsigned char *src, size_t len) {
  if (!s) {
    memcpy(dst, src, len);
    return CUDA_SUCCESS;
  }
  if (s->count == MAX_OPS) run(s);
  s->ops[s->count++] = (struct op){dst, src, len};
  return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t len, void *stream) {
  ENTER("cuMemcpyDtoHAsync_v2");
  NEED_CONTEXT();
  pthread_mutex_lock(&lock);
  struct alloc *a = find(src, len);
  CUresult r = a ? enqueue(stream, dst, a->shadow + (src - a->base), len) : CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, void *stream) {
  ENTER("cuMemcpyHtoDAsync_v2");
  NEED_CONTEXT();
  pthread_mutex_lock(&lock);
  struct alloc *a = find(dst, len);
  CUresult r = a ? enqueue(stream, a->shadow + (dst - a->base), src, len) : CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len) {
  ENTER("cuMemcpyDtoH_v2");
  return cuMemcpyDtoHAsync_v2(dst, src, len, NULL);
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t len) {
  ENTER("cuMemcpyHtoD_v2");
  return cuMemcpyHtoDAsync_v2(dst, src, len, NULL);
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *out, CUdeviceptr ptr) {
  ENTER("cuIpcGetMemHandle");
  NEED_CONTEXT();
  pthread_mutex_lock(&lock);
  struct alloc *a = find(ptr, 0);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  if (a && a->base == ptr && !a->ipc) {
    struct handle h = {.pid = getpid(), .fd = a->fd, .size = a->size, .device = a->device};
    memcpy(h.magic, MAGIC, 8);
    memset(out, 0, sizeof *out);
    memcpy(out->reserved, &h, sizeof h);
    r = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *ptr, CUipcMemHandle in, unsigned int flags) {
  ENTER("cuIpcOpenMemHandle_v2");
  NEED_CONTEXT();
  (void)flags;
  struct handle h;
  memcpy(&h, in.reserved, sizeof h);
  if (memcmp(h.magic, MAGIC, 8) != 0 || h.size == 0) return CUDA_ERROR_INVALID_HANDLE;
  if (h.pid == getpid()) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_ALLOCS; i++) {
    if (allocs[i].used && allocs[i].ipc && allocs[i].owner_pid == h.pid && allocs[i].owner_fd == h.fd) {
      pthread_mutex_unlock(&lock);
      return CUDA_ERROR_ALREADY_MAPPED;
    }
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  struct alloc *a = slot();
  CUresult r = CUDA_ERROR_INVALID_HANDLE;
  if (fd >= 0 && a) {
    r = map_alloc(a, fd, h.size, h.device);
    if (r == CUDA_SUCCESS) {
      a->ipc = 1;
      a->owner_pid = h.pid;
      a->owner_fd = h.fd;
      *ptr = a->base;
    }
  }
  if (r != CUDA_SUCCESS && fd >= 0) close(fd);
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr ptr) {
  ENTER("cuIpcCloseMemHandle");
  NEED_CONTEXT();
  pthread_mutex_lock(&lock);
  struct alloc *a = find(ptr, 0);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  if (a && a->base == ptr && a->ipc) {
    unmap_alloc(a);
    r = CUDA_SUCCESS;
  }
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags) {
  ENTER("cuMemHostRegister_v2");
  NEED_CONTEXT();
  (void)flags;
  unsigned char *start = p;
  if (!p || size == 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_mutex_lock(&lock);
  struct pinned *free_slot = NULL;
  CUresult r = CUDA_SUCCESS;
  for (int i = 0; i < MAX_PINNED; i++) {
    struct pinned *q = &pinned[i];
    if (!q->start) {
      if (!free_slot) free_slot = q;
    } else if (start < q->start + q->size && q->start < start + size) {
      r = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
  }
  if (r == CUDA_SUCCESS && !free_slot) r = CUDA_ERROR_UNKNOWN;
  if (r == CUDA_SUCCESS) *free_slot = (struct pinned){start, size};
  pthread_mutex_unlock(&lock);
  return r;
}

CUresult cuMemHostUnregister(void *p) {
  ENTER("cuMemHostUnregister");
  NEED_CONTEXT();
  pthread_mutex_lock(&lock);
  CUresult r = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
  for (int i = 0; i < MAX_PINNED; i++) {
    if (pinned[i].start && pinned[i].start == p) {
      pinned[i] = (struct pinned){0};
      r = CUDA_SUCCESS;
    }
  }
  pthread_mutex_unlock(&lock);
  return r;
}

/* Test hooks. */

/* Makes the calls named in `names` (comma separated; "" for none) fail from now on. */
void fake_cuda_fail(const char *names) {
  snprintf(fail_list, sizeof fail_list, "%s", names ? names : "");
}

/* Handles opened with cuIpcOpenMemHandle_v2 and not closed yet, in this process. */
int fake_cuda_open_ipc_handles(void) {
  int n = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_ALLOCS; i++) n += allocs[i].used && allocs[i].ipc;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Device allocations made with cuMemAlloc_v2 and not freed, in this process. */
int fake_cuda_allocations(void) {
  int n = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_ALLOCS; i++) n += allocs[i].used && !allocs[i].ipc;
  pthread_mutex_unlock(&lock);
  return n;
}

/* Bytes of host memory registered (pinned) and not unregistered, in this process. */
unsigned long long fake_cuda_pinned_bytes(void) {
  unsigned long long n = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < MAX_PINNED; i++) n += pinned[i].size;
  pthread_mutex_unlock(&lock);
  return n;
}
