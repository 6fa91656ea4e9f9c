//! Replica lists of objects in this node's own segment that a read of this client leased
//! recently, so that reading such an object again copies at once instead of asking the
//! master first.
//!
//! Why it is safe: the master grants every read a lease (`--default_kv_lease_ttl`), and
//! while an object's lease runs the master neither evicts it, nor removes it without
//! `force`, nor reuses the space of a version that was removed by force or replaced by
//! an upsert (that space is held until the lease ends). So the bytes a replica list names
//! stay the object's bytes for the whole lease. An entry is used for at most
//! `--read_cache_ms` and at most half the lease, counted from the moment the master was
//! asked (before it granted the lease), which leaves the copy the other half.
//!
//! A hit renews the object's lease at the master as a read asking it would (see
//! `MasterLink::locate`): removal stays refused, and eviction held off, until one TTL
//! after the last read, cached or not.
//!
//! What it changes: within that time, a read of this client may return the version it
//! read before although another client removed it by force or replaced it with an
//! upsert meanwhile (never bytes of another object). This client's own removals,
//! upserts and puts forget the keys first, so it always reads its own writes. Only
//! objects with a replica in this node's own segment are kept (a remounted segment,
//! after the master restarted, empties the cache first), and at most
//! [`MAX_CACHED_READS`] of them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use mooncake_core::types::ReplicaDescriptor;

/// Most replica lists kept at a time (about 200 bytes each).
pub const MAX_CACHED_READS: usize = 1 << 16;

/// Default of `--read_cache_ms` / `MOONCAKE_READ_CACHE_MS`.
pub const DEFAULT_READ_CACHE: Duration = Duration::from_millis(1000);

/// What a read needs to copy an object: its replicas, the master's lease on them, and
/// when the master was asked (the lease runs from no earlier than that).
#[derive(Clone, Debug)]
pub struct Located {
    /// The object's replicas.
    pub replicas: Vec<ReplicaDescriptor>,
    /// The lease the master granted with them.
    pub lease: Duration,
    /// When the master was asked.
    pub asked_at: Instant,
}

impl Located {
    /// Until when a cached copy of this list may start a read: `max_age` and half the
    /// lease after the master was asked, whichever comes first.
    fn usable_until(&self, max_age: Duration) -> Instant {
        self.asked_at + max_age.min(self.lease / 2)
    }
}

/// What the cache holds for one key.
#[derive(Debug)]
enum Slot {
    /// A read asked the master for the list (the number names that read): the list it
    /// brings back is kept only if nothing forgot the key meanwhile.
    Asked(u64),
    /// A list that may serve reads.
    Kept(Located),
}

/// The slots, by the master's name of the key.
#[derive(Debug, Default)]
struct Entries {
    slots: HashMap<String, Slot>,
    /// The number of the last read that asked the master.
    last_ask: u64,
}

impl Entries {
    /// Makes room for one more slot: drops what can no longer serve, then (if still
    /// full) everything.
    fn make_room(&mut self, now: Instant, max_age: Duration) {
        if self.slots.len() < MAX_CACHED_READS {
            return;
        }
        self.slots.retain(|_, slot| match slot {
            Slot::Kept(kept) => kept.usable_until(max_age) > now,
            Slot::Asked(_) => true,
        });
        if self.slots.len() >= MAX_CACHED_READS {
            self.slots.clear();
        }
    }
}

/// The read cache of one real client (see the module documentation).
#[derive(Debug)]
pub struct ReadCache {
    /// How long an entry may serve reads (zero: the cache is off).
    max_age: Duration,
    entries: Mutex<Entries>,
    hits: AtomicU64,
}

/// A read's claim on a key it is asking the master about (see [`ReadCache::lookup`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ask(u64);

/// What [`ReadCache::lookup`] found.
#[derive(Debug)]
pub enum Lookup {
    /// A list that may serve this read.
    Hit(Located),
    /// Nothing usable: ask the master, then hand the answer to
    /// [`ReadCache::keep`] with this claim (`None`: the cache is off).
    Miss(Option<Ask>),
}

impl ReadCache {
    /// A cache whose entries serve reads for at most `max_age` (zero: off).
    pub fn new(max_age: Duration) -> Self {
        ReadCache {
            max_age,
            entries: Mutex::new(Entries::default()),
            hits: AtomicU64::new(0),
        }
    }

