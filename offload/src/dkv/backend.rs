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
            move |objects| put_all(client.as_ref(), &store_keys, objects),
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

/// Stores the record of every object under its store key (header and key from a small
/// buffer, the value from where it is); when some fail, deletes the ones that were
/// stored (no half-written batch stays behind) and fails.
fn put_all(
    client: &dyn DkvClient,
    store_keys: &[Vec<u8>],
    objects: &[(&str, &[u8])],
) -> Result<(), StoreError> {
    let heads: Vec<Vec<u8>> = objects
        .iter()
        .map(|(key, value)| [&record::header(key.as_bytes(), value)[..], key.as_bytes()].concat())
        .collect();
    let items: Vec<PutFrom<'_>> = store_keys
        .iter()
        .zip(&heads)
        .zip(objects)
        .map(|((key, head), (_, value))| PutFrom {
            key,
            head,
            body: value,
        })
        .collect();
    let results = client.batch_put_from(&items);
    let failure = results.iter().find_map(|r| r.as_ref().err()).cloned();
    let Some(error) = failure else {
        return Ok(());
    };
    let stored: Vec<&[u8]> = items
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_ok())
        .map(|(item, _)| item.key)
        .collect();
    if !stored.is_empty() {
        let _ = client.batch_delete(&stored);
    }
    Err(remote(&error))
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
