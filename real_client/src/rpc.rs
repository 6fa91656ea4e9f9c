//! The RPC handlers a dummy's session is served by.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_bytes::ByteBuf;
use tarpc::context::Context;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::{LeaseBudget, TaskInfo};
use mooncake_core::protocol::bounded::Batch;
use mooncake_core::protocol::rpc::{
    Declaration, DeviceBufferDecl, GetItem, MAX_INLINE_BYTES, MemRange, PingReply, PutItem,
    PutSource, RangeRead, RealClientRpc, StatusReport, WriteMode,
};
use mooncake_core::types::{MAX_KEY_LEN, ReplicaDescriptor, ReplicateConfig};

use crate::metrics::Op;
use crate::region::Region;
use crate::session::Session;
use crate::state::ServerState;
use crate::store::Payload;

/// Serves one dummy: its session plus the shared server state.
#[derive(Clone, Debug)]
pub struct DummyHandler {
    /// The process-wide state.
    pub state: Arc<ServerState>,
    /// The dummy's session.
    pub session: Arc<Session>,
}

impl DummyHandler {
    /// The dummy's range in its shared memory or its declared memory; anything else is
    /// `INVALID_PARAMS`.
    fn translate(&self, range: MemRange) -> CodeResult<Region> {
        let region = self.session.region(range.addr, range.len).map_err(|error| {
            tracing::warn!(
                pid = self.session.pid,
                %error,
                "rejected a dummy range: neither in its shared memory nor wholly inside one range of memory it declared (usable across processes)"
            );
            ErrorCode::INVALID_PARAMS
        })?;
        if lost_pages(std::slice::from_ref(&region)) {
            tracing::warn!(
                pid = self.session.pid,
                "rejected a dummy range: its shared memory lost pages under the mapping (a hole punched in a hugetlb memfd?)"
            );
            return Err(ErrorCode::INVALID_PARAMS);
        }
        Ok(region)
    }

    /// True when `ranges` start in the dummy's staging buffer: the dummy copied their
    /// bytes there (writes) or will copy them out (reads).
    fn staged(&self, ranges: &[MemRange]) -> bool {
        ranges
            .first()
            .is_some_and(|range| self.session.in_staging(range.addr))
    }

    /// Records each result of a batch, sharing the batch's time among its items.
    fn record_all<T>(
        &self,
        op: Op,
        started: Instant,
        results: &[CodeResult<T>],
        bytes: impl Fn(&T) -> u64,
    ) {
        let each = started.elapsed() / u32::try_from(results.len().max(1)).unwrap_or(u32::MAX);
        for result in results {
            let moved = result.as_ref().map_or(0, &bytes);
            self.state.metrics.record(op, each, moved, result);
        }
    }

    fn translate_all(&self, ranges: &[MemRange]) -> CodeResult<Vec<Region>> {
        ranges.iter().map(|r| self.translate(*r)).collect()
    }

