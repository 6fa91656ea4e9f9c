//! The leader's replication journal: every metadata change in order, kept until each
//! standby has pulled it, and the wait that makes a write's answer follow its
//! replication.
//!
//! A standby pulls with the sequence number it wants next, which also acknowledges
//! everything before it. A standby that has caught up once is *in sync*: from then on
//! every write the leader answers waits until each in-sync standby has acknowledged it
//! (at most the sync timeout; a standby that does not answer in time is dropped from
//! the in-sync set, and the leader records that in etcd before it answers, see
//! [`crate::ha::node`]). Limits: [`MAX_JOURNAL_ENTRIES`] changes are kept for a lagging
//! standby (beyond that it starts over from a snapshot), and at most [`MAX_STANDBYS`]
//! standbys are served.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::StandbyStatus;
use mooncake_core::master_api::replication::{Change, ChangeBatch};

/// Changes kept for standbys that have not pulled them yet; a standby further behind
/// starts over from a snapshot.
pub const MAX_JOURNAL_ENTRIES: usize = 1 << 18;

/// Standbys a leader serves at once (pulls from more are refused with
/// `UNAVAILABLE_IN_CURRENT_STATUS`).
pub const MAX_STANDBYS: usize = 8;

/// Most changes in one pulled batch.
pub const MAX_BATCH_CHANGES: usize = 8192;

/// A standby not heard from for this long is forgotten (its changes are no longer
/// kept for it).
const FORGET_STANDBY_AFTER: Duration = Duration::from_secs(30);

#[derive(Debug)]
struct Standby {
    address: String,
    acked: u64,
    seen: Instant,
    in_sync: bool,
}

#[derive(Debug, Default)]
struct Entries {
    /// Sequence number of `changes[0]`.
    first: u64,
    changes: VecDeque<Change>,
    standbys: HashMap<u128, Standby>,
}

impl Entries {
    fn head(&self) -> u64 {
        self.first + self.changes.len() as u64
    }

    /// Drops the changes every standby has (all of them when none is listening).
    fn trim(&mut self) {
        let keep_from = self
            .standbys
            .values()
            .map(|s| s.acked)
            .min()
            .unwrap_or_else(|| self.head());
        while self.first < keep_from && self.changes.pop_front().is_some() {
            self.first += 1;
        }
        while self.changes.len() > MAX_JOURNAL_ENTRIES && self.changes.pop_front().is_some() {
            self.first += 1;
        }
    }
}

/// The leader's journal of one term.
#[derive(Debug)]
pub struct Journal {
    epoch: u64,
    sync_timeout: Duration,
    /// Mutations hold it shared; a snapshot holds it exclusively, so the state it
    /// copies and the journal position it starts from agree.
    gate: RwLock<()>,
    entries: Mutex<Entries>,
    appended: Notify,
    acknowledged: Notify,
}

/// What a standby's pull answers, and what it changed in the standby set.
#[derive(Debug)]
pub struct Pulled {
    /// The changes for the standby.
    pub batch: ChangeBatch,
    /// True when this pull made the standby in sync.
    pub joined: bool,
    /// Earlier instances at the same address, forgotten now (their process is gone:
    /// one address serves one master).
    pub replaced: Vec<u128>,
}

/// What a write's wait for replication found.
#[derive(Debug, Default)]
pub struct Replicated {
    /// Standbys dropped from the in-sync set because they did not acknowledge in time.
    pub dropped: Vec<u128>,
}

impl Journal {
    /// An empty journal for term `epoch`.
    pub fn new(epoch: u64, sync_timeout: Duration) -> Self {
        Journal {
            epoch,
            sync_timeout,
            gate: RwLock::new(()),
            entries: Mutex::new(Entries::default()),
            appended: Notify::new(),
            acknowledged: Notify::new(),
        }
    }

