//! The CUDA driver, loaded at run time through `cudarc` (no toolkit at build time; a
//! machine without the driver never loads it and runs as without a GPU).
//!
//! Every call runs with the device's primary context pushed on the calling thread and
//! popped afterwards, so a caller's own current context (torch's, in embedded mode)
//! is left as it was. Copies run on streams of a small per-device pool and are
//! synchronized before the call returns.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::{
    self, CUcontext, CUdeviceptr, CUipcMemHandle, CUmemorytype, CUpointer_attribute, CUresult,
    CUstream,
};
use parking_lot::Mutex;

use crate::{DeviceAllocation, DeviceError};

/// Environment variable naming the driver library to load before looking for
/// `libcuda.so` on the library path (a driver in an unusual place, or the stand-in
/// driver of the tests). Its soname must be `libcuda.so`.
pub const LIBRARY_ENV: &str = "MOONCAKE_CUDA_LIBRARY";

/// Streams kept idle per device; more concurrent copies create streams that are
/// destroyed after use.
const IDLE_STREAMS: usize = 8;

/// `CU_STREAM_NON_BLOCKING`: our streams do not wait for the legacy default stream.
const STREAM_NON_BLOCKING: u32 = 1;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
const IPC_LAZY_PEER_ACCESS: u32 = 1;
/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context.
const HOST_REGISTER_PORTABLE: u32 = 1;

/// Size of a CUDA IPC handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// IPC handles opened by this process and not closed yet.
static OPEN_HANDLES: AtomicU64 = AtomicU64::new(0);

/// Number of IPC handles this process has open (shown in status).
pub fn open_handles() -> u64 {
    OPEN_HANDLES.load(Ordering::Relaxed)
}

/// A context or stream pointer, owned by the driver, usable from any thread.
#[derive(Clone, Copy, Debug)]
struct Raw<T>(T);
// SAFETY: CUDA contexts and streams are handles that the driver lets any thread use.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Raw<T> {}

/// The loaded CUDA driver.
#[derive(Debug)]
pub struct Cuda {
    devices: i32,
    contexts: Mutex<HashMap<i32, Raw<CUcontext>>>,
    streams: Mutex<HashMap<i32, Vec<Raw<CUstream>>>>,
}

static DRIVER: OnceLock<Result<Cuda, String>> = OnceLock::new();

/// The CUDA driver, loaded and initialized on first call; the error says why there is
/// none (no library, no device, a failed `cuInit`).
pub fn driver() -> Result<&'static Cuda, DeviceError> {
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|why| DeviceError::NoDriver(why.clone()))
}

/// True when the driver is loaded already (without trying to load it).
pub fn is_loaded() -> bool {
    DRIVER.get().is_some_and(Result::is_ok)
}

fn load() -> Result<Cuda, String> {
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
        return Err("the CUDA driver library (libcuda.so) was not found".into());
    }
    // SAFETY: cuInit takes no pointers; the library is present.
    check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| e.to_string())?;
    let mut devices = 0;
    // SAFETY: `devices` is a valid out-pointer.
    check("cuDeviceGetCount", unsafe {
        sys::cuDeviceGetCount(&mut devices)
    })
    .map_err(|e| e.to_string())?;
    tracing::info!(devices, "CUDA driver loaded");
    Ok(Cuda {
        devices,
        contexts: Mutex::new(HashMap::new()),
        streams: Mutex::new(HashMap::new()),
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

/// The device's primary context, current on this thread until dropped (then the
/// thread's previous context is current again).
struct Entered;

impl Drop for Entered {
    fn drop(&mut self) {
        let mut popped: CUcontext = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread.
        let result = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        if let Err(error) = check("cuCtxPopCurrent_v2", result) {
            tracing::warn!(%error, "could not restore the thread's CUDA context");
        }
    }
}

/// A stream taken from the pool; goes back (or is destroyed) through [`Cuda::give_back`].
struct Stream {
    device: i32,
    raw: Raw<CUstream>,
}

/// A device allocation of another process, opened from its IPC handle; closed when
/// dropped.
#[derive(Debug)]
pub struct OpenedAllocation {
    driver: &'static Cuda,
    device: i32,
    ptr: u64,
}

impl OpenedAllocation {
    /// The allocation's start, as a device address of this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its device.
    pub fn device(&self) -> i32 {
        self.device
    }
}

impl Drop for OpenedAllocation {
    fn drop(&mut self) {
        let closed = self.driver.enter(self.device).and_then(|_entered| {
            // SAFETY: `ptr` was returned by cuIpcOpenMemHandle and is closed once.
            check("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(self.ptr)
            })
        });
        OPEN_HANDLES.fetch_sub(1, Ordering::Relaxed);
        if let Err(error) = closed {
            tracing::warn!(%error, "closing a device allocation of another process failed");
        }
    }
}

/// Host memory pinned (page-locked and known to the driver) until dropped.
#[derive(Debug)]
pub struct PinnedHost {
    driver: &'static Cuda,
    ptr: u64,
    len: u64,
}

impl PinnedHost {
    /// Bytes pinned.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always false: empty ranges are not pinned.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let unpinned = self.driver.enter(0).and_then(|_entered| {
            // SAFETY: `ptr` is the start of a range this guard registered.
            check("cuMemHostUnregister", unsafe {
                sys::cuMemHostUnregister(self.ptr as *mut c_void)
            })
        });
        if let Err(error) = unpinned {
            tracing::warn!(%error, "unpinning host memory failed");
        }
    }
}

