//! Ordinary memory a dummy declared (buffers it registered outside its shared memory:
//! heap, numpy arrays, pinned host memory), and whether this real client may reach it.
//!
//! The dummy declares each such buffer (address, length) to its session; a request may
//! then name any range wholly inside one declared range, and the store copies it once
//! with `process_vm_readv` / `process_vm_writev` ([`Region::Process`]). Nothing else of
//! the dummy's memory is ever touched. At most [`MAX_DECLARED_RANGES`] ranges are
//! declared at a time; unregistering a buffer forgets its range; the whole declaration
//! ends with the session.
//!
//! Whether the kernel lets this process read the dummy's memory (same uid, Yama's
//! `ptrace_scope`, `CAP_SYS_PTRACE`) is probed once per session, with a one-byte read
//! of the first declared range. When it does not, declared ranges are refused and the
//! dummy copies them through its staging buffer; the answer says why.

use std::collections::BTreeMap;
use std::sync::Arc;

use nix::errno::Errno;
use parking_lot::RwLock;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::{CrossMemory, Declaration, MAX_DECLARED_RANGES, MemRange};
use mooncake_shm::cross_memory::{CrossMemoryError, PeerProcess, yama_ptrace_scope};

use crate::region::{ProcessRange, Region};

/// What the probe found.
#[derive(Clone, Debug)]
enum Verdict {
    /// Not probed yet, or the last probe failed for a reason that may pass.
    Unknown(String),
    /// The dummy's memory can be read and written.
    Available,
    /// The kernel or its policy forbids it, for the life of the session.
    Forbidden(String),
}

#[derive(Debug)]
struct Declared {
    /// Start → length of each declared range.
    ranges: BTreeMap<u64, u64>,
    /// Length of the longest declared range (bounds the search for a containing one).
    longest: u64,
    verdict: Verdict,
}

/// The ordinary memory one dummy declared.
#[derive(Debug)]
pub struct DeclaredMemory {
    /// The dummy process, or why it cannot be opened.
    process: Result<Arc<PeerProcess>, String>,
    /// The dummy's uid, for explanations.
    uid: u32,
    declared: RwLock<Declared>,
}

/// Checks one range for declaration.
fn valid(range: MemRange) -> CodeResult<()> {
    let wraps = range.addr.checked_add(range.len).is_none();
    if range.addr == 0 || range.len == 0 || wraps {
        return Err(ErrorCode::INVALID_PARAMS);
    }
    Ok(())
}

impl Declared {
    fn insert(&mut self, range: MemRange) -> CodeResult<()> {
        valid(range)?;
        if !self.ranges.contains_key(&range.addr) && self.ranges.len() >= MAX_DECLARED_RANGES {
            return Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        self.ranges.insert(range.addr, range.len);
        self.longest = self.longest.max(range.len);
        Ok(())
    }

    fn remove(&mut self, addr: u64) -> bool {
        let removed = self.ranges.remove(&addr).is_some();
        if removed {
            self.longest = self.ranges.values().copied().max().unwrap_or(0);
        }
        removed
    }

    /// True when `addr..addr+len` lies wholly inside one declared range.
    fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        if len == 0 {
            return false;
        }
        // A containing range starts at most `longest` bytes before `addr`.
        let first = addr.saturating_sub(self.longest);
        self.ranges
            .range(first..=addr)
            .any(|(&start, &size)| start.saturating_add(size) >= end)
    }
}

