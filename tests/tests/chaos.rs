//! Chaos under high availability, checked by the history checker
//! (`mooncake_integration_tests::history`), bounded in time (`MOONCAKE_CHAOS_SECS`,
//! default 60, the short form `.ci/run` runs; run it for 600 by hand;
//! `MOONCAKE_CHAOS_DUMP=<file>` writes the whole recording there when the checker
//! finds a broken promise): a real etcd,
//! three masters, three nodes keeping their segments in files (`--segment_path`), and
//! six dummies (two per node) doing put, upsert, get, remove, batch put and batch get
//! on a small key space with one or two replicas, while a scheduler injects faults:
//! `kill -9` and restart of the leader master, a standby and a node (its two dummies'
//! calls fail meanwhile), a dummy process killed in the middle of its calls, and, in a
//! build with failpoints, a node whose transfer answers are cut mid-frame, whose SSD
//! tier's disk fails, or a master whose answers are lost after the change (each for a
//! while); every 20 s a filler writes as many bytes as the cluster's memory holds, which
//! forces eviction. Every call and its outcome is recorded, and so is every object the
//! store evicted (from the processes' eviction records, `mooncake::eviction`); at the
//! end each key is read once more and the checker must find no broken promise: nothing
//! acknowledged lost that no remove or eviction explains, no torn or foreign bytes, no
//! stale read after an acknowledged upsert or remove. Nothing the test started is left
//! running.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mooncake_core::logging::monotonic_us;
use mooncake_dummy_client::{CodeResult, DummyClient, ErrorCode, ReplicateConfig};
use mooncake_integration_tests::etcd::EtcdServer;
use mooncake_integration_tests::eviction_log;
use mooncake_integration_tests::failpoints::FailpointFile;
use mooncake_integration_tests::history::{Event, Op, Outcome, Read, ValueId, Violation, check};
use mooncake_integration_tests::offload::TempDir;
use mooncake_integration_tests::{
    DummyProcess, MasterProcess, RealClientProcess, eventually, unique_port,
};

/// Keys every dummy works on (a small space: their calls meet).
const KEYS: usize = 16;
/// Dummies calling, two per node.
const CALLERS: usize = 6;
/// Each node's memory segment.
const SEGMENT_BYTES: u64 = 128 << 20;
/// How often the filler forces eviction.
const FILL_EVERY: Duration = Duration::from_secs(20);
/// Size of the filler's objects.
const FILL_OBJECT_BYTES: usize = 4 << 20;

/// A small deterministic generator (the seed is printed, so a failure replays).
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap_or(0)
    }
}

fn key(index: usize) -> String {
    format!("chaos/k{index}")
}

