//! A loaded GPU driver (CUDA or HIP) as the rest of the code sees it: device
//! allocations of addresses, copies between device and host memory on streams of a
//! small pool, IPC handles, pinned host memory.
//!
//! Each interface implements the raw calls of [`Api`](crate::api) ([`crate::cuda`],
//! [`crate::hip`]); [`Driver`] adds what both share: the device made current around
//! every call (the caller's own current device or context is restored), the stream
//! pool, synchronization before a call returns, and the guards that close opened
//! allocations and unpin memory.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_core::types::DeviceApi;
use parking_lot::Mutex;

pub use crate::api::IPC_HANDLE_LEN;
use crate::api::{Api, DeviceAllocation, RawStream, Restore};
use crate::error::DeviceError;

/// Streams kept idle per device; more concurrent copies create streams that are
/// destroyed after use.
const IDLE_STREAMS: usize = 8;

/// IPC handles opened by this process and not closed yet (every interface).
static OPEN_HANDLES: AtomicU64 = AtomicU64::new(0);

/// Number of IPC handles this process has open (shown in status).
pub fn open_handles() -> u64 {
    OPEN_HANDLES.load(Ordering::Relaxed)
}

/// A loaded GPU driver.
#[derive(Debug)]
pub struct Driver {
    kind: DeviceApi,
    api: Box<dyn Api>,
    streams: Mutex<HashMap<i32, Vec<RawStream>>>,
}

static CUDA: OnceLock<Result<Driver, String>> = OnceLock::new();
static HIP: OnceLock<Result<Driver, String>> = OnceLock::new();

fn slot(kind: DeviceApi) -> &'static OnceLock<Result<Driver, String>> {
    match kind {
        DeviceApi::Cuda => &CUDA,
        DeviceApi::Hip => &HIP,
    }
}

/// The driver of `kind`, loaded and initialized on first call; the error says why
/// there is none (no library, no device, a failed initialization).
pub fn driver(kind: DeviceApi) -> Result<&'static Driver, DeviceError> {
    slot(kind)
        .get_or_init(|| {
            let api: Box<dyn Api> = match kind {
                DeviceApi::Cuda => Box::new(crate::cuda::load()?),
                DeviceApi::Hip => Box::new(crate::hip::load()?),
            };
            tracing::info!(api = %kind, devices = api.device_count(), "GPU driver loaded");
            Ok(Driver {
                kind,
                api,
                streams: Mutex::new(HashMap::new()),
            })
        })
        .as_ref()
        .map_err(|why| DeviceError::NoDriver(why.clone()))
}

/// True when the driver of `kind` is loaded already (without trying to load it).
pub fn is_loaded(kind: DeviceApi) -> bool {
    slot(kind).get().is_some_and(Result::is_ok)
}

/// A device current on this thread until dropped (then what was current before is
/// current again).
struct Entered<'a> {
    api: &'a dyn Api,
    restore: Restore,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.api.leave(self.restore);
    }
}

/// A device allocation of another process, opened from its IPC handle; closed when
/// dropped.
#[derive(Debug)]
pub struct OpenedAllocation {
    driver: &'static Driver,
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
        let closed = self
            .driver
            .enter(self.device)
            .and_then(|_entered| self.driver.api.ipc_close(self.ptr));
        OPEN_HANDLES.fetch_sub(1, Ordering::Relaxed);
        if let Err(error) = closed {
            tracing::warn!(%error, "closing a device allocation of another process failed");
        }
    }
}

/// Host memory pinned (page-locked and known to the driver) until dropped.
#[derive(Debug)]
pub struct PinnedHost {
    driver: &'static Driver,
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
            // SAFETY: `ptr` is the start of a range this guard pinned.
            unsafe { self.driver.api.host_unregister(self.ptr as *mut u8) }
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

impl Driver {
    /// The interface.
    pub fn kind(&self) -> DeviceApi {
        self.kind
    }

    /// Number of devices the driver sees.
    pub fn device_count(&self) -> i32 {
        self.api.device_count()
    }

    fn enter(&self, device: i32) -> Result<Entered<'_>, DeviceError> {
        let restore = self.api.enter(device)?;
        Ok(Entered {
            api: self.api.as_ref(),
            restore,
        })
    }

    /// A stream of `device` (the device must be current).
    fn take_stream(&self, device: i32) -> Result<RawStream, DeviceError> {
        if let Some(stream) = self.streams.lock().get_mut(&device).and_then(Vec::pop) {
            return Ok(stream);
        }
        self.api.create_stream()
    }

    /// Returns a synchronized stream to the pool, or destroys it when the pool is full.
    fn give_back(&self, device: i32, stream: RawStream) {
        let mut streams = self.streams.lock();
        let idle = streams.entry(device).or_default();
        if idle.len() < IDLE_STREAMS {
            idle.push(stream);
            return;
        }
        drop(streams);
        if let Err(error) = self.api.destroy_stream(stream) {
            tracing::debug!(%error, "destroying a spare stream failed");
        }
    }

    /// Runs `enqueue` on a stream of `device` and waits for it. A stream whose work
    /// failed to complete is not used again.
    fn on_stream(
        &self,
        device: i32,
        enqueue: impl FnOnce(RawStream) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let _entered = self.enter(device)?;
        let stream = self.take_stream(device)?;
        if let Err(error) = enqueue(stream) {
            self.give_back(device, stream);
            return Err(error);
        }
        let synced = self.api.synchronize(stream);
        match synced {
            Ok(()) => self.give_back(device, stream),
            // Its copies did not complete: the stream is left alone (the device is
            // unusable after such an error on real hardware anyway).
            Err(_) => tracing::warn!(api = %self.kind, "a GPU stream failed; it is not used again"),
        }
        synced
    }

    /// The device allocation holding `addr`, or `None` when the driver does not know
    /// the address as device memory.
    pub fn allocation_of(&self, addr: u64) -> Result<Option<DeviceAllocation>, DeviceError> {
        let Some(device) = self.api.device_of(addr)? else {
            return Ok(None);
        };
        let _entered = self.enter(device)?;
        let (base, len) = self.api.address_range(addr)?;
        Ok(Some(DeviceAllocation {
            api: self.kind,
            device,
            base,
            len,
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
            unsafe { self.api.copy_to_host_async(dst, src, len, stream) }
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
            unsafe { self.api.copy_from_host_async(dst, src, len, stream) }
        })
    }

    /// The IPC handle of the allocation starting at `base` (of `device`), for another
    /// process to open.
    pub fn export(&self, device: i32, base: u64) -> Result<[u8; IPC_HANDLE_LEN], DeviceError> {
        let _entered = self.enter(device)?;
        self.api.ipc_export(base)
    }

    /// Opens another process's allocation from its IPC handle, on `device`.
    pub fn open(
        &'static self,
        device: i32,
        handle: &[u8; IPC_HANDLE_LEN],
    ) -> Result<OpenedAllocation, DeviceError> {
        let devices = self.device_count();
        if !(0..devices).contains(&device) {
            return Err(DeviceError::Invalid(format!(
                "device {device} does not exist here ({devices} {} devices)",
                self.kind
            )));
        }
        let _entered = self.enter(device)?;
        let ptr = self.api.ipc_open(handle)?;
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
        unsafe { self.api.host_register(ptr, bytes) }?;
        Ok(PinnedHost {
            driver: self,
            ptr: ptr as u64,
            len,
        })
    }
}