impl DeclaredMemory {
    /// Nothing declared yet for the dummy process `pid` of user `uid`; opens the
    /// process (a pidfd) now, while the dummy is connected.
    pub fn new(pid: u32, uid: u32) -> Self {
        let process = i32::try_from(pid)
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| {
                "the dummy's pid is not visible to mooncake_client (it runs in another pid namespace, e.g. another container); share the pid namespace to enable cross-memory copies".to_string()
            })
            .and_then(|pid| {
                PeerProcess::open(pid)
                    .map(Arc::new)
                    .map_err(|e| explain(&e, uid))
            });
        DeclaredMemory {
            process,
            uid,
            declared: RwLock::new(Declared {
                ranges: BTreeMap::new(),
                longest: 0,
                verdict: Verdict::Unknown("no memory declared yet".into()),
            }),
        }
    }

    /// Declares `ranges` (one result each) and, on the session's first accepted range,
    /// probes whether the dummy's memory can be reached.
    pub fn declare(&self, ranges: &[MemRange]) -> Declaration {
        let mut declared = self.declared.write();
        let accepted: Vec<CodeResult<()>> = if ranges.len() > MAX_DECLARED_RANGES {
            vec![Err(ErrorCode::INVALID_PARAMS); ranges.len()]
        } else {
            ranges.iter().map(|r| declared.insert(*r)).collect()
        };
        let first = ranges
            .iter()
            .zip(&accepted)
            .find_map(|(range, result)| result.is_ok().then_some(*range));
        if let (Verdict::Unknown(_), Some(range)) = (&declared.verdict, first) {
            declared.verdict = self.probe(range.addr);
        }
        let cross_memory = match &declared.verdict {
            Verdict::Available => CrossMemory::Available,
            Verdict::Unknown(reason) | Verdict::Forbidden(reason) => {
                CrossMemory::Unavailable(reason.clone())
            }
        };
        Declaration {
            accepted,
            cross_memory,
        }
    }

    fn probe(&self, addr: u64) -> Verdict {
        let process = match &self.process {
            Ok(process) => process,
            Err(reason) => return Verdict::Forbidden(reason.clone()),
        };
        let verdict = match process.probe(addr) {
            Ok(()) => Verdict::Available,
            Err(error) => match error.errno().map(Errno::from_raw) {
                Some(Errno::EPERM | Errno::EACCES | Errno::ENOSYS | Errno::ESRCH) => {
                    Verdict::Forbidden(explain(&error, self.uid))
                }
                _ => Verdict::Unknown(format!(
                    "{error}: the declared memory could not be read; it is probed again at the next declaration"
                )),
            },
        };
        match &verdict {
            Verdict::Available => tracing::info!(
                pid = process.pid(),
                "cross-memory copies to and from the dummy's declared memory are available"
            ),
            Verdict::Unknown(reason) | Verdict::Forbidden(reason) => tracing::info!(
                pid = process.pid(),
                %reason,
                "no cross-memory copies for this dummy: its registered ordinary memory goes through its staging buffer"
            ),
        }
        verdict
    }

    /// Forgets the range declared at `addr`; `INVALID_PARAMS` when there is none.
    pub fn forget(&self, addr: u64) -> CodeResult<()> {
        if self.declared.write().remove(addr) {
            Ok(())
        } else {
            Err(ErrorCode::INVALID_PARAMS)
        }
    }

    /// The dummy's `addr..addr+len`, when it lies wholly inside one declared range and
    /// the dummy's memory can be reached.
    pub fn region(&self, addr: u64, len: u64) -> Option<Region> {
        let declared = self.declared.read();
        if !matches!(declared.verdict, Verdict::Available) || !declared.contains(addr, len) {
            return None;
        }
        let process = self.process.as_ref().ok()?;
        Some(Region::Process(ProcessRange {
            process: Arc::clone(process),
            addr,
            len,
        }))
    }

    /// Number of declared ranges.
    pub fn count(&self) -> usize {
        self.declared.read().ranges.len()
    }

    /// True once the probe found the dummy's memory reachable.
    pub fn reachable(&self) -> bool {
        matches!(self.declared.read().verdict, Verdict::Available)
    }
}

