//! Space in this node's own segment that the real client asked the master for ahead of
//! the keys it will hold, so that a put copies at once and needs one master round trip
//! (`put_commit`: the reserved write becomes the key's object) instead of two
//! (`put_start` before the copy, `put_end` after it).
//!
//! A reservation is an ordinary write in progress at the master, started under a name of
//! this client's own (`__mooncake_reserved__/<client>/<n>`): the master journals it like
//! any write (a standby that takes over knows it), never evicts it, and frees it if the
//! client goes away. Reservations are kept per value size and placement ("shape"), only
//! for values of at most [`MAX_RESERVED_VALUE`] without pins, and only when the master
//! placed every replica in this node's segment (the copy is a memcpy, and a master that
//! restarts must remount this segment first, which drops them all). They are refilled
//! in the background after a put used them, within [`MAX_RESERVED_BYTES`] in all, and
//! used for at most [`MAX_AGE`] (older ones are given back).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use mooncake_core::master_api::PutStarted;
use mooncake_core::types::ReplicateConfig;

/// Largest value reserved for: past it the copy dwarfs a round trip.
pub const MAX_RESERVED_VALUE: u64 = 2 << 20;

/// Most bytes reserved at a time, all shapes together (and at most a sixteenth of the
/// segment: reserved space is not there for objects, and asking for it may evict).
pub const MAX_RESERVED_BYTES: u64 = 64 << 20;

/// The reservation budget of a segment of `segment_size` bytes.
pub fn budget_for(segment_size: u64) -> u64 {
    MAX_RESERVED_BYTES.min(segment_size / 16)
}

/// Most reservations kept per shape.
pub const MAX_PER_SHAPE: usize = 256;

/// Oldest reservation used (far below the master's discard timeout of unfinished
/// writes, 30 s by default).
pub const MAX_AGE: Duration = Duration::from_secs(5);

/// How long a shape whose reservations the master placed elsewhere is not tried again.
pub const RETRY_ELSEWHERE_AFTER: Duration = Duration::from_secs(10);

pub use mooncake_core::master_api::RESERVED_PREFIX;

/// One reservation: a write the master started under a name of this client's.
#[derive(Clone, Debug)]
pub struct Reserved {
    /// The name it was started under (as this client names keys).
    pub name: String,
    /// Where to copy, and the write id to commit.
    pub started: PutStarted,
    /// When it was asked for.
    pub asked_at: Instant,
}

/// The values a reservation fits: their size and placement.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Shape {
    size: u64,
    replica_num: u32,
    preferred_segment: String,
    preferred_segments: Vec<String>,
    prefer_alloc_in_same_node: bool,
    soft_pin_ttl_ms: Option<u64>,
}

impl Shape {
    /// The shape of values of `size` bytes written with `config`, when reservations
    /// may serve them (`None`: too large, empty, or pinned).
    pub fn of(size: u64, config: &ReplicateConfig) -> Option<Shape> {
        let pinned = config.with_hard_pin
            || config.soft_pin_action != mooncake_core::types::SoftPinAction::Preserve;
        if size == 0 || size > MAX_RESERVED_VALUE || pinned || config.validate().is_err() {
            return None;
        }
        Some(Shape {
            size,
            replica_num: config.replica_num,
            preferred_segment: config.preferred_segment.clone(),
            preferred_segments: config.preferred_segments.clone(),
            prefer_alloc_in_same_node: config.prefer_alloc_in_same_node,
            soft_pin_ttl_ms: config.soft_pin_ttl_ms,
        })
    }

