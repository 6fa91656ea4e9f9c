//! Hostile peers: bytes no well-behaved dummy sends must not crash a process, nor leave
//! behind what a session holds.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use mooncake_core::protocol::PROTOCOL_VERSION;
use mooncake_core::protocol::address::SocketAddress;
use mooncake_core::protocol::handshake::{
    DummyFrame, Purpose, RealFrame, SegmentKind, SegmentRegistration, decode_len, decode_payload,
    encode_frame,
};
use mooncake_dummy_client::{DummyClient, ReplicateConfig};
use mooncake_integration_tests::{RealClientProcess, eventually, memfd_mappings};
use mooncake_shm::SharedMemory;
use mooncake_shm::fd_passing::{recv_exact_with_fds, send_with_fd};
use mooncake_shm::shared_memory::PageSize;

fn send(stream: &UnixStream, frame: &DummyFrame, memory: Option<&SharedMemory>) {
    let bytes = encode_frame(frame).expect("encode");
    send_with_fd(stream, &bytes, memory.and_then(SharedMemory::fd)).expect("send");
}

fn receive(stream: &UnixStream) -> RealFrame {
    let mut prefix = [0u8; 4];
    recv_exact_with_fds(stream, &mut prefix).expect("prefix");
    let mut payload = vec![0u8; decode_len(prefix).expect("length")];
    recv_exact_with_fds(stream, &mut payload).expect("payload");
    decode_payload(&payload).expect("frame")
}

/// Opens a session by hand with `memory` registered as its pool; returns the stream,
/// now carrying RPC.
fn open_session(address: &str, memory: &SharedMemory) -> UnixStream {
    let socket = SocketAddress::parse(address).expect("address");
    let stream = UnixStream::connect_addr(&socket.to_std().expect("socket")).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let hello = DummyFrame::Hello {
        version: PROTOCOL_VERSION,
        client_id: 0x5eed,
        pid: std::process::id(),
        name: "hostile".into(),
        purpose: Purpose::Session,
    };
    send(&stream, &hello, None);
    assert!(matches!(receive(&stream), RealFrame::Welcome { .. }));
    let registration = SegmentRegistration {
        dummy_base: memory.base(),
        len: memory.len() as u64,
        kind: SegmentKind::Pool,
    };
    send(&stream, &DummyFrame::Register(registration), Some(memory));
    assert_eq!(receive(&stream), RealFrame::Registered);
    send(&stream, &DummyFrame::Ready, None);
    assert_eq!(receive(&stream), RealFrame::Attached);
    stream
}

#[test]
fn a_request_with_a_huge_deadline_neither_kills_the_session_task_nor_leaks_its_memory() {
    let real = RealClientProcess::start("64MB", &[]);
    let memory = SharedMemory::create("hostile_pool", 4 << 20, PageSize::Normal).expect("shm");
    let mut stream = open_session(&real.address(), &memory);
    assert_eq!(memfd_mappings(real.pid(), "hostile_pool"), 1);

    // A tarpc request whose deadline is u64::MAX seconds ahead: variant 0 (Request),
    // the deadline's seconds and nanoseconds, an empty trace context, request id 1, and
    // a first byte of a message. tarpc adds the deadline to `Instant::now()`.
    let mut frame = vec![0u8];
    frame.extend_from_slice(&[0xff; 9]);
    frame.extend_from_slice(&[0x01, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00]);
    let mut message = u32::try_from(frame.len())
        .expect("short")
        .to_be_bytes()
        .to_vec();
    message.extend_from_slice(&frame);
    stream.write_all(&message).expect("send the request");
    drop(stream);

    assert!(
        eventually(Duration::from_secs(5), || memfd_mappings(
            real.pid(),
            "hostile_pool"
        ) == 0),
        "the session's memory is still mapped in mooncake_client after its connection closed"
    );
    let dummy = DummyClient::setup_dummy(1 << 20, 1 << 20, Some(&real.address()))
        .expect("a new dummy attaches");
    let status = dummy.status().expect("status");
    assert!(
        status.dummies.iter().all(|d| d.name != "hostile"),
        "the hostile session is still listed: {:?}",
        status.dummies
    );
    let block = dummy.alloc_from_mem_pool(4096);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { dummy.put_from("after_hostile", block, 4096, &ReplicateConfig::default()) }
        .expect("the real client keeps serving");
}

