//! The read path: whole, scattered, ranged and batched reads.
//!
//! Invariants:
//! * **A read copies under a lease.** The master names the replicas with a read lease;
//!   while it holds, no remove or eviction frees them. A copy counts only when it
//!   finished before the lease ended (counted from when the master was asked):
//!   otherwise the read answers `LEASE_EXPIRED`, since the bytes may be another
//!   object's by then ([`PlannedRead::finish`]).
//! * **Never a torn local read.** A replica in this node's segment is copied once no
//!   write in flight covers its bytes (`Store::place_to_read`, see
//!   [`crate::writes_in_flight`]); a failed write in flight fails the read.
//! * **Replica order.** This node's replica first, then the peers' in the master's
//!   order; a peer that fails (`TRANSFER_FAIL`) passes the read to the next replica.
//!   A batch asks the master once and pipelines the copies from each peer on one
//!   connection; an item whose peer copy failed is read again replica by replica.
//!   Its reads from this node's SSD tier run several at a time (an item whose disk
//!   read failed answers that read's error, as a single read would).
//! * **Nothing to release.** Leases end on their own; bounce and staging buffers are
//!   returned when dropped.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::types::ReplicaDescriptor;
use mooncake_shm::MemSlice;

use super::{Place, Store, transfer_blocking};
use crate::master_link::MasterLink;
use crate::read_cache::Located;
use crate::region::Region;
use crate::transfer::Transfer;
use crate::transfer::seam::{self, Direction};

impl Store {
    /// Copies the object into `dest`, which must be at least as large (else
    /// `BUFFER_OVERFLOW`). Returns the object size.
    pub async fn get_into(&self, key: &str, dest: &Region) -> CodeResult<u64> {
        self.get_scatter(key, std::slice::from_ref(dest)).await
    }

    /// Copies the object into `dests` in order (each filled before the next); together
    /// they must hold the whole object (else `BUFFER_OVERFLOW`). Returns the object size.
    pub async fn get_scatter(&self, key: &str, dests: &[Region]) -> CodeResult<u64> {
        self.read(key, |size| scatter(dests, size)).await
    }

    /// Copies the whole object into a new vector.
    pub async fn get_bytes(&self, key: &str) -> CodeResult<Vec<u8>> {
        self.get_bytes_with(&self.master, key).await
    }

    /// Copies fragments of one object under a single lease: each `(dest, src_offset)`
    /// gets `dest.len()` bytes from `src_offset`, or `INVALID_PARAMS` when that runs past
    /// the object. A missing object fails every fragment with the same code. Answers
    /// the object size (`None`: not read) and the result of each fragment.
    pub async fn get_ranges(
        &self,
        key: &str,
        fragments: &[(Region, u64)],
    ) -> (Option<u64>, Vec<CodeResult<u64>>) {
        let verdicts = parking_lot::Mutex::new(Vec::new());
        let result = self
            .read(key, |size| {
                let mut pieces = Vec::new();
                let mut out = Vec::new();
                for (dest, src_offset) in fragments {
                    let fits = src_offset
                        .checked_add(dest.len())
                        .is_some_and(|end| end <= size);
                    if fits {
                        pieces.push((*src_offset, dest.clone()));
                        out.push(Ok(dest.len()));
                    } else {
                        out.push(Err(ErrorCode::INVALID_PARAMS));
                    }
                }
                *verdicts.lock() = out;
                Ok(pieces)
            })
            .await;
        match result {
            Ok(size) => (Some(size), verdicts.into_inner()),
            Err(code) => (None, fragments.iter().map(|_| Err(code)).collect()),
        }
    }

    /// Finds a readable replica, asks `plan` which `(object offset, destination)`
    /// pieces to copy given the object size, copies them (memcpy from this node's
    /// segment, the transfer engine from a peer's), and checks that the read lease
    /// still held when the copy finished (else the bytes may be stale:
    /// `LEASE_EXPIRED`). Returns the object size.
    async fn read(
        &self,
        key: &str,
        plan: impl FnOnce(u64) -> CodeResult<Vec<(u64, Region)>>,
    ) -> CodeResult<u64> {
        self.read_with(&self.master, key, plan).await
    }

    /// Copies the whole object into a new vector, naming it through `link` (the SSD
    /// tier reads with the master's own keys).
    pub async fn get_bytes_with(&self, link: &MasterLink, key: &str) -> CodeResult<Vec<u8>> {
        let buffer = parking_lot::Mutex::new(None);
        self.read_with(link, key, |size| {
            let staged = stage_zeroed(size)?;
            *buffer.lock() = Some(staged.clone());
            Ok(vec![(0, Region::Mapped(staged))])
        })
        .await?;
        buffer
            .into_inner()
            .map(|s| s.to_vec())
            .ok_or(ErrorCode::INTERNAL_ERROR)
    }

