//! What the driver and its two interfaces share: the raw calls of one GPU interface
//! ([`Api`], implemented by [`crate::cuda`] and [`crate::hip`], used by
//! [`crate::driver`]), the values they pass, and what a device pointer belongs to.

use mooncake_core::types::DeviceApi;

use crate::error::DeviceError;

/// A device allocation: where a device pointer belongs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAllocation {
    /// The GPU interface that knows it.
    pub api: DeviceApi,
    /// Device ordinal.
    pub device: i32,
    /// Start of the allocation (a device address of this process).
    pub base: u64,
    /// Length of the allocation in bytes.
    pub len: u64,
}

/// Size of an IPC handle (CUDA's and HIP's).
pub const IPC_HANDLE_LEN: usize = 64;

/// A stream of the interface, as an address (streams are opaque pointers).
pub(crate) type RawStream = usize;

/// What [`Api::leave`] restores on the calling thread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Restore(pub(crate) i32);

/// The raw calls of one GPU interface. Errors name the call that failed.
pub(crate) trait Api: Send + Sync + std::fmt::Debug {
    /// Number of devices.
    fn device_count(&self) -> i32;
    /// Makes `device` current on this thread; the answer lets [`Api::leave`] put back
    /// what was current before.
    fn enter(&self, device: i32) -> Result<Restore, DeviceError>;
    /// Undoes [`Api::enter`].
    fn leave(&self, restore: Restore);
    /// A new non-blocking stream of the current device.
    fn create_stream(&self) -> Result<RawStream, DeviceError>;
    /// Destroys a stream.
    fn destroy_stream(&self, stream: RawStream) -> Result<(), DeviceError>;
    /// Waits for a stream's work.
    fn synchronize(&self, stream: RawStream) -> Result<(), DeviceError>;
    /// Queues a copy of device memory at `src` to host memory at `dst`.
    ///
    /// # Safety
    /// Both ranges must stay valid until the stream is synchronized.
    unsafe fn copy_to_host_async(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
        stream: RawStream,
    ) -> Result<(), DeviceError>;
    /// Queues a copy of host memory at `src` to device memory at `dst`.
    ///
    /// # Safety
    /// Both ranges must stay valid until the stream is synchronized.
    unsafe fn copy_from_host_async(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
        stream: RawStream,
    ) -> Result<(), DeviceError>;
    /// The device ordinal of `addr` when the interface knows it as device memory.
    fn device_of(&self, addr: u64) -> Result<Option<i32>, DeviceError>;
    /// The allocation holding `addr`: start and length (its device is current).
    fn address_range(&self, addr: u64) -> Result<(u64, u64), DeviceError>;
    /// The IPC handle of the allocation starting at `base` (its device is current).
    fn ipc_export(&self, base: u64) -> Result<[u8; IPC_HANDLE_LEN], DeviceError>;
    /// Opens another process's allocation on the current device.
    fn ipc_open(&self, handle: &[u8; IPC_HANDLE_LEN]) -> Result<u64, DeviceError>;
    /// Closes an allocation [`Api::ipc_open`] opened.
    fn ipc_close(&self, ptr: u64) -> Result<(), DeviceError>;
    /// Pins host memory for every device.
    ///
    /// # Safety
    /// The range must stay mapped until it is unregistered.
    unsafe fn host_register(&self, ptr: *mut u8, len: usize) -> Result<(), DeviceError>;
    /// Unpins host memory pinned at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be the start of a range [`Api::host_register`] pinned.
    unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<(), DeviceError>;
}
