//! The object store as seen from one real client: writes and reads through the master
//! and this node's global segment. The RPC handlers and the in-process (embedded) API
//! both call it with already-translated memory.

use std::sync::Arc;
use std::time::Instant;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master::MasterService;
use mooncake_core::protocol::rpc::WriteMode;
use mooncake_core::types::{ReplicaDescriptor, ReplicaLocation, ReplicateConfig, SegmentId};
use mooncake_shm::{MemSlice, SharedMemory};

/// Bytes to write: shared-memory slices (concatenated) or ordinary memory.
#[derive(Debug)]
pub enum Payload<'a> {
    /// Ranges of registered shared memory, in order.
    Slices(Vec<MemSlice>),
    /// Bytes in this process.
    Bytes(&'a [u8]),
}

impl Payload<'_> {
    /// Total length, or `None` if it overflows.
    pub fn total_len(&self) -> Option<u64> {
        match self {
            Payload::Slices(slices) => slices
                .iter()
                .try_fold(0u64, |acc, s| acc.checked_add(s.len() as u64)),
            Payload::Bytes(bytes) => Some(bytes.len() as u64),
        }
    }

    fn copy_into(&self, dest: &MemSlice) {
        match self {
            Payload::Bytes(bytes) => {
                dest.write_from(bytes);
            }
            Payload::Slices(slices) => {
                let mut offset = 0u64;
                for slice in slices {
                    if let Some(part) = dest.sub(offset, slice.len() as u64) {
                        slice.copy_to(&part);
                    }
                    offset += slice.len() as u64;
                }
            }
        }
    }
}

/// This node's global segment: its memory and its id at the master.
#[derive(Debug)]
pub struct LocalSegment {
    /// The segment's memory.
    pub memory: Arc<SharedMemory>,
    /// Its id at the master.
    pub id: SegmentId,
}

/// Reads and writes objects through the master and the local segment.
#[derive(Debug)]
pub struct Store {
    master: Arc<MasterService>,
    segment: LocalSegment,
}

impl Store {
    /// A store over `master` with `segment` mounted.
    pub fn new(master: Arc<MasterService>, segment: LocalSegment) -> Self {
        Store { master, segment }
    }

    /// The master this store talks to.
    pub fn master(&self) -> &Arc<MasterService> {
        &self.master
    }

    /// The local segment.
    pub fn segment(&self) -> &LocalSegment {
        &self.segment
    }

    /// The memory of one replica, if it lives in this node's segment.
    fn replica_memory(&self, replica: &ReplicaDescriptor) -> CodeResult<MemSlice> {
        let ReplicaLocation::Memory {
            segment, offset, ..
        } = &replica.location;
        if *segment != self.segment.id {
            // Remote segments need the transfer engine (cluster mode).
            return Err(ErrorCode::TRANSFER_FAIL);
        }
        self.segment
            .memory
            .slice(*offset, replica.size)
            .ok_or(ErrorCode::INVALID_REPLICA)
    }

    /// Writes `payload` under `key`. With [`WriteMode::Put`] an existing key is left
    /// unchanged and reported as success (puts never overwrite); with
    /// [`WriteMode::Upsert`] it is replaced once the new bytes are complete.
    pub fn put(
        &self,
        key: &str,
        payload: &Payload<'_>,
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> CodeResult<()> {
        let size = payload.total_len().ok_or(ErrorCode::INVALID_PARAMS)?;
        let started = match mode {
            WriteMode::Put => self.master.put_start(key, size, config),
            WriteMode::Upsert => self.master.upsert_start(key, size, config),
        };
        let started = match started {
            Ok(started) => started,
            Err(ErrorCode::OBJECT_ALREADY_EXISTS) if mode == WriteMode::Put => return Ok(()),
            Err(code) => return Err(code),
        };
        let written = started.replicas.iter().try_for_each(|replica| {
            let dest = self.replica_memory(replica)?;
            payload.copy_into(&dest);
            Ok(())
        });
        match written {
            Ok(()) => self.master.put_end(key),
            Err(code) => {
                let _ = self.master.put_revoke(key);
                Err(code)
            }
        }
    }

    /// Copies the object into `dest`, which must be at least as large (else
    /// `BUFFER_OVERFLOW`). Returns the object size.
    pub fn get_into(&self, key: &str, dest: &MemSlice) -> CodeResult<u64> {
        self.get_scatter(key, std::slice::from_ref(dest))
    }

    /// Copies the object into `dests` in order (each filled before the next); together
    /// they must hold the whole object (else `BUFFER_OVERFLOW`). Returns the object size.
    pub fn get_scatter(&self, key: &str, dests: &[MemSlice]) -> CodeResult<u64> {
        self.read(key, |source| {
            let size = source.len() as u64;
            let capacity = dests.iter().map(|d| d.len() as u64).sum::<u64>();
            if capacity < size {
                return Err(ErrorCode::BUFFER_OVERFLOW);
            }
            let mut offset = 0u64;
            for dest in dests {
                if offset == size {
                    break;
                }
                let len = (dest.len() as u64).min(size - offset);
                let part = source.sub(offset, len).ok_or(ErrorCode::INTERNAL_ERROR)?;
                part.copy_to(dest);
                offset += len;
            }
            Ok(size)
        })
    }

    /// Copies fragments of one object under a single lease: each `(dest, src_offset)`
    /// gets `dest.len()` bytes from `src_offset`, or `INVALID_PARAMS` when that runs past
    /// the object. A missing object fails every fragment with the same code.
    pub fn get_ranges(&self, key: &str, fragments: &[(MemSlice, u64)]) -> Vec<CodeResult<u64>> {
        let copied = self.read(key, |source| {
            Ok(fragments
                .iter()
                .map(|(dest, src_offset)| {
                    let part = source
                        .sub(*src_offset, dest.len() as u64)
                        .ok_or(ErrorCode::INVALID_PARAMS)?;
                    part.copy_to(dest);
                    Ok(dest.len() as u64)
                })
                .collect::<Vec<_>>())
        });
        copied.unwrap_or_else(|code| fragments.iter().map(|_| Err(code)).collect())
    }

    /// Copies the whole object into a new vector.
    pub fn get_bytes(&self, key: &str) -> CodeResult<Vec<u8>> {
        self.read(key, |source| Ok(source.to_vec()))
    }

    /// Finds a readable replica, runs `copy` on its memory, and checks that the read
    /// lease still held when the copy finished (else the bytes may be stale:
    /// `LEASE_EXPIRED`).
    fn read<T>(&self, key: &str, copy: impl FnOnce(&MemSlice) -> CodeResult<T>) -> CodeResult<T> {
        let before = Instant::now();
        let (replicas, lease) = self.master.get_replica_list(key)?;
        let replica = replicas.first().ok_or(ErrorCode::REPLICA_NOT_FOUND)?;
        let source = self.replica_memory(replica)?;
        let value = copy(&source)?;
        if before.elapsed() > lease {
            return Err(ErrorCode::LEASE_EXPIRED);
        }
        Ok(value)
    }
}
