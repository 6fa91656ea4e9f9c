//! A distributed KV store reached through a C plugin (`docs/mooncake_dkv_plugin.h`),
//! loaded at run time with `libloading` from `MOONCAKE_OFFLOAD_DKV_PLUGIN`.
//!
//! Loading checks the library, every symbol and the ABI version before anything is
//! called, so a wrong path or an incomplete plugin is a clear startup error, not a
//! crash.

use std::ffi::{CString, c_char, c_void};
use std::path::Path;

use libloading::Library;

use super::{DkvClient, DkvError, GetInto, ScanPage};

/// The interface version this build speaks.
pub const ABI_VERSION: u32 = 2;

const OK: i32 = 0;
const NOT_FOUND: i32 = 1;
const TOO_SMALL: i32 = 2;
const FULL: i32 = 3;

/// `mooncake_dkv_item` of the header.
#[repr(C)]
struct Item {
    key: *const u8,
    key_len: u32,
    value: *mut u8,
    len: u64,
    tail: *mut u8,
    tail_len: u64,
}

/// `mooncake_dkv_entry` of the header.
#[repr(C)]
struct Entry {
    key: *mut u8,
    key_len: u32,
    value_len: u64,
}

type Version = unsafe extern "C" fn() -> u32;
type Init = unsafe extern "C" fn(*const c_char) -> *mut c_void;
type Close = unsafe extern "C" fn(*mut c_void);
type Batch = unsafe extern "C" fn(*mut c_void, *mut Item, u32, *mut i32) -> i32;
type Scan = unsafe extern "C" fn(
    *mut c_void,
    *const u8,
    u32,
    u64,
    u32,
    *mut *mut Entry,
    *mut u32,
    *mut u64,
) -> i32;
type FreeEntries = unsafe extern "C" fn(*mut Entry, u32);
type Capacity = unsafe extern "C" fn(*mut c_void) -> i64;

/// Why a plugin could not be loaded or opened.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The library could not be loaded.
    #[error("MOONCAKE_OFFLOAD_DKV_PLUGIN={path}: cannot load it: {reason}")]
    Load {
        /// The library's path.
        path: String,
        /// The loader's message.
        reason: String,
    },
    /// A function of the interface is missing.
    #[error(
        "MOONCAKE_OFFLOAD_DKV_PLUGIN={path}: no symbol {symbol} (see docs/mooncake_dkv_plugin.h)"
    )]
    Symbol {
        /// The library's path.
        path: String,
        /// The missing function.
        symbol: &'static str,
    },
    /// The plugin speaks another version of the interface.
    #[error(
        "MOONCAKE_OFFLOAD_DKV_PLUGIN={path}: interface version {found}, this build needs {ABI_VERSION}"
    )]
    Version {
        /// The library's path.
        path: String,
        /// The version it reports.
        found: u32,
    },
    /// `mooncake_dkv_init` returned no store.
    #[error(
        "MOONCAKE_OFFLOAD_DKV_PLUGIN={path}: mooncake_dkv_init refused the configuration {config:?}"
    )]
    Init {
        /// The library's path.
        path: String,
        /// The configuration given, a password in it hidden.
        config: String,
    },
}

/// The interface's functions, resolved from the library.
struct Functions {
    close: Close,
    put: Batch,
    get: Batch,
    exists: Batch,
    delete: Batch,
    scan: Scan,
    free_entries: FreeEntries,
    capacity: Capacity,
}

/// A store opened through a plugin.
pub struct PluginClient {
    functions: Functions,
    store: *mut c_void,
    path: String,
    // Last field: unloaded after the store is closed (see `Drop`).
    _library: Library,
}

// SAFETY: the interface requires plugins to accept calls from several threads on one
// handle (docs/mooncake_dkv_plugin.h); the handle is only passed back to the plugin.
unsafe impl Send for PluginClient {}
// SAFETY: as above.
unsafe impl Sync for PluginClient {}

impl std::fmt::Debug for PluginClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginClient")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Resolves `name` in `library` as a function of type `T`.
///
/// # Safety
///
/// `T` must be the function type the header declares for `name`.
unsafe fn symbol<T: Copy>(
    library: &Library,
    path: &str,
    name: &'static str,
) -> Result<T, PluginError> {
    // SAFETY: forwarded from the caller (the type matches the header).
    unsafe { library.get::<T>(name.as_bytes()) }
        .map(|symbol| *symbol)
        .map_err(|_| PluginError::Symbol {
            path: path.to_string(),
            symbol: name,
        })
}

