//! The write calls: put and upsert of bytes, of shared-memory ranges, and of several
//! buffers per object.
//!
//! Shared-memory ranges go to the real client as addresses (zero-copy). Bytes and
//! registered ordinary buffers are copied once into the staging buffer (or, when they do
//! not fit there, sent inside the request).

use serde_bytes::ByteBuf;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::{DATA_DEADLINE, MemRange, PutItem, PutSource, WriteMode};
use mooncake_core::types::ReplicateConfig;

use crate::client::{DummyClient, all_failed};
use crate::memory::{RangeKind, StagingBlock};
use crate::user_memory;

/// One piece of a value to write.
#[derive(Clone, Copy, Debug)]
enum Part<'a> {
    /// Bytes in this process.
    Bytes(&'a [u8]),
    /// `len` bytes at `addr` (shared memory or a registered buffer).
    Range { addr: u64, len: u64 },
}

type WriteItem<'a> = (String, Vec<Part<'a>>);

fn first(results: Vec<CodeResult<()>>) -> CodeResult<()> {
    results
        .into_iter()
        .next()
        .unwrap_or(Err(ErrorCode::RPC_FAIL))
}

fn range_items<K: AsRef<str>>(
    keys: &[K],
    ptrs: &[u64],
    sizes: &[u64],
) -> Option<Vec<WriteItem<'static>>> {
    if keys.len() != ptrs.len() || keys.len() != sizes.len() {
        return None;
    }
    let items = keys
        .iter()
        .zip(ptrs.iter().zip(sizes))
        .map(|(key, (&addr, &len))| (key.as_ref().to_string(), vec![Part::Range { addr, len }]))
        .collect();
    Some(items)
}

fn multi_range_items<K: AsRef<str>>(
    keys: &[K],
    ptrs: &[Vec<u64>],
    sizes: &[Vec<u64>],
) -> Option<Vec<WriteItem<'static>>> {
    if keys.len() != ptrs.len() || keys.len() != sizes.len() {
        return None;
    }
    keys.iter()
        .zip(ptrs.iter().zip(sizes))
        .map(|(key, (ptrs, sizes))| {
            (ptrs.len() == sizes.len()).then(|| {
                let parts = ptrs
                    .iter()
                    .zip(sizes)
                    .map(|(&addr, &len)| Part::Range { addr, len })
                    .collect();
                (key.as_ref().to_string(), parts)
            })
        })
        .collect()
}

impl DummyClient {
    /// Stores `value` under `key` (copied once into the staging buffer). An existing key
    /// is kept and this returns success; use [`upsert`](Self::upsert) to replace.
    pub fn put(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> CodeResult<()> {
        self.put_parts(key, &[value], config)
    }

    /// Stores the concatenation of `parts` under `key`.
    pub fn put_parts(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        let item = (
            key.to_string(),
            parts.iter().map(|p| Part::Bytes(p)).collect(),
        );
        first(self.write(vec![item], config, WriteMode::Put))
    }

    /// Stores each value under its key in one request; one result per key.
    pub fn put_batch<K: AsRef<str>>(
        &self,
        keys: &[K],
        values: &[&[u8]],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        self.write_values(keys, values, config, WriteMode::Put)
    }

    /// Stores or replaces `value` under `key`. Readers see the old value until the new
    /// one is complete.
    pub fn upsert(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> CodeResult<()> {
        self.upsert_parts(key, &[value], config)
    }

    /// [`upsert`](Self::upsert) of the concatenation of `parts`.
    pub fn upsert_parts(
        &self,
        key: &str,
        parts: &[&[u8]],
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        let item = (
            key.to_string(),
            parts.iter().map(|p| Part::Bytes(p)).collect(),
        );
        first(self.write(vec![item], config, WriteMode::Upsert))
    }

    /// [`upsert`](Self::upsert) of many keys in one request.
    pub fn upsert_batch<K: AsRef<str>>(
        &self,
        keys: &[K],
        values: &[&[u8]],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        self.write_values(keys, values, config, WriteMode::Upsert)
    }

    fn write_values<K: AsRef<str>>(
        &self,
        keys: &[K],
        values: &[&[u8]],
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        if keys.len() != values.len() {
            return all_failed(keys.len(), ErrorCode::INVALID_PARAMS);
        }
        let items = keys
            .iter()
            .zip(values)
            .map(|(key, value)| (key.as_ref().to_string(), vec![Part::Bytes(value)]))
            .collect();
        self.write(items, config, mode)
    }

    /// Stores `size` bytes at `ptr` under `key`: zero-copy from shared memory, copied
    /// through staging from a registered ordinary buffer, `INVALID_PARAMS` otherwise.
    pub fn put_from(
        &self,
        key: &str,
        ptr: u64,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        first(self.batch_put_from(&[key], &[ptr], &[size], config))
    }

    /// [`put_from`](Self::put_from) for many keys in one request. Mismatched input
    /// lengths give `INVALID_PARAMS` for every key.
    pub fn batch_put_from<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[u64],
        sizes: &[u64],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        match range_items(keys, ptrs, sizes) {
            Some(items) => self.write(items, config, WriteMode::Put),
            None => all_failed(keys.len(), ErrorCode::INVALID_PARAMS),
        }
    }

    /// [`put_from`](Self::put_from) that replaces an existing object.
    pub fn upsert_from(
        &self,
        key: &str,
        ptr: u64,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        first(self.batch_upsert_from(&[key], &[ptr], &[size], config))
    }

    /// [`upsert_from`](Self::upsert_from) for many keys in one request.
    pub fn batch_upsert_from<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[u64],
        sizes: &[u64],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        match range_items(keys, ptrs, sizes) {
            Some(items) => self.write(items, config, WriteMode::Upsert),
            None => all_failed(keys.len(), ErrorCode::INVALID_PARAMS),
        }
    }

