//! Keeping the node's cores awake while requests flow (`--keep_awake_us`).
//!
//! A core with nothing to run sleeps; waking it for the next request, or for the
//! answer its caller waits for, costs tens of microseconds on a virtual machine whose
//! guest does not poll before it halts (and a deep C-state exit on bare metal) — more
//! than a small request takes. After each request a server serves, a few threads of
//! idle scheduling priority (`SCHED_IDLE`: they run only on a core that has nothing
//! else to run, and give it up the moment anything else wakes there) spin for a short
//! window, so that the next message wakes a running core. They sleep once the window
//! has passed without a request. The window is per process and set once, by
//! `mooncake_client` and `mooncake_master` from their flag; a real client embedded in
//! an application's process (`setup()`) does not keep its cores awake.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::flags::{FlagError, FlagSpec, ParsedFlags};

/// Window after a request during which the cores are kept awake, by default.
pub const DEFAULT_KEEP_AWAKE: Duration = Duration::from_micros(200);

/// The longest window accepted: past it, requests are too far apart for the cores to
/// be worth keeping awake.
pub const MAX_KEEP_AWAKE: Duration = Duration::from_millis(10);

/// Most threads kept spinning: one per core up to this many (a woken thread lands on
/// the core it last ran on when that core is idle, so each core that serves or waits
/// needs one).
pub const MAX_KEEP_AWAKE_THREADS: usize = 8;

/// The flag of the commands that keep their cores awake.
pub static KEEP_AWAKE_FLAGS: &[FlagSpec] = &[FlagSpec::value(
    "keep_awake_us",
    Some("200"),
    "microseconds after each request during which idle-priority threads keep this node's cores from sleeping, so the next request and its answer are not delayed by waking a sleeping core (0: off; at most 10000)",
)
.env("MOONCAKE_KEEP_AWAKE_US")
.ours()];

/// The window `--keep_awake_us` asks for.
pub fn window_from_flags(flags: &ParsedFlags) -> Result<Duration, FlagError> {
    let window = flags.typed("keep_awake_us", parse_window)?;
    Ok(window.unwrap_or(DEFAULT_KEEP_AWAKE))
}

fn parse_window(value: &str) -> Result<Duration, String> {
    let reason = || {
        format!(
            "give whole microseconds from 0 (off) to {}, for example 200",
            MAX_KEEP_AWAKE.as_micros()
        )
    };
    let micros: u64 = value.trim().parse().map_err(|_| reason())?;
    let window = Duration::from_micros(micros);
    if window > MAX_KEEP_AWAKE {
        return Err(reason());
    }
    Ok(window)
}

/// The spinning threads and when the last request came.
#[derive(Debug)]
struct KeepAwake {
    window_nanos: u64,
    started: Instant,
    /// Nanoseconds from `started` to the last request.
    last_request: AtomicU64,
    /// Threads asleep on `woken` (read without the lock on the request path).
    asleep: AtomicUsize,
    /// Nanoseconds spent spinning, all threads together.
    spun_nanos: AtomicU64,
    lock: Mutex<()>,
    woken: Condvar,
}

static KEEP_AWAKE: OnceLock<KeepAwake> = OnceLock::new();

