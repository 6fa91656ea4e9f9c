//! GPU buffers registered with `register_buffer` (vLLM registers its KV-cache tensors).
//!
//! This process never touches GPU memory. A device buffer is handed to the real client,
//! which copies requests' ranges straight between the device and its segment:
//! * embedded, the in-process real client uses the device pointers as they are;
//! * with a separate `mooncake_client`, the buffer's allocation is exported once as a
//!   CUDA (or HIP) IPC handle, which the real client opens (and closes when the buffer is
//!   unregistered or this process leaves). A reconnect declares every GPU buffer again.
//!
//! When the real client cannot reach the buffer (no driver there, a refused handle),
//! `register_buffer` fails with `INVALID_PARAMS` and the log says why.

use serde_bytes::ByteBuf;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::DeviceBufferDecl;
use mooncake_device::{DeviceAllocation, driver};

use crate::client::DummyClient;
use crate::connection::{Connected, Link};
use crate::declare::deadline;

impl DummyClient {
    /// Registers the GPU buffer `ptr..ptr+size` of `allocation` with the real client
    /// (declared again on reconnect when the real client is away now).
    pub(crate) fn register_device(
        &self,
        ptr: u64,
        size: u64,
        allocation: DeviceAllocation,
    ) -> CodeResult<()> {
        // Lock order as in `rpc`: link, then memory.
        let link = self.inner.link.lock();
        let declared = match &*link {
            Link::Up(connected) => {
                if let Err(reason) = self.reach_device(connected, ptr, size, allocation) {
                    tracing::error!(ptr, size, %reason, "register_buffer: the real client cannot reach this GPU buffer");
                    return Err(ErrorCode::INVALID_PARAMS);
                }
                true
            }
            _ => false,
        };
        self.inner
            .memory
            .lock()
            .register_device(ptr, size, allocation, declared);
        Ok(())
    }

    /// Hands a registered GPU buffer to the real client behind `connected`.
    fn reach_device(
        &self,
        connected: &Connected,
        ptr: u64,
        size: u64,
        allocation: DeviceAllocation,
    ) -> Result<(), String> {
        #[cfg(feature = "embedded")]
        if let crate::connection::Target::InProcess(host) = &self.inner.target {
            return host
                .register_device(self.inner.identity.client_id, ptr, size, allocation)
                .map_err(|code| format!("the in-process real client refused it ({code:?})"));
        }
        self.declare_device_over(connected, ptr, size, allocation)
    }

    /// Exports the buffer's allocation and declares the buffer over `connected`; the
    /// error says why the real client cannot reach it.
    fn declare_device_over(
        &self,
        connected: &Connected,
        ptr: u64,
        size: u64,
        allocation: DeviceAllocation,
    ) -> Result<(), String> {
        let driver = driver::driver(allocation.api).map_err(|e| e.to_string())?;
        let handle = driver
            .export(allocation.device, allocation.base)
            .map_err(|e| format!("exporting the GPU allocation failed: {e}"))?;
        let decl = DeviceBufferDecl {
            addr: ptr,
            len: size,
            device: allocation.device,
            alloc_base: allocation.base,
            alloc_len: allocation.len,
            handle: ByteBuf::from(handle.to_vec()),
            api: allocation.api,
        };
        let rpc = connected.rpc.clone();
        let call = async move { rpc.declare_device(deadline(), decl).await };
        match self.block_on(call) {
            Ok(answer) => answer,
            Err(error) => Err(format!("the real client did not answer: {error}")),
        }
    }

    /// Declares every registered GPU buffer over a new connection (or lends it again to
    /// a new in-process session).
    pub(crate) fn redeclare_devices(&self, connected: &Connected) {
        let buffers = self.inner.memory.lock().device_registrations();
        for (ptr, size, allocation) in buffers {
            let declared = self.reach_device(connected, ptr, size, allocation);
            if let Err(reason) = &declared {
                tracing::warn!(ptr, size, %reason, "after reconnecting, the real client cannot reach a registered GPU buffer; calls naming it fail");
            }
            self.inner
                .memory
                .lock()
                .register_device(ptr, size, allocation, declared.is_ok());
        }
    }
}
