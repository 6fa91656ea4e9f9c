//! The read-lease quota of one dummy. A read leases its objects for the master's lease
//! TTL, and a leased object is neither evicted nor removed, so a dummy that kept reading
//! everything could stop eviction for every other dummy of the cluster. Each dummy holds
//! leases on at most `--max_read_leased_bytes_per_dummy` bytes and [`MAX_LEASED_OBJECTS`]
//! objects: beyond that its reads wait until its oldest leases lapse, and its existence
//! checks answer without a lease. A key read again while leased counts once.

use std::collections::VecDeque;
use std::collections::hash_map::{HashMap, RandomState};
use std::hash::BuildHasher;
use std::time::Instant;

/// Most objects one dummy holds read leases on at a time (its tracking costs about
/// 64 bytes per object).
pub const MAX_LEASED_OBJECTS: usize = 1 << 18;

/// The read leases one dummy holds: objects by key hash, with their sizes and lease ends.
#[derive(Debug, Default)]
pub struct ReadLeases {
    /// Lease end and size per leased key (by hash: the keys are not kept).
    held: HashMap<u64, (Instant, u64)>,
    /// One entry per held key, in the order its lease was first counted; a key leased
    /// again is moved to the back when its first end comes.
    ends: VecDeque<(Instant, u64)>,
    /// Sum of the held sizes.
    bytes: u64,
    /// Hashes keys with keys of this session's own.
    hasher: RandomState,
    /// Whether a read of this dummy has waited for room yet.
    waited: bool,
}

impl ReadLeases {
    /// Bytes under lease at the last check.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Forgets the leases that ended by `now`.
    fn expire(&mut self, now: Instant) {
        while let Some(&(end, hash)) = self.ends.front() {
            if end > now {
                break;
            }
            self.ends.pop_front();
            match self.held.get(&hash) {
                Some(&(latest, _)) if latest > now => self.ends.push_back((latest, hash)),
                Some(&(_, size)) => {
                    self.held.remove(&hash);
                    self.bytes = self.bytes.saturating_sub(size);
                }
                None => {}
            }
        }
    }

    /// True when another read may take a full lease at `now`: fewer than `limit` bytes
    /// and [`MAX_LEASED_OBJECTS`] objects are leased.
    pub fn has_room(&mut self, now: Instant, limit: u64) -> bool {
        self.expire(now);
        self.bytes < limit && self.held.len() < MAX_LEASED_OBJECTS
    }

    /// Bytes another lease may take at `now` (0 when there is no room).
    pub fn room(&mut self, now: Instant, limit: u64) -> u64 {
        if self.has_room(now, limit) {
            limit.saturating_sub(self.bytes)
        } else {
            0
        }
    }

    /// The hash a key is counted under.
    pub fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Notes that a read waits for room; true the first time (to log it once).
    pub fn note_wait(&mut self) -> bool {
        !std::mem::replace(&mut self.waited, true)
    }

    /// When the earliest counted lease ends.
    pub fn next_end(&self) -> Option<Instant> {
        self.ends.front().map(|&(end, _)| end)
    }

    /// Counts leases until `end` on each `(key, size)`.
    pub fn record<'a>(&mut self, end: Instant, leased: impl IntoIterator<Item = (&'a str, u64)>) {
        let hasher = self.hasher.clone();
        self.record_hashed(
            end,
            leased
                .into_iter()
                .map(|(key, size)| (hasher.hash_one(key), size)),
        );
    }

    /// [`record`](Self::record) of keys already hashed with [`hash`](Self::hash).
    pub fn record_hashed(&mut self, end: Instant, leased: impl IntoIterator<Item = (u64, u64)>) {
        for (hash, size) in leased {
            match self.held.insert(hash, (end, size)) {
                Some((_, old)) => {
                    self.bytes = self.bytes.saturating_sub(old).saturating_add(size);
                }
                None => {
                    self.bytes = self.bytes.saturating_add(size);
                    self.ends.push_back((end, hash));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ReadLeases;
    use std::time::{Duration, Instant};

    #[test]
    fn leases_count_until_they_end_and_a_key_read_again_counts_once() {
        let mut leases = ReadLeases::default();
        let start = Instant::now();
        let ttl = Duration::from_secs(10);
        assert!(leases.has_room(start, 100));
        leases.record(start + ttl, [("a", 60), ("b", 30)]);
        assert_eq!(leases.bytes(), 90);
        assert!(leases.has_room(start, 100));
        leases.record(start + ttl, [("a", 60)]);
        assert_eq!(leases.bytes(), 90, "a key read again counts once");
        leases.record(start + ttl, [("c", 20)]);
        assert!(!leases.has_room(start, 100), "110 bytes leased");
        assert_eq!(leases.next_end(), Some(start + ttl));
        assert!(leases.has_room(start + ttl, 100), "every lease ended");
        assert_eq!(leases.bytes(), 0);
    }

    #[test]
    fn a_lease_renewed_before_its_end_keeps_counting() {
        let mut leases = ReadLeases::default();
        let start = Instant::now();
        let ttl = Duration::from_secs(10);
        leases.record(start + ttl, [("a", 100)]);
        let later = start + Duration::from_secs(5);
        leases.record(later + ttl, [("a", 100)]);
        assert!(!leases.has_room(start + ttl, 100), "renewed until 15 s");
        assert_eq!(leases.next_end(), Some(later + ttl));
        assert!(leases.has_room(later + ttl, 100));
    }
}
