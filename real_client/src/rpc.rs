//! The RPC handlers a dummy's session is served by.

use std::sync::Arc;

use serde_bytes::ByteBuf;
use tarpc::context::Context;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::{
    GetItem, MemRange, PingReply, PutItem, PutSource, RealClientRpc, StatusReport,
};
use mooncake_core::types::ReplicateConfig;
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

    fn put_one(&self, item: &PutItem, config: &ReplicateConfig) -> CodeResult<()> {
        let store = &self.state.store;
        match &item.source {
            PutSource::Inline(bytes) => store.put(&item.key, &Payload::Bytes(bytes), config),
            PutSource::Shared(ranges) => {
                let slices = ranges
                    .iter()
                    .map(|r| self.translate(*r))
                    .collect::<CodeResult<Vec<_>>>()?;
                store.put(&item.key, &Payload::Slices(slices), config)
            }
        }
    }

    fn get_one(&self, item: &GetItem) -> CodeResult<u64> {
        let dest = self.translate(item.dest)?;
        self.state.store.get_into(&item.key, &dest)
    }
}

impl RealClientRpc for DummyHandler {
    async fn ping(self, _: Context) -> PingReply {
        PingReply {
            instance_id: self.state.identity.instance_id,
            master_ok: true,
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
    ) -> Vec<CodeResult<()>> {
        items
            .iter()
            .map(|item| self.put_one(item, &config))
            .collect()
    }

    async fn get(self, _: Context, items: Vec<GetItem>) -> Vec<CodeResult<u64>> {
        items.iter().map(|item| self.get_one(item)).collect()
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