    fn payload<'a>(&self, item: &'a PutItem) -> CodeResult<Payload<'a>> {
        match &item.source {
            PutSource::Inline(bytes) => {
                self.state.metrics.add_staged(bytes.len() as u64);
                Ok(Payload::Bytes(bytes))
            }
            PutSource::Shared(ranges) => {
                let regions = self.translate_all(ranges)?;
                if self.staged(ranges) {
                    self.state
                        .metrics
                        .add_staged(ranges.iter().fold(0u64, |sum, r| sum.saturating_add(r.len)));
                }
                Ok(Payload::Regions(regions))
            }
        }
    }

    /// Writes a batch of distinct keys: one master round trip to start it and one to
    /// complete it.
    async fn put_batch(
        &self,
        items: &[PutItem],
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        let mut results: Vec<CodeResult<()>> = vec![Ok(()); items.len()];
        let mut payloads = Vec::with_capacity(items.len());
        let mut positions = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            match self.payload(item) {
                Ok(payload) => {
                    payloads.push((item.key.as_str(), payload));
                    positions.push(index);
                }
                Err(code) => results[index] = Err(code),
            }
        }
        let written = self.state.store.put_many(&payloads, config, mode).await;
        for (index, outcome) in positions.into_iter().zip(written) {
            results[index] = outcome;
        }
        results
    }

    /// Runs a dummy's `put`. To a remote master it spans round trips: it runs to its
    /// end (put_end or revoke) in a task of its own, so a request cancelled by its
    /// deadline or a closed connection leaves no write holding segment space until the
    /// master's release timeout. Not for a dummy in this process: its borrowed memory
    /// may be reused as soon as its call returns.
    async fn put_items(
        self,
        items: Vec<PutItem>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        if self.state.store.master().is_remote() && !self.session.is_in_process() {
            let count = items.len();
            return tokio::spawn(self.put_to_end(items, config, mode))
                .await
                .unwrap_or_else(|_| vec![Err(ErrorCode::INTERNAL_ERROR); count]);
        }
        self.put_to_end(items, config, mode).await
    }

    /// Reserves `bytes` of this dummy's hard-pin quota. When it looks used up, the
    /// keys the master no longer has (removed since) stop counting first.
    async fn admit_hard_pins(&self, bytes: u64) -> CodeResult<()> {
        let limit = self.state.max_hard_pinned_bytes_per_dummy;
        if self.session.hard_pins().lock().reserve(bytes, limit) {
            return Ok(());
        }
        let keys = self.session.hard_pins().lock().keys();
        let found = self.state.store.master().replica_desc(keys.clone()).await;
        let mut pins = self.session.hard_pins().lock();
        for (key, result) in keys.iter().zip(found) {
            if matches!(result, Err(ErrorCode::OBJECT_NOT_FOUND)) {
                pins.forget(key);
            }
        }
        if pins.reserve(bytes, limit) {
            return Ok(());
        }
        tracing::warn!(
            dummy = %self.session.name,
            pid = self.session.pid,
            held = pins.bytes(),
            asked = bytes,
            limit,
            "refusing a hard-pinned put: this dummy's hard-pinned objects would pass --max_hard_pinned_bytes_per_dummy; remove some, or raise the limit"
        );
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    }

    /// True when this dummy's reads count against the read-lease quota: every dummy
    /// but one in this process (the real client's own user).
    fn has_read_quota(&self) -> bool {
        !self.session.is_in_process()
    }

    /// Waits, until `deadline` at most, for this dummy's read leases to leave room for
    /// another read (see [`crate::read_leases`]); `RPC_TIMEOUT` when they do not.
    async fn admit_read(&self, deadline: Instant) -> CodeResult<()> {
        if !self.has_read_quota() {
            return Ok(());
        }
        let limit = self.state.read_leases.max_bytes_per_dummy;
        loop {
            let now = Instant::now();
            let (next_end, first_wait) = {
                let mut leases = self.session.read_leases().lock();
                if leases.has_room(now, limit) {
                    return Ok(());
                }
                (leases.next_end(), leases.note_wait())
            };
            if first_wait {
                tracing::warn!(
                    dummy = %self.session.name,
                    pid = self.session.pid,
                    limit,
                    "a dummy holds read leases on --max_read_leased_bytes_per_dummy bytes (or on the most objects): its reads wait for its oldest leases to lapse (logged once per dummy)"
                );
            }
            if now >= deadline {
                return Err(ErrorCode::RPC_TIMEOUT);
            }
            let wake = next_end
                .unwrap_or(now)
                .max(now + Duration::from_millis(1))
                .min(deadline);
            tokio::time::sleep_until(wake.into()).await;
        }
    }

    /// Counts the leases the master granted to this dummy's reads of `(key, size)`s.
    fn count_read_leases<'a>(&self, leased: impl IntoIterator<Item = (&'a str, u64)>) {
        if !self.has_read_quota() {
            return;
        }
        let end = Instant::now() + self.state.read_leases.ttl;
        self.session.read_leases().lock().record(end, leased);
    }

    /// Writes a batch of a dummy's `put` from start to end, and records its metrics.
    async fn put_to_end(
        self,
        items: Vec<PutItem>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        let started = Instant::now();
        // A batch naming a key twice runs in order, as a sequence of calls would.
        let results = if has_duplicates(items.iter().map(|i| i.key.as_str())) {
            let mut results = Vec::with_capacity(items.len());
            for item in &items {
                results.extend(
                    self.put_batch(std::slice::from_ref(item), &config, mode)
                        .await,
                );
            }
            results
        } else {
            self.put_batch(&items, &config, mode).await
        };
        let each = started.elapsed() / u32::try_from(items.len().max(1)).unwrap_or(u32::MAX);
        for (item, result) in items.iter().zip(&results) {
            let moved = if result.is_ok() { item_bytes(item) } else { 0 };
            self.state.metrics.record(Op::Put, each, moved, result);
        }
        results
    }

    /// Reads a batch: one master round trip for all its lookups.
    async fn get_batch(&self, items: &[GetItem]) -> Vec<CodeResult<u64>> {
        let mut results: Vec<CodeResult<u64>> = vec![Ok(0); items.len()];
        let mut reads = Vec::with_capacity(items.len());
        let mut positions = Vec::with_capacity(items.len());
        for (index, item) in items.iter().enumerate() {
            match self.translate_all(&item.dests) {
                Ok(dests) => {
                    reads.push((item.key.as_str(), dests));
                    positions.push(index);
                }
                Err(code) => results[index] = Err(code),
            }
        }
        let copied = self.state.store.get_scatter_many(&reads).await;
        for ((index, outcome), (_, dests)) in positions.into_iter().zip(copied).zip(&reads) {
            // Pages taken away during the copy: the bytes that landed are meaningless.
            let outcome = outcome.and_then(|len| {
                if lost_pages(dests) {
                    Err(ErrorCode::INVALID_PARAMS)
                } else {
                    Ok(len)
                }
            });
            if let Ok(len) = outcome
                && self.staged(&items[index].dests)
            {
                self.state.metrics.add_staged(len);
            }
            results[index] = outcome;
        }
        results
    }

    async fn get_ranges_one(&self, read: &RangeRead) -> Vec<CodeResult<u64>> {
        let mut results: Vec<CodeResult<u64>> = vec![Ok(0); read.fragments.len()];
        let mut valid = Vec::with_capacity(read.fragments.len());
        let mut positions = Vec::with_capacity(read.fragments.len());
        for (index, fragment) in read.fragments.iter().enumerate() {
            match self.translate(fragment.dest) {
                Ok(dest) => {
                    valid.push((dest, fragment.src_offset));
                    positions.push(index);
                }
                Err(code) => results[index] = Err(code),
            }
        }
        if !valid.is_empty() {
            let (size, copied) = self.state.store.get_ranges(&read.key, &valid).await;
            if let Some(size) = size {
                self.count_read_leases([(read.key.as_str(), size)]);
            }
            for ((index, result), (dest, _)) in positions.into_iter().zip(copied).zip(&valid) {
                let result = result.and_then(|len| {
                    if lost_pages(std::slice::from_ref(dest)) {
                        Err(ErrorCode::INVALID_PARAMS)
                    } else {
                        Ok(len)
                    }
                });
                if let Ok(len) = result
                    && self.session.in_staging(read.fragments[index].dest.addr)
                {
                    self.state.metrics.add_staged(len);
                }
                results[index] = result;
            }
        }
        results
    }
}

