//! The transfer engine: moves bytes between this node's memory (its segment, or a
//! dummy's shared memory) and other real clients' segments.
//!
//! The store sees one [`Transport`] ([`seam`]), chosen at startup: TCP
//! ([`TransferClient`]) or one-sided RDMA ([`rdma`]). Each real client also serves its
//! own segment to its peers over TCP ([`server`]): reads and writes, reads of its SSD
//! tier, and the exchange that connects an RDMA queue pair.
//!
//! Over TCP, a transfer is one request followed by the whole payload, streamed straight
//! from or into the mapped memory: no round trip per chunk. The client keeps a pool of
//! connections per peer ([`client`]); batches are pipelined: a window of requests leaves
//! in one vectored send, the server reads them through a small buffer ([`stream`]) and
//! sends its answers together once no further request is waiting. Every connection is
//! prepared by [`tuning`]: TCP_NODELAY, and the congestion control of
//! `--transfer_tcp_congestion`. The frames are in [`wire`].

pub mod client;
pub mod rdma;
pub mod seam;
pub mod served;
pub mod server;
mod stream;
pub mod tuning;
pub mod wire;

pub use client::TransferClient;
pub use seam::{Transfer, Transport};
pub use server::TransferServer;
pub use tuning::Congestion;

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64;

    use mooncake_core::error::ErrorCode;
    use mooncake_shm::shared_memory::PageSize;
    use mooncake_shm::{MemSlice, SharedMemory};

    use mooncake_core::protocol::auth::ClusterSecret;
    use mooncake_core::protocol::grant::{Access, GrantedRange, Scope, now_secs};

    use super::seam::{Direction, Transfer, Transport};
    use super::server::ServedSegment;
    use super::{TransferClient, TransferServer};

    fn at(
        segment: u64,
        offset: u64,
        grant: Option<GrantedRange>,
        local: &MemSlice,
    ) -> Transfer<'_> {
        Transfer {
            segment,
            offset,
            grant,
            local,
        }
    }

    const SEGMENT_ID: u64 = 7;

    fn memory(len: u64) -> Arc<SharedMemory> {
        Arc::new(SharedMemory::create("transfer-test", len, PageSize::Normal).expect("shm"))
    }

    fn serve(len: u64) -> (TransferServer, Arc<ServedSegment>) {
        serve_with(len, None)
    }

    fn serve_with(
        len: u64,
        secret: Option<Arc<ClusterSecret>>,
    ) -> (TransferServer, Arc<ServedSegment>) {
        let segment = Arc::new(ServedSegment {
            memory: memory(len),
            id: AtomicU64::new(SEGMENT_ID),
            contributes: true,
            name: "transfer-test".into(),
            writes: Default::default(),
            file: None,
        });
        let server = TransferServer::start(
            "127.0.0.1:0".parse().expect("address"),
            Arc::clone(&segment),
            None,
            super::Congestion::System,
            secret,
            None,
        )
        .expect("server");
        (server, segment)
    }

    fn patterned(memory: &Arc<SharedMemory>, index: u64, len: u64) -> MemSlice {
        let slice = memory.slice(index * len, len).expect("slice");
        let bytes: Vec<u8> = (0..len)
            .map(|i| ((i * 31 + index * 7) % 251) as u8)
            .collect();
        slice.write_from(&bytes);
        slice
    }

    #[test]
    fn a_peer_read_of_bytes_still_being_written_waits_for_them() {
        let (server, segment) = serve(1 << 20);
        let endpoint = server.address().to_string();
        let held = segment.writes.hold([(4096, 4096)]);
        let reader = {
            let endpoint = endpoint.clone();
            std::thread::spawn(move || {
                let dest = memory(4096).slice(0, 4096).expect("slice");
                let started = std::time::Instant::now();
                TransferClient::default()
                    .run_one(
                        &endpoint,
                        Direction::Read,
                        at(SEGMENT_ID, 4096, None, &dest),
                    )
                    .map(|()| (dest.to_vec(), started.elapsed()))
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        let written = patterned(&segment.memory, 1, 4096).to_vec();
        drop(held);
        let (read, waited) = reader.join().expect("reader").expect("read");
        assert_eq!(read, written, "the read saw the bytes once written");
        assert!(waited >= std::time::Duration::from_millis(40), "{waited:?}");
        // A write whose copy failed fails the reads of its bytes.
        let held = segment.writes.hold([(0, 4096)]);
        held.fail(0, 4096);
        let dest = memory(4096).slice(0, 4096).expect("slice");
        let client = TransferClient::default();
        assert!(
            client
                .run_one(&endpoint, Direction::Read, at(SEGMENT_ID, 0, None, &dest))
                .is_err()
        );
        drop(held);
        client
            .run_one(&endpoint, Direction::Read, at(SEGMENT_ID, 0, None, &dest))
            .expect("released");
    }

    #[test]
    fn with_a_secret_only_transfers_the_master_granted_are_served() {
        let secret = Arc::new(ClusterSecret::from_bytes(&[5; 32], "test"));
        let (server, segment) = serve_with(1 << 20, Some(Arc::clone(&secret)));
        let endpoint = server.address().to_string();
        let client = TransferClient::new(super::Congestion::System, Some(Arc::clone(&secret)));
        let source = memory(8192);
        let bytes = patterned(&source, 0, 8192);
        segment
            .memory
            .slice(65536, 8192)
            .expect("slice")
            .write_from(&[0xab; 8192]);
        let granted = |access, offset, len| {
            Some(GrantedRange {
                offset,
                len,
                grant: secret.grant(
                    access,
                    &Scope::Memory {
                        segment: SEGMENT_ID,
                        offset,
                        len,
                    },
                    now_secs() + 30,
                ),
            })
        };
        let write = granted(Access::Write, 4096, 8192);
        assert_eq!(
            client.run_one(
                &endpoint,
                Direction::Write,
                at(SEGMENT_ID, 4096, write, &bytes)
            ),
            Ok(())
        );
        let dest = memory(8192).slice(0, 8192).expect("slice");
        let read = granted(Access::Read, 4096, 8192);
        assert_eq!(
            client.run_one(
                &endpoint,
                Direction::Read,
                at(SEGMENT_ID, 4096, read, &dest)
            ),
            Ok(())
        );
        assert_eq!(dest.to_vec(), bytes.to_vec());
        // A member without a grant, or with one for other bytes, reaches nothing.
        let other = memory(8192).slice(0, 8192).expect("slice");
        assert_eq!(
            client.run_one(
                &endpoint,
                Direction::Read,
                at(SEGMENT_ID, 65536, None, &other)
            ),
            Err(ErrorCode::ILLEGAL_CLIENT)
        );
        assert_eq!(
            client.run_one(
                &endpoint,
                Direction::Read,
                at(SEGMENT_ID, 65536, read, &other)
            ),
            Err(ErrorCode::ILLEGAL_CLIENT)
        );
        assert_eq!(
            client.run_one(
                &endpoint,
                Direction::Write,
                at(SEGMENT_ID, 4096, read, &other)
            ),
            Err(ErrorCode::ILLEGAL_CLIENT),
            "a read grant does not allow writing"
        );
        let forged = read.map(|mut g| {
            g.offset = 65536;
            g
        });
        assert_eq!(
            client.run_one(
                &endpoint,
                Direction::Read,
                at(SEGMENT_ID, 65536, forged, &other)
            ),
            Err(ErrorCode::ILLEGAL_CLIENT)
        );
        let expired = Some(GrantedRange {
            offset: 4096,
            len: 8192,
            grant: secret.grant(
                Access::Read,
                &Scope::Memory {
                    segment: SEGMENT_ID,
                    offset: 4096,
                    len: 8192,
                },
                1,
            ),
        });
        assert_eq!(
            client.run_one(
                &endpoint,
                Direction::Read,
                at(SEGMENT_ID, 4096, expired, &other)
            ),
            Err(ErrorCode::LEASE_EXPIRED)
        );
        assert!(other.to_vec().iter().all(|b| *b == 0), "nothing was sent");
        assert!(
            segment
                .memory
                .slice(65536, 8192)
                .expect("slice")
                .to_vec()
                .iter()
                .all(|b| *b == 0xab),
            "nothing was written"
        );
    }
}
