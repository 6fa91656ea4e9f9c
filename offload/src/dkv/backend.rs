//! `distributed_kv_storage_backend`: the SSD tier's objects kept in a distributed KV
//! store through a [`DkvClient`].
//!
//! Each object is one [record](crate::record) (header with magic, lengths and
//! checksum, then key and value) stored under `<namespace>/<node>/<key>`, so a corrupt
//! or foreign value is detected at read time, several clusters or tenants can share a
//! store (`MOONCAKE_OFFLOAD_DKV_NAMESPACE`), and each node sees only its own objects. The index lives in the node's memory and is
//! rebuilt at startup by scanning the namespace (with progress); values are checked when
//! read. A batch whose write failed for some keys has the keys it did write deleted
//! again. Eviction takes single objects (`fifo`, or `lru`), two-phase as for every
//! backend: the store's copies are deleted after the master was told.

use std::sync::Arc;

use super::{DkvClient, DkvError, PutFrom, scan_all};
use crate::backend::RecordSource;
use crate::backend::{
    Eviction, Limits, PreparedBatch, Progress, ReadPlan, RecoveryReport, Room, StorageBackend,
    StoreError, check_batch, foreign_batch, record_len,
};
use crate::config::EvictionPolicy;
use crate::object_index::ObjectIndex;
use crate::record::{self, HEADER_LEN};

/// Keys listed per scan call during recovery.
const SCAN_PAGE: u32 = 1000;

/// `<namespace>/<node>/`: where the objects of `node` (its segment name) live; just
/// `<namespace>/` without a node name.
pub fn key_prefix(namespace: &str, node: &str) -> String {
    if node.is_empty() {
        format!("{namespace}/")
    } else {
        format!("{namespace}/{node}/")
    }
}

/// The backend over one store client.
#[derive(Debug)]
pub struct DkvStore {
    client: Arc<dyn DkvClient>,
    prefix: Vec<u8>,
    index: ObjectIndex<()>,
}

fn remote(error: &DkvError) -> StoreError {
    StoreError::Remote(error.to_string())
}

impl DkvStore {
    /// Opens the backend on `client` with keys under `prefix` (see [`key_prefix`]),
    /// and rebuilds the index by scanning them. The byte limit is capped by the store's
    /// capacity when it tells one.
    pub fn open(
        client: Arc<dyn DkvClient>,
        prefix: &str,
        limits: Limits,
        policy: EvictionPolicy,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        let limits = Limits {
            bytes: limits.bytes.min(client.capacity().unwrap_or(u64::MAX)),
            ..limits
        };
        let mut store = DkvStore {
            client,
            prefix: prefix.as_bytes().to_vec(),
            index: ObjectIndex::new(limits, policy),
        };
        let report = store.recover()?;
        Ok((store, report))
    }

    fn store_key(&self, key: &str) -> Vec<u8> {
        let mut store_key = self.prefix.clone();
        store_key.extend_from_slice(key.as_bytes());
        store_key
    }

    fn recover(&mut self) -> Result<RecoveryReport, StoreError> {
        let found =
            scan_all(self.client.as_ref(), &self.prefix, SCAN_PAGE).map_err(|e| remote(&e))?;
        let mut report = RecoveryReport::default();
        let mut progress = Progress::new("distributed_kv_storage_backend");
        for (store_key, stored) in found {
            progress.step();
            let key = store_key
                .strip_prefix(self.prefix.as_slice())
                .and_then(|k| std::str::from_utf8(k).ok());
            let value_len = key.and_then(|k| stored.checked_sub((HEADER_LEN + k.len()) as u64));
            // The lengths are the store's word: one that would carry the bytes in use
            // past `u64::MAX` is no record's, and is left out rather than summed.
            let counted = self.index.room().used.checked_add(stored).is_some();
            match (key, value_len) {
                (Some(key), Some(value_len)) if value_len > 0 && !key.is_empty() && counted => {
                    self.index.insert(key.to_string(), (), value_len, stored);
                }
                _ => report.corrupt_records += 1,
            }
        }
        report.objects = self.index.room().keys as u64;
        if report.corrupt_records > 0 {
            tracing::warn!(
                ?report,
                "SSD tier: foreign or damaged values left out at recovery"
            );
        }
        Ok(report)
    }

    /// Deletes `keys` from the store, logging failures (the index no longer has them).
    fn delete_in_store(&self, keys: &[String]) {
        let store_keys: Vec<Vec<u8>> = keys.iter().map(|k| self.store_key(k)).collect();
        let refs: Vec<&[u8]> = store_keys.iter().map(Vec::as_slice).collect();
        for (key, result) in keys.iter().zip(self.client.batch_delete(&refs)) {
            if let Err(error) = result {
                tracing::warn!(key, %error, "cannot delete an object from the distributed KV store");
            }
        }
    }
}

