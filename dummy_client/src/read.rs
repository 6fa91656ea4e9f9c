//! The read calls: whole objects into bytes or buffers, scattered into several
//! buffers, ranges of objects, and pool-backed buffer handles.
//!
//! Destinations in shared memory are written by the real client directly (zero-copy),
//! and so are registered ordinary buffers it reaches across processes. The other
//! registered ordinary buffers get the bytes through the staging buffer, in rounds that
//! fit it; an object larger than the whole staging buffer is read on its own and copied
//! into its buffers.

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::{DATA_DEADLINE, Fragment, GetItem, MemRange, RangeRead};

use crate::buffer::BufferHandle;
use crate::client::{DummyClient, all_failed};
use crate::memory::{RangeKind, StagingBlock};
use crate::user_memory;

/// How a read through a staging block ended.
enum Staged<R, F> {
    /// The value was read and consumed (or the read failed for good).
    Done(CodeResult<R>),
    /// The object is larger than the block.
    TooSmall(F),
    /// No staging block of that size could be had.
    NoRoom(F),
}

/// First guess of an object's size when `get` copies it through staging.
const GET_GUESS: u64 = 1 << 20;

/// A destination that is application memory reached through a staging block.
struct Bounce {
    block: StagingBlock,
    user_addr: u64,
}

/// Per destination of one item: its staging block, when it is copied through.
type Bounces = Vec<Option<Bounce>>;

/// Reads gathered for one request, with the staging they use.
#[derive(Default)]
struct ReadRound {
    requests: Vec<GetItem>,
    /// Per request: its position in the caller's batch, its destination lengths and
    /// their staging blocks.
    planned: Vec<(usize, Vec<u64>, Bounces)>,
}

impl ReadRound {
    fn push(&mut self, index: usize, key: String, dests: Vec<MemRange>, bounces: Bounces) {
        let lens = dests.iter().map(|r| r.len).collect();
        self.requests.push(GetItem { key, dests });
        self.planned.push((index, lens, bounces));
    }

    /// True when some read of the round holds staging.
    fn has_staging(&self) -> bool {
        self.planned
            .iter()
            .any(|(_, _, bounces)| bounces.iter().any(Option::is_some))
    }
}

impl Bounce {
    /// Copies the first `written` bytes of the block to the application's buffer.
    fn deliver(&self, written: u64) {
        if let (Some(part), Ok(len)) = (self.block.slice.sub(0, written), usize::try_from(written))
        {
            user_memory::copy_out(&part, self.user_addr, len);
        }
    }
}

/// Public convention: a destination too small for the object is `INVALID_PARAMS`.
fn too_small_is_invalid(result: CodeResult<u64>) -> CodeResult<u64> {
    result.map_err(|c| {
        if c == ErrorCode::BUFFER_OVERFLOW {
            ErrorCode::INVALID_PARAMS
        } else {
            c
        }
    })
}

/// Input shape of [`DummyClient::get_into_ranges`]: per buffer, per key, per fragment.
pub type Nested<T> = Vec<Vec<Vec<T>>>;

impl DummyClient {
    /// The range to send for application memory `addr..addr+len`, staging it when it is
    /// a registered ordinary buffer.
    fn destination(
        &self,
        addr: u64,
        len: u64,
        bounces: &mut Vec<Option<Bounce>>,
    ) -> CodeResult<MemRange> {
        let kind = self.inner.memory.lock().classify(addr, len);
        if kind != RangeKind::CopyThrough {
            bounces.push(None);
            return Ok(MemRange { addr, len });
        }
        let block = self.stage(len).ok_or(ErrorCode::NO_AVAILABLE_HANDLE)?;
        let range = block.range();
        bounces.push(Some(Bounce {
            block,
            user_addr: addr,
        }));
        Ok(range)
    }

