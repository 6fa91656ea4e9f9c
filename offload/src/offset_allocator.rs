//! `offset_allocator_storage_backend`: every object in one file, at offsets handed out
//! by an extent allocator, with a journal that makes the index durable.
//!
//! # On disk
//!
//! In the storage directory:
//!
//! * `kv_cache.data`: a sparse file as large as the byte limit. Each object is one
//!   [record](crate::record) at a 4 KiB-aligned offset, taking its length rounded up
//!   to 4 KiB.
//! * `kv_cache.journal`: `"MCJ1"`, then entries appended as objects come and go:
//!   kind (u8: 1 = stored, 2 = deleted), key length (u32), key, offset (u64), value
//!   length (u64), CRC-32C (u32) of the entry's preceding bytes. Little endian.
//!
//! A batch is written to the data file and synced before its "stored" entries are
//! appended and synced, so an entry never points at unwritten bytes. Space is
//! reused only after the "deleted" entry of its old object is durable. At startup the
//! journal is replayed up to its first torn or corrupt entry, every indexed record is
//! read back and checked (a bad one is dropped and counted), overlapping extents are
//! dropped, the free space is rebuilt from what is left, and the journal is rewritten
//! with only the live objects. It is rewritten the same way whenever it holds four
//! times more entries than live objects.
//!
//! # Eviction and reads
//!
//! Eviction takes single objects, oldest first (`fifo`) or least recently read first
//! (`lru`), until the batch fits: its total under the limits *and* each object an
//! extent in the free space (so fragmentation cannot fail a write after the master
//! was told). An extent freed while a reader holds its [`ReadPlan`] is kept out of
//! the free space until the plan is dropped, so a slow reader never sees its bytes
//! overwritten.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{
    Eviction, Limits, PreparedBatch, Progress, ReadPlan, RecoveryReport, Room, StorageBackend,
    StoreError, check_batch, check_record, foreign_batch, io_error, open_rw, record_len,
};
use crate::checksum::crc32c;
use crate::config::EvictionPolicy;
use crate::io::IoEngine;
use crate::object_index::{Indexed, ObjectIndex};
use crate::record::MAX_KEY_LEN;
use crate::record_writer::{Placement, write_records};

/// Name of the data file.
pub const DATA_FILE: &str = "kv_cache.data";
/// Name of the journal.
pub const JOURNAL_FILE: &str = "kv_cache.journal";

const ALIGN: u64 = 4096;
const JOURNAL_MAGIC: [u8; 4] = *b"MCJ1";
const STORED: u8 = 1;
const DELETED: u8 = 2;

/// Free space of the data file: extents by offset and by size.
#[derive(Clone, Debug, Default)]
struct Extents {
    by_offset: BTreeMap<u64, u64>,
    by_size: std::collections::BTreeSet<(u64, u64)>,
    free: u64,
}

impl Extents {
    /// All of `[0, capacity)` free.
    fn whole(capacity: u64) -> Self {
        let mut extents = Extents::default();
        if capacity > 0 {
            extents.insert(0, capacity);
        }
        extents
    }

    fn insert(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free += len;
    }

    fn take(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free -= len;
    }

    /// The smallest free extent of at least `len` bytes, split: returns its offset.
    fn allocate(&mut self, len: u64) -> Option<u64> {
        let &(size, offset) = self.by_size.range((len, 0)..).next()?;
        self.take(offset, size);
        if size > len {
            self.insert(offset + len, size - len);
        }
        Some(offset)
    }

    /// Marks `[offset, offset + len)` used (recovery); false when it is not free.
    fn reserve(&mut self, offset: u64, len: u64) -> bool {
        let Some((&start, &size)) = self.by_offset.range(..=offset).next_back() else {
            return false;
        };
        let Some(end) = offset.checked_add(len) else {
            return false;
        };
        if end > start + size {
            return false;
        }
        self.take(start, size);
        if offset > start {
            self.insert(start, offset - start);
        }
        if start + size > end {
            self.insert(end, start + size - end);
        }
        true
    }

