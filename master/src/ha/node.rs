//! [`HaNode`]: a master under high availability, as the RPC server sees it. While it
//! leads (it holds the etcd lease and its journal is on) it answers like any master,
//! except that a write's answer waits until every in-sync standby has the change;
//! while it stands by, or once its lease may have lapsed, every call but `hello` is
//! refused with `UNAVAILABLE_IN_CURRENT_STATUS` (real clients then look the leader up
//! again). It also serves its standbys: snapshots and the change stream.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::replication::{ChangeBatch, SnapshotPart};
use mooncake_core::master_api::{
    CallKind, CallShape, HaStatus, Master, MasterFuture, MasterHello, MasterRequest, MasterResponse,
};

use super::etcd::{Etcd, EtcdError};
use crate::MasterService;
use crate::journal::Journal;

/// Bytes per snapshot part.
pub const SNAPSHOT_PART_BYTES: usize = 8 << 20;

/// Longest a standby's pull waits for a change.
pub const MAX_PULL_WAIT: Duration = Duration::from_secs(1);

/// A snapshot being handed to one standby.
#[derive(Debug)]
struct Captured {
    epoch: u64,
    sequence: u64,
    parts: Vec<Vec<u8>>,
}

/// Counters for `/metrics` and `/health`.
#[derive(Debug, Default)]
pub struct HaCounters {
    /// Times this master became the leader.
    pub terms_led: AtomicU64,
    /// Snapshots taken for standbys.
    pub snapshots_served: AtomicU64,
    /// Bytes of the last snapshot taken or installed.
    pub last_snapshot_bytes: AtomicU64,
    /// Changes applied while standing by.
    pub changes_applied: AtomicU64,
    /// Snapshots installed while standing by.
    pub snapshots_installed: AtomicU64,
    /// Changes the leader had that this standby had not applied at its last pull.
    pub standby_lag: AtomicU64,
    /// Standbys dropped from the in-sync set for not acknowledging in time.
    pub standbys_dropped: AtomicU64,
}

/// A master under high availability.
#[derive(Debug)]
pub struct HaNode {
    master: Arc<MasterService>,
    etcd: Etcd,
    /// The RPC address it publishes when it leads.
    advertised: String,
    /// Until when this master's etcd lease surely holds (`None`: it does not lead).
    lease_until: Mutex<Option<Instant>>,
    snapshots: Mutex<HashMap<u128, Arc<Captured>>>,
    /// Who this master follows while it stands by: address and term.
    following: Mutex<Option<(String, u64)>>,
    /// Standbys etcd lists in sync for this master's term (while it leads).
    listed: Mutex<HashSet<u128>>,
    /// Held while etcd's in-sync list is updated, so that updates racing each other
    /// (a write dropping a standby, a pull listing it again) end as the journal ends.
    publishing: tokio::sync::Mutex<()>,
    /// The latest term whose leader this master was in sync with (0: none yet).
    synced_term: AtomicU64,
    /// True once this master installed a leader's snapshot (it holds an index).
    holds_index: AtomicBool,
    /// Counters.
    pub counters: HaCounters,
}

/// `count` copies of the refusal `code`.
impl HaNode {
    /// A standby node over `master` (which must be empty or hold a snapshot), which
    /// publishes `advertised` as its RPC address.
    pub fn new(master: Arc<MasterService>, etcd: Etcd, advertised: String) -> Self {
        HaNode {
            master,
            etcd,
            advertised,
            lease_until: Mutex::new(None),
            snapshots: Mutex::new(HashMap::new()),
            following: Mutex::new(None),
            listed: Mutex::new(HashSet::new()),
            publishing: tokio::sync::Mutex::new(()),
            synced_term: AtomicU64::new(0),
            holds_index: AtomicBool::new(false),
            counters: HaCounters::default(),
        }
    }

    /// The master.
    pub fn master(&self) -> &Arc<MasterService> {
        &self.master
    }

    /// The etcd connection.
    pub fn etcd(&self) -> &Etcd {
        &self.etcd
    }

    /// Becomes the leader of term `journal.epoch()`, its lease holding until `until`.
    pub fn lead(&self, journal: Arc<Journal>, until: Instant) {
        *self.lease_until.lock() = Some(until);
        *self.following.lock() = None;
        self.listed.lock().clear();
        self.master.take_over(journal);
        self.counters.terms_led.fetch_add(1, Ordering::Relaxed);
    }

    /// Records that the lease now surely holds until `until`.
    pub fn renewed(&self, until: Instant) {
        let mut lease = self.lease_until.lock();
        if let Some(current) = lease.as_mut() {
            *current = (*current).max(until);
        }
    }

