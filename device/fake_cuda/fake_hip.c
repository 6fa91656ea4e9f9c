/*
 * The HIP runtime calls (libamdhip64.so) mooncake-rs loads, over the stand-in CUDA
 * driver: this file is appended to fake_cuda.c and built as its own library, so the
 * same rules hold (device memory the CPU cannot touch, copies that run only when their
 * stream is synchronized, IPC handles between processes, pinned ranges).
 *
 * What differs is HIP's: no contexts, a current device per thread (hipSetDevice;
 * device 0 until set) that every call uses; hipGetErrorName answers the name itself;
 * device pointers are void *. Error numbers are CUDA's, as in HIP (hipSuccess 0,
 * hipErrorInvalidValue 1, ...). Every call can be made to fail by its hip name
 * (FAKE_CUDA_FAIL or fake_cuda_fail()).
 *
 * Built by the tests with: cc -shared -fPIC -Wl,-soname,libamdhip64.so
 */
typedef int hipError_t;
typedef struct { char reserved[64]; } hipIpcMemHandle_t;

static __thread int hip_device;

/* Fails on request, then makes the thread's HIP device current for the calls below. */
#define HIP_ENTER(name)                                            \
  do {                                                             \
    if (fails(name)) return CUDA_ERROR_UNKNOWN;                    \
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;           \
    current = &contexts[hip_device];                               \
  } while (0)

#define DPTR(p) ((CUdeviceptr)(uintptr_t)(p))

hipError_t hipInit(unsigned int flags) {
  ENTER("hipInit");
  return cuInit(flags);
}

hipError_t hipGetDeviceCount(int *count) {
  ENTER("hipGetDeviceCount");
  return cuDeviceGetCount(count);
}

hipError_t hipGetDevice(int *device) {
  HIP_ENTER("hipGetDevice");
  *device = hip_device;
  return CUDA_SUCCESS;
}

hipError_t hipSetDevice(int device) {
  HIP_ENTER("hipSetDevice");
  if (device < 0 || device >= DEVICES) return CUDA_ERROR_INVALID_DEVICE;
  hip_device = device;
  return CUDA_SUCCESS;
}

const char *hipGetErrorName(hipError_t error) {
  switch (error) {
    case CUDA_SUCCESS: return "hipSuccess";
    case CUDA_ERROR_INVALID_VALUE: return "hipErrorInvalidValue";
    case CUDA_ERROR_NOT_INITIALIZED: return "hipErrorNotInitialized";
    case CUDA_ERROR_INVALID_DEVICE: return "hipErrorInvalidDevice";
    case CUDA_ERROR_INVALID_CONTEXT: return "hipErrorInvalidContext";
    case CUDA_ERROR_ALREADY_MAPPED: return "hipErrorAlreadyMapped";
    case CUDA_ERROR_INVALID_HANDLE: return "hipErrorInvalidHandle";
    case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: return "hipErrorHostMemoryAlreadyRegistered";
    case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: return "hipErrorHostMemoryNotRegistered";
    default: return "hipErrorUnknown";
  }
}

hipError_t hipMalloc(void **ptr, size_t size) {
  HIP_ENTER("hipMalloc");
  CUdeviceptr p = 0;
  hipError_t r = cuMemAlloc_v2(&p, size);
  if (r == CUDA_SUCCESS) *ptr = (void *)(uintptr_t)p;
  return r;
}

hipError_t hipFree(void *ptr) {
  HIP_ENTER("hipFree");
  return cuMemFree_v2(DPTR(ptr));
}

hipError_t hipStreamCreateWithFlags(void **stream, unsigned int flags) {
  HIP_ENTER("hipStreamCreateWithFlags");
  return cuStreamCreate(stream, flags);
}

hipError_t hipStreamSynchronize(void *stream) {
  HIP_ENTER("hipStreamSynchronize");
  return cuStreamSynchronize(stream);
}

hipError_t hipStreamDestroy(void *stream) {
  HIP_ENTER("hipStreamDestroy");
  return cuStreamDestroy_v2(stream);
}

hipError_t hipMemcpyDtoHAsync(void *dst, void *src, size_t len, void *stream) {
  HIP_ENTER("hipMemcpyDtoHAsync");
  return cuMemcpyDtoHAsync_v2(dst, DPTR(src), len, stream);
}

hipError_t hipMemcpyHtoDAsync(void *dst, void *src, size_t len, void *stream) {
  HIP_ENTER("hipMemcpyHtoDAsync");
  return cuMemcpyHtoDAsync_v2(DPTR(dst), src, len, stream);
}

/* HIP_POINTER_ATTRIBUTE_* and hipMemoryType number as CUDA's (ROCm 6). */
hipError_t hipPointerGetAttribute(void *data, int attribute, void *ptr) {
  HIP_ENTER("hipPointerGetAttribute");
  return cuPointerGetAttribute(data, attribute, DPTR(ptr));
}

hipError_t hipMemGetAddressRange(void **base, size_t *size, void *ptr) {
  HIP_ENTER("hipMemGetAddressRange");
  CUdeviceptr b = 0;
  hipError_t r = cuMemGetAddressRange_v2(&b, size, DPTR(ptr));
  if (r == CUDA_SUCCESS && base) *base = (void *)(uintptr_t)b;
  return r;
}

hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *handle, void *ptr) {
  HIP_ENTER("hipIpcGetMemHandle");
  return cuIpcGetMemHandle((CUipcMemHandle *)handle, DPTR(ptr));
}

hipError_t hipIpcOpenMemHandle(void **ptr, hipIpcMemHandle_t handle, unsigned int flags) {
  HIP_ENTER("hipIpcOpenMemHandle");
  CUipcMemHandle raw;
  memcpy(raw.reserved, handle.reserved, sizeof raw.reserved);
  CUdeviceptr p = 0;
  hipError_t r = cuIpcOpenMemHandle_v2(&p, raw, flags);
  if (r == CUDA_SUCCESS) *ptr = (void *)(uintptr_t)p;
  return r;
}

hipError_t hipIpcCloseMemHandle(void *ptr) {
  HIP_ENTER("hipIpcCloseMemHandle");
  return cuIpcCloseMemHandle(DPTR(ptr));
}

hipError_t hipHostRegister(void *p, size_t size, unsigned int flags) {
  HIP_ENTER("hipHostRegister");
  return cuMemHostRegister_v2(p, size, flags);
}

hipError_t hipHostUnregister(void *p) {
  HIP_ENTER("hipHostUnregister");
  return cuMemHostUnregister(p);
}
