//! End-to-end tests of the single-node path: real `mooncake_client` processes, dummies in
//! this process and in child processes, zero-copy through shared memory.

use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ErrorCode, Health, ReplicateConfig};
use mooncake_integration_tests::{
    DummyProcess, RealClientProcess, binary, cli, eventually, memfd_mappings,
};

fn setup(real: &RealClientProcess, pool: u64) -> DummyClient {
    DummyClient::setup_dummy(pool, 8 << 20, Some(&real.address())).expect("setup_dummy")
}

/// Fills `len` bytes at `ptr` (a pool block) with a pattern derived from `seed`.
fn fill(ptr: u64, len: usize, seed: u8) {
    // SAFETY: `ptr` is a live block of at least `len` bytes from alloc_from_mem_pool,
    // used by this test only.
    let block = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
    for (i, byte) in block.iter_mut().enumerate() {
        *byte = i.to_le_bytes()[0].wrapping_mul(31).wrapping_add(seed);
    }
}

/// Copies `len` bytes at `ptr` (a pool block) out.
fn read(ptr: u64, len: usize) -> Vec<u8> {
    // SAFETY: as in `fill`.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }.to_vec()
}

fn config() -> ReplicateConfig {
    ReplicateConfig::default()
}

#[test]
fn two_dummy_processes_see_each_others_objects() {
    let real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 4 << 20);
    dummy
        .put("from_test", b"written by the test process", &config())
        .expect("put");

    let out = cli(&real.address(), &["get", "from_test"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(out.stdout, b"written by the test process");

    let out = cli(
        &real.address(),
        &["put", "from_cli", "written by mooncake_cli"],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        dummy.get("from_cli").expect("get"),
        b"written by mooncake_cli"
    );
    assert_eq!(dummy.get_size("from_cli"), Ok(23));
}

#[test]
fn put_from_and_get_into_round_trip_through_the_pool() {
    let real = RealClientProcess::start("256MB", &[]);
    let dummy = setup(&real, 160 << 20);
    for (index, size) in [4usize << 10, 1 << 20, 64 << 20].into_iter().enumerate() {
        let key = format!("object-{size}");
        let source = dummy.alloc_from_mem_pool(size as u64);
        assert_ne!(source, 0, "pool allocation of {size}");
        fill(source, size, index.to_le_bytes()[0] + 1);
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.put_from(&key, source, size as u64, &config()) }.expect("put_from");

        let dest = dummy.alloc_from_mem_pool(size as u64);
        assert_ne!(dest, 0);
        fill(dest, size, 0);
        assert_eq!(
            // SAFETY: the ranges are this client's pool memory or buffers registered with it,
            // alive for the call and touched by nothing else meanwhile (or deliberately
            // outside them, which the client refuses without touching).
            unsafe { dummy.get_into(&key, dest, size as u64) },
            Ok(size as u64)
        );
        assert!(
            read(source, size) == read(dest, size),
            "{size}-byte value differs"
        );
        dummy.free_to_mem_pool(source).expect("free");
        dummy.free_to_mem_pool(dest).expect("free");
    }
    assert_eq!(
        dummy.free_to_mem_pool(12345),
        Err(ErrorCode::INVALID_PARAMS)
    );
}

#[test]
fn the_safe_slice_forms_move_pool_slices_and_refuse_other_memory() {
    let real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 8 << 20);
    let len = 64usize << 10;
    let (a, b) = (
        dummy.alloc_from_mem_pool(len as u64),
        dummy.alloc_from_mem_pool(len as u64),
    );
    assert!(a != 0 && b != 0, "pool blocks");
    // SAFETY: two distinct live pool blocks of `len` bytes that only this test uses.
    let (source, dest) = unsafe {
        (
            std::slice::from_raw_parts_mut(a as *mut u8, len),
            std::slice::from_raw_parts_mut(b as *mut u8, len),
        )
    };
    source
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = i.to_le_bytes()[0]);
    dummy
        .put_from_slice("slice", source, &config())
        .expect("put_from_slice");
    assert_eq!(dummy.get_into_slice("slice", dest), Ok(len as u64));
    assert!(dest == source, "the slice read back differs");

    let mut batch = [&mut dest[..len / 2], &mut source[..len / 2]];
    assert_eq!(
        dummy.batch_get_into_slices(&["slice", "missing"], &mut batch),
        vec![
            Err(ErrorCode::INVALID_PARAMS),
            Err(ErrorCode::OBJECT_NOT_FOUND)
        ],
        "half a block is too small for the object; a missing key is named"
    );
    // Heap memory neither in the pool nor registered is refused, never touched.
    let mut heap = vec![7u8; len];
    assert_eq!(
        dummy.get_into_slice("slice", &mut heap),
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert!(heap.iter().all(|&x| x == 7));
    assert_eq!(
        dummy.batch_put_from_slices(&["heap"], &[&heap], &config()),
        vec![Err(ErrorCode::INVALID_PARAMS)]
    );
    dummy.free_to_mem_pool(a).expect("free");
    dummy.free_to_mem_pool(b).expect("free");
}