/// True when a region's shared memory lost pages under its mapping (see
/// `SharedMemory::is_poisoned`).
fn lost_pages(regions: &[Region]) -> bool {
    regions
        .iter()
        .any(|region| region.mapped().is_some_and(|slice| slice.is_poisoned()))
}

/// True when some key appears twice.
fn has_duplicates<'a>(keys: impl Iterator<Item = &'a str>) -> bool {
    let mut seen = std::collections::HashSet::new();
    keys.into_iter().any(|key| !seen.insert(key))
}

impl RealClientRpc for DummyHandler {
    async fn ping(self, _: Context) -> PingReply {
        PingReply {
            instance_id: self.state.identity.instance_id,
            master_ok: self.state.store.master().is_reachable().await,
            segment_name: self.state.identity.segment_name.clone(),
        }
    }

    async fn exist(self, _: Context, keys: Batch<String>) -> Vec<CodeResult<bool>> {
        let started = Instant::now();
        let keys = keys.into_inner();
        // A dummy's existence checks lease only what its quota has room for (no copy
        // needs those leases); the keys that may get one are hashed before they go.
        let (budget, hashes) = if self.has_read_quota() {
            let limit = self.state.read_leases.max_bytes_per_dummy;
            let leases = &mut *self.session.read_leases().lock();
            let room = leases.room(started, limit);
            let hashes =
                (room > 0).then(|| keys.iter().map(|key| leases.hash(key)).collect::<Vec<_>>());
            (LeaseBudget(Some(room)), hashes)
        } else {
            (LeaseBudget(None), None)
        };
        let found = self.state.store.master().exist(keys, budget).await;
        if let Some(hashes) = hashes {
            let mut left = budget;
            let end = Instant::now() + self.state.read_leases.ttl;
            let granted = hashes.into_iter().zip(&found).filter_map(|(hash, found)| {
                let size = found.ok().flatten()?;
                left.take(size).then_some((hash, size))
            });
            self.session
                .read_leases()
                .lock()
                .record_hashed(end, granted);
        }
        let results: Vec<CodeResult<bool>> = found
            .into_iter()
            .map(|found| found.map(|size| size.is_some()))
            .collect();
        self.record_all(Op::Exist, started, &results, |_| 0);
        results
    }