impl KeepAwake {
    fn now(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn quiet(&self) -> bool {
        let last = self.last_request.load(Ordering::SeqCst);
        self.now().saturating_sub(last) >= self.window_nanos
    }

    /// One spinning thread: sleeps while no request came within the window, spins while
    /// one did.
    fn run(&self) {
        loop {
            {
                let mut guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
                self.asleep.fetch_add(1, Ordering::SeqCst);
                while self.quiet() {
                    guard = self
                        .woken
                        .wait(guard)
                        .unwrap_or_else(PoisonError::into_inner);
                }
                self.asleep.fetch_sub(1, Ordering::SeqCst);
            }
            let from = Instant::now();
            while !self.quiet() {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            }
            let spun = u64::try_from(from.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.spun_nanos.fetch_add(spun, Ordering::Relaxed);
        }
    }
}

/// Starts keeping this process's cores awake for `window` after each [`touch`]: one
/// idle-priority thread per core, at most [`MAX_KEEP_AWAKE_THREADS`]. Does nothing for
/// a zero window, or when it was started already. Returns how many threads spin.
pub fn start(window: Duration) -> usize {
    if window.is_zero() || KEEP_AWAKE.get().is_some() {
        return 0;
    }
    if under_cpu_quota(&|path| std::fs::read_to_string(path).ok()) {
        // Said by the startup line (`keep_awake_us=0`): stderr carries one line when
        // startup fails.
        tracing::debug!(
            "a CPU quota limits this process (cgroup): cores are not kept awake after requests, which would spend the quota"
        );
        return 0;
    }
    let state = KEEP_AWAKE.get_or_init(|| KeepAwake {
        window_nanos: u64::try_from(window.as_nanos()).unwrap_or(u64::MAX),
        started: Instant::now(),
        last_request: AtomicU64::new(0),
        asleep: AtomicUsize::new(0),
        spun_nanos: AtomicU64::new(0),
        lock: Mutex::new(()),
        woken: Condvar::new(),
    });
    let threads = allowed_cores()
        .into_iter()
        .take(MAX_KEEP_AWAKE_THREADS)
        .filter(|&core| {
            std::thread::Builder::new()
                .name(format!("keep-awake-{core}"))
                .spawn(move || {
                    if let Err(error) = idle_priority() {
                        tracing::warn!(%error, "cannot give a keep-awake thread idle priority; it stops (cores are not kept awake)");
                        return;
                    }
                    // Kept on its core, so that every core has one: an application
                    // thread that sends and goes on working keeps its core, and the
                    // thread it woke runs on another one.
                    if let Err(error) = pin_to(core) {
                        tracing::debug!(%error, core, "a keep-awake thread cannot be kept on its core");
                    }
                    state.run();
                })
                .is_ok()
        })
        .count();
    tracing::debug!(
        threads,
        window_us = window.as_micros(),
        "keeping cores awake after each request"
    );
    threads
}

/// The window cores are kept awake for after each request; zero when keeping awake was
/// not started (off, embedded, or under a CPU quota). For the startup line.
pub fn window() -> Duration {
    KEEP_AWAKE.get().map_or(Duration::ZERO, |state| {
        Duration::from_nanos(state.window_nanos)
    })
}

/// Marks a request: the cores stay awake for the window from now. Costs a clock read
/// and an atomic store, plus a wake-up when the threads were asleep; nothing when
/// keeping awake was not started.
pub fn touch() {
    let Some(state) = KEEP_AWAKE.get() else {
        return;
    };
    state.last_request.store(state.now(), Ordering::SeqCst);
    if state.asleep.load(Ordering::SeqCst) > 0 {
        let _guard = state.lock.lock().unwrap_or_else(PoisonError::into_inner);
        state.woken.notify_all();
    }
}

/// Seconds spent spinning so far, all threads together (0 when not started).
pub fn spun_seconds() -> f64 {
    KEEP_AWAKE.get().map_or(0.0, |state| {
        state.spun_nanos.load(Ordering::Relaxed) as f64 / 1e9
    })
}

/// The Prometheus lines of the time spent keeping cores awake, for the server named
/// `server` (`client`, `master`): a counter of seconds, all threads together.
pub fn metrics(server: &str) -> String {
    format!(
        "# HELP mooncake_{server}_keep_awake_seconds_total CPU time idle-priority threads spent keeping cores awake after requests (--keep_awake_us).\n# TYPE mooncake_{server}_keep_awake_seconds_total counter\nmooncake_{server}_keep_awake_seconds_total {}\n",
        spun_seconds()
    )
}

/// Whether a cgroup CPU quota limits this process (`cpu.max` of cgroup v2,
/// `cpu.cfs_quota_us` of v1), reading files with `read`: idle-priority threads spend a
/// quota like any other, so they would take time from the process's real work.
fn under_cpu_quota(read: &dyn Fn(&str) -> Option<String>) -> bool {
    let Some(cgroups) = read("/proc/self/cgroup") else {
        return false;
    };
    cgroups.lines().any(|line| {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            return false;
        };
        let path = path.trim_end_matches('/');
        let file = if controllers.is_empty() {
            format!("/sys/fs/cgroup{path}/cpu.max")
        } else if controllers.split(',').any(|c| c == "cpu") {
            format!("/sys/fs/cgroup/cpu{path}/cpu.cfs_quota_us")
        } else {
            return false;
        };
        read(&file)
            .and_then(|text| text.split_whitespace().next().map(str::to_string))
            .is_some_and(|quota| quota != "max" && quota != "-1")
    })
}

/// The cores this process may run on (the first when they cannot be read).
fn allowed_cores() -> Vec<usize> {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set; the call writes at most
    // its size into it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a writable `cpu_set_t` of `size` bytes; pid 0 is this thread.
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return vec![0];
    }
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `cpu` is below CPU_SETSIZE, within `set`.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

/// Keeps the calling thread on `core`.
fn pin_to(core: usize) -> std::io::Result<()> {
    // SAFETY: an all-zero `cpu_set_t` is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `core` comes from `allowed_cores`, below CPU_SETSIZE, within `set`.
    unsafe { libc::CPU_SET(core, &mut set) };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `set` is a valid `cpu_set_t` of `size` bytes; pid 0 is this thread.
    if unsafe { libc::sched_setaffinity(0, size, &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Gives the calling thread idle scheduling priority.
fn idle_priority() -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call's duration; pid 0 is this
    // thread.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_checked() {
        assert_eq!(parse_window("0"), Ok(Duration::ZERO));
        assert_eq!(parse_window(" 200 "), Ok(Duration::from_micros(200)));
        assert_eq!(parse_window("10000"), Ok(MAX_KEEP_AWAKE));
        for bad in ["10001", "-1", "2ms", "", "x"] {
            let reason = parse_window(bad).expect_err(bad);
            assert!(reason.contains("whole microseconds"), "{bad}: {reason}");
        }
    }

    #[test]
    fn a_cgroup_cpu_quota_is_found_in_either_version() {
        let files = |entries: &'static [(&'static str, &'static str)]| {
            move |path: &str| {
                entries
                    .iter()
                    .find(|(name, _)| *name == path)
                    .map(|(_, text)| (*text).to_string())
            }
        };
        let v2_limited = files(&[
            ("/proc/self/cgroup", "0::/pods/a\n"),
            ("/sys/fs/cgroup/pods/a/cpu.max", "200000 100000\n"),
        ]);
        assert!(under_cpu_quota(&v2_limited));
        let v2_free = files(&[
            ("/proc/self/cgroup", "0::/\n"),
            ("/sys/fs/cgroup/cpu.max", "max 100000\n"),
        ]);
        assert!(!under_cpu_quota(&v2_free));
        let v1_limited = files(&[
            ("/proc/self/cgroup", "4:memory:/x\n2:cpu,cpuacct:/job\n"),
            ("/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us", "50000\n"),
        ]);
        assert!(under_cpu_quota(&v1_limited));
        let v1_free = files(&[
            ("/proc/self/cgroup", "1:cpu:/\n0::/\n"),
            ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n"),
        ]);
        assert!(!under_cpu_quota(&v1_free));
        assert!(!under_cpu_quota(&files(&[])));
    }

    #[test]
    fn threads_spin_after_a_request_and_sleep_when_requests_stop() {
        let threads = start(Duration::from_millis(2));
        let state = KEEP_AWAKE.get().expect("started");
        let wait_for = |what: &dyn Fn() -> bool| {
            let until = Instant::now() + Duration::from_secs(10);
            while !what() {
                assert!(Instant::now() < until, "timed out");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        // Without requests every thread sleeps.
        wait_for(&|| state.asleep.load(Ordering::SeqCst) == threads);
        let spun = state.spun_nanos.load(Ordering::Relaxed);
        // A request wakes them; they spin for the window, then sleep again.
        touch();
        wait_for(&|| {
            state.asleep.load(Ordering::SeqCst) == threads
                && state.spun_nanos.load(Ordering::Relaxed) > spun
        });
        assert!(spun_seconds() > 0.0);
        // Starting twice changes nothing.
        assert_eq!(start(Duration::from_millis(5)), 0);
    }
}
