//! The object store as seen from one real client: writes and reads through the master,
//! this node's segment (memcpy) and peers' segments (the transfer engine). The RPC
//! handlers and the in-process (embedded) API both call it with already-translated
//! memory: [`Region`]s of a dummy's shared memory (mapped here) or of its declared
//! ordinary memory (copied once across processes, straight to or from the segment; a
//! peer's segment is reached through a private bounce buffer, because the transfer
//! engine sends from and receives into mappings of this process).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::{PutStarted, TaskWork};
use mooncake_core::protocol::grant::{Grant, GrantedRange};
use mooncake_core::types::WriteMode;
use mooncake_core::types::{ReplicaDescriptor, ReplicaLocation, ReplicateConfig, SegmentId};
use mooncake_device::DeviceApi;
use mooncake_shm::MemSlice;

use crate::bounce::BouncePool;
use crate::disk::DiskTier;
use crate::master_link::MasterLink;
use crate::read_cache::Located;
use crate::region::Region;
use crate::reservations::{MAX_RESERVED_VALUE, Reserved, Shape};
use crate::transfer::TransferClient;
use crate::transfer::client::Transfer;
use crate::transfer::server::ServedSegment;

/// A reservation a put took, with the shape it was kept under (to give it back).
type Taken = (Arc<Shape>, Reserved);

/// Bytes to write: ranges of a dummy's memory (concatenated) or bytes of this process.
#[derive(Debug)]
pub enum Payload<'a> {
    /// Ranges of the dummy's shared or declared memory, in order.
    Regions(Vec<Region>),
    /// Bytes in this process.
    Bytes(&'a [u8]),
}

impl Payload<'_> {
    /// Total length, or `None` if it overflows.
    pub fn total_len(&self) -> Option<u64> {
        match self {
            Payload::Regions(regions) => regions
                .iter()
                .try_fold(0u64, |acc, r| acc.checked_add(r.len())),
            Payload::Bytes(bytes) => Some(bytes.len() as u64),
        }
    }

    /// True when the transfer engine can send every byte from where it is (bytes of
    /// this process and declared memory of a dummy must be bounced first).
    fn is_mapped(&self) -> bool {
        match self {
            Payload::Regions(regions) => regions.iter().all(|r| r.mapped().is_some()),
            Payload::Bytes(_) => false,
        }
    }

    /// The GPU interface of the first device range of the payload, if any.
    fn device_api(&self) -> Option<DeviceApi> {
        match self {
            Payload::Regions(regions) => regions.iter().find_map(Region::device_api),
            Payload::Bytes(_) => None,
        }
    }

    /// The whole payload copied into one bounce buffer of `pool` (for peers).
    fn bounce(&self, pool: &BouncePool) -> CodeResult<MemSlice> {
        let len = self.total_len().ok_or(ErrorCode::INVALID_PARAMS)?;
        let staged = pool.take(len, self.device_api())?;
        match self {
            Payload::Bytes(bytes) => {
                staged.write_from(bytes);
            }
            Payload::Regions(regions) => {
                let mut offset = 0u64;
                for region in regions {
                    let part = staged
                        .sub(offset, region.len())
                        .ok_or(ErrorCode::INTERNAL_ERROR)?;
                    region.copy_into(&part)?;
                    offset += region.len();
                }
            }
        }
        Ok(staged)
    }
}

/// One copy of a batch write bound for a peer's segment.
#[derive(Debug)]
struct PeerWrite {
    /// The batch item it belongs to.
    item: usize,
    endpoint: String,
    segment: u64,
    offset: u64,
    grant: Option<GrantedRange>,
    source: MemSlice,
}

/// Where one replica's bytes are, seen from this node.
enum Place<'a> {
    /// In this node's segment.
    Local(MemSlice),
    /// In a peer's segment.
    Remote {
        endpoint: &'a str,
        segment: u64,
        offset: u64,
        /// The master's grant for the replica's whole range.
        grant: Option<GrantedRange>,
    },
    /// On this node's SSD tier.
    LocalDisk,
    /// On a peer's SSD tier (its transfer engine reads it for us).
    RemoteDisk {
        endpoint: &'a str,
        grant: Option<Grant>,
    },
}