/// `len` as the driver's `size_t`.
fn size(len: u64) -> Result<usize, DeviceError> {
    usize::try_from(len).map_err(|_| DeviceError::Invalid(format!("{len} bytes do not fit")))
}

impl Cuda {
    /// Number of devices the driver sees.
    pub fn device_count(&self) -> i32 {
        self.devices
    }

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
        contexts.insert(device, Raw(context));
        Ok(context)
    }

    /// Makes `device`'s primary context current on this thread until the guard drops.
    fn enter(&self, device: i32) -> Result<Entered, DeviceError> {
        let context = self.context(device)?;
        // SAFETY: a context retained by `context`.
        check("cuCtxPushCurrent_v2", unsafe {
            sys::cuCtxPushCurrent_v2(context)
        })?;
        Ok(Entered)
    }

    /// A stream of `device` (the device's context must be current).
    fn take_stream(&self, device: i32) -> Result<Stream, DeviceError> {
        if let Some(raw) = self.streams.lock().get_mut(&device).and_then(Vec::pop) {
            return Ok(Stream { device, raw });
        }
        let mut stream: CUstream = std::ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, STREAM_NON_BLOCKING)
        })?;
        Ok(Stream {
            device,
            raw: Raw(stream),
        })
    }

    /// Returns a synchronized stream to the pool, or destroys it when the pool is full.
    fn give_back(&self, stream: Stream) {
        let mut streams = self.streams.lock();
        let idle = streams.entry(stream.device).or_default();
        if idle.len() < IDLE_STREAMS {
            idle.push(stream.raw);
            return;
        }
        drop(streams);
        // SAFETY: an idle stream of this driver, not used again.
        let result = unsafe { sys::cuStreamDestroy_v2(stream.raw.0) };
        if let Err(error) = check("cuStreamDestroy_v2", result) {
            tracing::debug!(%error, "destroying a spare stream failed");
        }
    }

    /// Runs `enqueue` on a stream of `device` and waits for it. A stream whose work
    /// failed to complete is not used again.
    fn on_stream(
        &self,
        device: i32,
        enqueue: impl FnOnce(CUstream) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let _entered = self.enter(device)?;
        let stream = self.take_stream(device)?;
        if let Err(error) = enqueue(stream.raw.0) {
            self.give_back(stream);
            return Err(error);
        }
        // SAFETY: a stream of this driver.
        let synced = check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(stream.raw.0)
        });
        match synced {
            Ok(()) => self.give_back(stream),
            // Its copies did not complete: the stream is left alone (the context is
            // unusable after such an error on a real device anyway).
            Err(_) => tracing::warn!("a CUDA stream failed; it is not used again"),
        }
        synced
    }

    /// The device allocation holding `addr`, or `None` when the driver does not know
    /// the address as device memory.
    pub fn allocation_of(&self, addr: u64) -> Result<Option<DeviceAllocation>, DeviceError> {
        let mut kind: u32 = 0;
        // SAFETY: MEMORY_TYPE writes an unsigned int to `kind`.
        let result = unsafe {
            sys::cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                addr,
            )
        };
        if result == CUresult::CUDA_ERROR_INVALID_VALUE {
            return Ok(None);
        }
        check("cuPointerGetAttribute", result)?;
        if kind != CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Ok(None);
        }
        let mut device: i32 = 0;
        // SAFETY: DEVICE_ORDINAL writes an int to `device`.
        check("cuPointerGetAttribute", unsafe {
            sys::cuPointerGetAttribute(
                (&mut device as *mut i32).cast(),
                CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                addr,
            )
        })?;
        let _entered = self.enter(device)?;
        let mut base: CUdeviceptr = 0;
        let mut len: usize = 0;
        // SAFETY: valid out-pointers.
        check("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut len, addr)
        })?;
        Ok(Some(DeviceAllocation {
            device,
            base,
            len: len as u64,
        }))
    }

    /// Copies `len` bytes of device memory at `src` (of `device`) to host memory at `dst`.
    ///
    /// # Safety
    /// `dst..dst+len` must be host memory writable for the duration of the call, and
    /// `src..src+len` device memory of `device` that stays allocated meanwhile.
    pub unsafe fn copy_to_host(
        &self,
        device: i32,
        src: u64,
        dst: *mut u8,
        len: u64,
    ) -> Result<(), DeviceError> {
        let len = size(len)?;
        self.on_stream(device, |stream| {
            // SAFETY: the caller vouches for both ranges; the copy completes before
            // `on_stream` returns.
            check("cuMemcpyDtoHAsync_v2", unsafe {
                sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream)
            })
        })
    }

    /// Copies `len` bytes of host memory at `src` to device memory at `dst` (of `device`).
    ///
    /// # Safety
    /// `src..src+len` must be readable host memory for the duration of the call, and
    /// `dst..dst+len` device memory of `device` that stays allocated meanwhile.
    pub unsafe fn copy_from_host(
        &self,
        device: i32,
        src: *const u8,
        dst: u64,
        len: u64,
    ) -> Result<(), DeviceError> {
        let len = size(len)?;
        self.on_stream(device, |stream| {
            // SAFETY: the caller vouches for both ranges; the copy completes before
            // `on_stream` returns.
            check("cuMemcpyHtoDAsync_v2", unsafe {
                sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream)
            })
        })
    }

    /// The IPC handle of the allocation starting at `base` (of `device`), for another
    /// process to open.
    pub fn export(&self, device: i32, base: u64) -> Result<[u8; IPC_HANDLE_LEN], DeviceError> {
        let _entered = self.enter(device)?;
        let mut handle = CUipcMemHandle {
            reserved: [0; IPC_HANDLE_LEN],
        };
        // SAFETY: `handle` is a valid out-pointer.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut handle, base)
        })?;
        Ok(handle.reserved.map(|b| u8::from_ne_bytes(b.to_ne_bytes())))
    }

    /// Opens another process's allocation from its IPC handle, on `device`.
    pub fn open(
        &'static self,
        device: i32,
        handle: &[u8; IPC_HANDLE_LEN],
    ) -> Result<OpenedAllocation, DeviceError> {
        if !(0..self.devices).contains(&device) {
            return Err(DeviceError::Invalid(format!(
                "device {device} does not exist here ({} devices)",
                self.devices
            )));
        }
        let _entered = self.enter(device)?;
        let raw = CUipcMemHandle {
            reserved: handle.map(|b| std::ffi::c_char::from_ne_bytes([b])),
        };
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value.
        check("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut ptr, raw, IPC_LAZY_PEER_ACCESS)
        })?;
        OPEN_HANDLES.fetch_add(1, Ordering::Relaxed);
        Ok(OpenedAllocation {
            driver: self,
            device,
            ptr,
        })
    }

    /// Pins host memory `ptr..ptr+len` so that copies to and from devices run at bus
    /// speed; unpinned when the guard drops.
    ///
    /// # Safety
    /// The range must stay mapped until the guard is dropped.
    pub unsafe fn pin(&'static self, ptr: *mut u8, len: u64) -> Result<PinnedHost, DeviceError> {
        if ptr.is_null() || len == 0 {
            return Err(DeviceError::Invalid(
                "pinning needs a non-empty range".into(),
            ));
        }
        let bytes = size(len)?;
        let _entered = self.enter(0)?;
        // SAFETY: the caller keeps the range mapped while it is registered.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(ptr.cast(), bytes, HOST_REGISTER_PORTABLE)
        })?;
        Ok(PinnedHost {
            driver: self,
            ptr: ptr as u64,
            len,
        })
    }
}
