//! This node's RDMA side: the devices it uses, its segment registered on each of them
//! for peers to read and write, and the server half of connecting a queue pair.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use mooncake_core::error::ErrorCode;
use mooncake_rdma::{Device, MemoryRegion, QueuePair, RdmaError, Reach};

use super::exchange::{Acceptance, Offer};
use crate::transfer::served::ServedSegment;

/// Work requests outstanding at once on one queue pair.
pub const QUEUE_DEPTH: u32 = mooncake_rdma::queue_pair::DEFAULT_DEPTH;

/// The devices this node uses and its segment's registration on each.
#[derive(Debug)]
pub struct RdmaNode {
    devices: Vec<Arc<Device>>,
    /// The segment, registered for peers' reads and writes on each device (empty for
    /// a node that contributes no memory).
    segment_regions: Vec<Arc<MemoryRegion>>,
    segment: Arc<ServedSegment>,
}

impl RdmaNode {
    /// Opens `devices` and registers `segment` on each.
    pub fn open(
        devices: &[String],
        segment: &Arc<ServedSegment>,
    ) -> Result<Arc<RdmaNode>, RdmaError> {
        let devices: Vec<Arc<Device>> = devices
            .iter()
            .map(|name| Device::open(name).map(Arc::new))
            .collect::<Result<_, _>>()?;
        let mut segment_regions = Vec::new();
        if segment.contributes {
            for device in &devices {
                let memory = &segment.memory;
                // SAFETY: the segment stays mapped while the node (which holds it) lives.
                let region = unsafe {
                    MemoryRegion::register(
                        device,
                        memory.base(),
                        memory.len() as u64,
                        Reach::Remote,
                    )
                }?;
                segment_regions.push(Arc::new(region));
            }
        }
        for device in &devices {
            tracing::info!(device = device.name(), address = ?device.address(), "RDMA device opened");
        }
        Ok(Arc::new(RdmaNode {
            devices,
            segment_regions,
            segment: Arc::clone(segment),
        }))
    }

    /// The devices in use.
    pub fn devices(&self) -> &[Arc<Device>] {
        &self.devices
    }

    /// The segment's registration on device `index` (when this node contributes).
    pub fn segment_region(&self, index: usize) -> Option<&Arc<MemoryRegion>> {
        self.segment_regions.get(index)
    }

    /// The segment this node serves.
    pub fn segment(&self) -> &Arc<ServedSegment> {
        &self.segment
    }

    /// Connects a queue pair to a peer's `offer` on the device it asked for; the
    /// queue pair lives as long as the connection that carried the offer.
    pub fn accept(&self, offer: &Offer) -> Result<(Acceptance, QueuePair), ErrorCode> {
        if !self.segment.contributes || self.devices.is_empty() {
            return Err(ErrorCode::SEGMENT_NOT_FOUND);
        }
        let index = usize::try_from(offer.device).unwrap_or(0) % self.devices.len();
        let refused = |error: RdmaError| {
            tracing::warn!(%error, "cannot connect a peer's RDMA queue pair");
            ErrorCode::TRANSFER_FAIL
        };
        let mut pair = QueuePair::create(&self.devices[index], QUEUE_DEPTH).map_err(refused)?;
        pair.connect(&offer.endpoint).map_err(refused)?;
        let region = self
            .segment_region(index)
            .ok_or(ErrorCode::SEGMENT_NOT_FOUND)?;
        let acceptance = Acceptance {
            endpoint: pair.endpoint(),
            rkey: region.rkey(),
            segment: self.segment.id.load(Ordering::Acquire),
            address: region.address(),
            len: region.len(),
        };
        Ok((acceptance, pair))
    }
}