    /// Reads answered from the cache since start.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Replica lists kept now (and reads asking about a key).
    pub fn len(&self) -> usize {
        self.entries.lock().slots.len()
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The list kept for `key` if a read starting at `now` may use it (and `usable`
    /// accepts it); else a claim for the answer the read is about to ask for.
    pub fn lookup(&self, key: &str, now: Instant, usable: impl FnOnce(&Located) -> bool) -> Lookup {
        if self.max_age.is_zero() {
            return Lookup::Miss(None);
        }
        let mut entries = self.entries.lock();
        if let Some(Slot::Kept(located)) = entries.slots.get(key)
            && now < located.usable_until(self.max_age)
            && usable(located)
        {
            self.hits.fetch_add(1, Ordering::Relaxed);
            return Lookup::Hit(located.clone());
        }
        entries.last_ask += 1;
        let ask = entries.last_ask;
        match entries.slots.get_mut(key) {
            Some(slot) => *slot = Slot::Asked(ask),
            None => {
                entries.make_room(now, self.max_age);
                entries.slots.insert(key.to_string(), Slot::Asked(ask));
            }
        }
        Lookup::Miss(Some(Ask(ask)))
    }

    /// Keeps the list the read that made `ask` got for `key` (`None`: nothing to keep),
    /// unless the key was forgotten or asked about again since, or the list is already
    /// too old to serve.
    pub fn keep(&self, key: &str, ask: Option<Ask>, located: Option<&Located>) {
        let Some(Ask(ask)) = ask else { return };
        let mut entries = self.entries.lock();
        let Some(slot) = entries.slots.get_mut(key) else {
            return;
        };
        if !matches!(slot, Slot::Asked(claim) if *claim == ask) {
            return;
        }
        match located {
            Some(located) if located.usable_until(self.max_age) > Instant::now() => {
                *slot = Slot::Kept(located.clone());
            }
            _ => {
                entries.slots.remove(key);
            }
        }
    }

    /// Forgets `keys`: what is kept, and what reads asking about them bring back.
    pub fn forget<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        if self.max_age.is_zero() {
            return;
        }
        let mut entries = self.entries.lock();
        if entries.slots.is_empty() {
            return;
        }
        for key in keys {
            entries.slots.remove(key);
        }
    }

    /// Forgets everything.
    pub fn clear(&self) {
        self.entries.lock().slots.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn located(lease_ms: u64, asked_ago_ms: u64) -> Located {
        Located {
            replicas: Vec::new(),
            lease: Duration::from_millis(lease_ms),
            asked_at: Instant::now() - Duration::from_millis(asked_ago_ms),
        }
    }

    fn ask(cache: &ReadCache, key: &str) -> Option<Ask> {
        match cache.lookup(key, Instant::now(), |_| true) {
            Lookup::Miss(ask) => ask,
            Lookup::Hit(_) => panic!("{key} was kept"),
        }
    }

    fn is_hit(cache: &ReadCache, key: &str, at: Instant) -> bool {
        matches!(cache.lookup(key, at, |_| true), Lookup::Hit(_))
    }

    #[test]
    fn an_entry_serves_for_the_shorter_of_max_age_and_half_the_lease() {
        let cache = ReadCache::new(Duration::from_millis(1000));
        let long = ask(&cache, "long");
        cache.keep("long", long, Some(&located(10_000, 0)));
        let short = ask(&cache, "short");
        cache.keep("short", short, Some(&located(100, 0)));
        let now = Instant::now();
        assert!(is_hit(&cache, "long", now));
        assert!(is_hit(&cache, "short", now));
        assert!(!is_hit(&cache, "short", now + Duration::from_millis(60)));
        assert!(!is_hit(&cache, "long", now + Duration::from_millis(1100)));
        assert_eq!(cache.hits(), 2);
    }

    #[test]
    fn a_list_asked_for_before_a_forget_is_not_kept() {
        let cache = ReadCache::new(Duration::from_millis(1000));
        let claim = ask(&cache, "k");
        cache.forget(["k"]);
        cache.keep("k", claim, Some(&located(10_000, 0)));
        assert!(!is_hit(&cache, "k", Instant::now()));
        let claim = ask(&cache, "k");
        cache.keep("k", claim, Some(&located(10_000, 0)));
        assert!(is_hit(&cache, "k", Instant::now()));
        cache.forget(["k"]);
        assert!(!is_hit(&cache, "k", Instant::now()));
    }

    #[test]
    fn only_the_latest_read_asking_about_a_key_is_kept() {
        let cache = ReadCache::new(Duration::from_millis(1000));
        let first = ask(&cache, "k");
        let second = ask(&cache, "k");
        cache.keep("k", first, Some(&located(10_000, 0)));
        assert!(!is_hit(&cache, "k", Instant::now()));
        let third = ask(&cache, "k");
        cache.keep("k", second, Some(&located(10_000, 0)));
        cache.keep("k", third, None);
        assert!(cache.is_empty());
    }

    #[test]
    fn lists_too_old_unusable_lists_and_a_cache_that_is_off_serve_nothing() {
        let cache = ReadCache::new(Duration::from_millis(1000));
        let old = ask(&cache, "old");
        cache.keep("old", old, Some(&located(10_000, 2000)));
        let unleased = ask(&cache, "no lease");
        cache.keep("no lease", unleased, Some(&located(0, 0)));
        assert!(cache.is_empty());
        let claim = ask(&cache, "k");
        cache.keep("k", claim, Some(&located(10_000, 0)));
        assert!(matches!(
            cache.lookup("k", Instant::now(), |_| false),
            Lookup::Miss(Some(_))
        ));
        let off = ReadCache::new(Duration::ZERO);
        assert!(matches!(
            off.lookup("k", Instant::now(), |_| true),
            Lookup::Miss(None)
        ));
    }

    #[test]
    fn a_full_cache_makes_room_and_stays_bounded() {
        let cache = ReadCache::new(Duration::from_millis(1000));
        for i in 0..MAX_CACHED_READS + 10 {
            let key = format!("k{i}");
            let claim = ask(&cache, &key);
            cache.keep(&key, claim, Some(&located(10_000, 0)));
        }
        assert!(cache.len() <= MAX_CACHED_READS);
        let last = format!("k{}", MAX_CACHED_READS + 9);
        assert!(is_hit(&cache, &last, Instant::now()));
    }
}
