//! The RPC handlers a dummy's session is served by.

use std::sync::Arc;

use serde_bytes::ByteBuf;
use tarpc::context::Context;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master::TaskInfo;
use mooncake_core::protocol::rpc::{
    GetItem, MemRange, PingReply, PutItem, PutSource, RangeRead, RealClientRpc, StatusReport,
    WriteMode,
};
use mooncake_core::types::{ReplicaDescriptor, ReplicateConfig};
use mooncake_shm::MemSlice;

use crate::server::ServerState;
use crate::session::Session;
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
    fn translate(&self, range: MemRange) -> CodeResult<MemSlice> {
        self.session
            .translate(range.addr, range.len)
            .map_err(|error| {
                tracing::warn!(pid = self.session.pid, %error, "rejected a dummy range");
                ErrorCode::INVALID_PARAMS
            })
    }

    fn translate_all(&self, ranges: &[MemRange]) -> CodeResult<Vec<MemSlice>> {
        ranges.iter().map(|r| self.translate(*r)).collect()
    }

    fn put_one(&self, item: &PutItem, config: &ReplicateConfig, mode: WriteMode) -> CodeResult<()> {
        let store = &self.state.store;
        match &item.source {
            PutSource::Inline(bytes) => store.put(&item.key, &Payload::Bytes(bytes), config, mode),
            PutSource::Shared(ranges) => {
                let slices = self.translate_all(ranges)?;
                store.put(&item.key, &Payload::Slices(slices), config, mode)
            }
        }
    }

    fn get_one(&self, item: &GetItem) -> CodeResult<u64> {
        let dests = self.translate_all(&item.dests)?;
        self.state.store.get_scatter(&item.key, &dests)
    }

    fn get_ranges_one(&self, read: &RangeRead) -> Vec<CodeResult<u64>> {
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
            let copied = self.state.store.get_ranges(&read.key, &valid);
            for (index, result) in positions.into_iter().zip(copied) {
                results[index] = result;
            }
        }
        results
    }

    fn task_id(&self) -> u128 {
        crate::random_id()
    }
}

impl RealClientRpc for DummyHandler {
    async fn ping(self, _: Context) -> PingReply {
        PingReply {
            instance_id: self.state.identity.instance_id,
            master_ok: true,
            segment_name: self.state.identity.segment_name.clone(),
        }
    }

    async fn exist(self, _: Context, keys: Vec<String>) -> Vec<CodeResult<bool>> {
        let master = self.state.store.master();
        keys.iter().map(|k| master.exist(k)).collect()
    }

    async fn object_size(self, _: Context, key: String) -> CodeResult<u64> {
        self.state.store.master().object_size(&key)
    }

    async fn put(
        self,
        _: Context,
        items: Vec<PutItem>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>> {
        items
            .iter()
            .map(|item| self.put_one(item, &config, mode))
            .collect()
    }

    async fn get(self, _: Context, items: Vec<GetItem>) -> Vec<CodeResult<u64>> {
        items.iter().map(|item| self.get_one(item)).collect()
    }

    async fn get_ranges(self, _: Context, reads: Vec<RangeRead>) -> Vec<Vec<CodeResult<u64>>> {
        reads.iter().map(|read| self.get_ranges_one(read)).collect()
    }

    async fn replica_desc(
        self,
        _: Context,
        keys: Vec<String>,
    ) -> Vec<CodeResult<Vec<ReplicaDescriptor>>> {
        let master = self.state.store.master();
        keys.iter().map(|k| master.replica_descriptors(k)).collect()
    }

    async fn remove_by_regex(self, _: Context, pattern: String, force: bool) -> CodeResult<u64> {
        self.state.store.master().remove_by_regex(&pattern, force)
    }

    async fn create_copy_task(
        self,
        _: Context,
        key: String,
        targets: Vec<String>,
    ) -> CodeResult<u128> {
        let id = self.task_id();
        self.state
            .store
            .master()
            .create_copy_task(&key, &targets, id)
    }

    async fn create_move_task(
        self,
        _: Context,
        key: String,
        source: String,
        target: String,
    ) -> CodeResult<u128> {
        let id = self.task_id();
        self.state
            .store
            .master()
            .create_move_task(&key, &source, &target, id)
    }

    async fn query_task(self, _: Context, id: u128) -> CodeResult<TaskInfo> {
        self.state.store.master().query_task(id)
    }

    async fn get_inline(self, _: Context, key: String) -> CodeResult<ByteBuf> {
        self.state.store.get_bytes(&key).map(ByteBuf::from)
    }

    async fn remove(self, _: Context, keys: Vec<String>, force: bool) -> Vec<CodeResult<()>> {
        self.state.store.master().batch_remove(&keys, force)
    }

    async fn remove_all(self, _: Context, force: bool) -> CodeResult<u64> {
        Ok(self.state.store.master().remove_all(force))
    }

    async fn status(self, _: Context) -> StatusReport {
        self.state.status()
    }
}