/// Says why the dummy's memory cannot be reached, with what to do about it.
fn explain(error: &CrossMemoryError, dummy_uid: u32) -> String {
    let own_uid = nix::unistd::getuid().as_raw();
    let errno = error.errno().map_or_else(
        || "an error".to_string(),
        |n| format!("{:?}", Errno::from_raw(n)),
    );
    let yama = match yama_ptrace_scope() {
        Some(1) => {
            "; Yama ptrace_scope is 1 (the dummy names mooncake_client with PR_SET_PTRACER, which helps only when both run as the same user)"
        }
        Some(2) => "; Yama ptrace_scope is 2: only a mooncake_client with CAP_SYS_PTRACE may",
        Some(3) => {
            "; Yama ptrace_scope is 3: no process may (lower it: sysctl kernel.yama.ptrace_scope=1)"
        }
        _ => "",
    };
    let advice = match error.errno().map(Errno::from_raw) {
        Some(Errno::EPERM | Errno::EACCES) => format!(
            "mooncake_client (uid {own_uid}) may not read the memory of the dummy (uid {dummy_uid}){yama}; run mooncake_client as the dummy's user, or give it CAP_SYS_PTRACE (setcap cap_sys_ptrace+ep on the binary)"
        ),
        Some(Errno::ENOSYS) => "the kernel lacks process_vm_readv or pidfd_open (Linux 5.3 or later), or a seccomp filter forbids them".to_string(),
        Some(Errno::ESRCH) => "the dummy's pid is not visible to mooncake_client (another pid namespace, e.g. another container); share the pid namespace".to_string(),
        _ => "the dummy's memory could not be read".to_string(),
    };
    format!("{errno} ({error}): {advice}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(addr: u64, len: u64) -> MemRange {
        MemRange { addr, len }
    }

    #[test]
    fn only_ranges_inside_one_declared_range_are_reachable() {
        let buffer = vec![7u8; 1 << 16];
        let base = buffer.as_ptr() as u64;
        let memory = DeclaredMemory::new(std::process::id(), 0);
        let answer = memory.declare(&[range(base, 4096), range(base + 8192, 4096)]);
        assert_eq!(answer.accepted, vec![Ok(()), Ok(())]);
        assert_eq!(answer.cross_memory, CrossMemory::Available);
        assert!(memory.region(base, 4096).is_some());
        assert!(memory.region(base + 100, 200).is_some());
        assert!(
            memory.region(base + 4000, 200).is_none(),
            "runs past the range"
        );
        assert!(memory.region(base + 4096, 4096).is_none(), "between ranges");
        assert!(memory.region(base, 12288).is_none(), "spans two ranges");
        assert!(memory.region(base, 0).is_none());
        assert!(memory.region(u64::MAX, 2).is_none());
        assert_eq!(memory.forget(base), Ok(()));
        assert_eq!(memory.forget(base), Err(ErrorCode::INVALID_PARAMS));
        assert!(memory.region(base, 1).is_none());
        assert!(memory.region(base + 8192, 4096).is_some());
        assert_eq!(memory.count(), 1);
    }

    #[test]
    fn bad_ranges_and_too_many_ranges_are_refused() {
        let memory = DeclaredMemory::new(std::process::id(), 0);
        let answer = memory.declare(&[range(0, 10), range(4096, 0), range(u64::MAX, 2)]);
        assert!(
            answer
                .accepted
                .iter()
                .all(|r| *r == Err(ErrorCode::INVALID_PARAMS))
        );
        let many: Vec<MemRange> = (1..=MAX_DECLARED_RANGES as u64 + 1)
            .map(|i| range(i << 20, 16))
            .collect();
        let answer = memory.declare(&many);
        assert!(
            answer
                .accepted
                .iter()
                .all(|r| *r == Err(ErrorCode::INVALID_PARAMS))
        );
        let answer = memory.declare(&many[..MAX_DECLARED_RANGES]);
        assert!(answer.accepted.iter().all(Result::is_ok));
        let extra = memory.declare(&many[MAX_DECLARED_RANGES..]);
        assert_eq!(extra.accepted, vec![Err(ErrorCode::NO_AVAILABLE_HANDLE)]);
        let again = memory.declare(&many[..1]);
        assert_eq!(again.accepted, vec![Ok(())], "re-declaring replaces");
    }

    #[test]
    fn an_unreachable_dummy_is_explained() {
        let memory = DeclaredMemory::new(0, 1234);
        let answer = memory.declare(&[range(4096, 4096)]);
        let CrossMemory::Unavailable(reason) = answer.cross_memory else {
            panic!("pid 0 cannot be reached");
        };
        assert!(reason.contains("pid namespace"), "{reason}");
        assert!(memory.region(4096, 1).is_none());
    }
}
