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
    dummy
        .put_from("after_hostile", block, 4096, &ReplicateConfig::default())
        .expect("the real client keeps serving");
}