/// Environment of [`helper_holds_connections`]: `ADDRESS,COUNT`.
const HOLD_ENV: &str = "MOONCAKE_TEST_HOLD";

/// Not a test on its own: run by [`connections_of_another_uid_take_no_thread_and_do_not_delay_dummies`]
/// as another user, it opens connections to the real client and holds them silently.
#[test]
fn helper_holds_connections() {
    let Ok(spec) = std::env::var(HOLD_ENV) else {
        return;
    };
    let (address, count) = spec.rsplit_once(',').expect("ADDRESS,COUNT");
    let socket = SocketAddress::parse(address).expect("address");
    let target = socket.to_std().expect("socket");
    let held: Vec<UnixStream> = (0..count.parse::<usize>().expect("count"))
        .filter_map(|_| UnixStream::connect_addr(&target).ok())
        .collect();
    // The test harness prints its own words on the same line first.
    println!("held {}", held.len());
    std::io::stdout().flush().expect("flush");
    std::thread::sleep(Duration::from_secs(30));
}

fn can_run_as_another_user() -> bool {
    let root = nix::unistd::geteuid().is_root();
    let setpriv = std::path::Path::new("/usr/bin/setpriv").exists();
    if !(root && setpriv) {
        eprintln!("skipping: running a peer as another user needs root and setpriv");
    }
    root && setpriv
}

#[test]
fn connections_of_another_uid_take_no_thread_and_do_not_delay_dummies() {
    use std::io::BufRead;
    if !can_run_as_another_user() {
        return;
    }
    let real = RealClientProcess::start("64MB", &[]);
    let me = std::env::current_exe().expect("test binary");
    let mut holder = std::process::Command::new("/usr/bin/setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--pdeathsig",
            "KILL",
        ])
        .arg(&me)
        .args([
            "--exact",
            "helper_holds_connections",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HOLD_ENV, format!("{},700", real.address()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the holder");
    let stdout = holder.stdout.take().expect("stdout");
    let held = std::io::BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find_map(|line| line.split_once("held ").map(|(_, n)| n.trim().to_string()))
        .expect("the holder reports");
    assert_eq!(held, "700", "connections held");

    // 700 silent connections of a disallowed uid are each refused within about a
    // second, on no thread of their own: a dummy attaching now is not kept waiting
    // (before, each held a blocking thread for 10 s, and 512 of them starved the rest).
    let started = std::time::Instant::now();
    let client = DummyClient::setup_dummy(4 << 20, 1 << 20, Some(&real.address())).expect("attach");
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(3), "attaching took {waited:?}");
    assert_eq!(
        client.put("after-the-flood", b"value", &ReplicateConfig::default()),
        Ok(())
    );
    let _ = holder.kill();
    let _ = holder.wait();
}

#[test]
fn a_handshake_that_trickles_is_closed_at_its_deadline() {
    let real = RealClientProcess::start("64MB", &[]);
    let socket = SocketAddress::parse(&real.address()).expect("address");
    let mut stream = UnixStream::connect_addr(&socket.to_std().expect("socket")).expect("connect");
    let hello = encode_frame(&DummyFrame::Hello {
        version: PROTOCOL_VERSION,
        client_id: 0x7e1e,
        pid: std::process::id(),
        name: "slow".into(),
        purpose: Purpose::Session,
    })
    .expect("encode");
    // One byte of the hello every 800 ms: each read finishes well within its own
    // timeout, so only a deadline on the whole handshake ends it.
    let started = std::time::Instant::now();
    let mut closed_after = None;
    for byte in hello.iter().cycle().take(25) {
        if stream.write_all(&[*byte]).is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(800));
    }
    let closed_after =
        closed_after.expect("the real client must close a handshake that never ends");
    assert!(
        closed_after < Duration::from_secs(13),
        "closed after {closed_after:?}"
    );
    // Others are not affected.
    let client = DummyClient::setup_dummy(4 << 20, 1 << 20, Some(&real.address())).expect("attach");
    assert_eq!(
        client.put("after-the-trickle", b"value", &ReplicateConfig::default()),
        Ok(())
    );
}