impl StorageBackend for DkvStore {
    fn name(&self) -> &'static str {
        "distributed_kv_storage_backend"
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
        let bytes: u64 = objects.iter().map(|(k, v)| record_len(k, v)).sum();
        self.index
            .make_room(bytes, objects.len() as u64, &mut Vec::new())
    }

    fn shrink_to(&mut self, bytes: u64, keys: u64) -> Eviction {
        self.index.shrink_to(bytes, keys, &mut Vec::new())
    }

    fn finish_eviction(&mut self, eviction: Eviction) {
        self.delete_in_store(&eviction.keys);
    }

    fn prepare_batch(&mut self, objects: &[(&str, &[u8])]) -> Result<PreparedBatch, StoreError> {
        check_batch(objects, |key| self.index.contains(key))?;
        let bytes: u64 = objects.iter().map(|(k, v)| record_len(k, v)).sum();
        if !self.room().fits(bytes, objects.len() as u64) {
            return Err(self.room().exceeded(bytes));
        }
        let store_keys: Vec<Vec<u8>> = objects.iter().map(|(key, _)| self.store_key(key)).collect();
        let entries: Vec<(String, u64, u64)> = objects
            .iter()
            .map(|(key, value)| {
                (
                    (*key).to_string(),
                    value.len() as u64,
                    record_len(key, value),
                )
            })
            .collect();
        let client = Arc::clone(&self.client);
        Ok(PreparedBatch::new(
            objects,
            move |objects| put_all(client.as_ref(), &store_keys, objects, PART_BYTES),
            entries,
        ))
    }

    fn commit_batch(
        &mut self,
        batch: PreparedBatch,
        written: Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let entries = batch
            .into_state::<Vec<(String, u64, u64)>>()
            .ok_or_else(foreign_batch)?;
        written?;
        for (key, value_len, bytes) in entries {
            self.index.insert(key, (), value_len, bytes);
        }
        Ok(())
    }

    fn copies_values(&self) -> bool {
        self.client.copies_values()
    }

    fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError> {
        let entry = self.index.read(key).ok_or(StoreError::NotFound)?;
        Ok(ReadPlan::in_store(
            Arc::new(StoredRecords(Arc::clone(&self.client))),
            self.store_key(key),
            key,
            entry.value_len,
        ))
    }

    fn remove(&mut self, key: &str) -> bool {
        if self.index.forget(key).is_none() {
            return false;
        }
        self.delete_in_store(&[key.to_string()]);
        true
    }

    fn remove_all(&mut self) -> usize {
        let keys: Vec<String> = self.index.clear().into_iter().map(|(k, _)| k).collect();
        self.delete_in_store(&keys);
        keys.len()
    }
}

/// Bytes of values per part of a batch: the record headers of the next part (a
/// checksum over its values) are computed on a helper thread while this part is sent.
const PART_BYTES: usize = 32 << 20;

/// Stores the record of every object under its store key (header and key from a small
/// buffer, the value from where it is), in parts of about `part_bytes` whose headers
/// are computed one part ahead; when some fail, no later part is sent, the ones that
/// were stored are deleted (no half-written batch stays behind) and it fails.
fn put_all(
    client: &dyn DkvClient,
    store_keys: &[Vec<u8>],
    objects: &[(&str, &[u8])],
    part_bytes: usize,
) -> Result<(), StoreError> {
    let parts = parts_by_bytes(objects, part_bytes);
    let mut results = Vec::with_capacity(objects.len());
    let mut send = |range: std::ops::Range<usize>, heads: Vec<Vec<u8>>| {
        let items: Vec<PutFrom<'_>> = store_keys[range.clone()]
            .iter()
            .zip(&heads)
            .zip(&objects[range])
            .map(|((key, head), (_, value))| PutFrom {
                key,
                head,
                body: value,
            })
            .collect();
        results.extend(client.batch_put_from(&items));
        results.iter().all(Result::is_ok)
    };
    if let [only] = parts.as_slice() {
        send(only.clone(), record_heads(objects));
    } else {
        std::thread::scope(|scope| {
            let (ahead, computed) = std::sync::mpsc::sync_channel(1);
            scope.spawn(move || {
                for range in parts {
                    let heads = record_heads(&objects[range.clone()]);
                    if ahead.send((range, heads)).is_err() {
                        break;
                    }
                }
            });
            for (range, heads) in computed {
                if !send(range, heads) {
                    break;
                }
            }
        });
    }
    let failure = results.iter().find_map(|r| r.as_ref().err()).cloned();
    let Some(error) = failure else {
        return Ok(());
    };
    let stored: Vec<&[u8]> = store_keys
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_ok())
        .map(|(key, _)| key.as_slice())
        .collect();
    if !stored.is_empty() {
        let _ = client.batch_delete(&stored);
    }
    Err(remote(&error))
}

