//! The HIP runtime (AMD GPUs, ROCm 6 or later), loaded at run time from
//! `libamdhip64.so` through `libloading`: no ROCm at build time, and a machine without
//! it never loads it.
//!
//! HIP has no contexts to push: each call runs with the device made current on the
//! calling thread (`hipSetDevice`) and the thread's previous device set back after.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use crate::api::{Api, IPC_HANDLE_LEN, RawStream, Restore};
use crate::error::DeviceError;

/// Environment variable naming the HIP runtime library to load instead of looking for
/// `libamdhip64.so` on the library path (a ROCm in an unusual place, or the stand-in
/// of the tests).
pub const LIBRARY_ENV: &str = "MOONCAKE_HIP_LIBRARY";

/// Names tried on the library path, in order.
const LIBRARY_NAMES: [&str; 3] = ["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"];

/// `hipSuccess`.
const SUCCESS: c_int = 0;
/// `hipErrorInvalidValue`: what `hipPointerGetAttribute` answers for an address HIP
/// does not know.
const ERROR_INVALID_VALUE: c_int = 1;
/// `HIP_POINTER_ATTRIBUTE_MEMORY_TYPE`.
const ATTRIBUTE_MEMORY_TYPE: c_int = 2;
/// `HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
const ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
/// `hipMemoryTypeDevice` (ROCm 6 numbering, as CUDA's).
const MEMORY_TYPE_DEVICE: c_uint = 2;
/// `hipStreamNonBlocking`.
const STREAM_NON_BLOCKING: c_uint = 1;
/// `hipIpcMemLazyEnablePeerAccess`.
const IPC_LAZY_PEER_ACCESS: c_uint = 1;
/// `hipHostRegisterPortable`.
const HOST_REGISTER_PORTABLE: c_uint = 1;

/// `hipIpcMemHandle_t`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcHandle {
    reserved: [c_char; IPC_HANDLE_LEN],
}

/// The runtime calls used, resolved once.
#[derive(Clone, Copy)]
struct Calls {
    init: unsafe extern "C" fn(c_uint) -> c_int,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_device: unsafe extern "C" fn(*mut c_int) -> c_int,
    set_device: unsafe extern "C" fn(c_int) -> c_int,
    get_error_name: unsafe extern "C" fn(c_int) -> *const c_char,
    stream_create_with_flags: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int,
    stream_destroy: unsafe extern "C" fn(*mut c_void) -> c_int,
    stream_synchronize: unsafe extern "C" fn(*mut c_void) -> c_int,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut c_void) -> c_int,
    memcpy_htod_async: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, *mut c_void) -> c_int,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> c_int,
    mem_get_address_range: unsafe extern "C" fn(*mut *mut c_void, *mut usize, *mut c_void) -> c_int,
    ipc_get_mem_handle: unsafe extern "C" fn(*mut IpcHandle, *mut c_void) -> c_int,
    ipc_open_mem_handle: unsafe extern "C" fn(*mut *mut c_void, IpcHandle, c_uint) -> c_int,
    ipc_close_mem_handle: unsafe extern "C" fn(*mut c_void) -> c_int,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> c_int,
}

/// The HIP runtime's calls.
pub(crate) struct Hip {
    calls: Calls,
    devices: i32,
    /// Keeps the library (and so `calls`) loaded.
    _library: libloading::Library,
}

impl std::fmt::Debug for Hip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hip")
            .field("devices", &self.devices)
            .finish()
    }
}

fn open_library() -> Result<libloading::Library, String> {
    if let Some(path) = std::env::var_os(LIBRARY_ENV) {
        // SAFETY: loading runs the library's initializers; the operator named it as the
        // HIP runtime.
        return unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("{LIBRARY_ENV}={}: {e}", path.to_string_lossy()));
    }
    for name in LIBRARY_NAMES {
        // SAFETY: as above, for the library ROCm installs under this name.
        if let Ok(library) = unsafe { libloading::Library::new(name) } {
            return Ok(library);
        }
    }
    Err(format!(
        "the HIP runtime library (libamdhip64.so) was not found (library path, or {LIBRARY_ENV})"
    ))
}