#[test]
fn puts_cancelled_by_their_deadline_leave_no_write_holding_space() {
    use mooncake_core::protocol::codec;
    use mooncake_core::protocol::rpc::{
        MemRange, PutItem, PutSource, RealClientRpcClient, WriteMode,
    };
    use mooncake_core::protocol::unix_stream::RpcUnixStream;
    use mooncake_integration_tests::MasterProcess;

    let master = MasterProcess::start(&[]);
    let node = RealClientProcess::join(&master, "1GB", &[]);
    let memory = SharedMemory::create("cancel_pool", 8 << 20, PageSize::Normal).expect("shm");
    let stream = open_session(&node.address(), &memory);
    stream.set_read_timeout(None).expect("blocking reads");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let in_progress = runtime.block_on(async move {
        let transport = codec::transport(RpcUnixStream::new(stream).expect("rpc stream"));
        let client = RealClientRpcClient::new(tarpc::client::Config::default(), transport).spawn();
        // 8 MiB puts (run in tasks of their own) with deadlines from 0.2 to 6 ms: many
        // end while the copy runs, so that the request is cancelled at `put_end`.
        for i in 0..100u64 {
            let mut ctx = tarpc::context::current();
            ctx.deadline = std::time::Instant::now() + Duration::from_micros(200 + (i % 30) * 200);
            let item = PutItem {
                key: format!("cancelled-{i}"),
                source: PutSource::Shared(vec![MemRange {
                    addr: memory.base(),
                    len: 8 << 20,
                }]),
            };
            let _ = client
                .put(
                    ctx,
                    vec![item].into(),
                    ReplicateConfig::default(),
                    WriteMode::Put,
                )
                .await;
        }
        // Every write the master started is ended or revoked within moments, not held
        // until its release timeout (600 s).
        let mut in_progress = u64::MAX;
        for _ in 0..100 {
            let status = client
                .status(tarpc::context::current())
                .await
                .expect("status");
            in_progress = status.master.writes_in_progress;
            if in_progress == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        in_progress
    });
    assert_eq!(in_progress, 0, "writes left in progress");
}

/// Sends `keys` in one `exist` request on a session opened by hand; the answer.
fn raw_exist(stream: UnixStream, keys: Vec<String>) -> Result<usize, tarpc::client::RpcError> {
    use mooncake_core::protocol::codec;
    use mooncake_core::protocol::rpc::RealClientRpcClient;
    use mooncake_core::protocol::unix_stream::RpcUnixStream;

    stream.set_read_timeout(None).expect("blocking reads");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let transport = codec::transport(RpcUnixStream::new(stream).expect("rpc stream"));
        let client = RealClientRpcClient::new(tarpc::client::Config::default(), transport).spawn();
        client
            .exist(tarpc::context::current(), keys.into())
            .await
            .map(|answers| answers.len())
    })
}

#[test]
fn requests_over_the_element_budget_or_the_frame_limit_close_only_their_connection() {
    let real = RealClientProcess::start("256MB", &[]);

    // 300 000 one-byte keys in one request: refused before they are decoded.
    let memory = SharedMemory::create("budget_pool", 1 << 20, PageSize::Normal).expect("shm");
    let stream = open_session(&real.address(), &memory);
    let keys: Vec<String> = (0..300_000u32)
        .map(|i| char::from(b'a' + (i % 26) as u8).to_string())
        .collect();
    assert!(
        raw_exist(stream, keys).is_err(),
        "a request of 300 000 keys was answered"
    );
    assert!(
        eventually(Duration::from_secs(5), || memfd_mappings(
            real.pid(),
            "budget_pool"
        ) == 0),
        "the refused session's memory is still mapped"
    );
    // Within the budget the same request is answered.
    let memory = SharedMemory::create("small_pool", 1 << 20, PageSize::Normal).expect("shm");
    let stream = open_session(&real.address(), &memory);
    let keys: Vec<String> = (0..1000).map(|i| format!("k{i}")).collect();
    assert_eq!(raw_exist(stream, keys).expect("answered"), 1000);

    // A frame announcing 1 GiB: the connection is closed, nothing is allocated for it.
    let memory = SharedMemory::create("frame_pool", 1 << 20, PageSize::Normal).expect("shm");
    let mut stream = open_session(&real.address(), &memory);
    stream
        .write_all(&(1u32 << 30).to_be_bytes())
        .expect("prefix");
    let _ = stream.write_all(&[0u8; 4096]);
    assert!(
        eventually(Duration::from_secs(5), || memfd_mappings(
            real.pid(),
            "frame_pool"
        ) == 0),
        "the session that sent an oversized frame is still attached"
    );

    // A dummy's own batch larger than the budget is split, and a value larger than its
    // staging buffer and the frame limit goes through its pool.
    let dummy = DummyClient::setup_dummy(4 << 20, 1 << 20, Some(&real.address())).expect("dummy");
    let keys: Vec<String> = (0..300_000).map(|i| format!("key-{i}")).collect();
    let answers = dummy.batch_is_exist(&keys);
    assert_eq!(answers.len(), keys.len());
    assert!(answers.iter().all(|answer| *answer == Ok(false)));
    let value: Vec<u8> = (0..100u32 << 20).map(|i| (i % 253) as u8).collect();
    let config = ReplicateConfig::default();
    dummy.put("large", &value, &config).expect("a 100 MiB put");
    assert!(dummy.get("large").expect("a 100 MiB get") == value);
}