    async fn object_size(self, _: Context, key: String) -> CodeResult<u64> {
        self.state.store.master().object_size(&key).await
    }

    async fn put(
        self,
        _: Context,
        items: Batch<PutItem>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        let items = items.into_inner();
        if !config.with_hard_pin {
            return self.put_items(items, config, mode).await;
        }
        let reserved = items
            .iter()
            .fold(0u64, |sum, item| sum.saturating_add(item_bytes(item)));
        if let Err(code) = self.admit_hard_pins(reserved).await {
            return vec![Err(code); items.len()];
        }
        let pinned: Vec<(String, u64)> = items
            .iter()
            .map(|item| (item.key.clone(), item_bytes(item)))
            .collect();
        let session = Arc::clone(&self.session);
        let results = self.put_items(items, config, mode).await;
        let written = pinned
            .into_iter()
            .zip(&results)
            .filter(|(_, result)| result.is_ok())
            .map(|(pin, _)| pin);
        session.hard_pins().lock().finish(reserved, written);
        results
    }

    async fn get(self, ctx: Context, items: Batch<GetItem>) -> Vec<CodeResult<u64>> {
        let started = Instant::now();
        if let Err(code) = self.admit_read(ctx.deadline).await {
            return vec![Err(code); items.len()];
        }
        let results = self.get_batch(&items).await;
        self.count_read_leases(
            items
                .iter()
                .zip(&results)
                .filter_map(|(item, result)| Some((item.key.as_str(), *result.as_ref().ok()?))),
        );
        self.record_all(Op::Get, started, &results, |n| *n);
        results
    }

    async fn get_ranges(self, ctx: Context, reads: Batch<RangeRead>) -> Vec<Vec<CodeResult<u64>>> {
        let mut results = Vec::with_capacity(reads.len());
        for read in reads.iter() {
            let started = Instant::now();
            if let Err(code) = self.admit_read(ctx.deadline).await {
                results.push(vec![Err(code); read.fragments.len()]);
                continue;
            }
            let fragments = self.get_ranges_one(read).await;
            self.record_all(Op::GetRanges, started, &fragments, |n| *n);
            results.push(fragments);
        }
        results
    }