    /// Logs, once per process, that a read into registered ordinary memory failed for
    /// want of staging room (not of segment space, which the code's name suggests).
    fn no_staging_room(&self, len: u64) {
        static LOGGED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !LOGGED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(
                len,
                staging = self.local_buffer_size(),
                "NO_AVAILABLE_HANDLE: the staging buffer has no room for a fragment read into registered ordinary memory (the real client cannot reach that memory itself); raise local_buffer_size or allocate the buffer with alloc_from_mem_pool"
            );
        }
    }

    fn release_bounces(&self, bounces: Bounces, before: u64) {
        let blocks: Vec<StagingBlock> = bounces.into_iter().flatten().map(|b| b.block).collect();
        self.unstage_after(&blocks, before);
    }

    /// Reads each object into its destinations (filled in order); one size or error per
    /// item. Destinations copied through staging are staged in rounds that fit the
    /// staging buffer (a round is read and delivered before the next is staged); an item
    /// that finds no room even in an empty round is read on its own
    /// ([`get_scattered`](Self::get_scattered)).
    fn read_scatter(&self, items: Vec<(String, Vec<(u64, u64)>)>) -> Vec<CodeResult<u64>> {
        let mut results: Vec<CodeResult<u64>> = vec![Ok(0); items.len()];
        let mut round = ReadRound::default();
        let mut alone = Vec::new();
        for (index, (key, dests)) in items.into_iter().enumerate() {
            let mut staged = self.stage_destinations(&dests);
            if staged.is_none() && round.has_staging() {
                self.read_round(&mut round, &mut results);
                staged = self.stage_destinations(&dests);
            }
            match staged {
                Some((ranges, bounces)) => round.push(index, key, ranges, bounces),
                None => alone.push((index, key, dests)),
            }
        }
        self.read_round(&mut round, &mut results);
        for (index, key, dests) in alone {
            results[index] = self.get_scattered(&key, &dests);
        }
        results
    }

    /// The ranges to send for `dests`, with a staging block for each one copied
    /// through; `None` (nothing held) when the staging buffer has no room for them.
    fn stage_destinations(&self, dests: &[(u64, u64)]) -> Option<(Vec<MemRange>, Bounces)> {
        let mut bounces = Vec::with_capacity(dests.len());
        let ranges: CodeResult<Vec<MemRange>> = dests
            .iter()
            .map(|&(addr, len)| self.destination(addr, len, &mut bounces))
            .collect();
        match ranges {
            Ok(ranges) => Some((ranges, bounces)),
            Err(_) => {
                // Never sent: nothing can be in doubt.
                self.release_bounces(bounces, self.calls_in_doubt());
                None
            }
        }
    }

    /// Sends the reads of `round` (one request), delivers what came through staging and
    /// releases it.
    fn read_round(&self, round: &mut ReadRound, results: &mut [CodeResult<u64>]) {
        let ReadRound { requests, planned } = std::mem::take(round);
        if requests.is_empty() {
            return;
        }
        let before = self.calls_in_doubt();
        let answers = self.call_chunked(requests, DATA_DEADLINE, |rpc, ctx, requests| async move {
            rpc.get(ctx, requests).await
        });
        for ((index, lens, bounces), answer) in planned.into_iter().zip(answers) {
            if let Ok(size) = answer {
                let mut remaining = size;
                for (len, bounce) in lens.iter().zip(&bounces) {
                    let written = remaining.min(*len);
                    if let Some(bounce) = bounce {
                        bounce.deliver(written);
                    }
                    remaining -= written;
                }
            }
            self.release_bounces(bounces, before);
            results[index] = answer;
        }
    }

    /// Reads `key` on its own (through staging, a pool block or the reply, as
    /// [`get_with`](Self::get_with) does) and copies it into `dests` in order: the read of
    /// an object whose registered ordinary buffers do not fit the staging buffer.
    /// Destinations together smaller than the object are `BUFFER_OVERFLOW`.
    fn get_scattered(&self, key: &str, dests: &[(u64, u64)]) -> CodeResult<u64> {
        let known = {
            let memory = self.inner.memory.lock();
            dests.iter().all(|&(addr, len)| memory.is_known(addr, len))
        };
        if !known {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        self.get_with(key, |bytes| {
            let capacity = dests
                .iter()
                .fold(0u64, |sum, &(_, len)| sum.saturating_add(len));
            if bytes.len() as u64 > capacity {
                return Err(ErrorCode::BUFFER_OVERFLOW);
            }
            let mut rest = bytes;
            for &(addr, len) in dests {
                let n = usize::try_from(len).unwrap_or(usize::MAX).min(rest.len());
                if n == 0 {
                    break;
                }
                user_memory::write_bytes(addr, &rest[..n]);
                rest = &rest[n..];
            }
            Ok(bytes.len() as u64)
        })?
    }

    /// Reads `key` into `ptr..ptr+size`; returns the object size. A buffer smaller than
    /// the object is `INVALID_PARAMS`; a pointer outside shared memory and registered
    /// buffers is `INVALID_PARAMS`.
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be valid for writes for the whole call, with no Rust
    /// reference to it alive: it is written behind Rust's back (by this client, or by
    /// the real client from another process). Ranges elsewhere are refused
    /// (`INVALID_PARAMS`), never written.
    pub unsafe fn get_into(&self, key: &str, ptr: u64, size: u64) -> CodeResult<u64> {
        // SAFETY: the caller keeps the promise of this function's safety section, which
        // is the same.
        unsafe { self.batch_get_into(&[key], &[ptr], &[size]) }
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))
    }

    /// [`get_into`](Self::get_into) for many keys in one request; one size or error per
    /// key. Mismatched input lengths give `INVALID_PARAMS` for every key.
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be valid for writes for the whole call, with no Rust
    /// reference to it alive: it is written behind Rust's back (by this client, or by
    /// the real client from another process). Ranges elsewhere are refused
    /// (`INVALID_PARAMS`), never written.
    pub unsafe fn batch_get_into<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[u64],
        sizes: &[u64],
    ) -> Vec<CodeResult<u64>> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return all_failed(keys.len(), ErrorCode::INVALID_PARAMS);
        }
        let items = keys
            .iter()
            .zip(ptrs.iter().zip(sizes))
            .map(|(key, (&addr, &len))| (key.as_ref().to_string(), vec![(addr, len)]))
            .collect();
        self.read_scatter(items)
            .into_iter()
            .map(too_small_is_invalid)
            .collect()
    }

    /// Reads each object into its list of buffers, filled in order (together they must
    /// hold the object). `prefer_same_node` is accepted for compatibility: a single
    /// node always reads locally.
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be valid for writes for the whole call, with no Rust
    /// reference to it alive: it is written behind Rust's back (by this client, or by
    /// the real client from another process). Ranges elsewhere are refused
    /// (`INVALID_PARAMS`), never written.
    pub unsafe fn batch_get_into_multi_buffers<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[Vec<u64>],
        sizes: &[Vec<u64>],
        prefer_same_node: bool,
    ) -> Vec<CodeResult<u64>> {
        let _ = prefer_same_node;
        if keys.len() != ptrs.len()
            || keys.len() != sizes.len()
            || ptrs.iter().zip(sizes).any(|(p, s)| p.len() != s.len())
        {
            return all_failed(keys.len(), ErrorCode::INVALID_PARAMS);
        }
        let items = keys
            .iter()
            .zip(ptrs.iter().zip(sizes))
            .map(|(key, (ptrs, sizes))| {
                (
                    key.as_ref().to_string(),
                    ptrs.iter().copied().zip(sizes.iter().copied()).collect(),
                )
            })
            .collect();
        self.read_scatter(items)
            .into_iter()
            .map(too_small_is_invalid)
            .collect()
    }

    /// Reads `key` into a new vector (through the staging buffer, or inside the reply
    /// when the object is larger than the staging buffer).
    pub fn get(&self, key: &str) -> CodeResult<Vec<u8>> {
        self.get_with(key, <[u8]>::to_vec)
    }

    /// Reads `key` and hands its bytes, in shared memory where possible, to `consume`: the one
    /// copy out of shared memory is the caller's (the Python binding builds its `bytes`
    /// there). The bytes come through a staging block, through a pool block when the
    /// object is larger than half the staging buffer, or, when neither has room, inside
    /// the reply.
    pub fn get_with<R>(&self, key: &str, consume: impl FnOnce(&[u8]) -> R) -> CodeResult<R> {
        self.get_with_or_in_place(key, consume, |_| None)
    }

    /// [`get_with`](Self::get_with), except that with a real client in this process
    /// (embedded mode) an object larger than the first guess (1 MiB) is offered to
    /// `in_place` with its size: `in_place(size)` can read it straight into memory of
    /// its own (one copy, by the real client) and answer the result, or answer `None`
    /// to take the staged path.
    pub fn get_with_or_in_place<R>(
        &self,
        key: &str,
        consume: impl FnOnce(&[u8]) -> R,
        in_place: impl FnOnce(u64) -> Option<R>,
    ) -> CodeResult<R> {
        let guess = GET_GUESS.min(self.inner.memory.lock().staging_capacity() / 2);
        let consume = match self.get_staged(key, guess, consume) {
            Staged::Done(result) => return result,
            Staged::TooSmall(consume) => consume,
            Staged::NoRoom(consume) => return self.get_inline(key, consume),
        };
        let size = self.get_size(key)?;
        if self.inner.target.is_in_process()
            && let Some(result) = in_place(size)
        {
            return Ok(result);
        }
        let consume = match self.get_staged(key, size, consume) {
            Staged::Done(result) => return result,
            Staged::TooSmall(consume) | Staged::NoRoom(consume) => consume,
        };
        match self.get_buffer(key) {
            Ok(handle) => Ok(consume(handle.as_slice())),
            Err(ErrorCode::NO_AVAILABLE_HANDLE) => self.get_inline(key, consume),
            Err(code) => Err(code),
        }
    }

    /// Reads `key` through a staging block of `capacity` bytes; gives `consume` back
    /// when the block is too small or cannot be had.
    fn get_staged<R, F: FnOnce(&[u8]) -> R>(
        &self,
        key: &str,
        capacity: u64,
        consume: F,
    ) -> Staged<R, F> {
        let Some(block) = self.stage(capacity) else {
            return Staged::NoRoom(consume);
        };
        let request = vec![GetItem {
            key: key.to_string(),
            dests: vec![block.range()],
        }];
        let before = self.calls_in_doubt();
        let read = self
            .call_batch(1, DATA_DEADLINE, |rpc, ctx| {
                let request = request.clone();
                async move { rpc.get(ctx, request.into()).await }
            })
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL));
        let outcome = match read {
            Err(ErrorCode::BUFFER_OVERFLOW) => Staged::TooSmall(consume),
            Err(code) => Staged::Done(Err(code)),
            Ok(size) => Staged::Done(
                block
                    .slice
                    .sub(0, size)
                    // SAFETY: the block is this call's alone until `unstage` below, and
                    // the real client finished writing it before answering.
                    .map(|value| consume(unsafe { value.as_bytes() }))
                    .ok_or(ErrorCode::INTERNAL_ERROR),
            ),
        };
        self.unstage_after(std::slice::from_ref(&block), before);
        outcome
    }

    /// Reads `key` inside the RPC reply (no shared memory free for it).
    fn get_inline<R>(&self, key: &str, consume: impl FnOnce(&[u8]) -> R) -> CodeResult<R> {
        let key = key.to_string();
        let bytes = self.call(DATA_DEADLINE, |rpc, ctx| {
            let key = key.clone();
            async move { rpc.get_inline(ctx, key).await }
        })??;
        Ok(consume(&bytes))
    }

    /// [`get`](Self::get) for many keys; one result per key.
    pub fn get_batch<K: AsRef<str>>(&self, keys: &[K]) -> Vec<CodeResult<Vec<u8>>> {
        keys.iter().map(|key| self.get(key.as_ref())).collect()
    }

    /// Reads `key` into a new block of the shared pool; the handle keeps the bytes valid
    /// until it is dropped.
    pub fn get_buffer(&self, key: &str) -> CodeResult<BufferHandle> {
        for _ in 0..3 {
            let size = self.get_size(key)?;
            let addr = self.alloc_from_mem_pool(size);
            if addr == 0 {
                return Err(ErrorCode::NO_AVAILABLE_HANDLE);
            }
            let handle = BufferHandle::new(self.clone(), addr, size);
            match self
                .read_scatter(vec![(key.to_string(), vec![(addr, size)])])
                .pop()
            {
                Some(Ok(read)) if read == size => return Ok(handle),
                // The object was replaced by one of another size meanwhile: try again.
                Some(Ok(_) | Err(ErrorCode::BUFFER_OVERFLOW)) => continue,
                Some(Err(code)) => return Err(code),
                None => return Err(ErrorCode::RPC_FAIL),
            }
        }
        Err(ErrorCode::OBJECT_REPLICA_BUSY)
    }

    /// [`get_buffer`](Self::get_buffer) for many keys.
    pub fn batch_get_buffer<K: AsRef<str>>(&self, keys: &[K]) -> Vec<CodeResult<BufferHandle>> {
        keys.iter()
            .map(|key| self.get_buffer(key.as_ref()))
            .collect()
    }

    /// Copies ranges of objects into buffers. For buffer `b` at `ptrs[b]`, key
    /// `keys[b][k]` and fragment `f`: `sizes[b][k][f]` bytes from offset `src[b][k][f]`
    /// of the object go to offset `dst[b][k][f]` of the buffer. The result has the shape
    /// of `dst`: bytes copied or an error per fragment. Mismatched shapes, fragments
    /// past the buffer (its registered or allocated size) or past the object are
    /// `INVALID_PARAMS`; a missing key fails its fragments with `OBJECT_NOT_FOUND`.
    ///
    /// # Safety
    /// Every range named that lies in this client's shared memory or in one of its
    /// registered buffers must be valid for writes for the whole call, with no Rust
    /// reference to it alive: it is written behind Rust's back (by this client, or by
    /// the real client from another process). Ranges elsewhere are refused
    /// (`INVALID_PARAMS`), never written.
    pub unsafe fn get_into_ranges(
        &self,
        ptrs: &[u64],
        keys: &[Vec<String>],
        dst: &Nested<u64>,
        src: &Nested<u64>,
        sizes: &Nested<u64>,
    ) -> Nested<CodeResult<u64>> {
        let invalid = |b: usize, k: usize| -> Vec<CodeResult<u64>> {
            let n = dst.get(b).and_then(|d| d.get(k)).map_or(0, Vec::len);
            all_failed(n, ErrorCode::INVALID_PARAMS)
        };
        let shape_ok = ptrs.len() == keys.len()
            && keys.len() == dst.len()
            && dst.len() == src.len()
            && src.len() == sizes.len();
        let mut results: Nested<CodeResult<u64>> = keys
            .iter()
            .enumerate()
            .map(|(b, ks)| (0..ks.len()).map(|k| invalid(b, k)).collect())
            .collect();
        if !shape_ok {
            return results;
        }
        let mut reads = Vec::new();
        let mut places = Vec::new();
        let mut bounces = Vec::new();
        for (b, ks) in keys.iter().enumerate() {
            if ks.len() != dst[b].len() || ks.len() != src[b].len() || ks.len() != sizes[b].len() {
                continue;
            }
            let capacity = self.inner.memory.lock().capacity_at(ptrs[b]);
            for (k, key) in ks.iter().enumerate() {
                let (d, s, z) = (&dst[b][k], &src[b][k], &sizes[b][k]);
                if d.len() != s.len() || d.len() != z.len() {
                    continue;
                }
                let mut fragments = Vec::new();
                let mut fragment_places = Vec::new();
                for f in 0..d.len() {
                    let fits =
                        d[f].checked_add(z[f]).is_some_and(|end| end <= capacity) && z[f] > 0;
                    if !fits {
                        continue;
                    }
                    match self.destination(ptrs[b].saturating_add(d[f]), z[f], &mut bounces) {
                        Ok(dest) => {
                            fragments.push(Fragment {
                                dest,
                                src_offset: s[f],
                            });
                            fragment_places.push((f, bounces.len() - 1));
                        }
                        Err(code) => {
                            self.no_staging_room(z[f]);
                            results[b][k][f] = Err(code);
                        }
                    }
                }
                if !fragments.is_empty() {
                    reads.push(RangeRead {
                        key: key.clone(),
                        fragments,
                    });
                    places.push((b, k, fragment_places));
                }
            }
        }
        let before = self.calls_in_doubt();
        if !reads.is_empty() {
            let answers = self.call_chunked(reads, DATA_DEADLINE, |rpc, ctx, reads| async move {
                rpc.get_ranges(ctx, reads)
                    .await
                    .map(|v| v.into_iter().map(Ok).collect())
            });
            for ((b, k, fragment_places), answer) in places.into_iter().zip(answers) {
                for (position, (f, bounce_index)) in fragment_places.into_iter().enumerate() {
                    let result = match &answer {
                        Ok(per_fragment) => per_fragment
                            .get(position)
                            .copied()
                            .unwrap_or(Err(ErrorCode::RPC_FAIL)),
                        Err(code) => Err(*code),
                    };
                    if let (Ok(n), Some(Some(bounce))) = (result, bounces.get(bounce_index)) {
                        bounce.deliver(n);
                    }
                    results[b][k][f] = result;
                }
            }
        }
        self.release_bounces(bounces, before);
        results
    }
}