    /// Returns `[offset, offset + len)`, merged with free neighbours.
    fn release(&mut self, mut offset: u64, mut len: u64) {
        if let Some((&start, &size)) = self.by_offset.range(..offset).next_back()
            && start + size == offset
        {
            self.take(start, size);
            offset = start;
            len += size;
        }
        if let Some(&size) = self.by_offset.get(&(offset + len)) {
            self.take(offset + len, size);
            len += size;
        }
        self.insert(offset, len);
    }
}

/// Where an indexed object is (its entry's bytes are the extent's length: the record
/// rounded up to 4 KiB).
#[derive(Clone, Debug)]
struct Slot {
    offset: u64,
    /// Held by read plans; the extent is reused only when this is the last holder.
    pin: Arc<()>,
}

/// A record placed by `prepare_batch`, indexed by `commit_batch`.
struct Placed {
    key: String,
    offset: u64,
    value_len: u64,
    extent: u64,
}

/// The one-file store in one directory.
#[derive(Debug)]
pub struct OffsetAllocatorStore {
    dir: PathBuf,
    data: Arc<File>,
    journal: File,
    journal_len: u64,
    journal_entries: u64,
    index: ObjectIndex<Slot>,
    free: Extents,
    /// Extents of evicted objects whose deletion is not journaled yet.
    evicting: Vec<(u64, u64, Arc<()>)>,
    /// Extents of dropped objects, free once no reader pins them.
    retired: Vec<(u64, u64, Arc<()>)>,
    io: Arc<IoEngine>,
}

fn extent_of(record: u64) -> u64 {
    record.next_multiple_of(ALIGN)
}

/// The extent each object of a batch takes.
fn extents_of(objects: &[(&str, &[u8])]) -> Vec<u64> {
    objects
        .iter()
        .map(|(k, v)| extent_of(record_len(k, v)))
        .collect()
}

fn journal_entry(kind: u8, key: &str, offset: u64, value_len: u64) -> Vec<u8> {
    let mut entry = Vec::with_capacity(25 + key.len());
    entry.push(kind);
    #[expect(
        clippy::cast_possible_truncation,
        reason = "keys are checked against MAX_KEY_LEN"
    )]
    entry.extend_from_slice(&(key.len() as u32).to_le_bytes());
    entry.extend_from_slice(key.as_bytes());
    entry.extend_from_slice(&offset.to_le_bytes());
    entry.extend_from_slice(&value_len.to_le_bytes());
    let crc = crc32c(&entry);
    entry.extend_from_slice(&crc.to_le_bytes());
    entry
}

/// One parsed journal entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalEntry {
    /// 1: the object was stored; 2: it was deleted.
    pub kind: u8,
    /// The object's key.
    pub key: String,
    /// Offset of its record in the data file.
    pub offset: u64,
    /// Length of its value.
    pub value_len: u64,
}

/// Parses the journal's entries (layout in the module documentation) up to the first
/// torn or corrupt one, as recovery replays it; returns them and the length of the
/// valid prefix.
pub fn parse_journal(bytes: &[u8]) -> (Vec<JournalEntry>, u64) {
    let mut entries = Vec::new();
    if bytes.get(..4) != Some(&JOURNAL_MAGIC[..]) {
        return (entries, 0);
    }
    let mut at = 4usize;
    while let Some((entry, len)) = parse_entry(&bytes[at..]) {
        entries.push(entry);
        at += len;
    }
    (entries, at as u64)
}

fn parse_entry(bytes: &[u8]) -> Option<(JournalEntry, usize)> {
    let kind = *bytes.first()?;
    let key_len = u32::from_le_bytes(bytes.get(1..5)?.try_into().ok()?);
    if key_len == 0 || key_len > MAX_KEY_LEN || !matches!(kind, STORED | DELETED) {
        return None;
    }
    let key_end = 5 + key_len as usize;
    let end = key_end + 20;
    let body = bytes.get(..end - 4)?;
    let crc = u32::from_le_bytes(bytes.get(end - 4..end)?.try_into().ok()?);
    if crc32c(body) != crc {
        return None;
    }
    let key = std::str::from_utf8(&bytes[5..key_end]).ok()?.to_string();
    let offset = u64::from_le_bytes(bytes[key_end..key_end + 8].try_into().ok()?);
    let value_len = u64::from_le_bytes(bytes[key_end + 8..key_end + 16].try_into().ok()?);
    Some((
        JournalEntry {
            kind,
            key,
            offset,
            value_len,
        },
        end,
    ))
}