/// Each object's record header followed by its key: what is stored before its value.
fn record_heads(objects: &[(&str, &[u8])]) -> Vec<Vec<u8>> {
    objects
        .iter()
        .map(|(key, value)| [&record::header(key.as_bytes(), value)[..], key.as_bytes()].concat())
        .collect()
}

/// `objects` cut into consecutive ranges of about `bytes` bytes of values each (at
/// least one object per range; none for no objects).
fn parts_by_bytes(objects: &[(&str, &[u8])], bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut parts = Vec::new();
    let (mut start, mut filled) = (0, 0);
    for (i, (_, value)) in objects.iter().enumerate() {
        filled += value.len();
        if filled >= bytes {
            parts.push(start..i + 1);
            (start, filled) = (i + 1, 0);
        }
    }
    if start < objects.len() {
        parts.push(start..objects.len());
    }
    parts
}

/// The records of a distributed KV store, as a [`RecordSource`] for read plans.
#[derive(Debug)]
struct StoredRecords(Arc<dyn DkvClient>);

impl RecordSource for StoredRecords {
    fn read_record(
        &self,
        store_key: &[u8],
        head: &mut [u8],
        value: &mut [u8],
    ) -> Result<u64, StoreError> {
        let got = self
            .0
            .batch_get(&mut [super::GetInto::split(store_key, head, value)])
            .pop()
            .unwrap_or(Err(DkvError::Store("no result".into())));
        match got {
            Ok(len) => Ok(len),
            Err(DkvError::NotFound | DkvError::TooSmall { .. }) => Err(StoreError::NotFound),
            Err(error) => Err(StoreError::Remote(error.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The store's listing and values come from another process: no listing or value
    //! may panic the backend, and a read returns only the bytes of the record written
    //! for its key.

    use proptest::prelude::*;

    use super::*;
    use crate::backend::encode_record;
    use crate::dkv::scripted::{ScriptedKey, ScriptedStore};
    use crate::dkv::{GetInto, ScanPage};

    const PREFIX: &str = "ns/node/";

    /// A key of a script: an object of this node whose stored bytes are its record,
    /// a damaged record, other bytes or gone, listed with its true length or any; or
    /// a key outside the node's prefix.
    fn scripted_key() -> impl Strategy<Value = ScriptedKey> {
        (
            "[a-z/]{0,6}",
            proptest::collection::vec(any::<u8>(), 0..48),
            0..4u8,
            (any::<usize>(), 1..=255u8),
            proptest::option::of(any::<u64>()),
            any::<bool>(),
        )
            .prop_map(|(name, value, stored, (at, flip), listed, ours)| {
                let mut record = encode_record(&name, &value);
                let value = match stored {
                    0 => Some(record),
                    1 => {
                        let at = at % record.len();
                        record[at] ^= flip;
                        Some(record)
                    }
                    2 => Some(value),
                    _ => None,
                };
                let key = if ours {
                    format!("{PREFIX}{name}")
                } else {
                    name
                };
                let true_len = value.as_ref().map_or(0, |v| v.len() as u64);
                ScriptedKey {
                    key: key.into_bytes(),
                    listed_len: listed.unwrap_or(true_len),
                    value,
                }
            })
    }

    fn open_and_read_all(script: &[ScriptedKey]) -> (RecoveryReport, usize) {
        super::super::scripted::open_and_read_all(script, PREFIX, 4096)
    }

    /// A store in memory that refuses to store keys containing `bad`, and counts the
    /// `SET`s it was sent.
    #[derive(Debug, Default)]
    struct MemoryStore {
        values: parking_lot::Mutex<std::collections::HashMap<Vec<u8>, Vec<u8>>>,
        puts: std::sync::atomic::AtomicUsize,
    }

    impl DkvClient for MemoryStore {
        fn describe(&self) -> String {
            "a store in memory".into()
        }

        fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Vec<Result<(), DkvError>> {
            items
                .iter()
                .map(|(key, value)| {
                    self.puts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if key.windows(3).any(|w| w == b"bad") {
                        return Err(DkvError::Store("refused".into()));
                    }
                    self.values.lock().insert(key.to_vec(), value.to_vec());
                    Ok(())
                })
                .collect()
        }

        fn batch_get(&self, items: &mut [GetInto<'_>]) -> Vec<Result<u64, DkvError>> {
            items
                .iter_mut()
                .map(|item| match self.values.lock().get(item.key) {
                    Some(value) => item.fill(value),
                    None => Err(DkvError::NotFound),
                })
                .collect()
        }

        fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, DkvError>> {
            let values = self.values.lock();
            keys.iter()
                .map(|key| Ok(values.contains_key(*key)))
                .collect()
        }

        fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Result<(), DkvError>> {
            let mut values = self.values.lock();
            keys.iter()
                .map(|key| {
                    values.remove(*key);
                    Ok(())
                })
                .collect()
        }

        fn scan(&self, _: &[u8], _: Option<u64>, _: u32) -> Result<ScanPage, DkvError> {
            Ok(ScanPage::default())
        }

        fn capacity(&self) -> Option<u64> {
            None
        }
    }

    /// Ten objects of 1000 bytes named `name-<i>`, the one at `bad` (if any) named so
    /// that the store refuses it.
    fn batch(bad: Option<usize>) -> Vec<(String, Vec<u8>)> {
        (0..10u8)
            .map(|i| {
                let name = if Some(usize::from(i)) == bad {
                    "bad"
                } else {
                    "name"
                };
                (format!("{name}-{i}"), vec![i; 1000])
            })
            .collect()
    }

    /// The store keys of `objects`: their names.
    fn keys_of(objects: &[(String, Vec<u8>)]) -> Vec<Vec<u8>> {
        objects
            .iter()
            .map(|(k, _)| k.clone().into_bytes())
            .collect()
    }

    #[test]
    fn parts_cover_the_batch_in_order_with_at_least_one_object_each() {
        let objects = batch(None);
        let objects: Vec<(&str, &[u8])> = objects
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        assert_eq!(
            parts_by_bytes(&objects, 3000),
            vec![0..3, 3..6, 6..9, 9..10]
        );
        assert_eq!(
            parts_by_bytes(&objects, 1),
            (0..10).map(|i| i..i + 1).collect::<Vec<_>>()
        );
        assert_eq!(parts_by_bytes(&objects, 1 << 20), vec![0..10]);
        assert!(parts_by_bytes(&[], 3000).is_empty());
    }

    #[test]
    fn a_batch_sent_in_parts_stores_every_record_whole() {
        let store = MemoryStore::default();
        let objects = batch(None);
        let keys = keys_of(&objects);
        let objects: Vec<(&str, &[u8])> = objects
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        put_all(&store, &keys, &objects, 3000).expect("stored");
        let values = store.values.lock();
        for (key, (name, value)) in keys.iter().zip(&objects) {
            assert_eq!(values.get(key), Some(&encode_record(name, value)));
        }
    }

    #[test]
    fn a_part_that_fails_stops_the_batch_and_what_was_stored_is_deleted() {
        let store = MemoryStore::default();
        let objects = batch(Some(4));
        let keys = keys_of(&objects);
        let objects: Vec<(&str, &[u8])> = objects
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let result = put_all(&store, &keys, &objects, 3000);
        assert!(matches!(result, Err(StoreError::Remote(_))), "{result:?}");
        assert!(store.values.lock().is_empty(), "nothing stays behind");
        assert_eq!(
            store.puts.load(std::sync::atomic::Ordering::Relaxed),
            6,
            "the parts after the failed one are not sent"
        );
    }

    #[test]
    fn listed_lengths_that_would_overflow_the_bytes_in_use_are_left_out() {
        // Found by the `dkv_record` fuzz target: two listed lengths whose sum passes
        // `u64::MAX` overflowed the index's byte count (a panic with overflow checks, a
        // wrapped count without).
        let huge = u64::MAX - 10;
        let script: Vec<ScriptedKey> = ["a", "b"]
            .iter()
            .map(|name| ScriptedKey {
                listed_len: huge,
                ..ScriptedKey::holding(format!("{PREFIX}{name}"), encode_record(name, b"v"))
            })
            .collect();
        let (report, read) = open_and_read_all(&script);
        assert_eq!((report.objects, report.corrupt_records, read), (1, 1, 0));
        let client = Arc::new(ScriptedStore::new(script, None));
        let (store, _) = DkvStore::open(
            client,
            PREFIX,
            Limits::bytes(u64::MAX),
            EvictionPolicy::Fifo,
        )
        .expect("opens");
        assert_eq!(store.used_bytes(), huge);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn no_listing_or_value_panics_the_distributed_kv_record_decoder(
            script in proptest::collection::vec(scripted_key(), 0..12),
        ) {
            open_and_read_all(&script);
        }

        #[test]
        fn distributed_kv_records_round_trip(
            objects in proptest::collection::btree_map(
                "[a-z]{1,8}",
                proptest::collection::vec(any::<u8>(), 1..64),
                0..12,
            ),
        ) {
            let script: Vec<ScriptedKey> = objects
                .iter()
                .map(|(key, value)| {
                    ScriptedKey::holding(format!("{PREFIX}{key}"), encode_record(key, value))
                })
                .collect();
            let (report, read) = open_and_read_all(&script);
            prop_assert_eq!(report.objects, objects.len() as u64);
            prop_assert_eq!(report.corrupt_records, 0);
            prop_assert_eq!(read, objects.len());
        }
    }
}
