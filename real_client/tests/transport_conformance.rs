//! The transport conformance suite: every scenario runs against every transport (TCP,
//! and RDMA on the stand-in verbs provider), each time against a peer in another
//! process (this test binary started again as [`peer_process`]), so that one-sided
//! RDMA really crosses processes and a peer can be killed mid-batch.
//!
//! The promises checked are those of `transfer::seam`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use mooncake_core::error::ErrorCode;
use mooncake_core::protocol::auth::ClusterSecret;
use mooncake_real_client::transfer::rdma::RdmaTransport;
use mooncake_real_client::transfer::rdma::node::RdmaNode;
use mooncake_real_client::transfer::server::ServedSegment;
use mooncake_real_client::transfer::{
    Congestion, Transfer, TransferClient, TransferServer, Transport,
};
use mooncake_shm::shared_memory::PageSize;
use mooncake_shm::{MemSlice, SharedMemory};

/// The peer's segment id.
const SEGMENT: u64 = 7;
/// The peer's segment size.
const PEER_SEGMENT: u64 = 64 << 20;
/// The secret of the scenarios with one.
const SECRET: [u8; 32] = [9; 32];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Tcp,
    Rdma,
}

const KINDS: [Kind; 2] = [Kind::Tcp, Kind::Rdma];

/// Builds the stand-in verbs provider and points this process at it (once).
fn stand_in() -> &'static PathBuf {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        // Under the target directory, shared by test processes (the same source is
        // built once) and left for the next run rather than in the temporary directory.
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("stand-in-verbs");
        let library = mooncake_rdma::fake::build(&dir).expect("build the stand-in verbs provider");
        // SAFETY: set before any thread of this process loads the verbs library; every
        // test calls this first and the values never change. Two devices, for striping.
        unsafe {
            std::env::set_var(mooncake_rdma::library::LIBRARY_VARIABLE, &library);
            std::env::set_var("FAKE_VERBS_DEVICES", "2");
        }
        library
    })
}

/// Faults are armed process-wide in the stand-in: scenarios run one at a time.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn memory(name: &str, len: u64) -> Arc<SharedMemory> {
    Arc::new(SharedMemory::create(name, len, PageSize::Normal).expect("shared memory"))
}

fn segment(len: u64) -> Arc<ServedSegment> {
    Arc::new(ServedSegment {
        memory: memory("conformance-segment", len),
        id: AtomicU64::new(SEGMENT),
        contributes: true,
        name: "conformance".into(),
        writes: Default::default(),
        file: None,
    })
}

fn secret() -> Arc<ClusterSecret> {
    Arc::new(ClusterSecret::from_bytes(&SECRET, "conformance"))
}

