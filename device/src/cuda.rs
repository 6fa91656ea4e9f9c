//! The CUDA driver, loaded at run time through `cudarc` (no toolkit at build time; a
//! machine without the driver never loads it and runs as without a GPU).
//!
//! Every call runs with the device's primary context pushed on the calling thread and
//! popped afterwards, so a caller's own current context (torch's, in embedded mode)
//! is left as it was.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::driver::sys::{
    self, CUcontext, CUdeviceptr, CUipcMemHandle, CUmemorytype, CUpointer_attribute, CUresult,
    CUstream,
};
use parking_lot::Mutex;

use crate::api::{Api, IPC_HANDLE_LEN, RawStream, Restore};
use crate::error::DeviceError;

/// Environment variable naming the driver library to load before looking for
/// `libcuda.so` on the library path (a driver in an unusual place, or the stand-in
/// driver of the tests). Its soname must be `libcuda.so`.
pub const LIBRARY_ENV: &str = "MOONCAKE_CUDA_LIBRARY";

/// `CU_STREAM_NON_BLOCKING`: our streams do not wait for the legacy default stream.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
const IPC_LAZY_PEER_ACCESS: u32 = 1;
/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context.
const HOST_REGISTER_PORTABLE: u32 = 1;

/// A context pointer, owned by the driver, usable from any thread.
#[derive(Clone, Copy, Debug)]
struct Context(CUcontext);
// SAFETY: CUDA contexts are handles that the driver lets any thread use.
unsafe impl Send for Context {}

/// The CUDA driver's calls.
#[derive(Debug)]
pub(crate) struct Cuda {
    devices: i32,
    contexts: Mutex<HashMap<i32, Context>>,
}

/// Loads and initializes the driver; the error says why there is none.
pub(crate) fn load() -> Result<Cuda, String> {
    if let Some(path) = std::env::var_os(LIBRARY_ENV) {
        // SAFETY: loading runs the library's initializers; the operator named it as the
        // CUDA driver.
        let library = unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("{LIBRARY_ENV}={}: {e}", path.to_string_lossy()))?;
        // Stays loaded for the life of the process: the driver calls below resolve
        // their symbols from it (found again by its soname, libcuda.so).
        std::mem::forget(library);
    }
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "the CUDA driver library (libcuda.so) was not found (library path, or {LIBRARY_ENV})"
        ));
    }
    // SAFETY: cuInit takes no pointers; the library is present.
    check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| e.to_string())?;
    let mut devices = 0;
    // SAFETY: `devices` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut devices)
    })
    .map_err(|e| e.to_string())?;
    Ok(Cuda {
        devices,
        contexts: Mutex::new(HashMap::new()),
    })
}

/// Turns a driver result into a `Result`.
fn check(call: &'static str, result: CUresult) -> Result<(), DeviceError> {
    if result == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Call {
            call,
            name: format!("{result:?}"),
            code: result as u32,
        })
    }
}

impl Cuda {
    fn context(&self, device: i32) -> Result<CUcontext, DeviceError> {
        let mut contexts = self.contexts.lock();
        if let Some(context) = contexts.get(&device) {
            return Ok(context.0);
        }
        let mut handle = 0;
        // SAFETY: `handle` is a valid out-pointer.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut handle, device)
        })?;
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: `context` is a valid out-pointer; the primary context is retained for
        // the life of the process.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut context, handle)
        })?;
        contexts.insert(device, Context(context));
        Ok(context)
    }

    fn pointer_attribute<T: Default>(
        &self,
        attribute: CUpointer_attribute,
        addr: u64,
    ) -> (CUresult, T) {
        let mut value = T::default();
        // SAFETY: the attributes asked for write a `T` (an unsigned or signed int).
        let result =
            unsafe { sys::cuPointerGetAttribute((&mut value as *mut T).cast(), attribute, addr) };
        (result, value)
    }
}

impl Api for Cuda {
    fn device_count(&self) -> i32 {
        self.devices
    }

    fn enter(&self, device: i32) -> Result<Restore, DeviceError> {
        let context = self.context(device)?;
        // SAFETY: a context retained by `context`.
        check("cuCtxPushCurrent_v2", unsafe {
            sys::cuCtxPushCurrent_v2(context)
        })?;
        Ok(Restore(device))
    }

    fn leave(&self, _: Restore) {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread.
        let result = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if let Err(error) = check("cuCtxPopCurrent_v2", result) {
            tracing::warn!(%error, "could not restore the thread's CUDA context");
        }
    }

    fn create_stream(&self) -> Result<RawStream, DeviceError> {
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, STREAM_NON_BLOCKING)
        })?;
        Ok(stream as RawStream)
    }

    fn destroy_stream(&self, stream: RawStream) -> Result<(), DeviceError> {
        // SAFETY: an idle stream of this driver, not used again.
        check("cuStreamDestroy_v2", unsafe {
            sys::cuStreamDestroy_v2(stream as CUstream)
        })
    }

    fn synchronize(&self, stream: RawStream) -> Result<(), DeviceError> {
        // SAFETY: a stream of this driver.
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream as CUstream)
        })
    }

    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: RawStream,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller vouches for both ranges until the stream is synchronized.
        check("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream as CUstream)
        })
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: RawStream,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller vouches for both ranges until the stream is synchronized.
        check("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream as CUstream)
        })
    }

    fn device_of(&self, addr: u64) -> Result<Option<i32>, DeviceError> {
        let (result, kind) = self
            .pointer_attribute::<u32>(CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, addr);
        if result == CUresult::CUDA_ERROR_INVALID_VALUE {
            return Ok(None);
        }
        check("cuPointerGetAttribute", result)?;
        if kind != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Ok(None);
        }
        let (result, device) = self.pointer_attribute::<i32>(
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr,
        );
        check("cuPointerGetAttribute", result)?;
        Ok(Some(device))
    }

    fn address_range(&self, addr: u64) -> Result<(u64, u64), DeviceError> {
        let mut base: CUdeviceptr = 0;
        let mut len: usize = 0;
        // SAFETY: valid out-pointers.
        check("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut len, addr)
        })?;
        Ok((base, len as u64))
    }

    fn ipc_export(&self, base: u64) -> Result<[u8; IPC_HANDLE_LEN], DeviceError> {
        let mut handle = CUipcMemHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: `handle` is a valid out-pointer.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
        })?;
        Ok(handle.reserved.map(|b| u8::from_ne_bytes(b.to_ne_bytes())))
    }

    fn ipc_open(&self, handle: &[u8; IPC_HANDLE_LEN]) -> Result<u64, DeviceError> {
        let raw = CUipcMemHandle {
            reserved: handle.map(|b| std::ffi::c_char::from_ne_bytes([b])),
        };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value.
        check("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, IPC_LAZY_PEER_ACCESS)
        })?;
        Ok(ptr)
    }

    fn ipc_close(&self, ptr: u64) -> Result<(), DeviceError> {
        // SAFETY: `ptr` was returned by cuIpcOpenMemHandle and is closed once.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(ptr)
        })
    }

    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<(), DeviceError> {
        // SAFETY: the caller keeps the range mapped while it is registered.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), len, HOST_REGISTER_PORTABLE)
        })
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<(), DeviceError> {
        // SAFETY: the caller passes the start of a registered range.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr.cast::<c_void>())
        })
    }
}