    /// Records that this standby installed a leader's snapshot.
    pub fn installed_snapshot(&self) {
        self.holds_index.store(true, Ordering::Relaxed);
    }

    /// Records that this standby is in sync with the leader of term `epoch`.
    pub fn in_sync_with(&self, epoch: u64) {
        self.synced_term.fetch_max(epoch, Ordering::Relaxed);
    }

    /// How many lease TTLs this master leaves to better informed ones before it
    /// campaigns, when the leader of `last_term` is gone and did not list it in sync:
    /// 2 when it was in sync with that leader once (it was dropped for lagging, or
    /// the leader died before listing it), 3 when it holds an older index, 4 when
    /// it holds nothing. The best informed survivor takes over first.
    pub fn takeover_delay_ttls(&self, last_term: u64) -> u32 {
        if self.synced_term.load(Ordering::Relaxed) >= last_term {
            2
        } else if self.holds_index.load(Ordering::Relaxed) {
            3
        } else {
            4
        }
    }

    /// True when `standby` is in sync and etcd lists it so (what `/health` reports).
    pub fn listed_in_sync(&self, journal: &Journal, standby: u128) -> bool {
        journal.is_in_sync(standby) && self.listed.lock().contains(&standby)
    }

    /// Makes etcd's in-sync list say what the journal says about `standbys`: listed
    /// when in sync, deleted otherwise (a delete is sent even when this master does
    /// not remember listing it: an earlier answer may have been lost).
    async fn publish_in_sync(&self, journal: &Journal, standbys: &[u128]) -> Result<(), EtcdError> {
        let _one_at_a_time = self.publishing.lock().await;
        for &standby in standbys {
            if journal.is_in_sync(standby) {
                if !self.listed.lock().contains(&standby) {
                    self.etcd.mark_in_sync(standby, journal.epoch()).await?;
                    self.listed.lock().insert(standby);
                }
            } else {
                self.etcd.mark_out_of_sync(standby).await?;
                self.listed.lock().remove(&standby);
            }
        }
        Ok(())
    }

    /// Records whom this standby follows.
    pub fn follow(&self, leader: Option<(String, u64)>) {
        *self.following.lock() = leader;
    }

    /// `"leader"` or `"standby"`, the term, and the leader followed (standby).
    pub fn role(&self) -> (&'static str, u64, Option<String>) {
        match self.leading() {
            Ok(journal) => ("leader", journal.epoch(), None),
            Err(_) => {
                let following = self.following.lock().clone();
                let epoch = following.as_ref().map_or(0, |(_, e)| *e);
                ("standby", epoch, following.map(|(a, _)| a))
            }
        }
    }

    /// The journal, while this master leads and its lease surely holds.
    pub fn leading(&self) -> CodeResult<Arc<Journal>> {
        let journal = self
            .master
            .journal()
            .ok_or(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS)?;
        match *self.lease_until.lock() {
            Some(until) if Instant::now() < until => Ok(Arc::clone(journal)),
            _ => Err(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS),
        }
    }

