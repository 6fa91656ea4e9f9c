//! Registered memory: a range the NIC may read and write, named by its keys.

use std::sync::Arc;

use crate::device::Device;
use crate::error::RdmaError;
use crate::library::verbs;
use crate::verbs::*;

/// A registered range; deregistered when dropped.
#[derive(Debug)]
pub struct MemoryRegion {
    device: Arc<Device>,
    mr: *mut ibv_mr,
    address: u64,
    len: u64,
    lkey: u32,
    rkey: u32,
}

// SAFETY: the region is only read after registration and freed in Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

/// Who may reach a region besides this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Only this node's own work requests (a source or destination of its transfers).
    Local,
    /// Peers too: one-sided reads and writes by whoever has the remote key.
    Remote,
}

impl MemoryRegion {
    /// Registers `len` bytes at `address` on `device`.
    ///
    /// # Safety
    /// The range must be mapped, and stay mapped until the region is dropped: the NIC
    /// reads and writes it without the CPU.
    pub unsafe fn register(
        device: &Arc<Device>,
        address: u64,
        len: u64,
        reach: Reach,
    ) -> Result<MemoryRegion, RdmaError> {
        let verbs = verbs()?;
        let access = match reach {
            Reach::Local => IBV_ACCESS_LOCAL_WRITE,
            Reach::Remote => {
                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE
            }
        };
        let length = usize::try_from(len).map_err(|_| RdmaError::Call {
            call: "ibv_reg_mr",
            device: device.name().to_string(),
            reason: format!("{len} bytes do not fit this machine's addresses"),
        })?;
        // SAFETY: the caller keeps the range mapped; the pd is open while `device` lives.
        let mr = unsafe { (verbs.reg_mr)(device.pd, address as *mut _, length, access) };
        if mr.is_null() {
            return Err(RdmaError::call("ibv_reg_mr", device.name()));
        }
        // SAFETY: a registered region, valid until deregistered.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(MemoryRegion {
            device: Arc::clone(device),
            mr,
            address,
            len,
            lkey,
            rkey,
        })
    }

    /// The key of this region in local work requests.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The key peers name this region with.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Start of the range.
    pub fn address(&self) -> u64 {
        self.address
    }

    /// Length of the range.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for an empty range (never registered; for clippy's sake).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when `[address, address + len)` lies inside the region.
    pub fn contains(&self, address: u64, len: u64) -> bool {
        address >= self.address
            && address
                .checked_add(len)
                .is_some_and(|end| end <= self.address + self.len)
    }

    /// The device the region is registered on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        if let Ok(verbs) = verbs() {
            // SAFETY: registered by us, deregistered once.
            unsafe { (verbs.dereg_mr)(self.mr) };
        }
    }
}
