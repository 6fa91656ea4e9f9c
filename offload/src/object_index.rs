//! The in-memory index of a backend that stores objects one by one (file-per-key,
//! offset allocator, distributed KV): each key's value length, the bytes it takes and a backend-specific
//! handle, the eviction order (`fifo` by insertion, `lru` by last read, never-read
//! objects first), and the room the objects take against the limits.

use std::collections::{BTreeMap, HashMap};

use crate::backend::{Eviction, Limits, Room, StoreError};
use crate::config::EvictionPolicy;

/// One indexed object.
#[derive(Clone, Debug)]
pub(crate) struct Indexed<H> {
    /// The backend's handle on it (a file id, nothing).
    pub(crate) handle: H,
    /// Bytes of its value.
    pub(crate) value_len: u64,
    /// Bytes it takes against the byte limit.
    pub(crate) bytes: u64,
    /// Position in the eviction order: `(last read, insertion)`.
    rank: (u64, u64),
}

/// Objects by key, in eviction order.
#[derive(Debug)]
pub(crate) struct ObjectIndex<H> {
    limits: Limits,
    policy: EvictionPolicy,
    entries: HashMap<String, Indexed<H>>,
    order: BTreeMap<(u64, u64), String>,
    used: u64,
    inserted: u64,
    reads: u64,
}

impl<H: Clone> ObjectIndex<H> {
    /// An empty index keeping to `limits`, evicting by `policy`.
    pub(crate) fn new(limits: Limits, policy: EvictionPolicy) -> Self {
        ObjectIndex {
            limits,
            policy,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            used: 0,
            inserted: 0,
            reads: 0,
        }
    }

    /// The limits and what the objects take.
    pub(crate) fn room(&self) -> Room {
        Room {
            limits: self.limits,
            used: self.used,
            keys: self.entries.len(),
        }
    }

    /// The eviction policy.
    pub(crate) fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Whether `key` is indexed.
    pub(crate) fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// Every key with its value length.
    pub(crate) fn objects(&self) -> Vec<(String, u64)> {
        self.entries
            .iter()
            .map(|(k, e)| (k.clone(), e.value_len))
            .collect()
    }

    /// Indexes `key` (last in the eviction order); an older entry of the key is
    /// replaced and returned.
    pub(crate) fn insert(
        &mut self,
        key: String,
        handle: H,
        value_len: u64,
        bytes: u64,
    ) -> Option<Indexed<H>> {
        let old = self.forget(&key);
        self.inserted += 1;
        let rank = (0, self.inserted);
        self.used += bytes;
        self.order.insert(rank, key.clone());
        self.entries.insert(
            key,
            Indexed {
                handle,
                value_len,
                bytes,
                rank,
            },
        );
        old
    }

    /// The entry of `key`, recording the read for `lru`.
    pub(crate) fn read(&mut self, key: &str) -> Option<Indexed<H>> {
        let entry = self.entries.get_mut(key)?;
        if self.policy == EvictionPolicy::Lru {
            self.reads += 1;
            let old = entry.rank;
            entry.rank = (self.reads, old.1);
            if let Some(name) = self.order.remove(&old) {
                self.order.insert(entry.rank, name);
            }
        }
        Some(entry.clone())
    }

    /// Takes `key` out; returns its entry.
    pub(crate) fn forget(&mut self, key: &str) -> Option<Indexed<H>> {
        let entry = self.entries.remove(key)?;
        self.order.remove(&entry.rank);
        self.used -= entry.bytes;
        Some(entry)
    }

    /// Every key with its entry, in eviction order.
    pub(crate) fn in_order(&self) -> impl Iterator<Item = (&str, &Indexed<H>)> {
        self.order
            .values()
            .filter_map(|key| Some((key.as_str(), self.entries.get(key)?)))
    }

    /// Takes out the object eviction would take first.
    pub(crate) fn pop_oldest(&mut self) -> Option<(String, Indexed<H>)> {
        let (_, key) = self.order.pop_first()?;
        let entry = self.entries.remove(&key)?;
        self.used -= entry.bytes;
        Some((key, entry))
    }

    /// Takes every key out; returns them with their entries.
    pub(crate) fn clear(&mut self) -> Vec<(String, Indexed<H>)> {
        self.order.clear();
        self.used = 0;
        self.entries.drain().collect()
    }

    /// Phase one of eviction for a batch of `bytes` bytes and `keys` objects (see
    /// [`StorageBackend::make_room`](crate::backend::StorageBackend::make_room));
    /// `handles` gets the victims' handles.
    pub(crate) fn make_room(
        &mut self,
        bytes: u64,
        keys: u64,
        handles: &mut Vec<H>,
    ) -> Result<Eviction, StoreError> {
        if self.room().before_eviction(bytes, keys, self.policy)? {
            return Ok(Eviction::default());
        }
        Ok(self.evict_until(|room| room.fits(bytes, keys), handles))
    }

    /// Watermark eviction down to `bytes` bytes and `keys` objects (nothing under
    /// policy `none`); `handles` gets the victims' handles.
    pub(crate) fn shrink_to(&mut self, bytes: u64, keys: u64, handles: &mut Vec<H>) -> Eviction {
        if self.policy == EvictionPolicy::None {
            return Eviction::default();
        }
        self.evict_until(|room| room.holds_at_most(bytes, keys), handles)
    }

    /// Takes objects out in eviction order until `done` says the room left is enough.
    fn evict_until(&mut self, done: impl Fn(&Room) -> bool, handles: &mut Vec<H>) -> Eviction {
        let mut eviction = Eviction::default();
        while !done(&self.room()) {
            let Some((key, entry)) = self.pop_oldest() else {
                break;
            };
            handles.push(entry.handle);
            eviction.keys.push(key);
        }
        eviction
    }
}
