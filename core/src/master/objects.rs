//! Per-object metadata kept by the master.
//!
//! Kept small on purpose: a cluster holds millions of objects, and each costs one
//! table slot (the key's `Box<str>` plus an [`ObjectEntry`], 80 bytes) and the key's
//! bytes. The single replica of an ordinary object is stored inline, and times are
//! 8-byte microsecond [`Stamp`]s instead of 16-byte `Instant`s.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use crate::allocator::Allocation;
use crate::types::{ReplicaDescriptor, ReplicaLocation, ReplicaStatus};

use super::segments::MountedSegment;

/// One replica's space inside a segment.
#[derive(Debug, Clone)]
pub struct StoredReplica {
    /// The segment holding the bytes.
    pub segment: Arc<MountedSegment>,
    /// The range allocated inside it.
    pub allocation: Allocation,
}

/// The replicas of a version: one inline (the common case, no allocation) or several.
#[derive(Debug, Clone)]
pub enum Replicas {
    /// Exactly one replica.
    One(StoredReplica),
    /// Any other number.
    Many(Vec<StoredReplica>),
}

impl From<Vec<StoredReplica>> for Replicas {
    fn from(mut replicas: Vec<StoredReplica>) -> Self {
        match replicas.pop() {
            Some(only) if replicas.is_empty() => Replicas::One(only),
            Some(last) => {
                replicas.push(last);
                Replicas::Many(replicas)
            }
            None => Replicas::Many(Vec::new()),
        }
    }
}

impl Replicas {
    /// The replicas, in placement order.
    pub fn as_slice(&self) -> &[StoredReplica] {
        match self {
            Replicas::One(replica) => std::slice::from_ref(replica),
            Replicas::Many(replicas) => replicas,
        }
    }

    /// Iterates over the replicas.
    pub fn iter(&self) -> std::slice::Iter<'_, StoredReplica> {
        self.as_slice().iter()
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// True when none is left.
    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// The replicas as a vector.
    pub fn into_vec(self) -> Vec<StoredReplica> {
        match self {
            Replicas::One(replica) => vec![replica],
            Replicas::Many(replicas) => replicas,
        }
    }

    /// Keeps the replicas `keep` accepts; returns the others.
    pub fn split_off(&mut self, keep: impl Fn(&StoredReplica) -> bool) -> Vec<StoredReplica> {
        if self.iter().all(&keep) {
            return Vec::new();
        }
        let all = std::mem::replace(self, Replicas::Many(Vec::new())).into_vec();
        let (kept, dropped): (Vec<_>, Vec<_>) = all.into_iter().partition(|r| keep(r));
        *self = kept.into();
        dropped
    }

    /// Adds replicas at the end.
    pub fn extend(&mut self, more: Vec<StoredReplica>) {
        if more.is_empty() {
            return;
        }
        let mut all = std::mem::replace(self, Replicas::Many(Vec::new())).into_vec();
        all.extend(more);
        *self = all.into();
    }
}

/// A version of the object's bytes: its size and where its replicas are.
#[derive(Debug)]
pub struct Version {
    /// Size in bytes.
    pub size: u64,
    /// Where its replicas live.
    pub replicas: Replicas,
}

impl Version {
    /// The replicas as handed to clients.
    pub fn descriptors(&self, status: ReplicaStatus) -> Vec<ReplicaDescriptor> {
        describe(self.replicas.as_slice(), self.size, status)
    }
}

/// Descriptors of `replicas` holding `size` bytes.
pub fn describe(
    replicas: &[StoredReplica],
    size: u64,
    status: ReplicaStatus,
) -> Vec<ReplicaDescriptor> {
    replicas
        .iter()
        .map(|r| ReplicaDescriptor {
            location: ReplicaLocation::Memory {
                segment: r.segment.id,
                segment_name: r.segment.name.clone(),
                offset: r.allocation.offset,
                endpoint: r.segment.endpoint.clone(),
            },
            size,
            status,
            grant: None,
        })
        .collect()
}

/// A write in progress: space allocated, bytes being copied.
#[derive(Debug)]
pub struct PendingWrite {
    /// The new version being written.
    pub version: Version,
    /// When the write began (for zombie-write cleanup).
    pub started: Instant,
    /// Soft-pin change applied when the write completes: `None` keeps the object's
    /// pin, `Some(None)` clears it, `Some(Some(ttl))` pins for `ttl` from completion.
    pub soft_pin: Option<Option<std::time::Duration>>,
    /// Identifies the writer (see `PutStarted::write_id`).
    pub write_id: u64,
}

/// The origin of [`Stamp`]s: an hour before first use, so that instants of a manual
/// clock created a little earlier still count from it.
static ORIGIN: LazyLock<Instant> = LazyLock::new(|| {
    let now = Instant::now();
    now.checked_sub(Duration::from_secs(3600)).unwrap_or(now)
});

/// An instant with microsecond resolution in 8 bytes. Lease and pin deadlines are
/// rounded up, so they never end early; plain uses and `now` are rounded down (a
/// lease outlives its deadline by at most 2 µs: a remove issued one TTL after a read
/// is not refused, as upstream's nanosecond clock would not refuse it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(u64);