/// The bytes of value `id` of `key`: its id and length, then a pattern of both.
fn value_of(key: &str, id: ValueId, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(0xcbf2_9ce4_8422_2325u64 ^ id, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    let mut bytes: Vec<u8> = (0..len as u64)
        .map(|i| seed.wrapping_add(i.wrapping_mul(0x9e37_79b9)).to_le_bytes()[3])
        .collect();
    bytes[..8].copy_from_slice(&id.to_le_bytes());
    bytes[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    bytes
}

/// Which value `bytes` are, or torn when they are no value of `key` written whole.
fn read_of(key: &str, bytes: &[u8]) -> Read {
    let number = |at: usize| {
        bytes
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    match (number(0), number(8)) {
        (Some(id), Some(len))
            if len == bytes.len() as u64 && value_of(key, id, bytes.len()) == bytes =>
        {
            Read::Value(id)
        }
        _ => Read::Torn,
    }
}

/// A call's outcome as the checker needs it: success, or unknown (a failure may come
/// from a transport cut after the change was made, or a retry after a failover).
fn outcome<T>(result: &CodeResult<T>) -> Outcome {
    if result.is_ok() {
        Outcome::Ok
    } else {
        Outcome::Unknown
    }
}

/// What a read answered, as the checker records it.
fn read_event(key: &str, result: &CodeResult<Vec<u8>>) -> (Op, Outcome) {
    match result {
        Ok(bytes) => (Op::Get(Some(read_of(key, bytes))), Outcome::Ok),
        Err(ErrorCode::OBJECT_NOT_FOUND) => (Op::Get(Some(Read::Absent)), Outcome::Ok),
        Err(_) => (Op::Get(None), Outcome::Unknown),
    }
}

/// The recording: every call with its times on one clock (µs since the start).
struct Recorder {
    started: Instant,
    /// `started` on the host's monotonic clock (the eviction records' clock), in µs.
    origin_us: u64,
    events: Mutex<Vec<Event>>,
    /// Which caller made each event (in step with `events`).
    callers: Mutex<Vec<usize>>,
}

impl Recorder {
    fn now(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn record(&self, caller: usize, key: &str, op: Op, invoked: u64, outcome: Outcome) {
        let returned = self.now();
        let mut events = self.events.lock().expect("recording");
        events.push(Event {
            key: key.to_string(),
            op,
            invoked,
            returned,
            outcome,
        });
        self.callers.lock().expect("callers").push(caller);
    }

    /// The eviction records in `dirs`, as store events of the recording.
    fn evictions(&self, dirs: &[std::path::PathBuf]) -> Vec<Event> {
        dirs.iter()
            .flat_map(|dir| eviction_log::read_dir(dir))
            .map(|record| {
                let at = record.monotonic_us.saturating_sub(self.origin_us);
                Event {
                    key: record.key,
                    op: Op::Evicted,
                    invoked: at,
                    returned: at,
                    outcome: Outcome::Ok,
                }
            })
            .collect()
    }

    /// Logs a fault with its time on the recording's clock.
    fn fault(&self, what: &str) {
        eprintln!("chaos: at {} µs: {what}", self.now());
    }
}

/// One dummy's calls until `stop`: each a random operation on random keys. `doing`
/// names the call in progress (for the report of a caller that does not finish).
fn call_until(
    client: &DummyClient,
    me: usize,
    seed: u64,
    stop: &AtomicBool,
    recorder: &Recorder,
    doing: &Mutex<String>,
) {
    let mut dice = Dice(seed);
    let mut next_value = (me as u64 + 1) << 40;
    let mut fresh = || {
        next_value += 1;
        next_value
    };
    while !stop.load(Ordering::Acquire) {
        let config = ReplicateConfig {
            replica_num: 1 + u32::from(dice.below(2) == 1),
            ..ReplicateConfig::default()
        };
        let len = [1 << 10, 8 << 10, 64 << 10][dice.below(3)];
        let k = key(dice.below(KEYS));
        let invoked = recorder.now();
        let pick = dice.below(12);
        *doing.lock().expect("doing") = format!("op {pick} on {k} since {invoked} µs");
        match pick {
            0..=2 => {
                let id = fresh();
                let result = client.put(&k, &value_of(&k, id, len), &config);
                recorder.record(me, &k, Op::Put(id), invoked, outcome(&result));
            }
            3..=4 => {
                let id = fresh();
                let result = client.upsert(&k, &value_of(&k, id, len), &config);
                recorder.record(me, &k, Op::Upsert(id), invoked, outcome(&result));
            }
            5..=8 => {
                let result = client.get(&k);
                let (op, outcome) = read_event(&k, &result);
                recorder.record(me, &k, op, invoked, outcome);
            }
            9 => {
                let result = client.remove(&k, true);
                recorder.record(me, &k, Op::Remove, invoked, outcome(&result));
            }
            10 => {
                let keys: Vec<String> = (0..3).map(|_| key(dice.below(KEYS))).collect();
                let mut keys = keys;
                keys.sort();
                keys.dedup();
                let ids: Vec<ValueId> = keys.iter().map(|_| fresh()).collect();
                let values: Vec<Vec<u8>> = keys
                    .iter()
                    .zip(&ids)
                    .map(|(k, id)| value_of(k, *id, len))
                    .collect();
                let slices: Vec<&[u8]> = values.iter().map(Vec::as_slice).collect();
                let results = client.put_batch(&keys, &slices, &config);
                for ((k, id), result) in keys.iter().zip(ids).zip(&results) {
                    recorder.record(me, k, Op::Put(id), invoked, outcome(result));
                }
            }
            _ => {
                let keys: Vec<String> = (0..3).map(|_| key(dice.below(KEYS))).collect();
                let results = client.get_batch(&keys);
                for (k, result) in keys.iter().zip(&results) {
                    let (op, outcome) = read_event(k, result);
                    recorder.record(me, k, op, invoked, outcome);
                }
            }
        }
    }
}

/// The filler: a dummy that forces eviction now and then.
struct Filler {
    client: DummyClient,
    next_value: ValueId,
    /// Keys of acknowledged puts of earlier rounds.
    written: Vec<String>,
}

impl Filler {
    /// The recording's caller number of the filler.
    const CALLER: usize = CALLERS;

    /// Writes `capacity` bytes (what the cluster's memory holds) in objects of keys of
    /// their own (of round `round`), which forces eviction; then reads back a few
    /// objects of earlier rounds (those evicted must read absent, explained by eviction
    /// records). Every call is recorded. Returns the bytes of the puts acknowledged.
    fn round(&mut self, round: usize, capacity: u64, recorder: &Recorder, dice: &mut Dice) -> u64 {
        let config = ReplicateConfig::default();
        let mut acknowledged = 0u64;
        let count = capacity / FILL_OBJECT_BYTES as u64;
        let mut written = Vec::new();
        for n in 0..count {
            let k = format!("chaos/fill{round}/{n}");
            self.next_value += 1;
            let id = self.next_value;
            let bytes = value_of(&k, id, FILL_OBJECT_BYTES);
            let invoked = recorder.now();
            let result = self.client.put(&k, &bytes, &config);
            recorder.record(Self::CALLER, &k, Op::Put(id), invoked, outcome(&result));
            if result.is_ok() {
                acknowledged += FILL_OBJECT_BYTES as u64;
                written.push(k);
            }
        }
        for _ in 0..8.min(self.written.len()) {
            let k = &self.written[dice.below(self.written.len())];
            let invoked = recorder.now();
            let (op, outcome) = read_event(k, &self.client.get(k));
            recorder.record(Self::CALLER, k, op, invoked, outcome);
        }
        self.written.extend(written);
        acknowledged
    }
}

/// The leader, once it counts both other (running) masters in sync. A master is
/// killed only then: the promise holds while an in-sync standby survives, and a standby
/// killed a moment ago still counts as in sync until a write waits for it in vain.
fn healthy_leader(masters: &mut [MasterProcess]) -> Option<usize> {
    let mut found = None;
    eventually(Duration::from_secs(10), || {
        found = leader_of(masters).filter(|&leader| {
            let health = masters[leader].health().unwrap_or_default();
            (0..masters.len()).filter(|&i| i != leader).all(|i| {
                let line = format!(r#""address":"{}","in_sync":true"#, masters[i].address());
                masters[i].is_running() && health.contains(&line)
            })
        });
        found.is_some()
    });
    found
}

fn leader_of(masters: &[MasterProcess]) -> Option<usize> {
    let leaders: Vec<usize> = (0..masters.len())
        .filter(|i| masters[*i].is_leader())
        .collect();
    (leaders.len() == 1).then(|| leaders[0])
}

/// A segment file per node on tmpfs when the machine has one; removed on drop.
struct SegmentFiles(Vec<std::path::PathBuf>);

impl SegmentFiles {
    fn new(count: usize) -> Self {
        let dir = std::path::PathBuf::from("/dev/shm");
        let dir = if dir.is_dir() {
            dir
        } else {
            std::env::temp_dir()
        };
        SegmentFiles(
            (0..count)
                .map(|i| dir.join(format!("mooncake-chaos-{}-{i}.segment", std::process::id())))
                .collect(),
        )
    }
}

impl Drop for SegmentFiles {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// How many of each fault the scheduler injected.
#[derive(Debug, Default)]
struct Faults {
    leader: usize,
    standby: usize,
    node: usize,
    dummy: usize,
    /// Failpoints switched on (no effect in a build without them).
    failpoints: usize,
}

/// The failpoints a scheduler may switch on, for a node and for a master.
/// (Not `master.answer.PutStart`: a write whose start answer is lost holds its space
/// until `--put_start_release_timeout_sec`, which at this test's write rate fills every
/// segment within seconds.)
const NODE_FAILPOINTS: &str = "transfer.answer=5%return";
/// The SSD tier's disk failing: writes, syncs and reads.
const DISK_FAILPOINTS: &str = "offload.disk.write=50%return(eio);offload.disk.fsync=20%return(eio);offload.disk.read=50%return(eio)";
const MASTER_FAILPOINTS: &str = "master.answer.PutEnd=5%return;master.answer.Remove=5%return";

#[test]
fn chaos_of_kills_breaks_no_promise_of_the_history() {
    let seconds = std::env::var("MOONCAKE_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60u64);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| {
            u64::try_from(d.as_nanos() % u128::from(u64::MAX)).unwrap_or(1)
        })
        | 1;
    eprintln!("chaos: {seconds} s, seed {seed}");
    let mut dice = Dice(seed);
    let etcd = EtcdServer::start();
    // Each process logs warnings to stderr and its eviction records to a file here.
    let logs = TempDir::new("chaos-logs");
    let log_dirs: Vec<std::path::PathBuf> = (0..6)
        .map(|i| std::path::Path::new(logs.path()).join(format!("process{i}")))
        .collect();
    let log_flags = |i: usize| {
        [
            format!("--log_dir={}", log_dirs[i].display()),
            "--stderrthreshold=1".to_string(),
            "--log_level=warn,mooncake::eviction=debug".to_string(),
        ]
    };
    let cluster = format!("chaos-{}-{}", std::process::id(), unique_port());
    // One failpoints file per process: the scheduler switches them one process at a time.
    let master_failpoints: Vec<FailpointFile> = (0..3).map(|_| FailpointFile::new()).collect();
    let node_failpoints: Vec<FailpointFile> = (0..3).map(|_| FailpointFile::new()).collect();
    let mut masters: Vec<MasterProcess> = master_failpoints
        .iter()
        .enumerate()
        .map(|(i, file)| {
            // Short read leases: an upsert's old version is freed one lease after it
            // was replaced; at this test's rate of upserts on a few keys, the default
            // (10 s) holds hundreds of MB and the callers' own writes would keep the
            // cluster evicting (only the filler should).
            let logging = log_flags(3 + i);
            let mut flags = vec!["--default_kv_lease_ttl=1000", "--enable_offload=true"];
            flags.extend(logging.iter().map(String::as_str));
            MasterProcess::start_ha_with_env(&etcd.endpoint(), &cluster, &flags, &[file.env()])
        })
        .collect();
    assert!(eventually(Duration::from_secs(15), || leader_of(&masters).is_some()));
    let master_flag = format!("--master_server_address=etcd://{}", etcd.endpoint());
    let cluster_flag = format!("--cluster_id={cluster}");
    let files = SegmentFiles::new(3);
    let disks: Vec<TempDir> = (0..3).map(|_| TempDir::new("chaos-disk")).collect();
    let segment = format!("{}MB", SEGMENT_BYTES >> 20);
    let mut nodes: Vec<RealClientProcess> = files
        .0
        .iter()
        .zip(&node_failpoints)
        .zip(&disks)
        .enumerate()
        .map(|(i, ((path, failpoints), disk))| {
            let file_flag = format!("--segment_path={}", path.display());
            let logging = log_flags(i);
            // Reads see other nodes' upserts and removes at once (no read cache: the
            // checker holds them to the strict promise). Each node has an SSD tier.
            let mut flags = vec![
                master_flag.as_str(),
                cluster_flag.as_str(),
                file_flag.as_str(),
                "--read_cache_ms=0",
                "--enable_offload=true",
            ];
            flags.extend(logging.iter().map(String::as_str));
            RealClientProcess::start_with_env(
                &segment,
                &flags,
                &[
                    failpoints.env(),
                    ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", disk.path()),
                    ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
                    ("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "1GiB"),
                ],
            )
        })
        .collect();
    // An idle dummy and a busy one (killed in the middle of its calls).
    let mut holders: Vec<DummyProcess> = (0..2)
        .map(|n| {
            let mut attached = None;
            eventually(Duration::from_secs(20), || {
                attached = DummyProcess::try_start_as(&nodes[n].address(), 4 << 20, n == 1);
                attached.is_some()
            });
            attached.expect("a helper dummy attaches")
        })
        .collect();
    let recorder = Arc::new(Recorder {
        started: Instant::now(),
        origin_us: monotonic_us(),
        events: Mutex::new(Vec::new()),
        callers: Mutex::new(Vec::new()),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let doing: Arc<Vec<Mutex<String>>> =
        Arc::new((0..CALLERS).map(|_| Mutex::new(String::new())).collect());
    let callers: Vec<_> = (0..CALLERS)
        .map(|me| {
            let doing = Arc::clone(&doing);
            let client =
                DummyClient::setup_dummy(32 << 20, 8 << 20, Some(&nodes[me % 3].address()))
                    .expect("a calling dummy attaches");
            let (stop, recorder) = (Arc::clone(&stop), Arc::clone(&recorder));
            let seed = seed.wrapping_mul(me as u64 + 3) | 1;
            std::thread::spawn(move || {
                call_until(&client, me, seed, &stop, &recorder, &doing[me]);
                client
            })
        })
        .collect();

    let mut filler = Filler {
        client: DummyClient::setup_dummy(32 << 20, 8 << 20, Some(&nodes[2].address()))
            .expect("the filler attaches"),
        next_value: (Filler::CALLER as u64 + 1) << 40,
        written: Vec::new(),
    };
    // A round fills every segment when each of its puts is acknowledged.
    let capacity = SEGMENT_BYTES * 3;
    let mut fills = 0;
    let mut full_fills = 0;
    let mut last_fill = Instant::now();

    let mut faults = Faults::default();
    let mut switched_on: Option<&FailpointFile> = None;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_millis(500));
        if last_fill.elapsed() >= FILL_EVERY {
            let acknowledged = filler.round(fills, capacity, &recorder, &mut dice);
            recorder.fault(&format!(
                "fill round {fills}: {} MB of puts acknowledged",
                acknowledged >> 20
            ));
            fills += 1;
            full_fills += usize::from(acknowledged * 10 >= capacity * 9);
            last_fill = Instant::now();
        }
        match dice.below(7) {
            0 => {
                if let Some(leader) = healthy_leader(&mut masters) {
                    masters[leader].kill9();
                    recorder.fault(&format!("kill -9 of the leader, master {leader}"));
                    faults.leader += 1;
                    std::thread::sleep(Duration::from_millis(200));
                    masters[leader].restart();
                }
            }
            1 => {
                if let Some(leader) = healthy_leader(&mut masters) {
                    let standby = (leader + 1 + dice.below(2)) % 3;
                    masters[standby].kill9();
                    recorder.fault(&format!("kill -9 of a standby, master {standby}"));
                    faults.standby += 1;
                    masters[standby].restart();
                }
            }
            2 => {
                let node = dice.below(nodes.len());
                nodes[node].kill9();
                recorder.fault(&format!("kill -9 of node {node}"));
                faults.node += 1;
                std::thread::sleep(Duration::from_millis(100));
                nodes[node].restart();
            }
            3 => {
                let holder = dice.below(holders.len());
                holders[holder].kill9();
                faults.dummy += 1;
                // The node may be restarting (it serves once its segment is mounted).
                let node = dice.below(nodes.len());
                let mut attached = None;
                eventually(Duration::from_secs(20), || {
                    attached =
                        DummyProcess::try_start_as(&nodes[node].address(), 4 << 20, holder == 1);
                    attached.is_some()
                });
                match attached {
                    Some(attached) => holders[holder] = attached,
                    None => recorder.fault("a new dummy could not attach within 20 s"),
                }
            }
            4 => {
                // One process at a time fails some of its answers, until the next switch.
                if let Some(file) = switched_on.take() {
                    file.clear();
                }
                let which = dice.below(6);
                let (file, spec) = match which {
                    0..=2 if dice.below(2) == 0 => (&node_failpoints[which], NODE_FAILPOINTS),
                    0..=2 => (&node_failpoints[which], DISK_FAILPOINTS),
                    _ => (&master_failpoints[which - 3], MASTER_FAILPOINTS),
                };
                file.set(spec);
                recorder.fault(&format!(
                    "failpoints of process {which} (0-2 nodes, 3-5 masters): {spec}"
                ));
                switched_on = Some(file);
                faults.failpoints += 1;
            }
            _ => {}
        }
    }
    stop.store(true, Ordering::Release);
    if let Some(file) = switched_on.take() {
        file.clear();
    }
    let mut waited = 0;
    while !callers.iter().all(std::thread::JoinHandle::is_finished) {
        std::thread::sleep(Duration::from_secs(1));
        waited += 1;
        if waited % 15 == 0 {
            for (me, caller) in callers.iter().enumerate() {
                if !caller.is_finished() {
                    let now = recorder.now();
                    eprintln!(
                        "chaos: caller {me} still in {} (now {now} µs)",
                        doing[me].lock().expect("doing")
                    );
                }
            }
        }
    }
    let mut clients: Vec<DummyClient> = callers
        .into_iter()
        .map(|c| c.join().expect("caller"))
        .collect();
    clients.push(filler.client);

    // The cluster serves, and every key is read once more.
    assert!(eventually(Duration::from_secs(20), || leader_of(&masters).is_some()));
    assert!(
        eventually(Duration::from_secs(20), || clients[0]
            .put("after-chaos", b"served", &ReplicateConfig::default())
            .is_ok()),
        "the cluster does not serve after the chaos"
    );
    for index in 0..KEYS {
        let k = key(index);
        let reader = &clients[index % CALLERS];
        let mut last = (Op::Get(None), Outcome::Unknown);
        let mut invoked = recorder.now();
        eventually(Duration::from_secs(20), || {
            invoked = recorder.now();
            last = read_event(&k, &reader.get(&k));
            last.1 == Outcome::Ok
        });
        recorder.record(usize::MAX, &k, last.0, invoked, last.1);
    }

    let mut events = std::mem::take(&mut *recorder.events.lock().expect("recording"));
    let evictions = recorder.evictions(&log_dirs);
    eprintln!(
        "chaos: {fills} fill rounds ({full_fills} filled the cluster), {} objects evicted \
         (memory and SSD tiers, from the eviction records)",
        evictions.len()
    );
    assert!(
        full_fills == 0 || !evictions.is_empty(),
        "the filler filled the cluster's memory and no eviction was recorded"
    );
    recorder
        .callers
        .lock()
        .expect("callers")
        .extend(std::iter::repeat_n(usize::MAX, evictions.len()));
    events.extend(evictions);
    let violations = check(&events);
    let count = |pick: fn(&Event) -> bool| events.iter().filter(|e| pick(e)).count();
    eprintln!(
        "chaos: {} calls ({} puts, {} upserts, {} reads, {} removes; {} acknowledged, {} in doubt), faults {faults:?}, {} violations",
        events.len(),
        count(|e| matches!(e.op, Op::Put(_))),
        count(|e| matches!(e.op, Op::Upsert(_))),
        count(|e| matches!(e.op, Op::Get(_))),
        count(|e| matches!(e.op, Op::Remove)),
        count(|e| e.outcome == Outcome::Ok),
        count(|e| e.outcome == Outcome::Unknown),
        violations.len()
    );
    assert!(
        count(|e| e.outcome == Outcome::Ok && matches!(e.op, Op::Get(Some(Read::Value(_))))) > 0,
        "no read found a value: the load did not run"
    );
    if !violations.is_empty() {
        for violation in violations.iter().take(10) {
            eprintln!("violation: {violation:?}");
        }
        // The first broken promise's key, from a second before its write to its read.
        let (key, from, to) = match &violations[0] {
            Violation::LostWrite { key, write, read } => (key, *write, *read),
            Violation::NeverWritten { key, read } => (key, *read, *read),
            Violation::StaleAfterUpsert {
                key, upsert, read, ..
            } => (key, *upsert, *read),
            Violation::ReadableAfterRemove {
                key, remove, read, ..
            } => (key, *remove, *read),
        };
        let start = events[from].invoked.saturating_sub(1_000_000);
        let end = events[to].returned;
        let callers = recorder.callers.lock().expect("callers");
        if let Ok(path) = std::env::var("MOONCAKE_CHAOS_DUMP") {
            let all: String = events
                .iter()
                .zip(callers.iter())
                .map(|(event, caller)| format!("{caller} {event:?}\n"))
                .collect();
            let _ = std::fs::write(&path, all);
            eprintln!("chaos: the recording is in {path}");
        }
        for (index, event) in events.iter().enumerate() {
            if &event.key == key && event.invoked >= start && event.invoked <= end {
                eprintln!("  #{index} caller {}: {event:?}", callers[index]);
            }
        }
    }
    assert!(
        violations.is_empty(),
        "{} broken promises (seed {seed})",
        violations.len()
    );

    drop(clients);
    let pids: Vec<u32> = holders
        .iter()
        .map(DummyProcess::pid)
        .chain(nodes.iter().map(RealClientProcess::pid))
        .chain(masters.iter().filter_map(MasterProcess::pid))
        .collect();
    drop(holders);
    drop(nodes);
    drop(masters);
    drop(etcd);
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "process {pid} still runs after the test"
        );
    }
}
