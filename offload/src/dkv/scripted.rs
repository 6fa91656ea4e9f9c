//! A distributed KV store that answers from a script, for tests and fuzz targets: its
//! listing and its values are whatever the script says, as a damaged, foreign or
//! hostile store's would be (lengths that disagree with the values, keys outside the
//! prefix, values that are not records, keys gone between listing and read).
//!
//! It lists every scripted key whatever the prefix asked for, in script order, and
//! refuses writes; deletes succeed and change nothing.

use std::sync::Arc;

use super::backend::DkvStore;
use super::{DkvClient, DkvError, GetInto, ScanPage};
use crate::backend::{Limits, RecoveryReport, StorageBackend, StoreError};
use crate::config::EvictionPolicy;
use crate::record::HEADER_LEN;

/// One key of a [`ScriptedStore`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScriptedKey {
    /// The key as the store names it.
    pub key: Vec<u8>,
    /// The value length the listing claims.
    pub listed_len: u64,
    /// The bytes a read returns; `None`: the key is gone by the time it is read.
    pub value: Option<Vec<u8>>,
}

impl ScriptedKey {
    /// A key holding `value`, listed with its true length.
    pub fn holding(key: impl Into<Vec<u8>>, value: Vec<u8>) -> Self {
        ScriptedKey {
            key: key.into(),
            listed_len: value.len() as u64,
            value: Some(value),
        }
    }
}

/// A read-only store that lists and serves exactly its script.
#[derive(Clone, Debug, Default)]
pub struct ScriptedStore {
    keys: Vec<ScriptedKey>,
    capacity: Option<u64>,
}

impl ScriptedStore {
    /// A store holding `keys` (the first of equal keys answers reads) that reports
    /// `capacity`.
    pub fn new(keys: Vec<ScriptedKey>, capacity: Option<u64>) -> Self {
        ScriptedStore { keys, capacity }
    }

    fn find(&self, key: &[u8]) -> Option<&[u8]> {
        self.keys
            .iter()
            .find(|scripted| scripted.key == key)
            .and_then(|scripted| scripted.value.as_deref())
    }
}

impl DkvClient for ScriptedStore {
    fn describe(&self) -> String {
        format!("a scripted store of {} keys", self.keys.len())
    }

    fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Vec<Result<(), DkvError>> {
        items
            .iter()
            .map(|_| Err(DkvError::Store("a scripted store is read-only".into())))
            .collect()
    }

    fn batch_get(&self, items: &mut [GetInto<'_>]) -> Vec<Result<u64, DkvError>> {
        items
            .iter_mut()
            .map(|item| match self.find(item.key) {
                Some(value) => item.fill(value),
                None => Err(DkvError::NotFound),
            })
            .collect()
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, DkvError>> {
        keys.iter()
            .map(|key| Ok(self.find(key).is_some()))
            .collect()
    }

    fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Result<(), DkvError>> {
        keys.iter().map(|_| Ok(())).collect()
    }

    fn scan(&self, _prefix: &[u8], cursor: Option<u64>, page: u32) -> Result<ScanPage, DkvError> {
        let start = cursor.map_or(0, |at| usize::try_from(at).unwrap_or(usize::MAX));
        let page = usize::try_from(page.max(1)).unwrap_or(usize::MAX);
        let end = start.saturating_add(page).min(self.keys.len());
        let keys = self
            .keys
            .get(start..end)
            .unwrap_or_default()
            .iter()
            .map(|scripted| (scripted.key.clone(), scripted.listed_len))
            .collect();
        Ok(ScanPage {
            keys,
            cursor: (end < self.keys.len()).then_some(end as u64),
        })
    }

    fn capacity(&self) -> Option<u64> {
        self.capacity
    }
}

/// Opens the distributed-KV backend (keys under `prefix`) on a store answering from
/// `script`, then reads back every object it indexed into buffers of at most
/// `max_read` bytes, checking that a read that succeeds returned the value of a whole
/// record the store holds for that key. Returns the recovery report and the objects
/// read. Shared by the proptests and the `dkv_record` fuzz target.
pub fn open_and_read_all(
    script: &[ScriptedKey],
    prefix: &str,
    max_read: usize,
) -> (RecoveryReport, usize) {
    let client = Arc::new(ScriptedStore::new(script.to_vec(), None));
    let (mut store, report) = DkvStore::open(
        client,
        prefix,
        Limits::bytes(u64::MAX),
        EvictionPolicy::Fifo,
    )
    .expect("a listing that succeeds opens the store");
    let mut read = 0;
    for (key, value_len) in store.objects() {
        let mut dest = vec![0u8; usize::try_from(value_len).map_or(max_read, |n| n.min(max_read))];
        match store.read_into(&key, &mut dest) {
            Ok(len) => {
                assert_eq!(len, value_len);
                let value = &dest[..usize::try_from(len).expect("at most the buffer")];
                let store_key = format!("{prefix}{key}").into_bytes();
                let stored = script
                    .iter()
                    .find(|s| s.key == store_key)
                    .and_then(|s| s.value.clone())
                    .expect("read from the store");
                let mut written = crate::backend::encode_record(&key, value);
                // The reserved bytes of the header are not read.
                written[20..HEADER_LEN].copy_from_slice(&stored[20..HEADER_LEN]);
                assert_eq!(
                    stored, written,
                    "a read returns only a whole record of its key"
                );
                read += 1;
            }
            Err(StoreError::BufferTooSmall { need, .. }) => assert!(need > max_read as u64),
            Err(_) => {}
        }
    }
    (report, read)
}
