//! Distributed KV stores as a tier behind the SSD tier's backend interface: the
//! contract every store client meets ([`DkvClient`]), its implementations (a C plugin
//! loaded at run time, [`plugin`]) and `distributed_kv_storage_backend` on top of it
//! ([`backend`]).
//!
//! Every call is a batch with one result per key, so a client can pipeline. Reads land
//! in the caller's buffers. `scan` lists keys by prefix with a restartable cursor, so a
//! node can rebuild its index from the store after a restart.

pub mod backend;
pub mod plugin;

/// Why a call on one key (or a whole batch) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DkvError {
    /// No such key.
    #[error("key not in the store")]
    NotFound,
    /// The destination is smaller than the value.
    #[error("destination of {have} bytes is smaller than the value of {need} bytes")]
    TooSmall {
        /// The value's length.
        need: u64,
        /// The destination's length.
        have: u64,
    },
    /// The store has no room.
    #[error("the store is full")]
    Full,
    /// The call was refused before reaching the store (bad key, bad batch).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The store failed or could not be reached.
    #[error("store error: {0}")]
    Store(String),
}

/// One page of a [`DkvClient::scan`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanPage {
    /// Keys found, with their value lengths.
    pub keys: Vec<(Vec<u8>, u64)>,
    /// Where the next page starts; `None` when the listing is complete.
    pub cursor: Option<u64>,
}

/// A client of a distributed KV store. Implementations are shared between threads.
pub trait DkvClient: Send + Sync + std::fmt::Debug {
    /// What it talks to, for logs.
    fn describe(&self) -> String;

    /// Stores every `(key, value)`; one result per item.
    fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Vec<Result<(), DkvError>>;

    /// Reads every key into its destination; one result per item: the value's length.
    fn batch_get(&self, items: &mut [(&[u8], &mut [u8])]) -> Vec<Result<u64, DkvError>>;

    /// Whether each key exists.
    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, DkvError>>;

    /// Deletes every key (a missing key is not an error); one result per key.
    fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Result<(), DkvError>>;

    /// Up to `page` keys starting with `prefix`, from `cursor` (`None` to start).
    fn scan(&self, prefix: &[u8], cursor: Option<u64>, page: u32) -> Result<ScanPage, DkvError>;

    /// Bytes the store can hold for this client, when it can tell.
    fn capacity(&self) -> Option<u64>;
}

/// Every key starting with `prefix`, page by page.
pub fn scan_all(
    client: &dyn DkvClient,
    prefix: &[u8],
    page: u32,
) -> Result<Vec<(Vec<u8>, u64)>, DkvError> {
    let mut keys = Vec::new();
    let mut cursor = None;
    loop {
        let found = client.scan(prefix, cursor, page)?;
        keys.extend(found.keys);
        match found.cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(keys),
        }
    }
}