    /// Waits until the in-sync standbys have everything journaled so far; standbys
    /// that did not answer in time are taken off etcd's in-sync list first (a write is
    /// acknowledged only when no standby that could take over lacks it).
    async fn replicated(&self, journal: &Journal) -> CodeResult<()> {
        let mut unlist = journal.replicated(journal.head()).await.dropped;
        for standby in &unlist {
            self.counters
                .standbys_dropped
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                standby = %format!("{standby:032x}"),
                "a standby did not acknowledge within the sync timeout; it leaves the in-sync set"
            );
        }
        // Also any standby still listed that the journal no longer counts (an earlier
        // delete failed, or it was dropped while being listed).
        let stale: Vec<u128> = self
            .listed
            .lock()
            .iter()
            .filter(|id| !journal.is_in_sync(**id) && !unlist.contains(id))
            .copied()
            .collect();
        unlist.extend(stale);
        if unlist.is_empty() {
            return Ok(());
        }
        self.publish_in_sync(journal, &unlist).await.map_err(|error| {
            tracing::error!(%error, "cannot record a lagging standby in etcd; the write is not acknowledged");
            ErrorCode::ETCD_OPERATION_ERROR
        })
    }

    /// Runs a mutating call on the master while leading, and answers once it is
    /// replicated (or fails it with the code that says why not).
    fn write(&self, shape: CallShape, request: MasterRequest) -> MasterFuture<'_, MasterResponse> {
        Box::pin(async move {
            let journal = match self.leading() {
                Ok(journal) => journal,
                Err(code) => return shape.failed(code),
            };
            // The whole mutation runs under the gate (the service answers at once).
            let response = {
                let _mutation = journal.mutation();
                self.master.handle(request)
            };
            match self.replicated(&journal).await {
                Ok(()) => response,
                Err(code) => shape.failed(code),
            }
        })
    }

    /// A standby's pull (see [`Journal::pull`]); a standby that catches up is listed
    /// in sync in etcd.
    pub async fn pull(
        &self,
        (standby, address): (u128, String),
        epoch: u64,
        from: u64,
        wait: Duration,
    ) -> CodeResult<ChangeBatch> {
        let journal = self.leading()?;
        let pulled = journal
            .pull(standby, &address, epoch, from, wait.min(MAX_PULL_WAIT))
            .await?;
        if pulled.joined {
            tracing::info!(standby = %format!("{standby:032x}"), %address, "a standby is in sync");
        }
        let unlisted = pulled.batch.in_sync && !self.listed.lock().contains(&standby);
        if unlisted || !pulled.replaced.is_empty() {
            let mut changed = pulled.replaced;
            changed.push(standby);
            if let Err(error) = self.publish_in_sync(&journal, &changed).await {
                tracing::warn!(%error, "cannot update etcd's in-sync list; retried at the next pull");
            }
        }
        Ok(pulled.batch)
    }

    /// Part `part` of a snapshot for `standby`; part 0 takes a new one (the standby
    /// then pulls changes from its sequence number on).
    pub async fn snapshot(&self, standby: u128, part: u32) -> CodeResult<SnapshotPart> {
        let journal = self.leading()?;
        if part == 0 {
            let (sequence, state) = {
                let _quiet = journal.quiesce();
                let sequence = journal.head();
                journal.attach(standby, sequence)?;
                (sequence, self.master.snapshot_state())
            };
            let bytes = tokio::task::spawn_blocking(move || postcard::to_allocvec(&state))
                .await
                .map_err(|_| ErrorCode::INTERNAL_ERROR)?
                .map_err(|_| ErrorCode::SERIALIZE_FAIL)?;
            self.counters
                .last_snapshot_bytes
                .store(bytes.len() as u64, Ordering::Relaxed);
            self.counters
                .snapshots_served
                .fetch_add(1, Ordering::Relaxed);
            let parts = bytes
                .chunks(SNAPSHOT_PART_BYTES)
                .map(<[u8]>::to_vec)
                .collect::<Vec<_>>();
            let parts = if parts.is_empty() {
                vec![Vec::new()]
            } else {
                parts
            };
            let mut snapshots = self.snapshots.lock();
            if !snapshots.contains_key(&standby) && snapshots.len() >= crate::journal::MAX_STANDBYS
            {
                return Err(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS);
            }
            snapshots.insert(
                standby,
                Arc::new(Captured {
                    epoch: journal.epoch(),
                    sequence,
                    parts,
                }),
            );
        }
        let mut snapshots = self.snapshots.lock();
        let captured = snapshots
            .get(&standby)
            .cloned()
            .ok_or(ErrorCode::INVALID_PARAMS)?;
        let index = usize::try_from(part).unwrap_or(usize::MAX);
        let bytes = captured
            .parts
            .get(index)
            .cloned()
            .ok_or(ErrorCode::INVALID_PARAMS)?;
        if index + 1 == captured.parts.len() {
            snapshots.remove(&standby);
        }
        Ok(SnapshotPart {
            epoch: captured.epoch,
            sequence: captured.sequence,
            parts: u32::try_from(captured.parts.len()).unwrap_or(u32::MAX),
            bytes,
        })
    }
}

impl Master for HaNode {
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>> {
        Box::pin(async move {
            let mut hello = Master::hello(&*self.master).await?;
            hello.epoch = self.leading().map_or(0, |journal| journal.epoch());
            Ok(hello)
        })
    }

    fn is_remote(&self) -> bool {
        false
    }

    fn call(&self, request: MasterRequest) -> MasterFuture<'_, MasterResponse> {
        let shape = request.shape();
        match shape.call.kind() {
            CallKind::Read => Box::pin(async move {
                let journal = match self.leading() {
                    Ok(journal) => journal,
                    Err(code) => return shape.failed(code),
                };
                let mut response = self.master.handle(request);
                if let MasterResponse::Stats(Ok(stats)) = &mut response {
                    stats.ha = Some(HaStatus {
                        epoch: journal.epoch(),
                        leader: self.advertised.clone(),
                        standbys: journal.standbys().into_iter().map(|(_, s)| s).collect(),
                    });
                }
                response
            }),
            CallKind::Write | CallKind::IndexScan => self.write(shape, request),
        }
    }
}
