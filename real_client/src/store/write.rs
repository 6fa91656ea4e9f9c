//! The write path: puts and upserts of one item or a batch.
//!
//! Invariants:
//! * **Acknowledged means readable and whole.** A put answers success only once every
//!   replica holds all its bytes and the master made the key readable (`put_end`, or
//!   `put_commit` for a write into a reservation). A put never overwrites: an existing
//!   key answers success and keeps its bytes; an upsert replaces the object once the
//!   new version is complete.
//! * **What a reader may see when.** Until the master makes a key readable, readers do
//!   not see it (the master keeps it *processing*). The one exception is a batch
//!   written into reservations of this node's segment while its commit travels
//!   (`write_while_committing`): the master may show the keys before their bytes are
//!   copied, so the copied ranges are held in the segment's
//!   [`WritesInFlight`](crate::writes_in_flight) until the copies are done; local
//!   readers wait on them (`Store::place_to_read`), peers read through this node's
//!   transfer engine, which waits the same way. A copy that failed after its commit
//!   keeps failing those readers until its key is removed again (here, at once).
//! * **Who releases what.** A started write whose copy failed is revoked at the master
//!   (`put_revoke`: its space is freed). A reservation whose copy failed, or whose key
//!   existed already, is given back to [`Reservations`](crate::reservations) (still
//!   reserved at the master: the next put overwrites it). Expired reservations and
//!   reservations the master placed in another segment are revoked in the background.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::PutStarted;
use mooncake_core::protocol::grant::GrantedRange;
use mooncake_core::types::{ReplicaDescriptor, ReplicateConfig, SegmentId, WriteMode};
use mooncake_shm::MemSlice;

use super::{Payload, Place, Store, all_in_segment, memory_range, transfer_blocking};
use crate::master_link::MasterLink;
use crate::region::Region;
use crate::reservations::{MAX_RESERVED_VALUE, Reserved, Shape};
use crate::transfer::{Transfer, seam};

/// A reservation a put took, with the shape it was kept under (to give it back).
type Taken = (Arc<Shape>, Reserved);

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

impl Store {
    /// Copies `payload` into one replica.
    pub(super) fn write_replica(
        &self,
        replica: &ReplicaDescriptor,
        payload: &Payload<'_>,
    ) -> CodeResult<()> {
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
            ) => {
                let mut at = offset;
                let mut transfers = Vec::with_capacity(regions.len());
                for region in regions {
                    // `write_replicas` bounced every region that is not mapped here.
                    let local = region.mapped().ok_or(ErrorCode::INTERNAL_ERROR)?;
                    transfers.push(Transfer {
                        segment,
                        offset: at,
                        grant,
                        local,
                    });
                    at += region.len();
                }
                let outcomes = transfer_blocking(|| {
                    self.transport
                        .write_many(endpoint, &transfers, seam::deadline())
                });
                outcomes.into_iter().collect()
            }
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
        // Peers reading this segment one-sided cannot wait for a copy in flight, and a
        // segment file outlives a crash that would leave such a copy half done under a
        // committed key (the master gives the segment back with its objects).
        if self.master.is_remote()
            && !self.transport.serves_one_sided()
            && self.segment.file.is_none()
            && copies_here_only(&accepted, &via, items)
        {
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
            let outcomes = transfer_blocking(|| {
                self.transport
                    .write_many(endpoint, &transfers, seam::deadline())
            });
            for (write, outcome) in writes.iter().zip(outcomes) {
                if let Err(code) = outcome {
                    failed.entry(write.item).or_insert(code);
                }
            }
        }
        failed
    }
}

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