/// Reads and writes objects through the master, the local segment and peers.
#[derive(Debug)]
pub struct Store {
    master: MasterLink,
    segment: Arc<ServedSegment>,
    transfers: TransferClient,
    /// This node's SSD tier, when enabled.
    disk: Option<Arc<DiskTier>>,
    /// This node's segment name (disk replicas name their owner by it).
    segment_name: String,
    /// Reads served from another node's SSD tier (upstream's offload RPC reads).
    remote_disk_reads: std::sync::atomic::AtomicU64,
    /// Buffers that carry to and from peers what is not mapped here.
    bounce: BouncePool,
}

fn transfer_blocking<T>(work: impl FnOnce() -> T) -> T {
    // Peer transfers are blocking socket I/O on a multi-threaded runtime: let the
    // runtime move other tasks off this worker meanwhile.
    tokio::task::block_in_place(work)
}

impl Store {
    /// A store over `master` with `segment` mounted, reaching peers through `transfers`.
    pub fn new(
        master: MasterLink,
        segment: Arc<ServedSegment>,
        segment_name: String,
        disk: Option<Arc<DiskTier>>,
        transfers: TransferClient,
    ) -> Self {
        Store {
            master,
            segment,
            transfers,
            disk,
            segment_name,
            remote_disk_reads: std::sync::atomic::AtomicU64::new(0),
            bounce: BouncePool::default(),
        }
    }