impl OffsetAllocatorStore {
    /// Opens (or creates) the store in `dir`, with a data file as large as
    /// `limits.bytes`, and rebuilds the index from the journal.
    pub fn open(
        dir: &Path,
        limits: Limits,
        policy: EvictionPolicy,
        io: Arc<IoEngine>,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        let data_path = dir.join(DATA_FILE);
        let data = Arc::new(open_rw(&data_path)?);
        let capacity = limits.bytes / ALIGN * ALIGN;
        if data.metadata().map_err(io_error("stat", &data_path))?.len() < capacity {
            data.set_len(capacity)
                .map_err(io_error("size", &data_path))?;
        }
        let journal = open_rw(&dir.join(JOURNAL_FILE))?;
        let mut store = OffsetAllocatorStore {
            dir: dir.to_path_buf(),
            data,
            journal,
            journal_len: 0,
            journal_entries: 0,
            index: ObjectIndex::new(limits, policy),
            free: Extents::whole(capacity),
            evicting: Vec::new(),
            retired: Vec::new(),
            io,
        };
        let report = store.recover()?;
        Ok((store, report))
    }

    fn journal_path(&self) -> PathBuf {
        self.dir.join(JOURNAL_FILE)
    }

    fn data_path(&self) -> PathBuf {
        self.dir.join(DATA_FILE)
    }

    /// Replays the journal, checks every record, rebuilds the free space and
    /// rewrites the journal.
    fn recover(&mut self) -> Result<RecoveryReport, StoreError> {
        let journal_path = self.journal_path();
        let bytes = std::fs::read(&journal_path).map_err(io_error("read", &journal_path))?;
        let (entries, _) = parse_journal(&bytes);
        let mut live: HashMap<String, (u64, u64)> = HashMap::new();
        let mut order = Vec::new();
        for entry in entries {
            if entry.kind == STORED {
                order.push(entry.key.clone());
                live.insert(entry.key, (entry.offset, entry.value_len));
            } else {
                live.remove(&entry.key);
            }
        }
        let mut report = RecoveryReport::default();
        let mut progress = Progress::new("offset_allocator_storage_backend");
        let mut buffer = Vec::new();
        for key in order {
            let Some((offset, value_len)) = live.remove(&key) else {
                continue;
            };
            progress.step();
            let valid = check_record(&self.data, offset, Some((&key, value_len)), &mut buffer)
                .is_some()
                && offset.is_multiple_of(ALIGN);
            let extent = extent_of(buffer.len() as u64);
            if !valid || !self.free.reserve(offset, extent) {
                report.corrupt_records += 1;
                continue;
            }
            self.index_entry(key, offset, value_len, extent);
        }
        report.objects = self.index.room().keys as u64;
        report.buckets = u64::from(report.objects > 0);
        self.rewrite_journal()?;
        if report.corrupt_records > 0 {
            tracing::warn!(?report, "SSD tier: damaged records left out at recovery");
        }
        Ok(report)
    }

    fn index_entry(&mut self, key: String, offset: u64, value_len: u64, extent: u64) {
        let slot = Slot {
            offset,
            pin: Arc::new(()),
        };
        self.index.insert(key, slot, value_len, extent);
    }

    /// Writes a journal holding only the live objects, atomically.
    fn rewrite_journal(&mut self) -> Result<(), StoreError> {
        let mut bytes = JOURNAL_MAGIC.to_vec();
        for (key, entry) in self.index.in_order() {
            bytes.extend(journal_entry(
                STORED,
                key,
                entry.handle.offset,
                entry.value_len,
            ));
        }
        let path = self.journal_path();
        let tmp = path.with_extension("journal.tmp");
        crate::backend::write_synced(&self.io, &tmp, &bytes)?;
        std::fs::rename(&tmp, &path).map_err(io_error("rename", &tmp))?;
        crate::backend::sync_dir(&self.dir)?;
        self.journal = open_rw(&path)?;
        self.journal_len = bytes.len() as u64;
        self.journal_entries = self.index.room().keys as u64;
        Ok(())
    }