    /// Stores `meta_size` bytes at `meta_ptr` followed by `size` bytes at `ptr` as one
    /// object (metadata first).
    pub fn put_from_with_metadata(
        &self,
        key: &str,
        ptr: u64,
        meta_ptr: u64,
        size: u64,
        meta_size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        let parts = vec![
            Part::Range {
                addr: meta_ptr,
                len: meta_size,
            },
            Part::Range {
                addr: ptr,
                len: size,
            },
        ];
        first(self.write(vec![(key.to_string(), parts)], config, WriteMode::Put))
    }

    /// Stores, for each key, the concatenation of its buffers. Mismatched lengths give
    /// `INVALID_PARAMS` for every key.
    pub fn batch_put_from_multi_buffers<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[Vec<u64>],
        sizes: &[Vec<u64>],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        match multi_range_items(keys, ptrs, sizes) {
            Some(items) => self.write(items, config, WriteMode::Put),
            None => all_failed(keys.len(), ErrorCode::INVALID_PARAMS),
        }
    }

    /// [`batch_put_from_multi_buffers`](Self::batch_put_from_multi_buffers) that
    /// replaces existing objects.
    pub fn batch_upsert_from_multi_buffers<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[Vec<u64>],
        sizes: &[Vec<u64>],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        match multi_range_items(keys, ptrs, sizes) {
            Some(items) => self.write(items, config, WriteMode::Upsert),
            None => all_failed(keys.len(), ErrorCode::INVALID_PARAMS),
        }
    }

    /// Builds the request for every item (staging what must be copied), sends it, and
    /// releases the staging blocks.
    fn write(
        &self,
        items: Vec<WriteItem<'_>>,
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        if items.is_empty() {
            return Vec::new();
        }
        let mut staged = Vec::new();
        let mut results: Vec<CodeResult<()>> = Vec::with_capacity(items.len());
        let mut requests = Vec::with_capacity(items.len());
        let mut positions = Vec::with_capacity(items.len());
        for (index, (key, parts)) in items.into_iter().enumerate() {
            results.push(Ok(()));
            match self.source_of(&parts, &mut staged) {
                Ok(source) => {
                    requests.push(PutItem { key, source });
                    positions.push(index);
                }
                Err(code) => results[index] = Err(code),
            }
        }
        if !requests.is_empty() {
            let count = requests.len();
            let config = config.clone();
            let answers = self.call_batch(count, DATA_DEADLINE, |rpc, ctx| async move {
                rpc.put(ctx, requests, config, mode).await
            });
            for (index, answer) in positions.into_iter().zip(answers) {
                results[index] = answer;
            }
        }
        self.unstage(&staged);
        results
    }

    /// How the bytes of one item travel: as shared ranges when every part is in shared
    /// memory (or unknown, for the real client to reject), else copied once.
    fn source_of(
        &self,
        parts: &[Part<'_>],
        staged: &mut Vec<StagingBlock>,
    ) -> CodeResult<PutSource> {
        let kinds: Vec<RangeKind> = {
            let memory = self.inner.memory.lock();
            parts
                .iter()
                .map(|part| match part {
                    Part::Bytes(_) => RangeKind::CopyThrough,
                    Part::Range { addr, len } => memory.classify(*addr, *len),
                })
                .collect()
        };
        if kinds.iter().all(|k| *k != RangeKind::CopyThrough) {
            let ranges = parts
                .iter()
                .filter_map(|part| match part {
                    Part::Range { addr, len } => Some(MemRange {
                        addr: *addr,
                        len: *len,
                    }),
                    Part::Bytes(_) => None,
                })
                .collect();
            return Ok(PutSource::Shared(ranges));
        }
        if kinds.contains(&RangeKind::Foreign) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let total = parts
            .iter()
            .try_fold(0u64, |acc, part| {
                let len = match part {
                    Part::Bytes(bytes) => bytes.len() as u64,
                    Part::Range { len, .. } => *len,
                };
                acc.checked_add(len)
            })
            .ok_or(ErrorCode::INVALID_PARAMS)?;
        match self.stage(total) {
            Some(block) => {
                let mut offset = 0u64;
                for part in parts {
                    offset += copy_part(part, &block, offset);
                }
                let range = block.range();
                staged.push(block);
                Ok(PutSource::Shared(vec![range]))
            }
            None => {
                let capacity = usize::try_from(total).map_err(|_| ErrorCode::INVALID_PARAMS)?;
                let mut bytes = Vec::with_capacity(capacity);
                for part in parts {
                    match part {
                        Part::Bytes(b) => bytes.extend_from_slice(b),
                        Part::Range { addr, len } => {
                            let len =
                                usize::try_from(*len).map_err(|_| ErrorCode::INVALID_PARAMS)?;
                            bytes.extend_from_slice(&user_memory::to_vec(*addr, len));
                        }
                    }
                }
                Ok(PutSource::Inline(ByteBuf::from(bytes)))
            }
        }
    }
}

/// Copies one part into `block` at `offset`; returns the bytes copied.
fn copy_part(part: &Part<'_>, block: &StagingBlock, offset: u64) -> u64 {
    match part {
        Part::Bytes(bytes) => block
            .slice
            .sub(offset, bytes.len() as u64)
            .map_or(0, |dest| dest.write_from(bytes) as u64),
        Part::Range { addr, len } => match (block.slice.sub(offset, *len), usize::try_from(*len)) {
            (Some(dest), Ok(n)) => {
                user_memory::copy_in(*addr, n, &dest);
                *len
            }
            _ => 0,
        },
    }
}
