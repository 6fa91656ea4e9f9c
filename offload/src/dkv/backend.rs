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

use super::{DkvClient, DkvError, scan_all};
use crate::backend::{
    Eviction, Limits, PreparedBatch, Progress, ReadPlan, RecoveryReport, Room, StorageBackend,
    StoreError, check_batch, encode_record, foreign_batch, record_len,
};
use crate::config::EvictionPolicy;
use crate::object_index::ObjectIndex;
use crate::record::HEADER_LEN;

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
            match (key, value_len) {
                (Some(key), Some(value_len)) if value_len > 0 && !key.is_empty() => {
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
        let records: Vec<(Vec<u8>, Vec<u8>)> = objects
            .iter()
            .map(|(key, value)| {
                let record = encode_record(key, value);
                (self.store_key(key), record)
            })
            .collect();
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
            move || put_all(client.as_ref(), &records),
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

    fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError> {
        let entry = self.index.read(key).ok_or(StoreError::NotFound)?;
        Ok(ReadPlan::in_store(
            Arc::clone(&self.client),
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

/// Stores every `(store key, record)`; when some fail, deletes the ones that were
/// stored (no half-written batch stays behind) and fails.
fn put_all(client: &dyn DkvClient, records: &[(Vec<u8>, Vec<u8>)]) -> Result<(), StoreError> {
    let items: Vec<(&[u8], &[u8])> = records
        .iter()
        .map(|(k, r)| (k.as_slice(), r.as_slice()))
        .collect();
    let results = client.batch_put(&items);
    let failure = results.iter().find_map(|r| r.as_ref().err()).cloned();
    let Some(error) = failure else {
        return Ok(());
    };
    let stored: Vec<&[u8]> = items
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_ok())
        .map(|((k, _), _)| *k)
        .collect();
    if !stored.is_empty() {
        let _ = client.batch_delete(&stored);
    }
    Err(remote(&error))
}
