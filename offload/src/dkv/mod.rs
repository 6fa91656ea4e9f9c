//! Distributed KV stores as a tier behind the SSD tier's backend interface: the
//! contract every store client meets ([`DkvClient`]), its implementations (Redis or
//! Valkey, [`redis`]; a C plugin loaded at run time, [`plugin`]) and
//! `distributed_kv_storage_backend` on top of it ([`backend`]).
//!
//! Every call is a batch with one result per key, so a client can pipeline. Reads land
//! in the caller's buffers ([`GetInto`]: a value can be split over two, so a record's
//! header and its payload go to different places without another copy). `scan` lists
//! keys by prefix with a restartable cursor, so a node can rebuild its index from the
//! store after a restart.
//!
//! With the `test-utils` feature, `scripted` offers a store that answers from a
//! script, to feed the backend what a damaged or hostile store would.

pub mod backend;
pub mod conformance;
pub mod plugin;
pub mod redis;
#[cfg(any(test, feature = "test-utils"))]
pub mod scripted;

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

/// One key of a [`DkvClient::batch_get`] and where its value goes: the first
/// `head.len()` bytes into `head`, the rest into `body`.
#[derive(Debug)]
pub struct GetInto<'a> {
    /// The key to read.
    pub key: &'a [u8],
    /// Where the value starts (may be empty).
    pub head: &'a mut [u8],
    /// Where the value continues after `head`.
    pub body: &'a mut [u8],
}

impl<'a> GetInto<'a> {
    /// Reads `key` into `dest`.
    pub fn new(key: &'a [u8], dest: &'a mut [u8]) -> Self {
        GetInto {
            key,
            head: &mut [],
            body: dest,
        }
    }

    /// Reads `key` into `head`, continuing in `body`.
    pub fn split(key: &'a [u8], head: &'a mut [u8], body: &'a mut [u8]) -> Self {
        GetInto { key, head, body }
    }

    /// Bytes the destination holds.
    pub fn capacity(&self) -> u64 {
        (self.head.len() + self.body.len()) as u64
    }

    /// Copies `value` into the destination; its length, or
    /// [`TooSmall`](DkvError::TooSmall) (nothing copied).
    pub fn fill(&mut self, value: &[u8]) -> Result<u64, DkvError> {
        let need = value.len() as u64;
        if need > self.capacity() {
            return Err(DkvError::TooSmall {
                need,
                have: self.capacity(),
            });
        }
        let (first, rest) = value.split_at(value.len().min(self.head.len()));
        self.head[..first.len()].copy_from_slice(first);
        self.body[..rest.len()].copy_from_slice(rest);
        Ok(need)
    }
}

/// One key of a [`DkvClient::batch_put_from`] and its value, given in two parts stored
/// one after the other (a record's header and the object's bytes), so that nothing is
/// assembled before the client sends it.
#[derive(Debug, Clone, Copy)]
pub struct PutFrom<'a> {
    /// The key to write.
    pub key: &'a [u8],
    /// The value's first bytes (may be empty).
    pub head: &'a [u8],
    /// The value's remaining bytes.
    pub body: &'a [u8],
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

    /// Stores every item, its value being `head` then `body`; one result per item.
    /// The default assembles each value in a buffer of its own and calls
    /// [`batch_put`](Self::batch_put).
    fn batch_put_from(&self, items: &[PutFrom<'_>]) -> Vec<Result<(), DkvError>> {
        put_assembled(self, items)
    }

    /// Whether [`batch_put_from`](Self::batch_put_from) copies each value into a
    /// buffer of its own before sending it (the default does).
    fn copies_values(&self) -> bool {
        true
    }

    /// Reads every key into its destination; one result per item: the value's length.
    fn batch_get(&self, items: &mut [GetInto<'_>]) -> Vec<Result<u64, DkvError>>;

    /// Whether each key exists.
    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, DkvError>>;

    /// Deletes every key (a missing key is not an error); one result per key.
    fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Result<(), DkvError>>;

    /// About `page` keys starting with `prefix`, from `cursor` (`None` to start). A
    /// key present for the whole listing is returned at least once; one written or
    /// deleted meanwhile may or may not be (as Redis `SCAN` promises).
    fn scan(&self, prefix: &[u8], cursor: Option<u64>, page: u32) -> Result<ScanPage, DkvError>;

    /// Bytes the store can hold for this client, when it can tell.
    fn capacity(&self) -> Option<u64>;
}

/// [`DkvClient::batch_put_from`] through [`DkvClient::batch_put`]: each value
/// assembled in a buffer of its own first.
pub fn put_assembled(
    client: &(impl DkvClient + ?Sized),
    items: &[PutFrom<'_>],
) -> Vec<Result<(), DkvError>> {
    let values: Vec<Vec<u8>> = items
        .iter()
        .map(|item| [item.head, item.body].concat())
        .collect();
    let pairs: Vec<(&[u8], &[u8])> = items
        .iter()
        .zip(&values)
        .map(|(item, value)| (item.key, value.as_slice()))
        .collect();
    client.batch_put(&pairs)
}

/// Listings [`scan_all`] starts before it gives up.
const SCAN_ATTEMPTS: usize = 3;

/// Every key starting with `prefix`, page by page, each once. A listing that fails
/// (the store went away, a cluster changed its primaries meanwhile, a cursor came
/// back twice) starts again from the beginning, [`SCAN_ATTEMPTS`] times at most.
pub fn scan_all(
    client: &dyn DkvClient,
    prefix: &[u8],
    page: u32,
) -> Result<Vec<(Vec<u8>, u64)>, DkvError> {
    let mut attempt = 1;
    loop {
        match scan_once(client, prefix, page) {
            Ok(keys) => return Ok(keys),
            Err(error) if attempt < SCAN_ATTEMPTS => {
                tracing::warn!(%error, attempt, "listing the store failed; starting again");
                attempt += 1;
            }
            Err(error) => return Err(error),
        }
    }
}

fn scan_once(
    client: &dyn DkvClient,
    prefix: &[u8],
    page: u32,
) -> Result<Vec<(Vec<u8>, u64)>, DkvError> {
    let mut keys = std::collections::HashMap::new();
    let mut seen = std::collections::HashSet::new();
    let mut cursor = None;
    loop {
        let found = client.scan(prefix, cursor, page)?;
        keys.extend(found.keys);
        match found.cursor {
            Some(next) if !seen.insert(next) => {
                return Err(DkvError::Store(format!(
                    "the store's scan returned cursor {next} twice: it does not advance"
                )));
            }
            Some(next) => cursor = Some(next),
            None => return Ok(keys.into_iter().collect()),
        }
    }
}