#[test]
fn batch_get_into_reports_per_key_results() {
    let real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 8 << 20);
    let src = dummy.alloc_from_mem_pool(8192);
    fill(src, 8192, 7);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let stored =
        unsafe { dummy.batch_put_from(&["a", "b"], &[src, src + 4096], &[4096, 4096], &config()) };
    assert_eq!(stored, vec![Ok(()), Ok(())]);

    let dest = dummy.alloc_from_mem_pool(3 * 4096);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let results = unsafe {
        dummy.batch_get_into(
            &["a", "missing", "b"],
            &[dest, dest + 4096, dest + 8192],
            &[4096, 4096, 100],
        )
    };
    assert_eq!(
        results,
        vec![
            Ok(4096),
            Err(ErrorCode::OBJECT_NOT_FOUND),
            Err(ErrorCode::INVALID_PARAMS)
        ]
    );
    assert_eq!(ErrorCode::OBJECT_NOT_FOUND.as_i32(), -704);
    assert_eq!(read(dest, 4096), read(src, 4096));

    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let mismatch =
        unsafe { dummy.batch_get_into(&["a", "b", "c"], &[dest, dest], &[4096, 4096, 4096]) };
    assert_eq!(mismatch, vec![Err(ErrorCode::INVALID_PARAMS); 3]);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let mismatch = unsafe { dummy.batch_put_from(&["x", "y"], &[src, src], &[64], &config()) };
    assert_eq!(mismatch, vec![Err(ErrorCode::INVALID_PARAMS); 2]);
    let empty: Vec<&str> = Vec::new();
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    assert!(unsafe { dummy.batch_get_into(&empty, &[], &[]) }.is_empty());
    assert!(dummy.batch_is_exist(&empty).is_empty());
    assert_eq!(
        dummy.batch_is_exist(&["a", "zzz"]),
        vec![Ok(true), Ok(false)]
    );
}

#[test]
fn put_never_overwrites_and_leases_block_remove() {
    let real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 4 << 20);
    dummy.put("k", b"first", &config()).expect("put");
    assert_eq!(dummy.put("k", b"second value", &config()), Ok(()));
    assert_eq!(dummy.get("k").expect("get"), b"first");

    assert_eq!(dummy.remove("k", false), Err(ErrorCode::OBJECT_HAS_LEASE));
    assert_eq!(ErrorCode::OBJECT_HAS_LEASE.as_i32(), -706);
    assert_eq!(dummy.remove("k", true), Ok(()));
    assert_eq!(dummy.is_exist("k"), Ok(false));
    assert_eq!(dummy.get("k"), Err(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(dummy.remove("k", true), Err(ErrorCode::OBJECT_NOT_FOUND));

    dummy.put("x", b"1", &config()).expect("put");
    dummy.put("y", b"2", &config()).expect("put");
    assert_eq!(
        dummy.batch_remove(&["x", "nope"], false),
        vec![Ok(()), Err(ErrorCode::OBJECT_NOT_FOUND)]
    );
    assert_eq!(dummy.remove_all(false), Ok(1));
    assert_eq!(dummy.status().expect("status").master.objects, 0);
}

#[test]
fn bad_ranges_are_rejected_and_the_real_client_keeps_serving() {
    let real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 1 << 20);
    let heap = vec![1u8; 4096];
    let outside = heap.as_ptr() as u64;
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.put_from("heap", outside, 4096, &config()) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.get_into("heap", outside, 4096) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    dummy.put("present", b"value", &config()).expect("put");
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.get_into("present", outside, 4096) },
        Err(ErrorCode::INVALID_PARAMS)
    );

    let block = dummy.alloc_from_mem_pool(1 << 20);
    assert_ne!(block, 0);
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.put_from("past_end", block + 4096, 1 << 20, &config()) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.put_from("null", 0, 16, &config()) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.put_from("wrap", u64::MAX - 8, 16, &config()) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { dummy.get_into("present", block + (1 << 20) - 2, 5) },
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        dummy.is_exist("past_end"),
        Ok(false),
        "nothing half-written is visible"
    );
    assert_eq!(dummy.health_check(), Health::Ok);
    assert_eq!(dummy.get("present").expect("still serving"), b"value");
}