    /// The value size.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// What is held for one shape.
#[derive(Debug, Default)]
struct Held {
    ready: VecDeque<Reserved>,
    /// A refill is on its way.
    refilling: bool,
    /// The master placed this shape's reservations elsewhere: not before then.
    not_before: Option<Instant>,
    /// Puts of this shape so far (the first one reserves nothing: a size written once
    /// is not worth reserving for).
    seen: u64,
}

/// The reservations of one real client.
#[derive(Debug)]
pub struct Reservations {
    held: Mutex<(HashMap<Shape, Held>, u64)>,
    /// Most bytes reserved at a time.
    budget: u64,
    next: AtomicU64,
    prefix: String,
    commits: AtomicU64,
}

/// What [`Reservations::take`] hands a put.
#[derive(Debug, Default)]
pub struct Taken {
    /// One per value asked for, in order (`None`: none was ready).
    pub reserved: Vec<Option<Reserved>>,
    /// Reservations too old to use: give them back to the master.
    pub expired: Vec<Reserved>,
    /// How many to ask the master for now, in the background (0: none).
    pub refill: usize,
}

impl Reservations {
    /// The reservations of the client `client` (its id names them), at most `budget`
    /// bytes at a time (see [`budget_for`]).
    pub fn new(client: u128, budget: u64) -> Self {
        Reservations {
            held: Mutex::new((HashMap::new(), 0)),
            budget,
            next: AtomicU64::new(0),
            prefix: format!("{RESERVED_PREFIX}{client:032x}/"),
            commits: AtomicU64::new(0),
        }
    }

    /// Puts completed through a reservation since start.
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// Counts `count` puts completed through a reservation.
    pub fn count_commits(&self, count: usize) {
        self.commits.fetch_add(count as u64, Ordering::Relaxed);
    }

    /// A fresh name to start a reservation under.
    pub fn name(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{}{n}", self.prefix)
    }

    /// Up to `count` ready reservations of `shape` (the rest `None`), and how many to
    /// ask for in the background so that the next put of as many finds them.
    pub fn take(&self, shape: &Shape, count: usize, now: Instant) -> Taken {
        let mut taken = Taken::default();
        let mut guard = self.held.lock();
        let (held, bytes) = &mut *guard;
        let entry = held.entry(shape.clone()).or_default();
        while let Some(front) = entry.ready.front() {
            if now.duration_since(front.asked_at) < MAX_AGE {
                break;
            }
            if let Some(old) = entry.ready.pop_front() {
                *bytes = bytes.saturating_sub(shape.size);
                taken.expired.push(old);
            }
        }
        for _ in 0..count {
            let next = entry.ready.pop_front();
            if next.is_some() {
                *bytes = bytes.saturating_sub(shape.size);
            }
            taken.reserved.push(next);
        }
        let blocked = entry.not_before.is_some_and(|t| now < t);
        entry.seen = entry.seen.saturating_add(1);
        if !entry.refilling && !blocked && entry.seen > 1 {
            let target = count.saturating_mul(4).clamp(16, MAX_PER_SHAPE);
            let room = usize::try_from(self.budget.saturating_sub(*bytes) / shape.size)
                .unwrap_or(usize::MAX);
            let wanted = target.saturating_sub(entry.ready.len()).min(room);
            if wanted * 2 >= target.min(room.max(1)) && wanted > 0 {
                entry.refilling = true;
                // Counted now, so that refills of other shapes stay within the budget.
                *bytes += shape.size * wanted as u64;
                taken.refill = wanted;
            }
        }
        taken
    }

    /// Hands back a reservation that was not used (its key existed).
    pub fn give_back(&self, shape: &Shape, reserved: Reserved) {
        let mut guard = self.held.lock();
        let (held, bytes) = &mut *guard;
        if let Some(entry) = held.get_mut(shape)
            && entry.ready.len() < MAX_PER_SHAPE
            && *bytes + shape.size <= self.budget
        {
            *bytes += shape.size;
            entry.ready.push_front(reserved);
        }
    }

    /// Adds what a refill of `asked` reservations brought; `elsewhere`: the master
    /// placed some outside this node's segment, so the shape is not tried again for a
    /// while.
    pub fn refilled(&self, shape: &Shape, asked: usize, got: Vec<Reserved>, elsewhere: bool) {
        let mut guard = self.held.lock();
        let (held, bytes) = &mut *guard;
        *bytes = bytes.saturating_sub(shape.size * asked as u64);
        let entry = held.entry(shape.clone()).or_default();
        entry.refilling = false;
        *bytes += shape.size * got.len() as u64;
        entry.ready.extend(got);
        if elsewhere {
            entry.not_before = Some(Instant::now() + RETRY_ELSEWHERE_AFTER);
        }
    }

    /// Forgets every reservation (the master no longer knows them: it asked for this
    /// node's segment again, or the segment is going away).
    pub fn clear(&self) {
        let mut guard = self.held.lock();
        guard.0.clear();
        guard.1 = 0;
    }