fn resolve(library: &libloading::Library) -> Result<Calls, String> {
    macro_rules! symbol {
        ($name:literal) => {
            // SAFETY: the HIP runtime's function of that name has this signature.
            *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("the HIP runtime lacks {}: {e}", $name))?
        };
    }
    Ok(Calls {
        init: symbol!("hipInit"),
        get_device_count: symbol!("hipGetDeviceCount"),
        get_device: symbol!("hipGetDevice"),
        set_device: symbol!("hipSetDevice"),
        get_error_name: symbol!("hipGetErrorName"),
        stream_create_with_flags: symbol!("hipStreamCreateWithFlags"),
        stream_destroy: symbol!("hipStreamDestroy"),
        stream_synchronize: symbol!("hipStreamSynchronize"),
        memcpy_dtoh_async: symbol!("hipMemcpyDtoHAsync"),
        memcpy_htod_async: symbol!("hipMemcpyHtoDAsync"),
        pointer_get_attribute: symbol!("hipPointerGetAttribute"),
        mem_get_address_range: symbol!("hipMemGetAddressRange"),
        ipc_get_mem_handle: symbol!("hipIpcGetMemHandle"),
        ipc_open_mem_handle: symbol!("hipIpcOpenMemHandle"),
        ipc_close_mem_handle: symbol!("hipIpcCloseMemHandle"),
        host_register: symbol!("hipHostRegister"),
        host_unregister: symbol!("hipHostUnregister"),
    })
}

/// Loads and initializes the runtime; the error says why there is none.
pub(crate) fn load() -> Result<Hip, String> {
    let library = open_library()?;
    let calls = resolve(&library)?;
    let mut hip = Hip {
        calls,
        devices: 0,
        _library: library,
    };
    // SAFETY: hipInit takes no pointers.
    hip.check("hipInit", unsafe { (calls.init)(0) })
        .map_err(|e| e.to_string())?;
    let mut devices = 0;
    // SAFETY: `devices` is a valid out-pointer.
    hip.check("hipGetDeviceCount", unsafe {
        (calls.get_device_count)(&mut devices)
    })
    .map_err(|e| e.to_string())?;
    hip.devices = devices;
    Ok(hip)
}

impl Hip {
    /// Turns a runtime result into a `Result`, naming the error as HIP does.
    fn check(&self, call: &'static str, result: c_int) -> Result<(), DeviceError> {
        if result == SUCCESS {
            return Ok(());
        }
        // SAFETY: hipGetErrorName answers a static string (or null).
        let name = unsafe { (self.calls.get_error_name)(result) };
        let name = if name.is_null() {
            format!("hipError {result}")
        } else {
            // SAFETY: a NUL-terminated static string of the runtime.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        };
        Err(DeviceError::Call {
            call,
            name,
            code: result.cast_unsigned(),
        })
    }

    fn pointer_attribute<T: Default>(&self, attribute: c_int, addr: u64) -> (c_int, T) {
        let mut value = T::default();
        // SAFETY: the attributes asked for write a `T` (an unsigned or signed int).
        let result = unsafe {
            (self.calls.pointer_get_attribute)(
                (&mut value as *mut T).cast(),
                attribute,
                addr as *mut c_void,
            )
        };
        (result, value)
    }
}

impl Api for Hip {
    fn device_count(&self) -> i32 {
        self.devices
    }

    fn enter(&self, device: i32) -> Result<Restore, DeviceError> {
        let mut previous = 0;
        // SAFETY: `previous` is a valid out-pointer.
        self.check("hipGetDevice", unsafe {
            (self.calls.get_device)(&mut previous)
        })?;
        // SAFETY: takes no pointers.
        self.check("hipSetDevice", unsafe { (self.calls.set_device)(device) })?;
        Ok(Restore(previous))
    }

    fn leave(&self, restore: Restore) {
        // SAFETY: takes no pointers.
        let result = unsafe { (self.calls.set_device)(restore.0) };
        if let Err(error) = self.check("hipSetDevice", result) {
            tracing::warn!(%error, "could not restore the thread's HIP device");
        }
    }