impl PluginClient {
    /// Loads the plugin at `path` and opens the store described by `config`.
    pub fn open(path: &Path, config: &str) -> Result<Self, PluginError> {
        let shown = path.display().to_string();
        // SAFETY: loading runs the library's initialisers; the operator chose it.
        let library = unsafe { Library::new(path) }.map_err(|error| PluginError::Load {
            path: shown.clone(),
            reason: error.to_string(),
        })?;
        // SAFETY: the type is the header's for this symbol.
        let version: Version = unsafe { symbol(&library, &shown, "mooncake_dkv_abi_version") }?;
        // SAFETY: a function of the interface, taking nothing.
        let found = unsafe { version() };
        if found != ABI_VERSION {
            return Err(PluginError::Version { path: shown, found });
        }
        // SAFETY: the type is the header's for this symbol.
        let init: Init = unsafe { symbol(&library, &shown, "mooncake_dkv_init") }?;
        // SAFETY: each type is the header's for its symbol.
        let functions = unsafe {
            Functions {
                close: symbol(&library, &shown, "mooncake_dkv_close")?,
                put: symbol(&library, &shown, "mooncake_dkv_batch_put")?,
                get: symbol(&library, &shown, "mooncake_dkv_batch_get")?,
                exists: symbol(&library, &shown, "mooncake_dkv_batch_exists")?,
                delete: symbol(&library, &shown, "mooncake_dkv_batch_delete")?,
                scan: symbol(&library, &shown, "mooncake_dkv_scan")?,
                free_entries: symbol(&library, &shown, "mooncake_dkv_free_entries")?,
                capacity: symbol(&library, &shown, "mooncake_dkv_capacity")?,
            }
        };
        let text = CString::new(config).map_err(|_| PluginError::Init {
            path: shown.clone(),
            config: super::redis::hide_password(config),
        })?;
        // SAFETY: a NUL-terminated string that lives for the call.
        let store = unsafe { init(text.as_ptr()) };
        if store.is_null() {
            return Err(PluginError::Init {
                path: shown,
                config: super::redis::hide_password(config),
            });
        }
        Ok(PluginClient {
            functions,
            store,
            path: shown,
            _library: library,
        })
    }

    /// Runs one batch function over `items`; the result code of each.
    fn run(&self, function: Batch, items: &mut [Item]) -> Vec<i32> {
        let Ok(count) = u32::try_from(items.len()) else {
            return vec![-1; items.len()];
        };
        let mut results = vec![-1i32; items.len()];
        // SAFETY: `items` and `results` hold `count` elements and live for the call;
        // every pointer in `items` refers to memory the caller keeps alive.
        let status =
            unsafe { function(self.store, items.as_mut_ptr(), count, results.as_mut_ptr()) };
        if status != 0 {
            results.fill(-1);
        }
        results
    }
}

fn key_item(key: &[u8]) -> Result<Item, DkvError> {
    if key.is_empty() || key.len() > crate::record::MAX_KEY_LEN as usize {
        return Err(DkvError::Invalid(format!("key of {} bytes", key.len())));
    }
    Ok(Item {
        key: key.as_ptr(),
        key_len: u32::try_from(key.len()).unwrap_or(0),
        value: std::ptr::null_mut(),
        len: 0,
        tail: std::ptr::null_mut(),
        tail_len: 0,
    })
}

fn outcome(code: i32) -> Result<(), DkvError> {
    match code {
        OK => Ok(()),
        NOT_FOUND => Err(DkvError::NotFound),
        FULL => Err(DkvError::Full),
        other => Err(DkvError::Store(format!("plugin result {other}"))),
    }
}

/// Runs `run` on the valid items; invalid ones keep their error. `finish` gets each
/// valid item's result code, the item after the call and its position in the batch.
fn batch_of<T>(
    prepared: Vec<Result<Item, DkvError>>,
    run: impl FnOnce(&mut [Item]) -> Vec<i32>,
    mut finish: impl FnMut(i32, &Item, usize) -> Result<T, DkvError>,
) -> Vec<Result<T, DkvError>> {
    let mut valid: Vec<Item> = Vec::new();
    let slots: Vec<Result<usize, DkvError>> = prepared
        .into_iter()
        .map(|item| {
            item.map(|item| {
                valid.push(item);
                valid.len() - 1
            })
        })
        .collect();
    let codes = if valid.is_empty() {
        Vec::new()
    } else {
        run(&mut valid)
    };
    slots
        .into_iter()
        .enumerate()
        .map(|(position, slot)| {
            slot.and_then(|i| finish(codes.get(i).copied().unwrap_or(-1), &valid[i], position))
        })
        .collect()
}

impl DkvClient for PluginClient {
    fn describe(&self) -> String {
        format!("plugin {}", self.path)
    }