#[test]
fn killed_dummy_is_released_at_once() {
    let real = RealClientProcess::start("64MB", &[]);
    let observer = setup(&real, 1 << 20);
    let before = memfd_mappings(real.pid(), "mooncake_pool");
    let mut holder = DummyProcess::start(&real.address(), 32 << 20);
    let status = observer.status().expect("status");
    let entry = status
        .dummies
        .iter()
        .find(|d| d.pid == holder.pid())
        .expect("holder attached");
    assert!(entry.mapped_bytes >= 32 << 20);
    assert_eq!(memfd_mappings(real.pid(), "mooncake_pool"), before + 1);

    holder.kill9();
    let gone = eventually(Duration::from_secs(1), || {
        observer
            .status()
            .is_ok_and(|s| s.dummies.iter().all(|d| d.pid != holder.pid()))
    });
    assert!(gone, "status still lists the killed dummy after 1 s");
    assert!(
        eventually(Duration::from_secs(1), || memfd_mappings(
            real.pid(),
            "mooncake_pool"
        ) == before),
        "the killed dummy's pool is still mapped in mooncake_client"
    );
    assert_eq!(observer.status().expect("status").dummies.len(), 1);
    assert!(
        observer
            .is_exist(&format!("dummy_holder_object/{}", holder.pid()))
            .expect("exist"),
        "its acknowledged object stays"
    );
}

#[test]
fn dummy_survives_a_real_client_restart() {
    let mut real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 4 << 20);
    let block = dummy.alloc_from_mem_pool(4096);
    fill(block, 4096, 3);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { dummy.put_from("before", block, 4096, &config()) }.expect("put_from");
    let first_instance = dummy.instance_id();

    real.kill9();
    for _ in 0..5 {
        let started = Instant::now();
        assert_eq!(dummy.is_exist("before"), Err(ErrorCode::RPC_FAIL));
        assert_eq!(
            // SAFETY: the ranges are this client's pool memory or buffers registered with it,
            // alive for the call and touched by nothing else meanwhile (or deliberately
            // outside them, which the client refuses without touching).
            unsafe { dummy.put_from("during", block, 4096, &config()) },
            Err(ErrorCode::RPC_FAIL)
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "calls must not hang while the real client is down"
        );
    }
    assert_eq!(dummy.health_check(), Health::Unreachable);

    real.restart();
    assert!(
        eventually(Duration::from_secs(5), || dummy.is_exist("x").is_ok()),
        "the dummy did not reconnect"
    );
    assert_ne!(
        dummy.instance_id(),
        first_instance,
        "a new instance was noticed"
    );
    assert_eq!(
        dummy.is_exist("before"),
        Ok(false),
        "memory objects died with the old instance"
    );
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { dummy.put_from("after", block, 4096, &config()) }.expect("pool registered again");
    let dest = dummy.alloc_from_mem_pool(4096);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    assert_eq!(unsafe { dummy.get_into("after", dest, 4096) }, Ok(4096));
    assert_eq!(read(dest, 4096), read(block, 4096));
    assert_eq!(dummy.health_check(), Health::Ok);
}

