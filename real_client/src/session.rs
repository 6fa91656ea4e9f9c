//! Per-dummy state: who the dummy is, the shared memory it registered and the ordinary
//! memory it declared.
//!
//! A session lives exactly as long as the dummy's main connection. When it closes (clean
//! exit, crash, kill -9), [`Sessions::remove`] drops the session, which unmaps the
//! dummy's memory as soon as no copy in flight still uses it, and forgets its declared
//! memory.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use mooncake_core::protocol::rpc::DummyInfo;
use mooncake_shm::{MemSlice, Registry, TranslateError};

use crate::declared::DeclaredMemory;
use crate::device_buffers::DeviceBuffers;
use crate::hard_pins::HardPins;
use crate::read_leases::ReadLeases;
use crate::region::Region;

/// One attached dummy.
#[derive(Debug)]
pub struct Session {
    /// The dummy's random id.
    pub client_id: u128,
    /// Its process id (from the socket credentials).
    pub pid: u32,
    /// Its uid (from the socket credentials).
    pub uid: u32,
    /// Its self-reported name.
    pub name: String,
    /// Its registered shared memory.
    registry: RwLock<Registry>,
    /// Its declared ordinary memory.
    declared: DeclaredMemory,
    /// Its registered GPU buffers.
    devices: DeviceBuffers,
    /// `(base, len)` of each registered segment that is a staging buffer.
    staging: RwLock<Vec<(u64, u64)>>,
    /// Its hard-pinned objects, against its quota.
    hard_pins: Mutex<HardPins>,
    /// The read leases its reads hold, against its quota.
    read_leases: Mutex<ReadLeases>,
    /// Whether it runs in this process (asked on every write: kept, not a syscall).
    in_process: bool,
}

impl Session {
    /// A session with no memory registered yet. Opens the dummy process (for copies of
    /// memory it may declare) now, while it is connected.
    pub fn new(client_id: u128, pid: u32, uid: u32, name: String) -> Self {
        Session {
            client_id,
            pid,
            uid,
            name,
            registry: RwLock::new(Registry::default()),
            declared: DeclaredMemory::new(pid, uid),
            devices: DeviceBuffers::default(),
            staging: RwLock::new(Vec::new()),
            hard_pins: Mutex::new(HardPins::default()),
            read_leases: Mutex::new(ReadLeases::default()),
            in_process: pid == std::process::id(),
        }
    }

    /// Its hard-pinned objects, counted against `--max_hard_pinned_bytes_per_dummy`.
    pub fn hard_pins(&self) -> &Mutex<HardPins> {
        &self.hard_pins
    }

    /// The read leases its reads hold, counted against
    /// `--max_read_leased_bytes_per_dummy`.
    pub fn read_leases(&self) -> &Mutex<ReadLeases> {
        &self.read_leases
    }

    /// True for a dummy running in this process (embedded mode).
    pub fn is_in_process(&self) -> bool {
        self.in_process
    }

    /// Translates a dummy range into its shared memory.
    pub fn translate(&self, addr: u64, len: u64) -> Result<MemSlice, TranslateError> {
        self.registry.read().translate(addr, len)
    }

    /// The dummy's `addr..addr+len`: inside its shared memory, or else wholly inside
    /// one range of ordinary memory it declared (when that can be reached), or one GPU
    /// buffer it registered.
    pub fn region(&self, addr: u64, len: u64) -> Result<Region, TranslateError> {
        match self.translate(addr, len) {
            Ok(slice) => Ok(Region::Mapped(slice)),
            Err(error) => self
                .declared
                .region(addr, len)
                .or_else(|| self.devices.region(addr, len))
                .ok_or(error),
        }
    }

    /// The GPU buffers the dummy registered.
    pub fn devices(&self) -> &DeviceBuffers {
        &self.devices
    }

    /// Notes that the registered segment at `base..base+len` is the dummy's staging
    /// buffer: bytes it names there were copied by the dummy.
    pub fn mark_staging(&self, base: u64, len: u64) {
        self.staging.write().push((base, len));
    }

    /// True when `addr` lies inside one of the dummy's staging buffers.
    pub fn in_staging(&self, addr: u64) -> bool {
        self.staging
            .read()
            .iter()
            .any(|&(base, len)| addr >= base && addr - base < len)
    }

    /// The ordinary memory the dummy declared.
    pub fn declared(&self) -> &DeclaredMemory {
        &self.declared
    }

    /// The registry, for adding segments.
    pub fn registry(&self) -> &RwLock<Registry> {
        &self.registry
    }

    /// A status line for this dummy.
    pub fn info(&self) -> DummyInfo {
        let registry = self.registry.read();
        DummyInfo {
            client_id: self.client_id,
            pid: self.pid,
            uid: self.uid,
            name: self.name.clone(),
            segments: u32::try_from(registry.segment_count()).unwrap_or(u32::MAX),
            mapped_bytes: registry.mapped_bytes(),
            declared_ranges: u32::try_from(self.declared.count()).unwrap_or(u32::MAX),
            cross_memory: self.declared.reachable(),
            device_buffers: u32::try_from(self.devices.count()).unwrap_or(u32::MAX),
        }
    }
}

/// Every attached dummy, by client id.
#[derive(Debug, Default)]
pub struct Sessions {
    by_id: Mutex<HashMap<u128, Arc<Session>>>,
    /// Held while a segment is registered (see [`Sessions::registering`]).
    registering: Mutex<()>,
}

impl Sessions {
    /// Sessions attached now.
    pub fn count(&self) -> usize {
        self.by_id.lock().len()
    }

    /// Serializes registrations, so that a limit on the total mapped by every session
    /// holds exactly.
    pub fn registering(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.registering.lock()
    }

    /// Bytes of shared memory mapped for every session but `session`.
    pub fn mapped_bytes_except(&self, session: &Arc<Session>) -> u64 {
        let others: Vec<Arc<Session>> = self
            .by_id
            .lock()
            .values()
            .filter(|other| !Arc::ptr_eq(other, session))
            .cloned()
            .collect();
        others
            .iter()
            .map(|other| other.registry().read().mapped_bytes())
            .fold(0, u64::saturating_add)
    }

    /// Adds a session, replacing a stale one with the same id.
    pub fn insert(&self, session: Arc<Session>) {
        self.by_id.lock().insert(session.client_id, session);
    }

    /// Removes `session` (only that exact session, not a newer one with the same id).
    pub fn remove(&self, session: &Arc<Session>) {
        let mut by_id = self.by_id.lock();
        if by_id
            .get(&session.client_id)
            .is_some_and(|current| Arc::ptr_eq(current, session))
        {
            by_id.remove(&session.client_id);
        }
    }

    /// The session of a client id.
    pub fn get(&self, client_id: u128) -> Option<Arc<Session>> {
        self.by_id.lock().get(&client_id).cloned()
    }

    /// Status of every session, sorted by pid.
    pub fn infos(&self) -> Vec<DummyInfo> {
        let sessions: Vec<Arc<Session>> = self.by_id.lock().values().cloned().collect();
        let mut infos: Vec<DummyInfo> = sessions.iter().map(|s| s.info()).collect();
        infos.sort_by_key(|i| i.pid);
        infos
    }
}
