//! Surviving shared memory that a peer takes away under our mapping.
//!
//! A peer can make pages of a memfd it shared with us inaccessible after we mapped it:
//! a hole punched in a hugetlb memfd is refilled on the next touch only while free
//! hugepages remain, and otherwise the touch raises SIGBUS, which ends the process.
//! Every copy into or out of a mapping here runs under [`guarded`]: a SIGBUS at an
//! address inside one of the mappings the copy names replaces the faulting page with
//! private zeroed memory (so the copy completes, with meaningless bytes) and marks that
//! mapping poisoned; its owner refuses every later use of it. A SIGBUS anywhere else
//! goes to the handler that was installed before ours, or ends the process as it would
//! have without us.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering, compiler_fence};

/// Most mappings one guarded section names (a copy's source and destination, plus
/// those of an enclosing section).
const SLOTS: usize = 4;

/// A mapping a guarded section may touch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Guarded {
    /// First byte of the mapping (aligned to its page size).
    start: usize,
    /// Length of the mapping (0: an empty slot).
    len: usize,
    /// Page size of the mapping (a hugetlb memfd's huge page size).
    page: usize,
    /// Set when a page of the mapping was replaced; outlives the section (it belongs
    /// to the mapping's owner, which the section keeps alive).
    poisoned: *const AtomicBool,
}

// SAFETY: `poisoned` points to an atomic flag, shared across threads by design, that
// outlives every section naming it.
unsafe impl Send for Guarded {}
// SAFETY: as above.
unsafe impl Sync for Guarded {}

impl Guarded {
    /// No mapping.
    pub(crate) const NONE: Guarded = Guarded {
        start: 0,
        len: 0,
        page: 0,
        poisoned: std::ptr::null(),
    };

    /// The mapping `start..start+len` with pages of `page` bytes, whose owner holds
    /// `poisoned` for as long as the mapping lives.
    pub(crate) fn new(start: usize, len: usize, page: usize, poisoned: &AtomicBool) -> Self {
        Guarded {
            start,
            len,
            page: page.max(4096),
            poisoned,
        }
    }

    fn contains(&self, addr: usize) -> bool {
        self.len > 0 && addr >= self.start && addr - self.start < self.len
    }
}

thread_local! {
    /// The mappings this thread's guarded sections name now.
    static GUARDS: Cell<[Guarded; SLOTS]> = const { Cell::new([Guarded::NONE; SLOTS]) };
}

/// The SIGBUS disposition before ours was installed.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Puts the previous guards back when a section ends, however it ends.
struct Restore([Guarded; SLOTS]);

impl Drop for Restore {
    fn drop(&mut self) {
        GUARDS.set(self.0);
    }
}

/// Runs `section` with SIGBUS faults inside `mappings` (and those of any enclosing
/// section) recovered as described in the module documentation.
pub(crate) fn guarded<R>(mappings: &[Guarded], section: impl FnOnce() -> R) -> R {
    install();
    let before = GUARDS.get();
    let mut now = before;
    let mut free = now.iter().position(|g| g.len == 0).unwrap_or(SLOTS);
    for mapping in mappings.iter().filter(|m| m.len > 0) {
        if free < SLOTS {
            now[free] = *mapping;
            free += 1;
        } else {
            // Overflow never happens with the callers here (two mappings, one level of
            // nesting); the newest win.
            now[SLOTS - 1] = *mapping;
        }
    }
    GUARDS.set(now);
    let _restore = Restore(before);
    // The handler reads the guards on this thread: no access of the section may be
    // moved by the compiler to before they are set or after they are put back (the
    // result is made opaque before they are).
    compiler_fence(Ordering::SeqCst);
    let result = std::hint::black_box(section());
    compiler_fence(Ordering::SeqCst);
    result
}

/// Installs the SIGBUS handler once per process.
fn install() {
    PREVIOUS.get_or_init(|| {
        // SAFETY: plain sigaction calls with initialized structures; the handler only
        // does async-signal-safe work (thread-local reads, mmap, atomics, sigaction).
        unsafe {
            let mut ours: libc::sigaction = std::mem::zeroed();
            let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                on_sigbus;
            ours.sa_sigaction = handler as usize;
            ours.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut ours.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &ours, &mut previous) != 0 {
                tracing::warn!(
                    error = %std::io::Error::last_os_error(),
                    "cannot install the SIGBUS handler; a peer removing pages of its shared memory can end this process"
                );
                previous.sa_sigaction = libc::SIG_DFL;
            }
            previous
        }
    });
}

/// Replaces the page holding `addr` when it lies in a guarded mapping of this thread;
/// true when it did.
fn replace_page(addr: usize) -> bool {
    let Some(mapping) = GUARDS.get().into_iter().find(|g| g.contains(addr)) else {
        return false;
    };
    let start = mapping.start + (addr - mapping.start) / mapping.page * mapping.page;
    // SAFETY: `start..start+page` is one page of a mapping the guarded section keeps
    // alive (a hugetlb mapping's length is a whole number of its pages); replacing it
    // with private memory only changes what that mapping's bytes read as.
    let replaced = unsafe {
        libc::mmap(
            start as *mut libc::c_void,
            mapping.page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if replaced == libc::MAP_FAILED {
        return false;
    }
    // SAFETY: the owner of the flag outlives the section (see `Guarded::poisoned`).
    unsafe { (*mapping.poisoned).store(true, Ordering::Release) };
    true
}

extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
    // A fault (code > 0) at a guarded address: retried on return, now on private memory.
    if code > 0 && replace_page(addr) {
        return;
    }
    let previous = PREVIOUS.get().map_or(libc::SIG_DFL, |p| p.sa_sigaction);
    if previous != libc::SIG_DFL && previous != libc::SIG_IGN {
        let flags = PREVIOUS.get().map_or(0, |p| p.sa_flags);
        // SAFETY: `previous` is the handler that was installed, of the kind its flags say.
        unsafe {
            if flags & libc::SA_SIGINFO != 0 {
                let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(previous);
                handler(signal, info, context);
            } else {
                let handler: extern "C" fn(libc::c_int) = std::mem::transmute(previous);
                handler(signal);
            }
        }
        return;
    }
    // As without us: the default action (the fault repeats on return; a signal that
    // was sent is raised again).
    // SAFETY: sigaction and raise are async-signal-safe.
    unsafe {
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
        if code <= 0 {
            libc::raise(signal);
        }
    }
}