    /// Appends entries to the journal and syncs it.
    fn append_journal(&mut self, bytes: &[u8], count: u64) -> Result<(), StoreError> {
        let path = self.journal_path();
        self.io
            .write_all_at(&self.journal, bytes, self.journal_len)
            .map_err(io_error("write", &path))?;
        self.io
            .sync_data(&self.journal)
            .map_err(io_error("sync", &path))?;
        self.journal_len += bytes.len() as u64;
        self.journal_entries += count;
        if self.journal_entries > 4 * (self.index.room().keys as u64).max(1024) {
            self.rewrite_journal()?;
        }
        Ok(())
    }

    /// Moves retired extents no reader holds any more back to the free space.
    fn reclaim(&mut self) {
        let free = &mut self.free;
        self.retired.retain(|(offset, len, pin)| {
            let held = Arc::strong_count(pin) > 1;
            if !held {
                free.release(*offset, *len);
            }
            held
        });
    }

    /// The free space once every eviction under way is finished.
    fn projected_free(&self) -> Extents {
        let mut free = self.free.clone();
        for (offset, extent, _) in &self.evicting {
            free.release(*offset, *extent);
        }
        free
    }

    /// Takes objects out of the index, by the policy's order, until `done` says the
    /// room left (and the free space once evictions finish) is enough.
    fn evict_until(&mut self, done: impl Fn(&Self, &Extents) -> bool) -> Eviction {
        let mut projected = self.projected_free();
        let mut eviction = Eviction::default();
        while !done(self, &projected) {
            let Some((key, entry)) = self.index.pop_oldest() else {
                break;
            };
            let Slot { offset, pin } = entry.handle;
            projected.release(offset, entry.bytes);
            eviction.units.push(offset);
            self.evicting.push((offset, entry.bytes, pin));
            eviction.keys.push(key);
        }
        eviction
    }

    /// Whether every extent of `sizes` can be placed in `free`.
    fn fits(free: &Extents, sizes: &[u64]) -> bool {
        let mut trial = free.clone();
        sizes.iter().all(|size| trial.allocate(*size).is_some())
    }

    /// Journals the deletion of `entries` and retires their extents.
    fn drop_entries(&mut self, dropped: Vec<(String, Indexed<Slot>)>) {
        if dropped.is_empty() {
            return;
        }
        let mut bytes = Vec::new();
        for (key, entry) in &dropped {
            bytes.extend(journal_entry(
                DELETED,
                key,
                entry.handle.offset,
                entry.value_len,
            ));
        }
        if let Err(error) = self.append_journal(&bytes, dropped.len() as u64) {
            // Without a durable deletion the extents must not be reused: a restart
            // would index the old record again over new bytes.
            tracing::warn!(%error, "cannot journal SSD-tier deletions; their space stays unused until restart");
            return;
        }
        for (_, entry) in dropped {
            self.retired
                .push((entry.handle.offset, entry.bytes, entry.handle.pin));
        }
        self.reclaim();
    }
}

