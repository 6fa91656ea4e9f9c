//! Safe forms of the pointer calls, over Rust slices: the slice is borrowed for the
//! whole call, which is what the pointer calls' safety sections ask for. A slice gets
//! the zero-copy path only where it lies in this client's shared memory (from
//! `alloc_from_mem_pool`) or in a registered buffer; elsewhere the call is refused
//! with `INVALID_PARAMS`, like its pointer form (use `put` / `get` for such bytes).

use mooncake_core::error::CodeResult;
use mooncake_core::types::ReplicateConfig;

use crate::client::DummyClient;

/// Address and length of a slice, as the pointer calls name a range.
fn range(bytes: &[u8]) -> (u64, u64) {
    (bytes.as_ptr() as u64, bytes.len() as u64)
}

impl DummyClient {
    /// [`put_from`](Self::put_from) of the bytes of `value`.
    pub fn put_from_slice(
        &self,
        key: &str,
        value: &[u8],
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        let (ptr, size) = range(value);
        // SAFETY: `value` is borrowed for the whole call: readable, and written by
        // nobody meanwhile.
        unsafe { self.put_from(key, ptr, size, config) }
    }

    /// [`batch_put_from`](Self::batch_put_from) of the bytes of each value.
    pub fn batch_put_from_slices<K: AsRef<str>>(
        &self,
        keys: &[K],
        values: &[&[u8]],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        let (ptrs, sizes): (Vec<u64>, Vec<u64>) = values.iter().map(|v| range(v)).unzip();
        // SAFETY: every value is borrowed for the whole call: readable, and written by
        // nobody meanwhile.
        unsafe { self.batch_put_from(keys, &ptrs, &sizes, config) }
    }

    /// [`get_into`](Self::get_into) `dest`; returns the object size.
    pub fn get_into_slice(&self, key: &str, dest: &mut [u8]) -> CodeResult<u64> {
        let (ptr, size) = range(dest);
        // SAFETY: `dest` is borrowed exclusively for the whole call: valid for writes,
        // and no other reference to it is alive.
        unsafe { self.get_into(key, ptr, size) }
    }

    /// [`batch_get_into`](Self::batch_get_into) each destination; one size or error
    /// per key.
    pub fn batch_get_into_slices<K: AsRef<str>>(
        &self,
        keys: &[K],
        dests: &mut [&mut [u8]],
    ) -> Vec<CodeResult<u64>> {
        let (ptrs, sizes): (Vec<u64>, Vec<u64>) = dests.iter().map(|d| range(d)).unzip();
        // SAFETY: every destination is borrowed exclusively for the whole call: valid
        // for writes, and no other reference to it is alive.
        unsafe { self.batch_get_into(keys, &ptrs, &sizes) }
    }
}
