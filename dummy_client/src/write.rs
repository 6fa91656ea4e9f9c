//! The write calls: put and upsert of bytes, of shared-memory ranges, and of several
//! buffers per object.
//!
//! Shared-memory ranges, and registered ordinary buffers the real client reaches across
//! processes, go to the real client as addresses (it copies them once). Bytes and the
//! other registered ordinary buffers are copied once into the staging buffer, in rounds
//! that fit it; a value larger than the whole staging buffer is copied into a block of
//! the shared pool, and only when the pool cannot grow either does it travel inside the
//! request (up to [`MAX_INLINE_BYTES`] per request).

use serde_bytes::ByteBuf;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::{
    DATA_DEADLINE, MAX_INLINE_BYTES, MemRange, PutItem, PutSource, WriteMode,
};
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
    /// once by the real client (or else through staging) from a registered ordinary
    /// buffer, `INVALID_PARAMS` otherwise.
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be readable for the whole call and written by nobody
    /// meanwhile: it is read behind Rust's back (by this client, or by the real client
    /// from another process). Ranges elsewhere are refused (`INVALID_PARAMS`), never
    /// read.
    pub unsafe fn put_from(
        &self,
        key: &str,
        ptr: u64,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        // SAFETY: the caller keeps the promise of this function's safety section,
        // which is the same.
        first(unsafe { self.batch_put_from(&[key], &[ptr], &[size], config) })
    }

    /// [`put_from`](Self::put_from) for many keys in one request. Mismatched input
    /// lengths give `INVALID_PARAMS` for every key.
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be readable for the whole call and written by nobody
    /// meanwhile: it is read behind Rust's back (by this client, or by the real client
    /// from another process). Ranges elsewhere are refused (`INVALID_PARAMS`), never
    /// read.
    pub unsafe fn batch_put_from<K: AsRef<str>>(
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
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be readable for the whole call and written by nobody
    /// meanwhile: it is read behind Rust's back (by this client, or by the real client
    /// from another process). Ranges elsewhere are refused (`INVALID_PARAMS`), never
    /// read.
    pub unsafe fn upsert_from(
        &self,
        key: &str,
        ptr: u64,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        // SAFETY: the caller keeps the promise of this function's safety section,
        // which is the same.
        first(unsafe { self.batch_upsert_from(&[key], &[ptr], &[size], config) })
    }

    /// [`upsert_from`](Self::upsert_from) for many keys in one request.
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be readable for the whole call and written by nobody
    /// meanwhile: it is read behind Rust's back (by this client, or by the real client
    /// from another process). Ranges elsewhere are refused (`INVALID_PARAMS`), never
    /// read.
    pub unsafe fn batch_upsert_from<K: AsRef<str>>(
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
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be readable for the whole call and written by nobody
    /// meanwhile: it is read behind Rust's back (by this client, or by the real client
    /// from another process). Ranges elsewhere are refused (`INVALID_PARAMS`), never
    /// read.
    pub unsafe fn put_from_with_metadata(
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
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be readable for the whole call and written by nobody
    /// meanwhile: it is read behind Rust's back (by this client, or by the real client
    /// from another process). Ranges elsewhere are refused (`INVALID_PARAMS`), never
    /// read.
    pub unsafe fn batch_put_from_multi_buffers<K: AsRef<str>>(
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
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be readable for the whole call and written by nobody
    /// meanwhile: it is read behind Rust's back (by this client, or by the real client
    /// from another process). Ranges elsewhere are refused (`INVALID_PARAMS`), never
    /// read.
    pub unsafe fn batch_upsert_from_multi_buffers<K: AsRef<str>>(
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

    /// Sends every item, in order: items naming only memory the real client reaches go
    /// as ranges; the others are copied once into the staging buffer, in rounds that
    /// each fit it (a round is sent and its staging released before the next one is
    /// staged); an item larger than the whole staging buffer goes through a pool block,
    /// or inside the request when the pool cannot have one.
    fn write(
        &self,
        items: Vec<WriteItem<'_>>,
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        let mut results: Vec<CodeResult<()>> = vec![Ok(()); items.len()];
        let mut round = WriteRound::default();
        for (index, (key, parts)) in items.into_iter().enumerate() {
            let source = match self.plan(&parts) {
                Ok(Plan::Direct(ranges)) => Ok(PutSource::Shared(ranges)),
                Ok(Plan::Copy(total)) => self.copied_source(&parts, total, &mut round, |round| {
                    self.send_round(round, &mut results, config, mode);
                }),
                Err(code) => Err(code),
            };
            match source {
                Ok(source) => round.items.push((index, PutItem { key, source })),
                Err(code) => results[index] = Err(code),
            }
        }
        self.send_round(&mut round, &mut results, config, mode);
        results
    }

    /// The bytes of an item to copy (`total` of them), staged in `round`'s staging; when
    /// the staging buffer is full, `flush` sends the round first and staging is tried
    /// again; an item that still finds no room goes through a block of the pool, else
    /// inline (`NO_AVAILABLE_HANDLE` past [`MAX_INLINE_BYTES`]).
    fn copied_source(
        &self,
        parts: &[Part<'_>],
        total: u64,
        round: &mut WriteRound,
        mut flush: impl FnMut(&mut WriteRound),
    ) -> CodeResult<PutSource> {
        if let Some(source) = self.staged_source(parts, total, &mut round.staged) {
            return Ok(source);
        }
        let fits = total <= self.inner.memory.lock().staging_capacity();
        if fits && !round.staged.is_empty() {
            flush(round);
            if let Some(source) = self.staged_source(parts, total, &mut round.staged) {
                return Ok(source);
            }
        }
        if let Some(source) = self.pooled_source(parts, total, &mut round.pooled) {
            return Ok(source);
        }
        if total > MAX_INLINE_BYTES {
            tracing::warn!(
                bytes = total,
                limit = MAX_INLINE_BYTES,
                "a value larger than the staging buffer found no room in the shared pool and is too large to send inside a request"
            );
            return Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        if round.inline_bytes + total > MAX_INLINE_BYTES {
            flush(round);
        }
        round.inline_bytes += total;
        inline_source(parts, total)
    }

    /// The item copied into a new block of the shared pool (freed once its round is
    /// answered); `None` when the pool cannot grow.
    fn pooled_source(
        &self,
        parts: &[Part<'_>],
        total: u64,
        pooled: &mut Vec<StagingBlock>,
    ) -> Option<PutSource> {
        let addr = self.alloc_from_mem_pool(total);
        if addr == 0 {
            return None;
        }
        let Some(slice) = self.inner.memory.lock().pool_slice(addr, total) else {
            let _ = self.free_to_mem_pool(addr);
            return None;
        };
        Some(filled(parts, StagingBlock { addr, slice }, pooled))
    }

    /// Sends the items of `round` (one request) and releases its staging.
    fn send_round(
        &self,
        round: &mut WriteRound,
        results: &mut [CodeResult<()>],
        config: &ReplicateConfig,
        mode: WriteMode,
    ) {
        let items = std::mem::take(&mut round.items);
        let before = self.calls_in_doubt();
        if !items.is_empty() {
            let (positions, requests): (Vec<usize>, Vec<PutItem>) = items.into_iter().unzip();
            let answers = self.call_chunked(requests, DATA_DEADLINE, |rpc, ctx, requests| {
                let config = config.clone();
                async move { rpc.put(ctx, requests, config, mode).await }
            });
            for (index, answer) in positions.into_iter().zip(answers) {
                results[index] = answer;
            }
        }
        self.unstage_after(&std::mem::take(&mut round.staged), before);
        let pooled = std::mem::take(&mut round.pooled);
        if self.calls_in_doubt() == before {
            for block in pooled {
                let _ = self.free_to_mem_pool(block.addr);
            }
        } else if !pooled.is_empty() {
            tracing::warn!(
                blocks = pooled.len(),
                "a put failed in transport while the real client may still read its pool blocks; they are not reused"
            );
        }
        round.inline_bytes = 0;
    }

    /// How the bytes of one item travel: as ranges when every part is memory the real
    /// client reaches (or unknown, for the real client to reject), else copied once.
    fn plan(&self, parts: &[Part<'_>]) -> CodeResult<Plan> {
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
            return Ok(Plan::Direct(ranges));
        }
        // Unknown memory, and GPU memory (never copied by this process), cannot join
        // a copy.
        if kinds.contains(&RangeKind::Foreign) || kinds.contains(&RangeKind::Device) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        parts
            .iter()
            .try_fold(0u64, |acc, part| acc.checked_add(part_len(part)))
            .map(Plan::Copy)
            .ok_or(ErrorCode::INVALID_PARAMS)
    }

    /// The item copied into one staging block (kept in `staged` until its round is
    /// sent); `None` when the staging buffer has no room for `total` bytes.
    fn staged_source(
        &self,
        parts: &[Part<'_>],
        total: u64,
        staged: &mut Vec<StagingBlock>,
    ) -> Option<PutSource> {
        let block = self.stage(total)?;
        Some(filled(parts, block, staged))
    }
}

/// How an item's bytes reach the real client.
enum Plan {
    /// As ranges the real client reads itself.
    Direct(Vec<MemRange>),
    /// Copied by the dummy (this many bytes), into staging or the request.
    Copy(u64),
}

/// Requests gathered for one request, with the staging they use.
#[derive(Default)]
struct WriteRound {
    /// (position in the caller's batch, item).
    items: Vec<(usize, PutItem)>,
    /// Staging blocks the items name, released once the round is answered.
    staged: Vec<StagingBlock>,
    /// Pool blocks the items name (values larger than staging), freed likewise.
    pooled: Vec<StagingBlock>,
    /// Bytes the items carry inside the request.
    inline_bytes: u64,
}

fn part_len(part: &Part<'_>) -> u64 {
    match part {
        Part::Bytes(bytes) => bytes.len() as u64,
        Part::Range { len, .. } => *len,
    }
}

/// The item's bytes inside the request (it does not fit the staging buffer).
fn inline_source(parts: &[Part<'_>], total: u64) -> CodeResult<PutSource> {
    let capacity = usize::try_from(total).map_err(|_| ErrorCode::INVALID_PARAMS)?;
    let mut bytes = Vec::with_capacity(capacity);
    for part in parts {
        match part {
            Part::Bytes(b) => bytes.extend_from_slice(b),
            Part::Range { addr, len } => {
                let len = usize::try_from(*len).map_err(|_| ErrorCode::INVALID_PARAMS)?;
                bytes.extend_from_slice(&user_memory::to_vec(*addr, len));
            }
        }
    }
    Ok(PutSource::Inline(ByteBuf::from(bytes)))
}

/// The item's parts copied into `block`, which `held` keeps until the item's round is
/// answered; the item's source.
fn filled(parts: &[Part<'_>], block: StagingBlock, held: &mut Vec<StagingBlock>) -> PutSource {
    let mut offset = 0u64;
    for part in parts {
        offset += copy_part(part, &block, offset);
    }
    let range = block.range();
    held.push(block);
    PutSource::Shared(vec![range])
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