    /// Bytes reserved now (and asked for).
    pub fn bytes(&self) -> u64 {
        self.held.lock().1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reserved(name: &str, asked_at: Instant) -> Reserved {
        Reserved {
            name: name.into(),
            started: PutStarted {
                replicas: Vec::new(),
                write_id: 1,
            },
            asked_at,
        }
    }

    #[test]
    fn shapes_leave_out_large_empty_and_pinned_values() {
        let plain = ReplicateConfig::default();
        assert!(Shape::of(4096, &plain).is_some());
        assert!(Shape::of(0, &plain).is_none());
        assert!(Shape::of(MAX_RESERVED_VALUE + 1, &plain).is_none());
        let pinned = ReplicateConfig {
            with_hard_pin: true,
            ..ReplicateConfig::default()
        };
        assert!(Shape::of(4096, &pinned).is_none());
        let invalid = ReplicateConfig {
            soft_pin_ttl_ms: Some(100),
            ..ReplicateConfig::default()
        };
        assert!(Shape::of(4096, &invalid).is_none());
        let elsewhere = ReplicateConfig {
            preferred_segment: "other".into(),
            ..ReplicateConfig::default()
        };
        assert_ne!(Shape::of(4096, &plain), Shape::of(4096, &elsewhere));
    }

    #[test]
    fn a_put_takes_what_is_ready_and_asks_for_a_refill_once() {
        let pool = Reservations::new(7, MAX_RESERVED_BYTES);
        let shape = Shape::of(4096, &ReplicateConfig::default()).expect("shape");
        let now = Instant::now();
        // A size written once reserves nothing; the second put of it does.
        assert_eq!(pool.take(&shape, 4, now).refill, 0);
        let first = pool.take(&shape, 4, now);
        assert!(first.reserved.iter().all(Option::is_none));
        assert_eq!(first.refill, 16);
        // A refill is on its way: no second one.
        assert_eq!(pool.take(&shape, 4, now).refill, 0);
        let got = (0..16).map(|i| reserved(&format!("r{i}"), now)).collect();
        pool.refilled(&shape, 16, got, false);
        assert_eq!(pool.bytes(), 16 * 4096);
        let second = pool.take(&shape, 4, now);
        assert!(second.reserved.iter().all(Option::is_some));
        // 12 left of 16: not yet worth a round trip.
        assert_eq!(second.refill, 0);
        let third = pool.take(&shape, 4, now);
        assert_eq!(third.refill, 8);
        assert_eq!(pool.bytes(), 16 * 4096);
    }

    #[test]
    fn old_reservations_are_handed_back_and_a_misplaced_shape_waits() {
        let pool = Reservations::new(7, MAX_RESERVED_BYTES);
        let shape = Shape::of(4096, &ReplicateConfig::default()).expect("shape");
        let now = Instant::now();
        let _ = pool.take(&shape, 1, now);
        let _ = pool.take(&shape, 1, now);
        pool.refilled(&shape, 16, vec![reserved("old", now)], false);
        let later = pool.take(&shape, 1, now + MAX_AGE);
        assert_eq!(later.expired.len(), 1);
        assert!(later.reserved[0].is_none());
        pool.refilled(&shape, later.refill, Vec::new(), true);
        assert_eq!(pool.take(&shape, 1, Instant::now()).refill, 0);
    }

    #[test]
    fn the_byte_budget_bounds_every_shape_together() {
        let pool = Reservations::new(7, MAX_RESERVED_BYTES);
        let big = Shape::of(MAX_RESERVED_VALUE, &ReplicateConfig::default()).expect("shape");
        let _ = pool.take(&big, 1000, Instant::now());
        let asked = pool.take(&big, 1000, Instant::now()).refill;
        assert!(asked > 0 && asked as u64 * MAX_RESERVED_VALUE <= MAX_RESERVED_BYTES);
        assert!(pool.bytes() <= MAX_RESERVED_BYTES);
        let small = Reservations::new(7, budget_for(64 << 20));
        let _ = small.take(&big, 1000, Instant::now());
        let asked = small.take(&big, 1000, Instant::now()).refill;
        assert_eq!(asked as u64 * MAX_RESERVED_VALUE, 4 << 20);
        pool.clear();
        assert_eq!(pool.bytes(), 0);
    }
}