    /// [`read`](Self::read) with keys named through `link`.
    async fn read_with(
        &self,
        link: &MasterLink,
        key: &str,
        plan: impl FnOnce(u64) -> CodeResult<Vec<(u64, Region)>>,
    ) -> CodeResult<u64> {
        let located = link
            .locate(&[key], |replicas| self.own_replica(replicas).is_some())
            .await
            .pop()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))?;
        self.read_located(&link.scope(key), located, plan)
    }

    /// Copies each object into its destinations as
    /// [`get_scatter`](Self::get_scatter) does, with one master round trip for the
    /// whole batch; the copies from each peer are pipelined on one connection, and
    /// those from this node's SSD tier read several at a time. One result (the object
    /// size) per item, in order.
    pub async fn get_scatter_many(&self, items: &[(&str, Vec<Region>)]) -> Vec<CodeResult<u64>> {
        let keys: Vec<&str> = items.iter().map(|(key, _)| *key).collect();
        let located = self
            .master
            .locate(&keys, |replicas| self.own_replica(replicas).is_some())
            .await;
        let planned: Vec<CodeResult<PlannedRead>> = items
            .iter()
            .zip(located)
            .map(|((_, dests), located)| self.plan_read(located?, |size| scatter(dests, size)))
            .collect();
        let copied_from_peers = self.read_from_peers(&planned);
        let from_disk = self.read_from_local_disk(&keys, &planned, &copied_from_peers);
        let mut done = copied_from_peers;
        done.extend(from_disk.keys());
        // The item's plan, unless planning or its read from this node's disk failed:
        // both paths below start here, so neither can answer success for a failed read.
        let ready = |index: usize| {
            let planned = planned[index].as_ref().map_err(|code| *code)?;
            if let Some(read) = from_disk.get(&index) {
                read.map(|_| ())?;
            }
            Ok(planned)
        };
        let finish = |index: usize| {
            let planned = ready(index)?;
            // Not for a peer or the disk, or its peer failed: replica by replica.
            if !done.contains(&index) {
                self.copy_planned(&self.master.scope(items[index].0), planned)?;
            }
            planned.finish()
        };
        let Some((bytes, sources)) = self.local_host_sources(&planned, &done) else {
            return (0..items.len()).map(finish).collect();
        };
        // Plain memory copies from slices resolved here: nothing on the copy threads
        // looks at the segment's state, a peer, a disk or a GPU.
        mooncake_shm::map_items(items.len(), bytes, |index| {
            let planned = ready(index)?;
            if let Some(source) = &sources[index] {
                copy_local(source, &planned.pieces)?;
            }
            planned.finish()
        })
    }

    /// When every planned read left to copy here is a plain memory copy (from this
    /// node's segment into host memory): the bytes they move and, per item, the slice
    /// of the segment to copy from (`None`: nothing to copy here). `None` when some
    /// read goes to a disk, a peer or a GPU.
    fn local_host_sources(
        &self,
        planned: &[CodeResult<PlannedRead>],
        done: &HashSet<usize>,
    ) -> Option<(u64, Vec<Option<MemSlice>>)> {
        let mut bytes = 0u64;
        let mut sources = Vec::with_capacity(planned.len());
        for (index, planned) in planned.iter().enumerate() {
            let planned = match planned {
                Ok(planned) if !done.contains(&index) => planned,
                _ => {
                    sources.push(None);
                    continue;
                }
            };
            let Some(Ok(Place::Local(source))) =
                planned.replicas.first().map(|r| self.place_to_read(r))
            else {
                return None;
            };
            if planned
                .pieces
                .iter()
                .any(|(_, dest)| dest.device_api().is_some())
            {
                return None;
            }
            bytes = bytes.saturating_add(planned.size);
            sources.push(Some(source));
        }
        Some((bytes, sources))
    }

    /// Copies, per peer and pipelined, every planned read whose first replica is in a
    /// peer's segment and whose destinations are all mapped here; answers the items
    /// wholly copied that way (the others are left to [`copy_planned`](Self::copy_planned)).
    fn read_from_peers(&self, planned: &[CodeResult<PlannedRead>]) -> HashSet<usize> {
        let mut by_peer: BTreeMap<&str, Vec<(usize, Transfer<'_>)>> = Default::default();
        let mut copied = HashSet::new();
        for (index, planned) in planned.iter().enumerate() {
            let Ok(planned) = planned else { continue };
            let Some(Ok(Place::Remote {
                endpoint,
                segment,
                offset,
                grant,
            })) = planned.replicas.first().map(|r| self.place(r))
            else {
                continue;
            };
            let mapped: Option<Vec<(u64, &MemSlice)>> = planned
                .pieces
                .iter()
                .map(|(at, dest)| dest.mapped().map(|local| (*at, local)))
                .collect();
            let Some(mapped) = mapped else { continue };
            let reads = by_peer.entry(endpoint).or_default();
            for (at, local) in mapped {
                let transfer = Transfer {
                    segment,
                    offset: offset + at,
                    grant,
                    local,
                };
                reads.push((index, transfer));
            }
            copied.insert(index);
        }
        for (endpoint, reads) in by_peer {
            let transfers: Vec<Transfer<'_>> = reads.iter().map(|(_, t)| *t).collect();
            let outcomes = transfer_blocking(|| {
                self.transport
                    .read_many(endpoint, &transfers, seam::deadline())
            });
            for ((index, _), outcome) in reads.iter().zip(outcomes) {
                if outcome.is_err() {
                    copied.remove(index);
                }
            }
        }
        copied
    }

    /// Reads, several at a time, every planned read (of `keys[i]`) not `copied` yet
    /// whose first replica is on this node's SSD tier and whose single destination is
    /// mapped here and holds the whole object; answers each such item's outcome by
    /// index, except those that failed with `TRANSFER_FAIL` (left, with the others, to
    /// [`copy_planned`](Self::copy_planned), which tries the next replica).
    fn read_from_local_disk(
        &self,
        keys: &[&str],
        planned: &[CodeResult<PlannedRead>],
        copied: &HashSet<usize>,
    ) -> BTreeMap<usize, CodeResult<u64>> {
        let Some(disk) = self.disk.as_ref() else {
            return BTreeMap::new();
        };
        let mut reads: Vec<(usize, String, &MemSlice)> = Vec::new();
        for (index, (key, planned)) in keys.iter().zip(planned).enumerate() {
            let Ok(planned) = planned else { continue };
            let Some(replica) = planned.replicas.first() else {
                continue;
            };
            let whole = match planned.pieces.as_slice() {
                [(0, dest)] if dest.len() == replica.size => dest.mapped(),
                _ => None,
            };
            if let (Some(dest), Ok(Place::LocalDisk), false) =
                (whole, self.place(replica), copied.contains(&index))
            {
                reads.push((index, self.master.scope(key).into_owned(), dest));
            }
        }
        if reads.len() < 2 {
            return BTreeMap::new();
        }
        let items: Vec<(&str, &MemSlice)> = reads
            .iter()
            .map(|(_, key, dest)| (key.as_str(), *dest))
            .collect();
        let outcomes = transfer_blocking(|| disk.read_many_into(&items));
        reads
            .iter()
            .zip(outcomes)
            .filter(|(_, outcome)| *outcome != Err(ErrorCode::TRANSFER_FAIL))
            .map(|((index, ..), outcome)| (*index, outcome))
            .collect()
    }

    /// Copies from the replicas the master named.
    fn read_located(
        &self,
        stored_key: &str,
        located: Located,
        plan: impl FnOnce(u64) -> CodeResult<Vec<(u64, Region)>>,
    ) -> CodeResult<u64> {
        let planned = self.plan_read(located, plan)?;
        self.copy_planned(stored_key, &planned)?;
        planned.finish()
    }

    /// Orders the replicas (this node's first, then the peers' in the master's order)
    /// and asks `plan` for the pieces to copy.
    fn plan_read(
        &self,
        Located {
            mut replicas,
            lease,
            asked_at,
        }: Located,
        plan: impl FnOnce(u64) -> CodeResult<Vec<(u64, Region)>>,
    ) -> CodeResult<PlannedRead> {
        replicas.sort_by_key(|r| !matches!(self.place(r), Ok(Place::Local(_))));
        let size = replicas.first().ok_or(ErrorCode::REPLICA_NOT_FOUND)?.size;
        let pieces = plan(size)?;
        Ok(PlannedRead {
            replicas,
            lease,
            asked_at,
            size,
            pieces,
        })
    }

    /// Copies a planned read from its first replica that answers.
    fn copy_planned(&self, stored_key: &str, planned: &PlannedRead) -> CodeResult<()> {
        let mut outcome = Err(ErrorCode::REPLICA_NOT_FOUND);
        for replica in &planned.replicas {
            outcome = self.copy_from(replica, &planned.pieces, stored_key);
            match outcome {
                // A peer that died since the master answered: try the next replica.
                Err(ErrorCode::TRANSFER_FAIL) => continue,
                _ => break,
            }
        }
        outcome
    }

    /// Copies `(object offset, destination)` pieces from one replica.
    fn copy_from(
        &self,
        replica: &ReplicaDescriptor,
        pieces: &[(u64, Region)],
        stored_key: &str,
    ) -> CodeResult<()> {
        let from_value = |value: &[u8]| -> CodeResult<()> {
            if value.len() as u64 != replica.size {
                return Err(ErrorCode::TRANSFER_FAIL);
            }
            for (offset, dest) in pieces {
                let start = usize::try_from(*offset).map_err(|_| ErrorCode::INVALID_PARAMS)?;
                let len = usize::try_from(dest.len()).map_err(|_| ErrorCode::INVALID_PARAMS)?;
                let part = start
                    .checked_add(len)
                    .and_then(|end| value.get(start..end))
                    .ok_or(ErrorCode::INVALID_PARAMS)?;
                dest.write_bytes(part)?;
            }
            Ok(())
        };
        // The whole object into one mapped destination: disk reads land there directly.
        let whole = match pieces {
            [(0, dest)] if dest.len() == replica.size => dest.mapped(),
            _ => None,
        };
        match self.place_to_read(replica)? {
            Place::LocalDisk => {
                let disk = self.disk.as_ref().ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
                transfer_blocking(|| match whole {
                    Some(dest) => dest
                        .fill_with(|bytes| disk.read_into(stored_key, bytes))
                        .map(|_| ()),
                    None => from_value(&disk.read_staged(stored_key)?),
                })
            }
            Place::RemoteDisk { endpoint, grant } => transfer_blocking(|| {
                self.remote_disk_reads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                match whole {
                    Some(dest) => self.peers.read_disk_into(endpoint, stored_key, grant, dest),
                    None => from_value(&self.peers.read_disk(
                        endpoint,
                        stored_key,
                        grant,
                        replica.size,
                    )?),
                }
            }),
            Place::Local(source) => copy_local(&source, pieces),
            Place::Remote {
                endpoint,
                segment,
                offset,
                grant,
            } => transfer_blocking(|| {
                pieces.iter().try_for_each(|(at, dest)| {
                    let read = |local: &MemSlice| {
                        let transfer = Transfer {
                            segment,
                            offset: offset + at,
                            grant,
                            local,
                        };
                        self.transport.run_one(endpoint, Direction::Read, transfer)
                    };
                    match dest.mapped() {
                        Some(slice) => read(slice),
                        // Declared or GPU memory: received into a bounce buffer,
                        // then copied over.
                        None => {
                            let bounce = self.bounce.take(dest.len(), dest.device_api())?;
                            read(&bounce)?;
                            dest.fill_from(&bounce)
                        }
                    }
                })
            }),
        }
    }
}