impl StorageBackend for OffsetAllocatorStore {
    fn name(&self) -> &'static str {
        "offset_allocator_storage_backend"
    }

    fn room(&self) -> Room {
        self.index.room()
    }

    fn contains(&self, key: &str) -> bool {
        self.index.contains(key)
    }

    fn objects(&self) -> Vec<(String, u64)> {
        self.index.objects()
    }

    fn make_room(&mut self, objects: &[(&str, &[u8])]) -> Result<Eviction, StoreError> {
        self.reclaim();
        let sizes = extents_of(objects);
        let bytes: u64 = sizes.iter().sum();
        let keys = objects.len() as u64;
        let room = |store: &Self, free: &Extents| {
            store.room().fits(bytes, keys) && Self::fits(free, &sizes)
        };
        if room(self, &self.free) {
            return Ok(Eviction::default());
        }
        self.room()
            .before_eviction(bytes, keys, self.index.policy())?;
        let eviction = self.evict_until(|store, free| room(store, free));
        if !room(self, &self.projected_free()) {
            // Even an empty store cannot place the batch: leave the victims evicted
            // (the master is told) and report the failure at write time.
            tracing::warn!(
                bytes,
                "SSD tier: the data file is too fragmented for a batch"
            );
        }
        Ok(eviction)
    }

    fn shrink_to(&mut self, bytes: u64, keys: u64) -> Eviction {
        if self.index.policy() == EvictionPolicy::None {
            return Eviction::default();
        }
        self.evict_until(|store, _| store.room().holds_at_most(bytes, keys))
    }

    fn finish_eviction(&mut self, eviction: Eviction) {
        if eviction.units.is_empty() {
            return;
        }
        let victims: Vec<u64> = eviction.units;
        let mut bytes = Vec::new();
        for (key, offset) in eviction.keys.iter().zip(&victims) {
            bytes.extend(journal_entry(DELETED, key, *offset, 0));
        }
        let pending: Vec<(u64, u64, Arc<()>)> = {
            let (mine, others) = std::mem::take(&mut self.evicting)
                .into_iter()
                .partition(|(offset, _, _)| victims.contains(offset));
            self.evicting = others;
            mine
        };
        if let Err(error) = self.append_journal(&bytes, victims.len() as u64) {
            tracing::warn!(%error, "cannot journal SSD-tier evictions; their space stays unused until restart");
            return;
        }
        self.retired.extend(pending);
        self.reclaim();
    }

    fn prepare_batch(&mut self, objects: &[(&str, &[u8])]) -> Result<PreparedBatch, StoreError> {
        check_batch(objects, |key| self.index.contains(key))?;
        self.reclaim();
        let sizes = extents_of(objects);
        let bytes: u64 = sizes.iter().sum();
        if !self.room().fits(bytes, objects.len() as u64) || !Self::fits(&self.free, &sizes) {
            return Err(self.room().exceeded(bytes));
        }
        // Taken out of the free space now: nothing else is placed there meanwhile.
        let offsets: Vec<u64> = sizes
            .iter()
            .filter_map(|size| self.free.allocate(*size))
            .collect();
        let placed: Vec<Placed> = objects
            .iter()
            .zip(offsets.iter().zip(&sizes))
            .map(|((key, value), (offset, extent))| Placed {
                key: (*key).to_string(),
                offset: *offset,
                value_len: value.len() as u64,
                extent: *extent,
            })
            .collect();
        let (io, data, path) = (
            Arc::clone(&self.io),
            Arc::clone(&self.data),
            self.data_path(),
        );
        Ok(PreparedBatch::new(
            objects,
            move |objects| {
                let mut records: Vec<Placement<'_>> = objects
                    .iter()
                    .zip(&offsets)
                    .map(|((key, value), offset)| Placement {
                        offset: *offset,
                        key,
                        value,
                    })
                    .collect();
                records.sort_unstable_by_key(|record| record.offset);
                write_records(&io, &data, &records)
                    .and_then(|()| io.sync_data(&data))
                    .map_err(io_error("write", &path))
            },
            placed,
        ))
    }

    /// Journals the written records (then they are durable), and indexes them.
    fn commit_batch(
        &mut self,
        batch: PreparedBatch,
        written: Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let placed = batch
            .into_state::<Vec<Placed>>()
            .ok_or_else(foreign_batch)?;
        let mut journal = Vec::new();
        for record in &placed {
            journal.extend(journal_entry(
                STORED,
                &record.key,
                record.offset,
                record.value_len,
            ));
        }
        let committed = written.and_then(|()| self.append_journal(&journal, placed.len() as u64));
        if let Err(error) = committed {
            for record in &placed {
                self.free.release(record.offset, record.extent);
            }
            return Err(error);
        }
        for record in placed {
            self.index_entry(record.key, record.offset, record.value_len, record.extent);
        }
        Ok(())
    }

    fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError> {
        let entry = self.index.read(key).ok_or(StoreError::NotFound)?;
        Ok(ReadPlan::in_file(
            self.data_path(),
            entry.handle.offset,
            key,
            entry.value_len,
            Arc::clone(&self.io),
            Some(entry.handle.pin),
        ))
    }

    fn remove(&mut self, key: &str) -> bool {
        match self.index.forget(key) {
            Some(entry) => {
                self.drop_entries(vec![(key.to_string(), entry)]);
                true
            }
            None => false,
        }
    }

    fn remove_all(&mut self) -> usize {
        let dropped = self.index.clear();
        let count = dropped.len();
        self.drop_entries(dropped);
        count
    }
}