    /// Number of reads served from another node's SSD tier since start.
    pub fn remote_disk_reads(&self) -> u64 {
        self.remote_disk_reads
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This node's SSD tier, when enabled.
    pub fn disk(&self) -> Option<&Arc<DiskTier>> {
        self.disk.as_ref()
    }

    /// The master this store talks to.
    pub fn master(&self) -> &MasterLink {
        &self.master
    }

    /// The local segment.
    pub fn segment(&self) -> &Arc<ServedSegment> {
        &self.segment
    }

    /// The bytes of the replica among `replicas` that lies in this node's own segment.
    pub fn own_replica(&self, replicas: &[ReplicaDescriptor]) -> Option<MemSlice> {
        replicas
            .iter()
            .find_map(|replica| match self.place_to_read(replica) {
                Ok(Place::Local(bytes)) => Some(bytes),
                _ => None,
            })
    }

    /// [`place`](Self::place) for reading `replica`: a replica in this node's segment
    /// once no write in flight covers its bytes (see [`crate::writes_in_flight`]).
    fn place_to_read<'a>(&self, replica: &'a ReplicaDescriptor) -> CodeResult<Place<'a>> {
        let place = self.place(replica)?;
        if let (Place::Local(_), ReplicaLocation::Memory { offset, .. }) =
            (&place, &replica.location)
        {
            self.segment.writes.settle(*offset, replica.size)?;
        }
        Ok(place)
    }

    fn place<'a>(&self, replica: &'a ReplicaDescriptor) -> CodeResult<Place<'a>> {
        let (segment, segment_name, offset, endpoint) = match &replica.location {
            ReplicaLocation::Memory {
                segment,
                segment_name,
                offset,
                endpoint,
            } => (segment, segment_name, offset, endpoint),
            ReplicaLocation::Disk {
                segment_name,
                endpoint,
            } => {
                return Ok(if *segment_name == self.segment_name {
                    Place::LocalDisk
                } else {
                    Place::RemoteDisk {
                        endpoint,
                        grant: replica.grant,
                    }
                });
            }
        };
        let own = (
            self.segment.id.load(Ordering::Acquire),
            self.segment_name.as_str(),
        );
        if is_own_segment((*segment, segment_name.as_str()), own) {
            return self
                .segment
                .memory
                .slice(*offset, replica.size)
                .map(Place::Local)
                .ok_or(ErrorCode::INVALID_REPLICA);
        }
        if endpoint.is_empty() {
            return Err(ErrorCode::TRANSFER_FAIL);
        }
        Ok(Place::Remote {
            endpoint,
            segment: *segment,
            offset: *offset,
            grant: replica.grant.map(|grant| GrantedRange {
                offset: *offset,
                len: replica.size,
                grant,
            }),
        })
    }

    /// Copies `payload` into one replica.
    fn write_replica(&self, replica: &ReplicaDescriptor, payload: &Payload<'_>) -> CodeResult<()> {
        match (self.place(replica)?, payload) {
            (Place::Local(dest), Payload::Bytes(bytes)) => {
                dest.write_from(bytes);
                Ok(())
            }
            (Place::Local(dest), Payload::Regions(regions)) => {
                let mut offset = 0u64;
                for region in regions {
                    let part = dest
                        .sub(offset, region.len())
                        .ok_or(ErrorCode::INTERNAL_ERROR)?;
                    region.store_into(&part)?;
                    offset += region.len();
                }
                Ok(())
            }
            (
                Place::Remote {
                    endpoint,
                    segment,
                    offset,
                    grant,
                },
                Payload::Regions(regions),
            ) => transfer_blocking(|| {
                let mut at = offset;
                for region in regions {
                    // `write_replicas` bounced every region that is not mapped here.
                    let slice = region.mapped().ok_or(ErrorCode::INTERNAL_ERROR)?;
                    self.transfers.write(endpoint, segment, at, grant, slice)?;
                    at += region.len();
                }
                Ok(())
            }),
            (Place::Remote { .. }, Payload::Bytes(_)) => Err(ErrorCode::NOT_SUPPORTED),
            (Place::LocalDisk | Place::RemoteDisk { .. }, _) => Err(ErrorCode::INVALID_REPLICA),
        }
    }

    /// Writes `payload` under `key`. With [`WriteMode::Put`] an existing key is left
    /// unchanged and reported as success (puts never overwrite); with
    /// [`WriteMode::Upsert`] it is replaced once the new bytes are complete.
    pub async fn put(
        &self,
        key: &str,
        payload: Payload<'_>,
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> CodeResult<()> {
        self.put_many(&[(key, payload)], config, mode)
            .await
            .pop()
            .unwrap_or(Err(ErrorCode::INTERNAL_ERROR))
    }

    /// Writes each `(key, payload)` as [`put`](Self::put) does, with one master round
    /// trip to start the whole batch and one to complete it; values that a reservation
    /// of this node's segment serves need only the second ([`crate::reservations`]).
    /// Keys must be distinct. One result per item, in order.
    pub async fn put_many(
        &self,
        items: &[(&str, Payload<'_>)],
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        let mut results: Vec<CodeResult<()>> = vec![Ok(()); items.len()];
        let mut starts = Vec::with_capacity(items.len());
        let mut positions = Vec::with_capacity(items.len());
        for (index, (key, payload)) in items.iter().enumerate() {
            match payload.total_len() {
                Some(size) => {
                    starts.push((*key, size));
                    positions.push(index);
                }
                None => results[index] = Err(ErrorCode::INVALID_PARAMS),
            }
        }
        let mut reserved = self.take_reservations(&starts, config, mode);
        let to_start: Vec<(&str, u64)> = starts
            .iter()
            .zip(&reserved)
            .filter(|(_, r)| r.is_none())
            .map(|(start, _)| *start)
            .collect();
        let mut started = if to_start.is_empty() {
            Vec::new()
        } else {
            self.master.put_start_many(&to_start, config, mode).await
        }
        .into_iter();
        let mut accepted = Vec::with_capacity(starts.len());
        let mut via = Vec::with_capacity(starts.len());
        for ((index, (key, _)), reservation) in positions.into_iter().zip(starts).zip(&mut reserved)
        {
            if let Some((shape, reservation)) = reservation.take() {
                accepted.push((index, key, reservation.started.clone()));
                via.push(Some((shape, reservation)));
                continue;
            }
            match started.next().unwrap_or(Err(ErrorCode::RPC_FAIL)) {
                Ok(started) => {
                    accepted.push((index, key, started));
                    via.push(None);
                }
                Err(ErrorCode::OBJECT_ALREADY_EXISTS) if mode == WriteMode::Put => {}
                Err(code) => results[index] = Err(code),
            }
        }
        if self.master.is_remote() && copies_here_only(&accepted, &via, items) {
            let reserved = via.into_iter().flatten().collect();
            self.write_while_committing(&accepted, reserved, items, mode, &mut results)
                .await;
            return results;
        }
        // Copies into this node's segment happen now; copies to peers are collected and
        // then pipelined, one connection per peer for the whole batch.
        let written = self.write_started(&accepted, items);
        let mut to_peers = Vec::new();
        let mut copied = Vec::with_capacity(accepted.len());
        let mut revoked = Vec::new();
        for (((index, key, started), via), outcome) in accepted.into_iter().zip(via).zip(written) {
            match outcome {
                Ok(peer_writes) => {
                    to_peers.extend(peer_writes);
                    copied.push((index, key, started.write_id, via));
                }
                Err(code) => {
                    results[index] = Err(code);
                    match via {
                        // Still reserved at the master: the next put overwrites it.
                        Some((shape, reservation)) => {
                            self.master.reservations().give_back(&shape, reservation);
                        }
                        None => revoked.push((key, started.write_id)),
                    }
                }
            }
        }
        let failed = self.write_to_peers(&to_peers);
        let (mut ended, mut ended_at) = (Vec::new(), Vec::new());
        let mut committed = Vec::new();
        for (index, key, write_id, via) in copied {
            match (failed.get(&index), via) {
                (Some(code), None) => {
                    results[index] = Err(*code);
                    revoked.push((key, write_id));
                }
                (Some(code), Some((shape, reservation))) => {
                    results[index] = Err(*code);
                    self.master.reservations().give_back(&shape, reservation);
                }
                (None, None) => {
                    ended.push((key, write_id));
                    ended_at.push(index);
                }
                (None, Some(reserved)) => committed.push((index, key, reserved)),
            }
        }
        if !revoked.is_empty() {
            let _ = self.master.put_revoke_many(&revoked).await;
        }
        if !committed.is_empty() {
            self.commit(committed, mode, &mut results).await;
        }
        if !ended.is_empty() {
            let outcomes = self.master.put_end_many(&ended).await;
            for (index, outcome) in ended_at.into_iter().zip(outcomes) {
                results[index] = outcome;
            }
        }
        results
    }

    /// A ready reservation of this node's segment per `(key, size)` to write, where one
    /// serves (plain puts of small values without pins); asks for more in the
    /// background and gives the expired ones back.
    fn take_reservations(
        &self,
        starts: &[(&str, u64)],
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<Option<Taken>> {
        let mut taken: Vec<Option<Taken>> = starts.iter().map(|_| None).collect();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return taken;
        };
        if mode != WriteMode::Put || !self.segment.contributes {
            return taken;
        }
        // The batch shares one config: one shape per distinct size.
        let mut by_size: std::collections::HashMap<u64, Vec<usize>> = Default::default();
        for (index, (_, size)) in starts.iter().enumerate() {
            by_size.entry(*size).or_default().push(index);
        }
        let reservations = self.master.reservations();
        let own = self.own_segment();
        let now = Instant::now();
        for (size, indexes) in by_size {
            let Some(shape) = Shape::of(size, config).map(Arc::new) else {
                continue;
            };
            let got = reservations.take(&shape, indexes.len(), now);
            for (index, reservation) in indexes.into_iter().zip(got.reserved) {
                taken[index] = reservation
                    .filter(|r| all_in_segment(&r.started.replicas, (own.0, &own.1)))
                    .map(|r| (Arc::clone(&shape), r));
            }
            if !got.expired.is_empty() {
                let master = self.master.clone();
                runtime.spawn(async move {
                    let items: Vec<(&str, u64)> = got
                        .expired
                        .iter()
                        .map(|r| (r.name.as_str(), r.started.write_id))
                        .collect();
                    let _ = master.put_revoke_many(&items).await;
                });
            }
            if got.refill > 0 {
                runtime.spawn(refill(
                    self.master.clone(),
                    Shape::clone(&shape),
                    got.refill,
                    config.clone(),
                    own.clone(),
                ));
            }
        }
        taken
    }

    /// This node's segment id and name.
    fn own_segment(&self) -> (SegmentId, String) {
        (
            self.segment.id.load(Ordering::Acquire),
            self.segment_name.clone(),
        )
    }

    /// Completes puts written into reservations (one master round trip). A key that
    /// existed already leaves its reservation reserved (given back for the next put).
    async fn commit(
        &self,
        committed: Vec<(usize, &str, Taken)>,
        mode: WriteMode,
        results: &mut [CodeResult<()>],
    ) {
        let items: Vec<(&str, u64, &str)> = committed
            .iter()
            .map(|(_, key, taken)| commit_item(key, taken))
            .collect();
        let outcomes = self.master.put_commit_many(&items).await;
        let committed = committed
            .into_iter()
            .map(|(index, _, taken)| (index, taken));
        self.settle_commits(committed.zip(outcomes), mode, results);
    }

    /// Answers puts written into reservations from the master's answers to their
    /// commits, and gives back the reservations of keys that existed already.
    fn settle_commits(
        &self,
        answered: impl IntoIterator<Item = ((usize, Taken), CodeResult<()>)>,
        mode: WriteMode,
        results: &mut [CodeResult<()>],
    ) {
        let reservations = self.master.reservations();
        let mut done = 0;
        for ((index, (shape, reservation)), outcome) in answered {
            results[index] = match outcome {
                Ok(()) => {
                    done += 1;
                    Ok(())
                }
                Err(ErrorCode::OBJECT_ALREADY_EXISTS) if mode == WriteMode::Put => {
                    reservations.give_back(&shape, reservation);
                    Ok(())
                }
                Err(code) => Err(code),
            };
        }
        reservations.count_commits(done);
    }

    /// Copies writes into their reservations in this node's segment while their commit
    /// travels to the master and back, so that the round trip hides behind the copy.
    /// The master may show a key readable before its bytes are copied: the copied
    /// ranges are held in the segment's [`WritesInFlight`](crate::writes_in_flight)
    /// until the copies are done, so readers wait for them (not for the answer). A copy
    /// that failed fails those readers until its key, if it became readable, is
    /// removed again.
    async fn write_while_committing(
        &self,
        accepted: &[(usize, &str, PutStarted)],
        reserved: Vec<Taken>,
        items: &[(&str, Payload<'_>)],
        mode: WriteMode,
        results: &mut [CodeResult<()>],
    ) {
        let ranges = || {
            accepted
                .iter()
                .flat_map(|(_, _, started)| started.replicas.iter().filter_map(memory_range))
        };
        let held = self.segment.writes.hold(ranges());
        let commits: Vec<(&str, u64, &str)> = accepted
            .iter()
            .zip(&reserved)
            .map(|((_, key, _), taken)| commit_item(key, taken))
            .collect();
        // The copies' outcomes, and the hold when a copy failed (kept until its key is
        // removed again): readers of whole copies go on as soon as they are done.
        let written = parking_lot::Mutex::new(None);
        // A copy as long as a round trip stays on this thread: the master, on this
        // machine or not, answers sooner than helper threads would save.
        let alone = payload_bytes(accepted, items) <= MAX_RESERVED_VALUE;
        let copy = || {
            let write = || self.write_started(accepted, items);
            let outcome = if alone {
                mooncake_shm::on_this_thread(write)
            } else {
                write()
            };
            let failed = failed_ranges(accepted, &outcome);
            let kept = (!failed.is_empty()).then(|| {
                failed
                    .iter()
                    .for_each(|(offset, len)| held.fail(*offset, *len));
                held
            });
            *written.lock() = Some((outcome, kept));
        };
        let outcomes = self
            .master
            .put_commit_many_during(&commits, Box::new(copy))
            .await;
        // The master ran the copy (its contract); should it not have, copy now.
        let (written, kept) = written.into_inner().unwrap_or_else(|| {
            let _held = self.segment.writes.hold(ranges());
            (self.write_started(accepted, items), None)
        });
        let mut copied = Vec::with_capacity(accepted.len());
        let mut unreadable = Vec::new();
        let answers = accepted.iter().zip(reserved).zip(written).zip(outcomes);
        for ((((index, key, _), taken), written), outcome) in answers {
            let Err(code) = written else {
                copied.push(((*index, taken), outcome));
                continue;
            };
            results[*index] = Err(code);
            match outcome {
                Ok(()) => unreadable.push(key.to_string()),
                // Still reserved at the master: the next put overwrites it.
                Err(ErrorCode::OBJECT_ALREADY_EXISTS) => {
                    let (shape, reservation) = taken;
                    self.master.reservations().give_back(&shape, reservation);
                }
                Err(_) => {}
            }
        }
        self.settle_commits(copied, mode, results);
        if !unreadable.is_empty() {
            tracing::warn!(
                keys = unreadable.len(),
                "puts whose copy failed after their commit are removed again"
            );
            let _ = self.master.remove(unreadable, true).await;
        }
        drop(kept);
    }

    /// Runs [`write_replicas`](Self::write_replicas) for every started `(item, key,
    /// write)`, answering each item's copies bound for peers. A batch of host memory
    /// is shared out across the copy threads ([`mooncake_shm::map_items`]); GPU
    /// memory is copied on this thread, where its driver context is.
    fn write_started(
        &self,
        accepted: &[(usize, &str, PutStarted)],
        items: &[(&str, Payload<'_>)],
    ) -> Vec<CodeResult<Vec<PeerWrite>>> {
        let write = |(item, _, started): &(usize, &str, PutStarted)| {
            let mut to_peers = Vec::new();
            self.write_replicas(started, &items[*item].1, *item, &mut to_peers)
                .map(|()| to_peers)
        };
        if accepted
            .iter()
            .any(|(item, _, _)| items[*item].1.device_api().is_some())
        {
            return accepted.iter().map(write).collect();
        }
        let bytes = payload_bytes(accepted, items);
        mooncake_shm::map_items(accepted.len(), bytes, |index| write(&accepted[index]))
    }

    /// Copies `payload` into every replica of a started write in this node's segment,
    /// and adds the copies bound for peers to `to_peers` (tagged with `item`).
    fn write_replicas(
        &self,
        started: &PutStarted,
        payload: &Payload<'_>,
        item: usize,
        to_peers: &mut Vec<PeerWrite>,
    ) -> CodeResult<()> {
        let staged;
        let to_peer = started
            .replicas
            .iter()
            .any(|r| matches!(self.place(r), Ok(Place::Remote { .. })));
        // Bytes and declared memory bound for a peer travel from a private shared
        // buffer of this process (copied there once, then sent).
        let payload = if to_peer && !payload.is_mapped() {
            staged = Payload::Regions(vec![Region::Mapped(payload.bounce(&self.bounce)?)]);
            &staged
        } else {
            payload
        };
        for replica in &started.replicas {
            match (self.place(replica)?, payload) {
                (
                    Place::Remote {
                        endpoint,
                        segment,
                        offset,
                        grant,
                    },
                    Payload::Regions(regions),
                ) => {
                    let mut at = offset;
                    for region in regions {
                        // Bounced above when not mapped here.
                        let slice = region.mapped().ok_or(ErrorCode::INTERNAL_ERROR)?;
                        to_peers.push(PeerWrite {
                            item,
                            endpoint: endpoint.to_string(),
                            segment,
                            offset: at,
                            grant,
                            source: slice.clone(),
                        });
                        at += region.len();
                    }
                }
                _ => self.write_replica(replica, payload)?,
            }
        }
        Ok(())
    }

    /// Sends the collected peer copies, pipelined per peer; answers the items whose
    /// copy failed, with the failure.
    fn write_to_peers(&self, writes: &[PeerWrite]) -> std::collections::HashMap<usize, ErrorCode> {
        let mut by_peer: std::collections::BTreeMap<&str, Vec<&PeerWrite>> = Default::default();
        for write in writes {
            by_peer
                .entry(write.endpoint.as_str())
                .or_default()
                .push(write);
        }
        let mut failed = std::collections::HashMap::new();
        for (endpoint, writes) in by_peer {
            let transfers: Vec<Transfer<'_>> = writes
                .iter()
                .map(|w| Transfer {
                    segment: w.segment,
                    offset: w.offset,
                    grant: w.grant,
                    local: &w.source,
                })
                .collect();
            let outcomes = transfer_blocking(|| self.transfers.write_many(endpoint, &transfers));
            for (write, outcome) in writes.iter().zip(outcomes) {
                if let Err(code) = outcome {
                    failed.entry(write.item).or_insert(code);
                }
            }
        }
        failed
    }

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
    /// whole batch; the copies from each peer are pipelined on one connection. One
    /// result (the object size) per item, in order.
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
        let finish = |index: usize| {
            let planned = planned[index].as_ref().map_err(|code| *code)?;
            // Not for a peer, or its peer failed: replica by replica.
            if !copied_from_peers.contains(&index) {
                self.copy_planned(&self.master.scope(items[index].0), planned)?;
            }
            planned.finish()
        };
        let Some((bytes, sources)) = self.local_host_sources(&planned, &copied_from_peers) else {
            return (0..items.len()).map(finish).collect();
        };
        // Plain memory copies from slices resolved here: nothing on the copy threads
        // looks at the segment's state, a peer, a disk or a GPU.
        mooncake_shm::map_items(items.len(), bytes, |index| {
            let planned = planned[index].as_ref().map_err(|code| *code)?;
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
        copied_from_peers: &std::collections::HashSet<usize>,
    ) -> Option<(u64, Vec<Option<MemSlice>>)> {
        let mut bytes = 0u64;
        let mut sources = Vec::with_capacity(planned.len());
        for (index, planned) in planned.iter().enumerate() {
            let planned = match planned {
                Ok(planned) if !copied_from_peers.contains(&index) => planned,
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
    fn read_from_peers(
        &self,
        planned: &[CodeResult<PlannedRead>],
    ) -> std::collections::HashSet<usize> {
        let mut by_peer: std::collections::BTreeMap<&str, Vec<(usize, Transfer<'_>)>> =
            Default::default();
        let mut copied = std::collections::HashSet::new();
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
            let outcomes = transfer_blocking(|| self.transfers.read_many(endpoint, &transfers));
            for ((index, _), outcome) in reads.iter().zip(outcomes) {
                if outcome.is_err() {
                    copied.remove(index);
                }
            }
        }
        copied
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

impl Store {
    /// Executes a copy or move task: copies its source replica, which must be in this
    /// node's segment, into every target.
    pub fn replicate(&self, task: &TaskWork) -> CodeResult<()> {
        let Place::Local(source) = self.place_to_read(&task.source)? else {
            return Err(ErrorCode::INVALID_REPLICA);
        };
        let payload = Payload::Regions(vec![Region::Mapped(source)]);
        task.targets
            .iter()
            .try_for_each(|target| self.write_replica(target, &payload))
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
                    Some(dest) => self
                        .transfers
                        .read_disk_into(endpoint, stored_key, grant, dest),
                    None => from_value(&self.transfers.read_disk(
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
                pieces
                    .iter()
                    .try_for_each(|(at, dest)| match dest.mapped() {
                        Some(slice) => {
                            self.transfers
                                .read(endpoint, segment, offset + at, grant, slice)
                        }
                        // Declared or GPU memory: received into a bounce buffer, then
                        // copied over.
                        None => {
                            let bounce = self.bounce.take(dest.len(), dest.device_api())?;
                            self.transfers
                                .read(endpoint, segment, offset + at, grant, &bounce)?;
                            dest.fill_from(&bounce)
                        }
                    })
            }),
        }
    }
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

/// True when a replica in segment `replica` (id, name) lives in this node's segment
/// `own` (id, name). The name must match too: a restarted master hands out ids again,
/// so until the next heartbeat another node's segment may carry this node's old id.
/// Asks the master for `count` reservations of `shape` in this node's segment (`own`:
/// its id and name); reservations it placed elsewhere are given back, and the shape is
/// not tried again for a while.
async fn refill(
    master: MasterLink,
    shape: Shape,
    count: usize,
    config: ReplicateConfig,
    own: (SegmentId, String),
) {
    let reservations = std::sync::Arc::clone(master.reservations());
    let names: Vec<String> = (0..count).map(|_| reservations.name()).collect();
    let items: Vec<(&str, u64)> = names.iter().map(|n| (n.as_str(), shape.size())).collect();
    let asked_at = Instant::now();
    let answers = master.put_start_many(&items, &config, WriteMode::Put).await;
    let mut got = Vec::with_capacity(count);
    let mut elsewhere = Vec::new();
    for (name, answer) in names.iter().zip(answers) {
        match answer {
            Ok(started) if all_in_segment(&started.replicas, (own.0, &own.1)) => {
                got.push(Reserved {
                    name: name.clone(),
                    started,
                    asked_at,
                });
            }
            Ok(started) => elsewhere.push((name.as_str(), started.write_id)),
            Err(_) => {}
        }
    }
    if !elsewhere.is_empty() {
        let _ = master.put_revoke_many(&elsewhere).await;
    }
    reservations.refilled(&shape, count, got, !elsewhere.is_empty());
}

/// What a commit of `key` written into the reservation `taken` names: `(reserved name,
/// write id, key)`.
fn commit_item<'a>(key: &'a str, (_, reserved): &'a Taken) -> (&'a str, u64, &'a str) {
    (reserved.name.as_str(), reserved.started.write_id, key)
}

/// The `(offset, len)` of every replica of the started writes whose copy failed.
fn failed_ranges<T>(
    accepted: &[(usize, &str, PutStarted)],
    written: &[CodeResult<T>],
) -> Vec<(u64, u64)> {
    accepted
        .iter()
        .zip(written)
        .filter(|(_, written)| written.is_err())
        .flat_map(|((_, _, started), _)| started.replicas.iter().filter_map(memory_range))
        .collect()
}

/// The bytes the payloads of started writes hold, all together.
fn payload_bytes(accepted: &[(usize, &str, PutStarted)], items: &[(&str, Payload<'_>)]) -> u64 {
    accepted
        .iter()
        .map(|(item, _, _)| items[*item].1.total_len().unwrap_or(0))
        .fold(0u64, u64::saturating_add)
}

/// The `(offset, len)` of a replica in memory.
fn memory_range(replica: &ReplicaDescriptor) -> Option<(u64, u64)> {
    match &replica.location {
        ReplicaLocation::Memory { offset, .. } => Some((*offset, replica.size)),
        ReplicaLocation::Disk { .. } => None,
    }
}

/// True when every started write of a batch goes into a reservation (each replica in
/// this node's segment) from host memory mapped here: plain memory copies, with no
/// peer, disk or GPU taking part.
fn copies_here_only(
    accepted: &[(usize, &str, PutStarted)],
    via: &[Option<Taken>],
    items: &[(&str, Payload<'_>)],
) -> bool {
    let mapped = |payload: &Payload<'_>| match payload {
        Payload::Bytes(_) => true,
        Payload::Regions(regions) => regions.iter().all(|r| matches!(r, Region::Mapped(_))),
    };
    !accepted.is_empty()
        && via.iter().all(Option::is_some)
        && accepted.iter().all(|(item, _, _)| mapped(&items[*item].1))
}

/// True when every replica is in memory of the segment `own` (id and name).
fn all_in_segment(replicas: &[ReplicaDescriptor], own: (SegmentId, &str)) -> bool {
    !replicas.is_empty()
        && replicas.iter().all(|replica| match &replica.location {
            ReplicaLocation::Memory {
                segment,
                segment_name,
                ..
            } => is_own_segment((*segment, segment_name.as_str()), own),
            ReplicaLocation::Disk { .. } => false,
        })
}

fn is_own_segment(replica: (SegmentId, &str), own: (SegmentId, &str)) -> bool {
    replica.0 == own.0 && replica.1 == own.1
}

#[cfg(test)]
mod locality_tests {
    use super::*;

    #[test]
    fn a_replica_is_local_only_when_both_id_and_name_are_this_nodes() {
        let own = (1, "10.0.0.1:50052");
        assert!(is_own_segment((1, "10.0.0.1:50052"), own));
        assert!(
            !is_own_segment((1, "10.0.0.2:50052"), own),
            "another node's segment under this node's old id (a restarted master)"
        );
        assert!(!is_own_segment((2, "10.0.0.1:50052"), own));
    }
}