    fn create_stream(&self) -> Result<RawStream, DeviceError> {
        let mut stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer.
        self.check("hipStreamCreateWithFlags", unsafe {
            (self.calls.stream_create_with_flags)(&mut stream, STREAM_NON_BLOCKING)
        })?;
        Ok(stream as RawStream)
    }

    fn destroy_stream(&self, stream: RawStream) -> Result<(), DeviceError> {
        // SAFETY: an idle stream of this runtime, not used again.
        self.check("hipStreamDestroy", unsafe {
            (self.calls.stream_destroy)(stream as *mut c_void)
        })
    }

    fn synchronize(&self, stream: RawStream) -> Result<(), DeviceError> {
        // SAFETY: a stream of this runtime.
        self.check("hipStreamSynchronize", unsafe {
            (self.calls.stream_synchronize)(stream as *mut c_void)
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
        self.check("hipMemcpyDtoHAsync", unsafe {
            (self.calls.memcpy_dtoh_async)(
                dst.cast(),
                src as *mut c_void,
                len,
                stream as *mut c_void,
            )
        })
    }

    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: RawStream,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller vouches for both ranges until the stream is synchronized;
        // the runtime only reads `src`.
        self.check("hipMemcpyHtoDAsync", unsafe {
            (self.calls.memcpy_htod_async)(
                dst as *mut c_void,
                src.cast_mut().cast(),
                len,
                stream as *mut c_void,
            )
        })
    }

    fn device_of(&self, addr: u64) -> Result<Option<i32>, DeviceError> {
        let (result, kind) = self.pointer_attribute::<c_uint>(ATTRIBUTE_MEMORY_TYPE, addr);
        if result == ERROR_INVALID_VALUE {
            return Ok(None);
        }
        self.check("hipPointerGetAttribute", result)?;
        if kind != MEMORY_TYPE_DEVICE {
            return Ok(None);
        }
        let (result, device) = self.pointer_attribute::<c_int>(ATTRIBUTE_DEVICE_ORDINAL, addr);
        self.check("hipPointerGetAttribute", result)?;
        Ok(Some(device))
    }

    fn address_range(&self, addr: u64) -> Result<(u64, u64), DeviceError> {
        let mut base: *mut c_void = std::ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: valid out-pointers.
        self.check("hipMemGetAddressRange", unsafe {
            (self.calls.mem_get_address_range)(&mut base, &mut len, addr as *mut c_void)
        })?;
        Ok((base as u64, len as u64))
    }

    fn ipc_export(&self, base: u64) -> Result<[u8; IPC_HANDLE_LEN], DeviceError> {
        let mut handle = IpcHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: `handle` is a valid out-pointer.
        self.check("hipIpcGetMemHandle", unsafe {
            (self.calls.ipc_get_mem_handle)(&mut handle, base as *mut c_void)
        })?;
        Ok(handle.reserved.map(|b| u8::from_ne_bytes(b.to_ne_bytes())))
    }

    fn ipc_open(&self, handle: &[u8; IPC_HANDLE_LEN]) -> Result<u64, DeviceError> {
        let raw = IpcHandle {
            reserved: handle.map(|b| c_char::from_ne_bytes([b])),
        };
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value.
        self.check("hipIpcOpenMemHandle", unsafe {
            (self.calls.ipc_open_mem_handle)(&mut ptr, raw, IPC_LAZY_PEER_ACCESS)
        })?;
        Ok(ptr as u64)
    }

    fn ipc_close(&self, ptr: u64) -> Result<(), DeviceError> {
        // SAFETY: `ptr` was returned by hipIpcOpenMemHandle and is closed once.
        self.check("hipIpcCloseMemHandle", unsafe {
            (self.calls.ipc_close_mem_handle)(ptr as *mut c_void)
        })
    }

    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<(), DeviceError> {
        // SAFETY: the caller keeps the range mapped while it is registered.
        self.check("hipHostRegister", unsafe {
            (self.calls.host_register)(ptr.cast(), len, HOST_REGISTER_PORTABLE)
        })
    }

    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<(), DeviceError> {
        // SAFETY: the caller passes the start of a registered range.
        self.check("hipHostUnregister", unsafe {
            (self.calls.host_unregister)(ptr.cast())
        })
    }
}
