//! Per-object metadata kept by the master.
//!
//! Kept small on purpose: a cluster holds millions of objects, and each costs one
//! table slot (the key's `Box<str>` plus an [`ObjectEntry`], 80 bytes) and the key's
//! bytes. The single replica of an ordinary object is stored inline, and times are an
//! 8-byte microsecond [`Stamp`] and millisecond offsets from it instead of 16-byte
//! `Instant`s.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use mooncake_core::allocator::Allocation;
use mooncake_core::master_api::replication::ReplicaSpace;
use mooncake_core::types::{ReplicaDescriptor, ReplicaLocation, ReplicaStatus};

use super::config::MAX_LEASE_TTL;
use super::segments::MountedSegment;

/// One replica's space inside a segment.
#[derive(Debug, Clone)]
pub struct StoredReplica {
    /// The segment holding the bytes.
    pub segment: Arc<MountedSegment>,
    /// The range allocated inside it.
    pub allocation: Allocation,
}

impl StoredReplica {
    /// The space it takes, as a leader streams it to its standbys.
    pub fn space(&self) -> ReplicaSpace {
        ReplicaSpace {
            segment: self.segment.id,
            offset: self.allocation.offset,
            len: self.allocation.len,
        }
    }
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

    /// The replicas, mutable in place.
    pub fn as_mut_slice(&mut self) -> &mut [StoredReplica] {
        match self {
            Replicas::One(replica) => std::slice::from_mut(replica),
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

/// An instant with microsecond resolution in 8 bytes. Pin deadlines are rounded up, so
/// they never end early; plain uses and `now` are rounded down, and a read lease ends
/// one TTL after its read rounded down to the microsecond (a remove issued one TTL
/// after a read is not refused, as upstream's nanosecond clock would not refuse it).
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
        whole.saturating_add(u64::from(partial)).min(STAMP_MASK)
    }

    /// The instant this stamp stands for.
    pub fn instant(self) -> Instant {
        *ORIGIN + Duration::from_micros(self.0)
    }
}

/// Low 61 bits of [`ObjectEntry::used_and_flags`]: the stamp of the last use.
const STAMP_MASK: u64 = (1 << 61) - 1;
/// Bit of [`ObjectEntry::used_and_flags`]: queued for (or being written to) an SSD tier.
const OFFLOAD_PENDING: u64 = 1 << 61;
/// Bit of [`ObjectEntry::used_and_flags`]: never evicted.
const HARD_PIN: u64 = 1 << 63;
/// Bit of [`ObjectEntry::used_and_flags`]: a copy or move task is unfinished.
const REPLICATING: u64 = 1 << 62;

/// Microseconds from `base` to `end`, 0 when `end` is not after `base`, at most
/// `u32::MAX`.
fn micros_after(end: Stamp, base: Stamp) -> u32 {
    u32::try_from(end.0.saturating_sub(base.0)).unwrap_or(u32::MAX)
}

/// Milliseconds from `base` to `end`, rounded up (so a deadline never comes early),
/// 0 when `end` is not after `base`, at most `u32::MAX`.
fn millis_after(end: Stamp, base: Stamp) -> u32 {
    let micros = end.0.saturating_sub(base.0);
    u32::try_from(micros.div_ceil(1000)).unwrap_or(u32::MAX)
}

/// Metadata of one object: the readable version (if any) and a write in progress (if
/// any). An upsert writes its new version beside the readable one and swaps at the end,
/// so readers never see a half-written value.
///
/// Its times take 16 bytes: the last use (a [`Stamp`], sharing its word with three
/// flags), the end of the read lease in microseconds after it and the end of the soft
/// pin in milliseconds after it.
#[derive(Debug)]
pub struct ObjectEntry {
    /// The version readers get.
    pub readable: Option<Version>,
    /// A write in progress (boxed: rare, and it keeps idle entries small).
    pub pending: Option<Box<PendingWrite>>,
    /// The last read or write (low 61 bits): the eviction order, least recently used
    /// first. Not the lease end, which would rank a read a whole lease ahead of writes
    /// made after it. The top bits are the hard-pin, task and offload flags.
    used_and_flags: u64,
    /// Removal (unless forced) is refused until this many µs after the last use.
    lease_us: u32,
    /// Pinned against the first eviction pass until this many ms after the last use
    /// (0: not pinned).
    soft_pin_ms: u32,
}

impl ObjectEntry {
    /// An entry with nothing readable yet, created at `now`.
    pub fn new(now: Instant) -> Self {
        ObjectEntry {
            readable: None,
            pending: None,
            used_and_flags: Stamp::floor(now).0,
            lease_us: 0,
            soft_pin_ms: 0,
        }
    }

    /// True once a version is readable.
    pub fn is_readable(&self) -> bool {
        self.readable.is_some()
    }