    /// The term.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Held (shared) while a mutation runs.
    pub fn mutation(&self) -> parking_lot::RwLockReadGuard<'_, ()> {
        self.gate.read()
    }

    /// Held (exclusive) while a snapshot is taken.
    pub fn quiesce(&self) -> parking_lot::RwLockWriteGuard<'_, ()> {
        self.gate.write()
    }

    /// Appends a change; called with the lock that orders it (shard, allocator) held.
    pub fn record(&self, change: Change) {
        let mut entries = self.entries.lock();
        if entries.standbys.is_empty() {
            entries.first = entries.head() + 1;
            entries.changes.clear();
            return;
        }
        entries.changes.push_back(change);
        if entries.changes.len() > MAX_JOURNAL_ENTRIES {
            entries.changes.pop_front();
            entries.first += 1;
        }
        drop(entries);
        self.appended.notify_waiters();
    }

    /// The next sequence number.
    pub fn head(&self) -> u64 {
        self.entries.lock().head()
    }

    /// How far the slowest in-sync standby is behind, in changes.
    pub fn lag(&self) -> u64 {
        let entries = self.entries.lock();
        let head = entries.head();
        entries
            .standbys
            .values()
            .map(|s| head.saturating_sub(s.acked))
            .max()
            .unwrap_or(0)
    }

    /// Standbys heard from recently: id, address, whether in sync, changes behind.
    pub fn standbys(&self) -> Vec<(u128, StandbyStatus)> {
        let entries = self.entries.lock();
        let head = entries.head();
        entries
            .standbys
            .iter()
            .map(|(id, s)| {
                let status = StandbyStatus {
                    address: s.address.clone(),
                    in_sync: s.in_sync,
                    behind: head.saturating_sub(s.acked),
                };
                (*id, status)
            })
            .collect()
    }

    /// Registers `standby` at sequence number `from` (a snapshot taken at `from` was
    /// handed to it): changes from there on are kept for it.
    pub fn attach(&self, standby: u128, from: u64) -> CodeResult<()> {
        let mut entries = self.entries.lock();
        let now = Instant::now();
        entries
            .standbys
            .retain(|_, s| now.duration_since(s.seen) < FORGET_STANDBY_AFTER);
        if !entries.standbys.contains_key(&standby) && entries.standbys.len() >= MAX_STANDBYS {
            return Err(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS);
        }
        entries.standbys.insert(
            standby,
            Standby {
                address: String::new(),
                acked: from,
                seen: now,
                in_sync: false,
            },
        );
        Ok(())
    }

    /// True when `standby` is in the in-sync set.
    pub fn is_in_sync(&self, standby: u128) -> bool {
        self.entries
            .lock()
            .standbys
            .get(&standby)
            .is_some_and(|s| s.in_sync)
    }

    /// A standby's pull: acknowledges everything before `from`, and answers the changes
    /// from `from` on, waiting up to `wait` for one. `OPLOG_ENTRY_NOT_FOUND` when they
    /// are not kept (another term, or too far behind): take a snapshot.
    pub async fn pull(
        &self,
        standby: u128,
        address: &str,
        epoch: u64,
        from: u64,
        wait: Duration,
    ) -> CodeResult<Pulled> {
        if epoch != self.epoch {
            return Err(ErrorCode::OPLOG_ENTRY_NOT_FOUND);
        }
        let deadline = Instant::now() + wait;
        let mut joined = false;
        let mut replaced = Vec::new();
        loop {
            let appended = self.appended.notified();
            tokio::pin!(appended);
            appended.as_mut().enable();
            {
                let mut entries = self.entries.lock();
                let head = entries.head();
                if from < entries.first || from > head {
                    entries.standbys.remove(&standby);
                    return Err(ErrorCode::OPLOG_ENTRY_NOT_FOUND);
                }
                let Some(state) = entries.standbys.get_mut(&standby) else {
                    return Err(ErrorCode::OPLOG_ENTRY_NOT_FOUND);
                };
                state.acked = from;
                state.seen = Instant::now();
                if state.address != address {
                    state.address = address.to_string();
                    replaced.extend(
                        entries
                            .standbys
                            .iter()
                            .filter(|(id, s)| **id != standby && s.address == address)
                            .map(|(id, _)| *id),
                    );
                    for id in &replaced {
                        entries.standbys.remove(id);
                    }
                }
                let Some(state) = entries.standbys.get_mut(&standby) else {
                    return Err(ErrorCode::OPLOG_ENTRY_NOT_FOUND);
                };
                if from == head && !state.in_sync {
                    state.in_sync = true;
                    joined = true;
                }
                let in_sync = state.in_sync;
                entries.trim();
                if from < head || Instant::now() >= deadline {
                    let start = usize::try_from(from - entries.first).unwrap_or(usize::MAX);
                    let changes: Vec<Change> = entries
                        .changes
                        .iter()
                        .skip(start)
                        .take(MAX_BATCH_CHANGES)
                        .cloned()
                        .collect();
                    drop(entries);
                    self.acknowledged.notify_waiters();
                    let batch = ChangeBatch {
                        changes,
                        head,
                        in_sync,
                        epoch: self.epoch,
                    };
                    return Ok(Pulled {
                        batch,
                        joined,
                        replaced,
                    });
                }
            }
            self.acknowledged.notify_waiters();
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, appended).await;
        }
    }

    /// Waits until every in-sync standby acknowledged the changes before `sequence`,
    /// at most the sync timeout; those that did not are dropped from the in-sync set
    /// and returned.
    pub async fn replicated(&self, sequence: u64) -> Replicated {
        let deadline = Instant::now() + self.sync_timeout;
        loop {
            let acknowledged = self.acknowledged.notified();
            tokio::pin!(acknowledged);
            acknowledged.as_mut().enable();
            {
                let mut entries = self.entries.lock();
                let behind = |s: &Standby| s.in_sync && s.acked < sequence;
                if !entries.standbys.values().any(behind) {
                    return Replicated::default();
                }
                if Instant::now() >= deadline {
                    let mut dropped = Vec::new();
                    for (id, state) in &mut entries.standbys {
                        if behind(state) {
                            state.in_sync = false;
                            dropped.push(*id);
                        }
                    }
                    return Replicated { dropped };
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = tokio::time::timeout(left, acknowledged).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(n: u64) -> Change {
        Change::Unmounted { id: n }
    }

    #[tokio::test]
    async fn a_standby_gets_every_change_in_order_and_acknowledges_by_pulling() {
        let journal = Journal::new(7, Duration::from_millis(200));
        journal.record(change(0));
        assert_eq!(journal.head(), 1, "counted, not kept: nobody listens");
        journal.attach(1, 1).expect("attach");
        journal.record(change(1));
        journal.record(change(2));
        let pulled = journal
            .pull(1, "s", 7, 1, Duration::ZERO)
            .await
            .expect("pull");
        assert_eq!(pulled.batch.changes, vec![change(1), change(2)]);
        assert!(!pulled.batch.in_sync && !pulled.joined);
        let pulled = journal
            .pull(1, "s", 7, 3, Duration::ZERO)
            .await
            .expect("pull");
        assert!(pulled.batch.changes.is_empty() && pulled.batch.in_sync && pulled.joined);
        assert!(journal.is_in_sync(1));
        assert_eq!(
            journal.pull(1, "s", 8, 3, Duration::ZERO).await.err(),
            Some(ErrorCode::OPLOG_ENTRY_NOT_FOUND),
            "another term"
        );
    }

    #[tokio::test]
    async fn a_write_waits_for_in_sync_standbys_and_drops_a_silent_one() {
        let journal = std::sync::Arc::new(Journal::new(1, Duration::from_millis(300)));
        journal.attach(9, 0).expect("attach");
        journal
            .pull(9, "s", 1, 0, Duration::ZERO)
            .await
            .expect("in sync");
        journal.record(change(1));
        let head = journal.head();
        let puller = {
            let journal = std::sync::Arc::clone(&journal);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                journal.pull(9, "s", 1, head, Duration::ZERO).await
            })
        };
        let started = Instant::now();
        assert!(journal.replicated(head).await.dropped.is_empty());
        assert!(started.elapsed() >= Duration::from_millis(15));
        puller.await.expect("join").expect("pull");
        journal.record(change(2));
        let dropped = journal.replicated(journal.head()).await.dropped;
        assert_eq!(dropped, vec![9], "silent standby leaves the in-sync set");
        assert!(
            journal.replicated(journal.head()).await.dropped.is_empty(),
            "and is not waited for again"
        );
    }

    #[tokio::test]
    async fn a_restarted_standby_at_the_same_address_replaces_its_old_instance() {
        let journal = Journal::new(3, Duration::from_millis(100));
        journal.attach(1, 0).expect("attach");
        let first = journal.pull(1, "m:1", 3, 0, Duration::ZERO).await;
        assert!(first.expect("pull").joined);
        journal.record(change(1));
        journal
            .attach(2, journal.head())
            .expect("attach the new instance");
        let pulled = journal
            .pull(2, "m:1", 3, journal.head(), Duration::ZERO)
            .await
            .expect("pull");
        assert_eq!(pulled.replaced, vec![1], "the old instance is forgotten");
        assert!(!journal.is_in_sync(1));
        let listed: Vec<String> = journal
            .standbys()
            .into_iter()
            .map(|(_, s)| s.address)
            .collect();
        assert_eq!(listed, vec!["m:1".to_string()], "one entry per address");
    }
}