    fn batch_put(&self, items: &[(&[u8], &[u8])]) -> Vec<Result<(), DkvError>> {
        let prepared = items
            .iter()
            .map(|(key, value)| {
                if value.is_empty() {
                    return Err(DkvError::Invalid("empty value".into()));
                }
                key_item(key).map(|item| Item {
                    // The plugin only reads a put's value.
                    value: value.as_ptr().cast_mut(),
                    len: value.len() as u64,
                    ..item
                })
            })
            .collect();
        batch_of(
            prepared,
            |items| self.run(self.functions.put, items),
            |code, _, _| outcome(code),
        )
    }

    fn batch_get(&self, items: &mut [GetInto<'_>]) -> Vec<Result<u64, DkvError>> {
        let capacities: Vec<u64> = items.iter().map(GetInto::capacity).collect();
        let prepared = items
            .iter_mut()
            .map(|item| {
                key_item(item.key).map(|key| Item {
                    value: item.head.as_mut_ptr(),
                    len: item.head.len() as u64,
                    tail: item.body.as_mut_ptr(),
                    tail_len: item.body.len() as u64,
                    ..key
                })
            })
            .collect();
        batch_of(
            prepared,
            |items| self.run(self.functions.get, items),
            |code, item, at| {
                let have = capacities.get(at).copied().unwrap_or(0);
                match code {
                    OK if item.len <= have => Ok(item.len),
                    OK | TOO_SMALL => Err(DkvError::TooSmall {
                        need: item.len,
                        have,
                    }),
                    other => outcome(other).map(|()| 0),
                }
            },
        )
    }

    fn batch_exists(&self, keys: &[&[u8]]) -> Vec<Result<bool, DkvError>> {
        let prepared = keys.iter().map(|key| key_item(key)).collect();
        batch_of(
            prepared,
            |items| self.run(self.functions.exists, items),
            |code, _, _| match code {
                OK => Ok(true),
                NOT_FOUND => Ok(false),
                other => outcome(other).map(|()| false),
            },
        )
    }

    fn batch_delete(&self, keys: &[&[u8]]) -> Vec<Result<(), DkvError>> {
        let prepared = keys.iter().map(|key| key_item(key)).collect();
        batch_of(
            prepared,
            |items| self.run(self.functions.delete, items),
            |code, _, _| match code {
                OK | NOT_FOUND => Ok(()),
                other => outcome(other),
            },
        )
    }

    fn scan(&self, prefix: &[u8], cursor: Option<u64>, page: u32) -> Result<ScanPage, DkvError> {
        let prefix_len =
            u32::try_from(prefix.len()).map_err(|_| DkvError::Invalid("prefix too long".into()))?;
        let mut entries: *mut Entry = std::ptr::null_mut();
        let (mut count, mut next) = (0u32, 0u64);
        // SAFETY: every pointer is valid for the call; the plugin fills the outputs.
        let status = unsafe {
            (self.functions.scan)(
                self.store,
                prefix.as_ptr(),
                prefix_len,
                cursor.unwrap_or(0),
                page.max(1),
                &raw mut entries,
                &raw mut count,
                &raw mut next,
            )
        };
        if status != 0 {
            return Err(DkvError::Store("scan failed".into()));
        }
        let mut keys = Vec::new();
        if entries.is_null() {
            return Ok(ScanPage {
                keys,
                cursor: (next != 0).then_some(next),
            });
        }
        if count > 0 {
            // SAFETY: the plugin returned `count` entries at `entries`, each key
            // `key_len` bytes long, valid until `free_entries`.
            let found = unsafe { std::slice::from_raw_parts(entries, count as usize) };
            keys.reserve(found.len());
            for entry in found {
                if entry.key.is_null() {
                    continue;
                }
                // SAFETY: as above.
                let key = unsafe { std::slice::from_raw_parts(entry.key, entry.key_len as usize) };
                keys.push((key.to_vec(), entry.value_len));
            }
        }
        // SAFETY: returns what the plugin allocated (also an empty page), once.
        unsafe { (self.functions.free_entries)(entries, count) };
        Ok(ScanPage {
            keys,
            cursor: (next != 0).then_some(next),
        })
    }

    fn capacity(&self) -> Option<u64> {
        // SAFETY: the handle is open.
        u64::try_from(unsafe { (self.functions.capacity)(self.store) }).ok()
    }
}

impl Drop for PluginClient {
    fn drop(&mut self) {
        // SAFETY: the handle came from `mooncake_dkv_init` and is closed once; the
        // library is unloaded only afterwards (field order).
        unsafe { (self.functions.close)(self.store) };
    }
}