/// A read ready to copy: the replicas to try in order, the master's lease on them and
/// when it was asked, the object size and the `(object offset, destination)` pieces.
struct PlannedRead {
    replicas: Vec<ReplicaDescriptor>,
    lease: std::time::Duration,
    asked_at: Instant,
    size: u64,
    pieces: Vec<(u64, Region)>,
}

impl PlannedRead {
    /// The object size, once copied, if the lease (counted from when the master was
    /// asked) still held: else the bytes may be stale (`LEASE_EXPIRED`).
    fn finish(&self) -> CodeResult<u64> {
        if self.asked_at.elapsed() > self.lease {
            return Err(ErrorCode::LEASE_EXPIRED);
        }
        Ok(self.size)
    }
}

/// Copies `(object offset, destination)` pieces from a replica in this node's segment.
fn copy_local(source: &MemSlice, pieces: &[(u64, Region)]) -> CodeResult<()> {
    for (offset, dest) in pieces {
        let part = source
            .sub(*offset, dest.len())
            .ok_or(ErrorCode::INVALID_PARAMS)?;
        dest.fill_from(&part)?;
    }
    Ok(())
}

/// The `(object offset, destination)` pieces that fill `dests` in order with an object
/// of `size` bytes; `BUFFER_OVERFLOW` when they hold less.
fn scatter(dests: &[Region], size: u64) -> CodeResult<Vec<(u64, Region)>> {
    let capacity = dests.iter().map(Region::len).sum::<u64>();
    if capacity < size {
        return Err(ErrorCode::BUFFER_OVERFLOW);
    }
    let mut offset = 0u64;
    let mut pieces = Vec::with_capacity(dests.len());
    for dest in dests {
        if offset == size {
            break;
        }
        let len = dest.len().min(size - offset);
        pieces.push((offset, dest.sub(0, len).ok_or(ErrorCode::INTERNAL_ERROR)?));
        offset += len;
    }
    Ok(pieces)
}

fn stage_zeroed(len: u64) -> CodeResult<MemSlice> {
    let memory = mooncake_shm::SharedMemory::create(
        "mooncake_bounce",
        len.max(1),
        mooncake_shm::shared_memory::PageSize::Normal,
    )
    .map_err(|_| ErrorCode::NO_AVAILABLE_HANDLE)?;
    Arc::new(memory)
        .slice(0, len)
        .ok_or(ErrorCode::INVALID_PARAMS)
}