    /// The stamp `ms` milliseconds after the last use.
    fn after_use(&self, ms: u32) -> Stamp {
        Stamp(self.last_used().0 + u64::from(ms) * 1000)
    }

    /// When the read lease ends.
    fn lease_end(&self) -> Stamp {
        Stamp(self.last_used().0 + u64::from(self.lease_us))
    }

    /// Records a read at `now` and extends the read lease to at least `now + ttl`
    /// (`now` rounded down to the microsecond: never later than `now + ttl`).
    pub fn grant_lease(&mut self, now: Instant, ttl: Duration) {
        self.touch(now);
        let ttl_us = u64::try_from(ttl.min(MAX_LEASE_TTL).as_micros()).unwrap_or(u64::MAX);
        let until = Stamp(Stamp::floor(now).0.saturating_add(ttl_us));
        self.lease_us = self.lease_us.max(micros_after(until, self.last_used()));
    }

    /// Records a use at `now` for the LRU order, without granting a lease. The lease
    /// keeps its end; the soft pin's end is rounded up to the millisecond.
    pub fn touch(&mut self, now: Instant) {
        let (old, new) = (self.last_used(), Stamp::floor(now));
        if new <= old {
            return;
        }
        let (lease_end, pin_end) = (self.lease_end(), self.after_use(self.soft_pin_ms));
        self.used_and_flags = (self.used_and_flags & !STAMP_MASK) | new.0;
        self.lease_us = micros_after(lease_end, new);
        if self.soft_pin_ms != 0 {
            self.soft_pin_ms = millis_after(pin_end, new);
        }
    }

    /// When the last read lease ends (at or before the last use when none was granted).
    pub fn lease_until(&self) -> Instant {
        self.lease_end().instant()
    }

    /// The LRU order key: the last read or write (later means more recently used).
    pub fn last_used(&self) -> Stamp {
        Stamp(self.used_and_flags & STAMP_MASK)
    }

    /// True while a read lease is active at `now`.
    pub fn has_lease(&self, now: Instant) -> bool {
        self.lease_end() > Stamp::floor(now)
    }

    /// True when the object was read or written within `window` before `now`.
    pub fn used_within(&self, now: Instant, window: Duration) -> bool {
        now.checked_sub(window)
            .is_none_or(|since| self.last_used() > Stamp::floor(since))
    }

    /// True while a soft pin is active at `now`.
    pub fn is_soft_pinned(&self, now: Instant) -> bool {
        self.soft_pin_ms != 0 && self.after_use(self.soft_pin_ms) > Stamp::floor(now)
    }

    /// Pins the object against eviction (first pass) until `until`; `None` unpins.
    pub fn set_soft_pin(&mut self, until: Option<Instant>) {
        self.soft_pin_ms = until.map_or(0, |t| {
            let ms = millis_after(Stamp::ceil(t), self.last_used());
            ms.max(1)
        });
    }

    /// Milliseconds left of the soft pin at `now` (0: not pinned).
    pub fn soft_pin_left_ms(&self, now: Instant) -> u32 {
        if self.soft_pin_ms == 0 {
            return 0;
        }
        millis_after(self.after_use(self.soft_pin_ms), Stamp::floor(now))
    }

    /// Refuses removal (unless forced) and eviction until at least `until`, without
    /// counting as a use (a new leader honouring leases its predecessor granted).
    pub fn hold_lease_until(&mut self, until: Instant) {
        let us = micros_after(Stamp::ceil(until), self.last_used());
        self.lease_us = self.lease_us.max(us);
    }

    /// True when the object is never evicted.
    pub fn is_hard_pinned(&self) -> bool {
        self.used_and_flags & HARD_PIN != 0
    }

    /// Makes the object never evicted.
    pub fn pin_hard(&mut self) {
        self.used_and_flags |= HARD_PIN;
    }

    /// True when a copy or move task holds the object.
    pub fn has_task(&self) -> bool {
        self.used_and_flags & REPLICATING != 0
    }

    /// True while the object waits for its SSD tier write (not evicted meanwhile).
    pub fn is_offload_pending(&self) -> bool {
        self.used_and_flags & OFFLOAD_PENDING != 0
    }

    /// Marks the object as waiting for its SSD tier write (or done).
    pub fn set_offload_pending(&mut self, pending: bool) {
        if pending {
            self.used_and_flags |= OFFLOAD_PENDING;
        } else {
            self.used_and_flags &= !OFFLOAD_PENDING;
        }
    }

    /// Marks the object held (or released) by a copy or move task.
    pub fn set_task(&mut self, held: bool) {
        if held {
            self.used_and_flags |= REPLICATING;
        } else {
            self.used_and_flags &= !REPLICATING;
        }
    }
}