#[test]
fn dummies_and_their_shared_memory_are_capped_per_process() {
    let real = RealClientProcess::start(
        "64MB",
        &["--max_dummy_sessions=2", "--max_total_dummy_shm_size=20MB"],
    );
    let address = real.address();
    let first = DummyClient::setup_dummy(8 << 20, 1 << 20, Some(&address)).expect("first");
    let second = DummyClient::setup_dummy(8 << 20, 1 << 20, Some(&address)).expect("second");
    let third = DummyClient::setup_dummy(1 << 20, 1 << 20, Some(&address))
        .expect_err("a third dummy past --max_dummy_sessions=2");
    assert!(
        third.to_string().contains("too many dummies attached"),
        "{third}"
    );
    second.close();
    assert!(
        eventually(Duration::from_secs(5), || first
            .status()
            .is_ok_and(|s| s.dummies.len() == 1)),
        "the closed dummy is still listed"
    );
    // 9 MiB mapped for the first; 13 more would pass 20 MB for all together.
    let greedy = DummyClient::setup_dummy(12 << 20, 1 << 20, Some(&address))
        .expect_err("past --max_total_dummy_shm_size");
    assert!(
        greedy.to_string().contains("--max_total_dummy_shm_size"),
        "{greedy}"
    );
    let modest = DummyClient::setup_dummy(1 << 20, 1 << 20, Some(&address)).expect("fits");
    let block = modest.alloc_from_mem_pool(4096);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { modest.put_from("capped", block, 4096, &ReplicateConfig::default()) }
        .expect("the admitted dummy works");
    let value = first.get("capped").expect("and the first sees it");
    assert_eq!(value.len(), 4096);
}

#[test]
fn staging_of_a_call_lost_in_transport_is_not_reused() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;

    let real = RealClientProcess::start("64MB", &[]);
    let dummy = DummyClient::setup_dummy(1 << 20, 16 << 20, Some(&real.address())).expect("dummy");
    dummy
        .put("warm", b"up", &ReplicateConfig::default())
        .expect("a first put");
    assert_eq!(dummy.withheld_staging_bytes(), 0);

    // The real client stops while a put's bytes sit in staging, and dies before it
    // answers: it might have been reading them still.
    let pid = Pid::from_raw(i32::try_from(real.pid()).expect("pid"));
    kill(pid, Signal::SIGSTOP).expect("stop");
    let writer = {
        let dummy = dummy.clone();
        std::thread::spawn(move || {
            dummy.put("lost", &vec![7u8; 8 << 20], &ReplicateConfig::default())
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    kill(pid, Signal::SIGKILL).expect("kill");
    let outcome = writer.join().expect("writer");
    assert!(
        outcome.is_err(),
        "the put was acknowledged by a dead process"
    );
    assert_eq!(
        dummy.withheld_staging_bytes(),
        8 << 20,
        "the lost call's staging block went back into use"
    );
}