/// Not a scenario: the peer, when this binary is started by [`Peer::start`]. Serves
/// a segment until killed.
#[test]
fn peer_process() {
    let Ok(kind) = std::env::var("CONFORMANCE_PEER") else {
        return;
    };
    let with_secret = std::env::var("CONFORMANCE_SECRET").is_ok();
    let served = segment(PEER_SEGMENT);
    let rdma = (kind == "rdma").then(|| {
        stand_in();
        RdmaNode::open(&["fake_rdma0".to_string()], &served).expect("rdma node")
    });
    let server = TransferServer::start(
        "127.0.0.1:0".parse().expect("address"),
        served,
        None,
        Congestion::System,
        with_secret.then(secret),
        rdma,
    )
    .expect("transfer server");
    println!("PEER {}", server.address());
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

/// A peer process; killed when dropped.
struct Peer {
    child: Child,
    endpoint: String,
}

impl Peer {
    fn start(kind: Kind, with_secret: bool) -> Peer {
        let mut command = Command::new(std::env::current_exe().expect("this test binary"));
        command
            .args(["--exact", "peer_process", "--nocapture", "--test-threads=1"])
            .env(
                "CONFORMANCE_PEER",
                if kind == Kind::Rdma { "rdma" } else { "tcp" },
            )
            .stdout(Stdio::piped());
        if with_secret {
            command.env("CONFORMANCE_SECRET", "1");
        }
        let mut child = command.spawn().expect("peer process");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let endpoint = loop {
            let line = lines
                .next()
                .expect("the peer said where it serves")
                .expect("line");
            // libtest prints the test's name first, on the same line.
            if let Some(at) = line.find("PEER ") {
                break line[at + 5..].trim().to_string();
            }
        };
        Peer { child, endpoint }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// This side: a transport of `kind` (with its own segment, as a real client has).
struct Local {
    transport: Arc<dyn Transport>,
    segment: Arc<ServedSegment>,
}

fn this_side(kind: Kind, with_secret: bool) -> Local {
    let segment = segment(16 << 20);
    let tcp = Arc::new(TransferClient::new(
        Congestion::System,
        with_secret.then(secret),
    ));
    let transport: Arc<dyn Transport> = match kind {
        Kind::Tcp => tcp,
        Kind::Rdma => {
            stand_in();
            let node = RdmaNode::open(&["fake_rdma0".to_string()], &segment).expect("rdma node");
            Arc::new(RdmaTransport::new(node, tcp))
        }
    };
    Local { transport, segment }
}

fn patterned(slice: &MemSlice, seed: u64) {
    let bytes: Vec<u8> = (0..slice.len() as u64)
        .map(|i| ((i * 31 + seed * 7) % 251) as u8)
        .collect();
    slice.write_from(&bytes);
}

/// Transfers of `slices`, one after another from `at` in the peer's segment.
fn consecutive(slices: &[MemSlice], at: u64) -> Vec<Transfer<'_>> {
    let mut offset = at;
    slices
        .iter()
        .map(|local| {
            let transfer = Transfer {
                segment: SEGMENT,
                offset,
                grant: None,
                local,
            };
            offset += local.len() as u64;
            transfer
        })
        .collect()
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

fn all_ok(results: &[Result<(), ErrorCode>]) -> bool {
    results.iter().all(Result::is_ok)
}

/// Writes `sources` to the peer, reads them back into fresh memory, compares.
fn round_trip(transport: &dyn Transport, endpoint: &str, sources: &[MemSlice], at: u64) {
    let writes = consecutive(sources, at);
    let written = transport.write_many(endpoint, &writes, deadline());
    assert!(all_ok(&written), "{:?}", written);
    let total: u64 = sources.iter().map(|s| s.len() as u64).sum();
    let back = memory("back", total.max(1));
    let mut offset = 0;
    let dests: Vec<MemSlice> = sources
        .iter()
        .map(|s| {
            let slice = back.slice(offset, s.len() as u64).expect("slice");
            offset += s.len() as u64;
            slice
        })
        .collect();
    let reads = consecutive(&dests, at);
    let read = transport.read_many(endpoint, &reads, deadline());
    assert!(all_ok(&read), "{:?}", read);
    for (i, (dest, source)) in dests.iter().zip(sources).enumerate() {
        assert!(
            dest.to_vec() == source.to_vec(),
            "transfer {i} came back different"
        );
    }
}

#[test]
fn batched_scatter_gather_is_byte_exact() {
    let _serial = one_at_a_time();
    for kind in KINDS {
        let peer = Peer::start(kind, false);
        let local = this_side(kind, false);
        for (count, len) in [(200u64, 4096u64), (3, 5 << 20), (17, 65536 + 3)] {
            let source = memory("source", count * len);
            let sources: Vec<MemSlice> = (0..count)
                .map(|i| {
                    let slice = source.slice(i * len, len).expect("slice");
                    patterned(&slice, i + len);
                    slice
                })
                .collect();
            round_trip(local.transport.as_ref(), &peer.endpoint, &sources, 8192);
        }
        // Scattered: every other range of the peer, from ranges of two mappings.
        let a = memory("a", 1 << 20);
        let b = memory("b", 1 << 20);
        let sources: Vec<MemSlice> = (0..16u64)
            .map(|i| {
                let from = if i % 2 == 0 { &a } else { &b };
                let slice = from.slice(i * 4096 + 100, 3000).expect("slice");
                patterned(&slice, i);
                slice
            })
            .collect();
        let writes: Vec<Transfer<'_>> = sources
            .iter()
            .enumerate()
            .map(|(i, local)| Transfer {
                segment: SEGMENT,
                offset: (i as u64) * 2 * 4096 + 17,
                grant: None,
                local,
            })
            .collect();
        let written = local
            .transport
            .write_many(&peer.endpoint, &writes, deadline());
        assert!(all_ok(&written), "{kind:?}: {written:?}");
        let back = memory("back", 16 * 3000);
        let dests: Vec<MemSlice> = (0..16u64)
            .map(|i| back.slice(i * 3000, 3000).expect("slice"))
            .collect();
        let reads: Vec<Transfer<'_>> = dests
            .iter()
            .zip(&writes)
            .map(|(local, write)| Transfer { local, ..*write })
            .collect();
        let read = local
            .transport
            .read_many(&peer.endpoint, &reads, deadline());
        assert!(all_ok(&read), "{kind:?}: {read:?}");
        for (dest, source) in dests.iter().zip(&sources) {
            assert!(
                dest.to_vec() == source.to_vec(),
                "{kind:?}: scattered bytes differ"
            );
        }
    }
}

#[test]
fn every_kind_of_local_memory_moves() {
    let _serial = one_at_a_time();
    for kind in KINDS {
        let peer = Peer::start(kind, false);
        let local = this_side(kind, false);
        // This node's own segment (a replica copied from it).
        let own = local.segment.memory.slice(4096, 65536).expect("slice");
        patterned(&own, 1);
        // A dummy's pool: a memfd mapped a second time, as the real client maps it.
        let pool = memory("pool", 1 << 20);
        let fd = pool.fd().expect("memfd").try_clone_to_owned().expect("dup");
        let mapped = Arc::new(SharedMemory::map_received(fd, 1 << 20).expect("map"));
        let from_pool = mapped.slice(8192, 65536).expect("slice");
        patterned(&from_pool, 2);
        // An application's registered host buffer.
        let mut buffer = vec![0u8; 1 << 20].into_boxed_slice();
        // SAFETY: the buffer outlives the mapping, which is dropped first below.
        let borrowed = Arc::new(
            unsafe { SharedMemory::borrowed(buffer.as_mut_ptr() as u64, 1 << 20) }.expect("borrow"),
        );
        let from_app = borrowed.slice(0, 65536).expect("slice");
        patterned(&from_app, 3);
        // A bounce buffer (device memory reaches a transport only through one).
        let bounce = memory("bounce", 65536);
        let from_bounce = bounce.slice(0, 65536).expect("slice");
        patterned(&from_bounce, 4);
        let sources = [own, from_pool, from_app, from_bounce];
        round_trip(local.transport.as_ref(), &peer.endpoint, &sources, 0);
        drop(sources);
        drop(borrowed);
        drop(buffer);
    }
}

#[test]
fn out_of_range_and_unknown_segments_are_refused_alone() {
    let _serial = one_at_a_time();
    for kind in KINDS {
        let peer = Peer::start(kind, false);
        let local = this_side(kind, false);
        let source = memory("source", 3 * 4096);
        let sources: Vec<MemSlice> = (0..3u64)
            .map(|i| {
                let slice = source.slice(i * 4096, 4096).expect("slice");
                patterned(&slice, i);
                slice
            })
            .collect();
        let transfer = |segment, offset, local| Transfer {
            segment,
            offset,
            grant: None,
            local,
        };
        let writes = [
            transfer(SEGMENT, 0, &sources[0]),
            transfer(SEGMENT + 1, 0, &sources[1]),
            transfer(SEGMENT, PEER_SEGMENT - 100, &sources[1]),
            transfer(SEGMENT, u64::MAX - 10, &sources[1]),
            transfer(SEGMENT, 4096, &sources[2]),
        ];
        let outcomes = local
            .transport
            .write_many(&peer.endpoint, &writes, deadline());
        assert_eq!(
            outcomes,
            vec![
                Ok(()),
                Err(ErrorCode::SEGMENT_NOT_FOUND),
                Err(ErrorCode::INVALID_PARAMS),
                Err(ErrorCode::INVALID_PARAMS),
                Ok(())
            ],
            "{kind:?}"
        );
        // The channel stays usable, and the good writes landed.
        round_trip(local.transport.as_ref(), &peer.endpoint, &sources[..1], 0);
        let back = memory("back", 4096);
        let dest = back.slice(0, 4096).expect("slice");
        let read = local.transport.read_many(
            &peer.endpoint,
            &[transfer(SEGMENT, 4096, &dest)],
            deadline(),
        );
        assert_eq!(read, vec![Ok(())], "{kind:?}");
        assert!(dest.to_vec() == sources[2].to_vec(), "{kind:?}");
    }
}

#[test]
fn a_peer_killed_mid_batch_fails_what_is_left_and_nothing_hangs() {
    let _serial = one_at_a_time();
    for kind in KINDS {
        let mut peer = Peer::start(kind, false);
        let local = this_side(kind, false);
        let len = 1u64 << 20;
        let source = memory("source", 48 * len);
        let sources: Vec<MemSlice> = (0..48u64)
            .map(|i| source.slice(i * len, len).expect("slice"))
            .collect();
        // Warm: the channel is connected.
        round_trip(local.transport.as_ref(), &peer.endpoint, &sources[..1], 0);
        let transport = Arc::clone(&local.transport);
        let endpoint = peer.endpoint.clone();
        let started = Instant::now();
        let batch = std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            for _ in 0..20 {
                let writes = consecutive(&sources, 0);
                outcomes = transport.write_many(
                    &endpoint,
                    &writes,
                    Instant::now() + Duration::from_secs(10),
                );
                if outcomes.iter().any(Result::is_err) {
                    break;
                }
            }
            outcomes
        });
        std::thread::sleep(Duration::from_millis(30));
        peer.kill();
        let outcomes = batch.join().expect("batch");
        assert!(
            started.elapsed() < Duration::from_secs(12),
            "{kind:?}: took {:?}",
            started.elapsed()
        );
        assert_eq!(outcomes.len(), 48);
        assert!(
            outcomes
                .iter()
                .all(|o| matches!(o, Ok(()) | Err(ErrorCode::TRANSFER_FAIL))),
            "{kind:?}: {outcomes:?}"
        );
        // The next batch fails at once: the peer is gone.
        let before = Instant::now();
        let dest = memory("dest", 4096).slice(0, 4096).expect("slice");
        let read = local
            .transport
            .read_many(&peer.endpoint, &consecutive(&[dest], 0), deadline());
        assert_eq!(read, vec![Err(ErrorCode::TRANSFER_FAIL)], "{kind:?}");
        assert!(before.elapsed() < Duration::from_secs(5), "{kind:?}");
    }
}

#[test]
fn with_a_cluster_secret_only_members_reach_the_segment() {
    let _serial = one_at_a_time();
    for kind in KINDS {
        let peer = Peer::start(kind, true);
        let stranger = this_side(kind, false);
        let source = memory("source", 4096);
        let slice = source.slice(0, 4096).expect("slice");
        patterned(&slice, 5);
        let written = stranger.transport.write_many(
            &peer.endpoint,
            &consecutive(std::slice::from_ref(&slice), 0),
            deadline(),
        );
        assert_eq!(written, vec![Err(ErrorCode::TRANSFER_FAIL)], "{kind:?}");
        let member = this_side(kind, true);
        if kind == Kind::Rdma {
            // RDMA moves bytes once the pair is connected: membership is what counts.
            round_trip(
                member.transport.as_ref(),
                &peer.endpoint,
                std::slice::from_ref(&slice),
                0,
            );
        }
    }
}

/// The stand-in's test hooks, from the same library the transport loaded.
fn inject(fault: &str, after: u32) {
    let library = stand_in();
    // SAFETY: the stand-in exports this with the declared signature.
    unsafe {
        let handle = libloading::Library::new(library).expect("stand-in");
        let inject: libloading::Symbol<unsafe extern "C" fn(*const std::ffi::c_char, u32) -> i32> =
            handle
                .get(b"fake_verbs_inject\0")
                .expect("fake_verbs_inject");
        let name = std::ffi::CString::new(fault).expect("name");
        assert_eq!(inject(name.as_ptr(), after), 0, "{fault}");
        std::mem::forget(handle);
    }
}

#[test]
fn rdma_queue_pair_failures_fail_their_items_and_reconnect() {
    let _serial = one_at_a_time();
    let peer = Peer::start(Kind::Rdma, false);
    let local = this_side(Kind::Rdma, false);
    let len = 4096u64;
    let source = memory("source", 32 * len);
    let sources: Vec<MemSlice> = (0..32u64)
        .map(|i| {
            let slice = source.slice(i * len, len).expect("slice");
            patterned(&slice, i);
            slice
        })
        .collect();
    round_trip(local.transport.as_ref(), &peer.endpoint, &sources, 0);
    for fault in ["retry_exceeded", "remote_access", "qp_error", "cq_overrun"] {
        inject(fault, 10);
        let outcomes =
            local
                .transport
                .write_many(&peer.endpoint, &consecutive(&sources, 0), deadline());
        // An overrun completion queue loses the completions it held: nothing in it
        // can be vouched for.
        let vouched = if fault == "cq_overrun" { 0 } else { 10 };
        assert!(
            all_ok(&outcomes[..vouched]),
            "{fault}: the items before it completed: {outcomes:?}"
        );
        assert!(
            outcomes[vouched..]
                .iter()
                .all(|o| *o == Err(ErrorCode::TRANSFER_FAIL)),
            "{fault}: the item and those after it fail: {outcomes:?}"
        );
        // A new queue pair carries the next batch.
        round_trip(local.transport.as_ref(), &peer.endpoint, &sources, 0);
    }
}

#[test]
fn transfers_the_peer_never_completes_end_at_the_deadline() {
    let _serial = one_at_a_time();
    // RDMA: a peer whose NIC stops answering.
    let peer = Peer::start(Kind::Rdma, false);
    let local = this_side(Kind::Rdma, false);
    let slice = memory("source", 4096).slice(0, 4096).expect("slice");
    round_trip(
        local.transport.as_ref(),
        &peer.endpoint,
        std::slice::from_ref(&slice),
        0,
    );
    inject("never_complete", 0);
    let started = Instant::now();
    let outcomes = local.transport.write_many(
        &peer.endpoint,
        &consecutive(std::slice::from_ref(&slice), 0),
        Instant::now() + Duration::from_millis(300),
    );
    assert_eq!(outcomes, vec![Err(ErrorCode::TRANSFER_FAIL)]);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    round_trip(
        local.transport.as_ref(),
        &peer.endpoint,
        std::slice::from_ref(&slice),
        0,
    );
    // TCP: a peer that accepts and never answers.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = silent.local_addr().expect("address").to_string();
    let held = std::thread::spawn(move || silent.accept().map(|(stream, _)| stream));
    let tcp = this_side(Kind::Tcp, false);
    let started = Instant::now();
    let outcomes = tcp.transport.read_many(
        &endpoint,
        &consecutive(std::slice::from_ref(&slice), 0),
        Instant::now() + Duration::from_millis(300),
    );
    assert_eq!(outcomes, vec![Err(ErrorCode::TRANSFER_FAIL)]);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    drop(held.join());
}

#[test]
fn a_large_batch_is_striped_over_every_device() {
    let _serial = one_at_a_time();
    let peer = Peer::start(Kind::Rdma, false);
    stand_in();
    let segment = segment(16 << 20);
    let devices = ["fake_rdma0".to_string(), "fake_rdma1".to_string()];
    let node = RdmaNode::open(&devices, &segment).expect("two devices");
    let tcp = Arc::new(TransferClient::new(Congestion::System, None));
    let transport = RdmaTransport::new(node, tcp);
    let len = 3u64 << 20;
    let source = memory("source", 4 * len);
    let sources: Vec<MemSlice> = (0..4u64)
        .map(|i| {
            let slice = source.slice(i * len, len).expect("slice");
            patterned(&slice, i + 40);
            slice
        })
        .collect();
    round_trip(&transport, &peer.endpoint, &sources, 0);
    assert_eq!(
        transport.pooled_channels(),
        2,
        "a channel per device carried the batch"
    );
    // Small batches take one device at a time, in turns.
    round_trip(&transport, &peer.endpoint, &sources[..1], 0);
    assert_eq!(transport.pooled_channels(), 2);
}