impl Stamp {
    /// `instant` rounded down to the microsecond.
    pub fn floor(instant: Instant) -> Self {
        Stamp(Self::millis(
            instant.saturating_duration_since(*ORIGIN),
            false,
        ))
    }

    /// `instant` rounded up to the microsecond.
    pub fn ceil(instant: Instant) -> Self {
        Stamp(Self::millis(
            instant.saturating_duration_since(*ORIGIN),
            true,
        ))
    }

    fn millis(since: Duration, round_up: bool) -> u64 {
        let whole = u64::try_from(since.as_micros()).unwrap_or(u64::MAX >> 2);
        let partial = round_up && !since.subsec_nanos().is_multiple_of(1_000);
        whole
            .saturating_add(u64::from(partial))
            .min(PINS_STAMP_MASK)
    }

    /// The instant this stamp stands for.
    pub fn instant(self) -> Instant {
        *ORIGIN + Duration::from_micros(self.0)
    }
}

/// Low 61 bits of [`ObjectEntry::pins`]: the soft-pin deadline stamp (0: none).
const PINS_STAMP_MASK: u64 = (1 << 61) - 1;
/// Bit of [`ObjectEntry::pins`]: queued for (or being written to) an SSD tier.
const OFFLOAD_PENDING: u64 = 1 << 61;
/// Bit of [`ObjectEntry::pins`]: never evicted.
const HARD_PIN: u64 = 1 << 63;
/// Bit of [`ObjectEntry::pins`]: a copy or move task is unfinished.
const REPLICATING: u64 = 1 << 62;

/// Metadata of one object: the readable version (if any) and a write in progress (if
/// any). An upsert writes its new version beside the readable one and swaps at the end,
/// so readers never see a half-written value.
#[derive(Debug)]
pub struct ObjectEntry {
    /// The version readers get.
    pub readable: Option<Version>,
    /// A write in progress (boxed: rare, and it keeps idle entries small).
    pub pending: Option<Box<PendingWrite>>,
    /// Removal (unless forced) is refused until then; it doubles as the LRU stamp.
    lease_until: Stamp,
    /// Soft-pin deadline, hard pin and task flag (see the `PINS_*` constants).
    pins: u64,
}

impl ObjectEntry {
    /// An entry with nothing readable yet, created at `now`.
    pub fn new(now: Instant) -> Self {
        ObjectEntry {
            readable: None,
            pending: None,
            lease_until: Stamp::floor(now),
            pins: 0,
        }
    }

    /// True once a version is readable.
    pub fn is_readable(&self) -> bool {
        self.readable.is_some()
    }

    /// Extends the read lease to at least `until`.
    pub fn grant_lease(&mut self, until: Instant) {
        self.lease_until = self.lease_until.max(Stamp::ceil(until));
    }

    /// Records a use at `now` for the LRU order, without granting a lease.
    pub fn touch(&mut self, now: Instant) {
        self.lease_until = self.lease_until.max(Stamp::floor(now));
    }

    /// When the last read lease ends (or the last use, when no lease is active).
    pub fn lease_until(&self) -> Instant {
        self.lease_until.instant()
    }

    /// The LRU order key: later means more recently used.
    pub fn last_used(&self) -> Stamp {
        self.lease_until
    }

    /// True while a read lease is active at `now`.
    pub fn has_lease(&self, now: Instant) -> bool {
        self.lease_until > Stamp::floor(now)
    }

    /// True while a soft pin is active at `now`.
    pub fn is_soft_pinned(&self, now: Instant) -> bool {
        let until = self.pins & PINS_STAMP_MASK;
        until != 0 && Stamp(until) > Stamp::floor(now)
    }

    /// Pins the object against eviction (first pass) until `until`; `None` unpins.
    pub fn set_soft_pin(&mut self, until: Option<Instant>) {
        let stamp = until.map_or(0, |t| Stamp::ceil(t).0.max(1));
        self.pins = (self.pins & !PINS_STAMP_MASK) | stamp;
    }

    /// True when the object is never evicted.
    pub fn is_hard_pinned(&self) -> bool {
        self.pins & HARD_PIN != 0
    }

    /// Makes the object never evicted.
    pub fn pin_hard(&mut self) {
        self.pins |= HARD_PIN;
    }

    /// True when a copy or move task holds the object.
    pub fn has_task(&self) -> bool {
        self.pins & REPLICATING != 0
    }

    /// True while the object waits for its SSD tier write (not evicted meanwhile).
    pub fn is_offload_pending(&self) -> bool {
        self.pins & OFFLOAD_PENDING != 0
    }

    /// Marks the object as waiting for its SSD tier write (or done).
    pub fn set_offload_pending(&mut self, pending: bool) {
        if pending {
            self.pins |= OFFLOAD_PENDING;
        } else {
            self.pins &= !OFFLOAD_PENDING;
        }
    }

    /// Marks the object held (or released) by a copy or move task.
    pub fn set_task(&mut self, held: bool) {
        if held {
            self.pins |= REPLICATING;
        } else {
            self.pins &= !REPLICATING;
        }
    }
}