    async fn replica_desc(
        self,
        _: Context,
        keys: Batch<String>,
    ) -> Vec<CodeResult<Vec<ReplicaDescriptor>>> {
        self.state
            .store
            .master()
            .replica_desc(keys.into_inner())
            .await
    }

    async fn remove_by_regex(self, _: Context, pattern: String, force: bool) -> CodeResult<u64> {
        self.state
            .store
            .master()
            .remove_by_regex(pattern, force)
            .await
    }

    async fn create_copy_task(
        self,
        _: Context,
        key: String,
        targets: Batch<String>,
    ) -> CodeResult<u128> {
        self.state
            .store
            .master()
            .create_copy_task(key, targets.into_inner(), mooncake_core::ids::random_id())
            .await
    }

    async fn create_move_task(
        self,
        _: Context,
        key: String,
        source: String,
        target: String,
    ) -> CodeResult<u128> {
        self.state
            .store
            .master()
            .create_move_task(key, source, target, mooncake_core::ids::random_id())
            .await
    }

    async fn query_task(self, _: Context, id: u128) -> CodeResult<TaskInfo> {
        self.state.store.master().query_task(id).await
    }

    async fn get_inline(self, ctx: Context, key: String) -> CodeResult<ByteBuf> {
        self.admit_read(ctx.deadline).await?;
        let bytes = self.state.store.get_bytes(&key).await?;
        self.count_read_leases([(key.as_str(), bytes.len() as u64)]);
        if bytes.len() as u64 > MAX_INLINE_BYTES {
            // The reply would pass the frame limit: the dummy needs shared memory for it.
            return Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        self.state.metrics.add_staged(bytes.len() as u64);
        Ok(ByteBuf::from(bytes))
    }

    async fn remove(self, _: Context, keys: Batch<String>, force: bool) -> Vec<CodeResult<()>> {
        let started = Instant::now();
        let results = self
            .state
            .store
            .master()
            .remove(keys.into_inner(), force)
            .await;
        self.record_all(Op::Remove, started, &results, |_| 0);
        results
    }

    async fn clear_replicas(
        self,
        _: Context,
        keys: Batch<String>,
        segment: Option<String>,
    ) -> Vec<CodeResult<()>> {
        let keys = keys.into_inner();
        if segment
            .as_ref()
            .is_some_and(|s| s.is_empty() || s.len() > MAX_KEY_LEN)
        {
            return keys
                .iter()
                .map(|_| Err(ErrorCode::INVALID_PARAMS))
                .collect();
        }
        let started = Instant::now();
        let results = self
            .state
            .store
            .master()
            .clear_replicas(keys, segment)
            .await;
        self.record_all(Op::Remove, started, &results, |_| 0);
        results
    }

    async fn remove_all(self, _: Context, force: bool) -> CodeResult<u64> {
        self.state.store.master().remove_all(force).await
    }

    async fn status(self, _: Context) -> StatusReport {
        self.state.status().await
    }

    async fn declare_memory(self, _: Context, ranges: Batch<MemRange>) -> Declaration {
        self.session.declared().declare(&ranges)
    }

    async fn forget_memory(self, _: Context, addr: u64) -> CodeResult<()> {
        if self.session.devices().forget(addr) {
            return Ok(());
        }
        self.session.declared().forget(addr)
    }

    async fn declare_device(self, _: Context, buffer: DeviceBufferDecl) -> Result<(), String> {
        let segment = &self.state.store.segment().memory;
        let declared = self.session.devices().declare(&buffer, segment);
        if let Err(reason) = &declared {
            tracing::warn!(pid = self.session.pid, %reason, "a dummy's GPU buffer cannot be reached");
        }
        declared
    }
}

/// The bytes a put item writes.
fn item_bytes(item: &PutItem) -> u64 {
    match &item.source {
        PutSource::Inline(bytes) => bytes.len() as u64,
        PutSource::Shared(ranges) => ranges
            .iter()
            .fold(0u64, |sum, range| sum.saturating_add(range.len)),
    }
}