#[test]
fn pool_grows_with_a_registered_segment() {
    let real = RealClientProcess::start("256MB", &[]);
    let dummy = setup(&real, 1 << 20);
    let small = dummy.alloc_from_mem_pool(1 << 20);
    assert_ne!(small, 0);
    let big = dummy.alloc_from_mem_pool(96 << 20);
    assert_ne!(big, 0, "pool must grow");
    fill(big, 96 << 20, 9);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { dummy.put_from("grown", big, 96 << 20, &config()) }
        .expect("new segment is registered");
    let status = dummy.status().expect("status");
    assert_eq!(
        status.dummies[0].segments, 3,
        "pool, staging and the grown segment"
    );
}

#[test]
fn calls_after_close_fail_without_crashing() {
    let real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 1 << 20);
    dummy.close();
    assert_eq!(dummy.health_check(), Health::NotInitialized);
    assert!(dummy.put("k", b"v", &config()).is_err());
    assert!(dummy.is_exist("k").is_err());
    assert_eq!(dummy.alloc_from_mem_pool(64), 0);
    dummy.close();
}

fn run_as_nobody(args: &[&str]) -> Option<std::process::Output> {
    let is_root = nix::unistd::geteuid().is_root();
    let setpriv = std::path::Path::new("/usr/bin/setpriv");
    if !is_root || !setpriv.exists() {
        eprintln!("skipping the uid check: needs root and setpriv");
        return None;
    }
    let mut command = std::process::Command::new(setpriv);
    command
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(binary("mooncake_cli"))
        .args(args);
    Some(command.output().expect("run setpriv"))
}

#[test]
fn disallowed_uid_is_refused_with_a_clear_error() {
    let real = RealClientProcess::start("64MB", &[]);
    let address = real.address();
    let Some(out) = run_as_nobody(&["--client", &address, "exists", "k"]) else {
        return;
    };
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("uid 65534 is not allowed"), "{stderr}");
    assert!(stderr.contains("--allowed_uids"), "{stderr}");

    let allowed = RealClientProcess::start("64MB", &["--allowed_uids=65534"]);
    let address = allowed.address();
    let out = run_as_nobody(&["--client", &address, "put", "k", "v"]).expect("checked above");
    assert!(out.status.success(), "{out:?}");
}

fn start_expecting_failure(args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(binary("mooncake_client"))
        .args(args)
        .output()
        .expect("run mooncake_client");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_configuration_exits_2_with_one_line() {
    let port = mooncake_integration_tests::unique_port().to_string();
    for (args, needle) in [
        (vec!["--global_segment_size=lots"], "global_segment_size"),
        (vec!["--global_segment_size=0"], "global_segment_size"),
        (vec!["--no_such_flag=1"], "unknown flag"),
        (vec!["--default_kv_lease_ttl=soon"], "default_kv_lease_ttl"),
    ] {
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        args.push(format!("--port={port}"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = start_expecting_failure(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let real = RealClientProcess::start("64MB", &[]);
    let port = format!("--port={}", real.port);
    let (code, stderr) = start_expecting_failure(&[&port, "--global_segment_size=64MB"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("already in use"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

#[test]
fn sigterm_shuts_down_cleanly_and_frees_the_socket() {
    let mut real = RealClientProcess::start("64MB", &[]);
    let dummy = setup(&real, 1 << 20);
    dummy.put("k", b"v", &config()).expect("put");
    let status = real.terminate();
    assert!(status.success(), "{status:?}");
    assert_eq!(dummy.is_exist("k"), Err(ErrorCode::RPC_FAIL));
    real.restart();
    assert!(eventually(Duration::from_secs(5), || dummy.health_check()
        == Health::Ok));
}

#[test]
fn cli_exit_codes() {
    let real = RealClientProcess::start("64MB", &[]);
    let address = real.address();
    assert_eq!(cli(&address, &["exists", "nope"]).status.code(), Some(1));
    assert_eq!(cli(&address, &["get", "nope"]).status.code(), Some(1));
    assert_eq!(cli(&address, &["size", "nope"]).status.code(), Some(1));
    assert_eq!(cli(&address, &["bogus"]).status.code(), Some(2));
    let out = cli(&address, &["status"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("dummies"));
    let unreachable = cli("@mooncake_no_such_socket", &["exists", "k"]);
    assert_eq!(unreachable.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&unreachable.stderr);
    assert!(stderr.contains("is mooncake_client running"), "{stderr}");
}