#[cfg(test)]
mod tests {
    //! The journal comes back from disk: no bytes may panic its decoder, a journal
    //! decodes to the entries written, and replay stops at the first damaged one.

    use proptest::prelude::*;

    use super::*;

    fn journal_of(entries: &[JournalEntry]) -> Vec<u8> {
        let mut bytes = JOURNAL_MAGIC.to_vec();
        for entry in entries {
            bytes.extend(journal_entry(
                entry.kind,
                &entry.key,
                entry.offset,
                entry.value_len,
            ));
        }
        bytes
    }

    /// Decodes `bytes`; the valid prefix is exactly what the store writes for the
    /// entries found.
    fn decode(bytes: &[u8]) -> (Vec<JournalEntry>, u64) {
        let (entries, valid) = parse_journal(bytes);
        let valid_len = usize::try_from(valid).expect("small");
        assert!(valid_len <= bytes.len());
        if valid_len > 0 {
            assert_eq!(journal_of(&entries), &bytes[..valid_len]);
        } else {
            assert!(entries.is_empty());
        }
        (entries, valid)
    }

    fn entry() -> impl Strategy<Value = JournalEntry> {
        (
            prop_oneof![Just(STORED), Just(DELETED)],
            ".{1,12}",
            any::<u64>(),
            any::<u64>(),
        )
            .prop_map(|(kind, key, offset, value_len)| JournalEntry {
                kind,
                key,
                offset,
                value_len,
            })
    }

    /// Where each entry of `entries` starts in their journal, and where it ends.
    fn bounds(entries: &[JournalEntry]) -> Vec<(usize, usize)> {
        let mut at = JOURNAL_MAGIC.len();
        entries
            .iter()
            .map(|entry| {
                let start = at;
                at += 25 + entry.key.len();
                (start, at)
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn no_input_panics_the_offset_allocator_journal_decoder(
            bytes in proptest::collection::vec(any::<u8>(), 0..160),
            entries in proptest::collection::vec(entry(), 0..3),
        ) {
            decode(&bytes);
            // The same bytes after valid entries, and after the magic alone.
            let mut journal = journal_of(&entries);
            journal.extend_from_slice(&bytes);
            let (found, _) = decode(&journal);
            prop_assert!(found.len() >= entries.len());
            let mut bare = JOURNAL_MAGIC.to_vec();
            bare.extend_from_slice(&bytes);
            decode(&bare);
        }

        #[test]
        fn offset_allocator_journals_round_trip(
            entries in proptest::collection::vec(entry(), 0..8),
        ) {
            let journal = journal_of(&entries);
            prop_assert_eq!(decode(&journal), (entries, journal.len() as u64));
        }

        #[test]
        fn journal_replay_stops_at_the_first_damaged_or_torn_entry(
            entries in proptest::collection::vec(entry(), 1..8),
            at in any::<usize>(),
            flip in 1..=255u8,
        ) {
            let journal = journal_of(&entries);
            let at = at % journal.len();
            let bounds = bounds(&entries);
            // The entries wholly before `at` survive; the one holding `at` does not.
            let intact = bounds.iter().take_while(|(_, end)| *end <= at).count();
            let kept = intact
                .checked_sub(1)
                .map_or(JOURNAL_MAGIC.len(), |last| bounds[last].1);
            let expected = if at < JOURNAL_MAGIC.len() {
                (Vec::new(), 0)
            } else {
                (entries[..intact].to_vec(), kept as u64)
            };
            let mut damaged = journal.clone();
            damaged[at] ^= flip;
            prop_assert_eq!(decode(&damaged), expected.clone(), "a flipped byte");
            prop_assert_eq!(decode(&journal[..at]), expected, "a torn journal");
        }
    }
}
