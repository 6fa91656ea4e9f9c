//! [`SharedMemory`]: one memfd-backed mapping, created here or received from a peer.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::MmapRaw;
use nix::fcntl::{FcntlArg, SealFlag, fcntl};

use crate::fault_guard::{Guarded, guarded};
use crate::{parallel, sys};

/// Why shared memory could not be created or mapped.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// memfd_create or sizing failed.
    #[error("cannot create a {len}-byte shared memory segment: {source}")]
    Create {
        /// Requested size.
        len: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// mmap failed.
    #[error(
        "cannot map a {len}-byte shared memory segment: {source} (check `ulimit -v` and free memory)"
    )]
    Map {
        /// Requested size.
        len: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// A zero or oversized length.
    #[error("invalid shared memory size {len}: must be between 1 byte and the address space")]
    BadSize {
        /// Requested size.
        len: u64,
    },
    /// A received memfd is smaller than the size its sender declared.
    #[error("received memfd holds {actual} bytes but {declared} were declared")]
    TooSmall {
        /// Declared size.
        declared: u64,
        /// Actual file size.
        actual: u64,
    },
    /// A received memfd could still be shrunk under the mapping.
    #[error(
        "received memfd is not sealed against shrinking (F_SEAL_SHRINK); it could be truncated under the mapping"
    )]
    NotSealed,
    /// fstat or fcntl on a received fd failed.
    #[error("cannot inspect the received file descriptor: {0}")]
    Inspect(std::io::Error),
}

/// Page size used for a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageSize {
    /// The normal page size.
    Normal,
    /// 2 MiB hugepages.
    Huge2M,
    /// 1 GiB hugepages.
    Huge1G,
}

impl PageSize {
    /// The page size requested by `MC_STORE_USE_HUGEPAGE` / `MC_STORE_HUGEPAGE_SIZE`.
    pub fn from_env() -> Self {
        let enabled = std::env::var("MC_STORE_USE_HUGEPAGE")
            .ok()
            .and_then(|v| mooncake_core::flags::parse_bool(&v))
            .unwrap_or(false);
        if !enabled {
            return PageSize::Normal;
        }
        match std::env::var("MC_STORE_HUGEPAGE_SIZE")
            .ok()
            .as_deref()
            .map(str::trim)
        {
            Some("1GB" | "1G" | "1GiB" | "1gb" | "1g") => PageSize::Huge1G,
            _ => PageSize::Huge2M,
        }
    }

    fn bytes(self) -> u64 {
        match self {
            PageSize::Normal => 4096,
            PageSize::Huge2M => 2 << 20,
            PageSize::Huge1G => 1 << 30,
        }
    }
}

/// A memfd and its shared mapping in this process, or (in an embedded real client)
/// the application's own memory, borrowed in place.
#[derive(Debug)]
pub struct SharedMemory {
    backing: Backing,
    len: usize,
    /// Page size of the mapping (a hugetlb memfd's huge page size).
    page: usize,
    /// Set when the peer took pages away under the mapping (see [`is_poisoned`](Self::is_poisoned)).
    poisoned: AtomicBool,
}

/// What a [`SharedMemory`] is made of.
#[derive(Debug)]
enum Backing {
    /// A memfd (or a file on tmpfs or hugetlbfs) mapped shared in this process (can be
    /// passed to a peer).
    Mapped { file: File, map: MmapRaw },
    /// Memory of this process that the application registered and keeps valid; never
    /// passed to another process.
    Borrowed { base: *mut u8 },
}

// SAFETY: the mapping is plain memory shared by design; all access goes through raw
// pointers under the contract of `sys::copy_bytes`, never through Rust references.
unsafe impl Send for SharedMemory {}
// SAFETY: as above; no interior state besides the mapping itself.
unsafe impl Sync for SharedMemory {}

fn to_usize(len: u64) -> Result<usize, ShmError> {
    usize::try_from(len)
        .ok()
        .filter(|l| *l > 0)
        .ok_or(ShmError::BadSize { len })
}

impl SharedMemory {
    /// Creates a sealed memfd of `len` bytes (rounded up to the page size) and maps it,
    /// with every page faulted in. Hugepages fall back to normal pages, with a warning,
    /// when the pool is empty.
    pub fn create(name: &str, len: u64, page: PageSize) -> Result<Self, ShmError> {
        Self::create_populated(name, len, page, true)
    }

    /// Like [`create`](Self::create), but leaves the pages to be faulted in on first use
    /// (or by [`prefault`](Self::prefault)) when `populate` is false, so that a large
    /// segment does not delay startup.
    pub fn create_populated(
        name: &str,
        len: u64,
        page: PageSize,
        populate: bool,
    ) -> Result<Self, ShmError> {
        if page != PageSize::Normal {
            match Self::create_with(name, len, page, populate) {
                Ok(mem) => return Ok(mem),
                Err(error) => tracing::warn!(
                    %error, ?page,
                    "hugepages unavailable (is /proc/sys/vm/nr_hugepages 0?); falling back to normal pages"
                ),
            }
        }
        Self::create_with(name, len, PageSize::Normal, populate)
    }

    fn create_with(name: &str, len: u64, page: PageSize, populate: bool) -> Result<Self, ShmError> {
        let rounded = len
            .checked_next_multiple_of(page.bytes())
            .ok_or(ShmError::BadSize { len })?;
        let size = to_usize(rounded)?;
        let create_err = |source| ShmError::Create { len, source };
        let mut options = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .close_on_exec(true);
        options = match page {
            PageSize::Normal => options,
            PageSize::Huge2M => options.hugetlb(Some(memfd::HugetlbSize::Huge2MB)),
            PageSize::Huge1G => options.hugetlb(Some(memfd::HugetlbSize::Huge1GB)),
        };
        let memfd = options
            .create(name)
            .map_err(|e| create_err(std::io::Error::other(e)))?;
        memfd.as_file().set_len(rounded).map_err(create_err)?;
        memfd
            .add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow])
            .and_then(|()| memfd.add_seal(memfd::FileSeal::SealSeal))
            .map_err(|e| create_err(std::io::Error::other(e)))?;
        let file = memfd.into_file();
        let map = sys::map_shared(&file, size, populate)
            .map_err(|source| ShmError::Map { len, source })?;
        Ok(SharedMemory {
            backing: Backing::Mapped { file, map },
            len: size,
            page: usize::try_from(page.bytes()).unwrap_or(4096),
            poisoned: AtomicBool::new(false),
        })
    }

    /// Maps a memfd received from a peer that declared it `declared_len` bytes long,
    /// after checking it is that large and sealed against shrinking.
    pub fn map_received(fd: OwnedFd, declared_len: u64) -> Result<Self, ShmError> {
        let len = to_usize(declared_len)?;
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS)
            .map_err(|e| ShmError::Inspect(std::io::Error::from(e)))?;
        if !SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SHRINK) {
            return Err(ShmError::NotSealed);
        }
        let file = File::from(fd);
        let metadata = file.metadata().map_err(ShmError::Inspect)?;
        let actual = metadata.len();
        // A hugetlb memfd reports its huge page size here.
        let page = usize::try_from(metadata.blksize()).unwrap_or(4096);
        if actual < declared_len {
            return Err(ShmError::TooSmall {
                declared: declared_len,
                actual,
            });
        }
        // Not populated: a peer's memfd may be large and sparse; pages are faulted in
        // when transfers touch them.
        let map = sys::map_shared(&file, len, false).map_err(|source| ShmError::Map {
            len: declared_len,
            source,
        })?;
        Ok(SharedMemory {
            backing: Backing::Mapped { file, map },
            len,
            page,
            poisoned: AtomicBool::new(false),
        })
    }

    /// Maps the first `len` bytes of `file` (a file on tmpfs or hugetlbfs that outlives
    /// this process, so that a restarted real client finds its segment's bytes again).
    /// The file must already be at least `len` bytes long; `len` must be a multiple of
    /// the file's page size.
    pub fn map_file(file: File, len: u64, populate: bool) -> Result<Self, ShmError> {
        let size = to_usize(len)?;
        let metadata = file.metadata().map_err(ShmError::Inspect)?;
        if metadata.len() < len {
            return Err(ShmError::TooSmall {
                declared: len,
                actual: metadata.len(),
            });
        }
        // hugetlbfs reports its huge page size here.
        let page = usize::try_from(metadata.blksize()).unwrap_or(4096);
        let map = sys::map_shared(&file, size, populate)
            .map_err(|source| ShmError::Map { len, source })?;
        Ok(SharedMemory {
            backing: Backing::Mapped { file, map },
            len: size,
            page,
            poisoned: AtomicBool::new(false),
        })
    }

    /// Wraps `len` bytes of this process's memory at `base` (an embedded real client
    /// reads and writes an application's registered buffer in place through it).
    ///
    /// # Safety
    /// `base..base+len` must stay readable and writable for as long as the returned
    /// value (and every [`MemSlice`] of it) lives; bytes are only accessed under the
    /// contract of shared memory (raw copies, concurrent changes give mixed bytes).
    pub unsafe fn borrowed(base: u64, len: u64) -> Result<Self, ShmError> {
        let size = to_usize(len)?;
        if base == 0 || base.checked_add(len).is_none() {
            return Err(ShmError::BadSize { len });
        }
        Ok(SharedMemory {
            backing: Backing::Borrowed {
                base: base as *mut u8,
            },
            len: size,
            page: 4096,
            poisoned: AtomicBool::new(false),
        })
    }

    fn ptr(&self) -> *mut u8 {
        match &self.backing {
            Backing::Mapped { map, .. } => map.as_mut_ptr(),
            Backing::Borrowed { base } => *base,
        }
    }

    /// True once a page of the mapping was found taken away by the peer that shared it
    /// (a hole punched in a hugetlb memfd with no hugepage left to refill it): the
    /// bytes of every copy since may be meaningless, and the mapping must not be used
    /// again.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// The mapping as a guarded section names it (none for borrowed memory, which no
    /// peer can take away).
    fn guard(&self) -> Guarded {
        match &self.backing {
            Backing::Mapped { map, .. } => Guarded::new(
                map.as_mut_ptr() as usize,
                self.len,
                self.page,
                &self.poisoned,
            ),
            Backing::Borrowed { .. } => Guarded::NONE,
        }
    }

    /// Start of the mapping in this process.
    pub fn base(&self) -> u64 {
        self.ptr() as u64
    }

    /// True for application memory wrapped with [`borrowed`](Self::borrowed).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.backing, Backing::Borrowed { .. })
    }

    /// Length of the mapping.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the memory that are resident (faulted in), from the memfd's allocated
    /// blocks; for borrowed application memory, its whole length (the application's).
    pub fn resident_bytes(&self) -> u64 {
        match &self.backing {
            Backing::Mapped { file, .. } => {
                use std::os::unix::fs::MetadataExt;
                file.metadata()
                    .map(|meta| (meta.blocks() * 512).min(self.len as u64))
                    .unwrap_or(0)
            }
            Backing::Borrowed { .. } => self.len as u64,
        }
    }

    /// Always false: segments are never empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Faults in every page now (MADV_POPULATE_WRITE) so later copies do not pay page
    /// faults; best effort, errors are logged at debug level.
    pub fn prefault(&self) {
        // Small steps: the address space's lock is taken per step, never for long.
        const CHUNK: usize = 8 << 20;
        let Backing::Mapped { map, .. } = &self.backing else {
            return;
        };
        let mut offset = 0;
        while offset < self.len {
            let len = CHUNK.min(self.len - offset);
            if let Err(error) = map.advise_range(memmap2::Advice::PopulateWrite, offset, len) {
                tracing::debug!(%error, "prefault stopped");
                return;
            }
            offset += len;
        }
    }

    /// [`prefault`](Self::prefault) on a background thread named `thread` at the lowest
    /// priority: the pages become resident while the process is otherwise idle, and a
    /// busy process keeps its cores (what it touches first it faults in itself).
    pub fn prefault_in_background(self: &Arc<Self>, thread: &str) {
        let memory = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || {
                sys::lower_thread_priority();
                memory.prefault();
            });
        if let Err(error) = spawned {
            tracing::debug!(%error, thread, "prefault thread not started");
        }
    }

    /// The memfd, for sending to a peer; `None` for borrowed application memory,
    /// which never leaves this process.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Mapped { file, .. } => Some(file.as_fd()),
            Backing::Borrowed { .. } => None,
        }
    }

    /// A view of `offset..offset+len`, or `None` when it is not wholly inside.
    pub fn slice(self: &Arc<Self>, offset: u64, len: u64) -> Option<MemSlice> {
        let end = offset.checked_add(len)?;
        if len == 0 || end > self.len as u64 {
            return None;
        }
        Some(MemSlice {
            mem: Arc::clone(self),
            offset: usize::try_from(offset).ok()?,
            len: usize::try_from(len).ok()?,
        })
    }
}

/// How a long copy stores to its destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stores {
    /// Through the cache: the destination is read soon (a value handed to the caller).
    Cached,
    /// Past the cache ([`sys::stream_bytes`]) from [`STREAM_FROM`] bytes on: the
    /// destination is not read soon (a value written into the segment).
    Streamed,
}

/// Shortest copy written with non-temporal stores by [`Stores::Streamed`]: below it the
/// destination's lines are likely in cache already, and the cache keeps them.
const STREAM_FROM: usize = 256 << 10;

/// Copies `len` bytes from `src` to `dst` like [`sys::copy_bytes`], with SIGBUS inside
/// `mappings` recovered ([`guarded`]); a long copy between ranges that do not overlap
/// is split across threads ([`parallel`]) and stored as `stores` says.
///
/// # Safety
/// As for [`sys::copy_bytes`].
unsafe fn copy_long(
    src: *const u8,
    dst: *mut u8,
    len: usize,
    mappings: &[Guarded; 2],
    stores: Stores,
) {
    let (from, to) = (src.expose_provenance(), dst.expose_provenance());
    let overlap = from < to.saturating_add(len) && to < from.saturating_add(len);
    let streamed = stores == Stores::Streamed && !overlap && len >= STREAM_FROM;
    // Copies `len` bytes at `offset` of both ranges (inside them: the callers below).
    let copy = |offset: usize, len: usize| {
        let src: *const u8 = std::ptr::with_exposed_provenance(from + offset);
        let dst: *mut u8 = std::ptr::with_exposed_provenance_mut(to + offset);
        if streamed {
            // SAFETY: the caller's guarantee, for a part of its ranges, which do not
            // overlap (`streamed`).
            guarded(mappings, || unsafe { sys::stream_bytes(src, dst, len) });
        } else {
            // SAFETY: the caller's guarantee, for a part of its ranges.
            guarded(mappings, || unsafe { sys::copy_bytes(src, dst, len) });
        }
    };
    if overlap || len < 2 * parallel::MEMCPY_PIECE {
        copy(0, len);
        return;
    }
    // Each piece lies inside both of the caller's ranges, which stay valid until
    // `split_copy` returns.
    let _ = parallel::split_copy(len, parallel::MEMCPY_PIECE, &|offset, piece| {
        copy(offset, piece);
        Ok(())
    });
}

/// One piece of a vectored send ([`send_vectored`]).
#[derive(Clone, Copy, Debug)]
pub enum Outgoing<'a> {
    /// Bytes of this process (a frame header).
    Bytes(&'a [u8]),
    /// A mapped range (a payload).
    Slice(&'a MemSlice),
}

/// Sends every piece, in order, on a connected socket with as few system calls as the
/// socket's buffer allows (no intermediate buffer): headers and payloads of many frames
/// leave in one `sendmsg`.
pub fn send_vectored(
    socket: &impl std::os::fd::AsRawFd,
    pieces: &[Outgoing<'_>],
) -> std::io::Result<()> {
    let raw: Vec<(*const u8, usize)> = pieces
        .iter()
        .map(|piece| match piece {
            Outgoing::Bytes(bytes) => (bytes.as_ptr(), bytes.len()),
            Outgoing::Slice(slice) => (slice.ptr().cast_const(), slice.len),
        })
        .collect();
    // SAFETY: byte slices are borrowed for the call; mapped slices were bounds-checked
    // against mappings they keep alive, and they are borrowed for the call too.
    unsafe { sys::send_vectored_all(socket.as_raw_fd(), &raw) }
}

/// A bounds-checked range of some [`SharedMemory`] that keeps the mapping alive.
#[derive(Debug, Clone)]
pub struct MemSlice {
    mem: Arc<SharedMemory>,
    offset: usize,
    len: usize,
}

impl MemSlice {
    /// The mapping this slice lies in (to register it with a NIC once for all its
    /// slices).
    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.mem
    }

    /// The slice's address in this process.
    pub fn address(&self) -> u64 {
        self.mem.base() + self.offset as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty slices are never created.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: `offset < mem.len` was checked when the slice was made.
        unsafe { self.mem.ptr().add(self.offset) }
    }

    /// Copies `min(self.len, dst.len)` bytes from this slice into `dst`; returns the count.
    pub fn copy_to(&self, dst: &MemSlice) -> usize {
        self.copy_with(dst, Stores::Cached)
    }

    /// Like [`copy_to`](Self::copy_to), for a `dst` this process will not read soon (a
    /// value written into the segment): a long copy bypasses the cache, which spares
    /// reading the destination's lines first and evicting what the cache holds.
    pub fn stream_to(&self, dst: &MemSlice) -> usize {
        self.copy_with(dst, Stores::Streamed)
    }

    fn copy_with(&self, dst: &MemSlice, stores: Stores) -> usize {
        let len = self.len.min(dst.len);
        let mappings = [self.mem.guard(), dst.mem.guard()];
        // SAFETY: both slices were bounds-checked against live mappings they keep alive.
        unsafe { copy_long(self.ptr(), dst.ptr(), len, &mappings, stores) };
        len
    }

    /// Copies from ordinary memory into this slice; `src` must not be longer.
    pub fn write_from(&self, src: &[u8]) -> usize {
        let len = self.len.min(src.len());
        let mappings = [self.mem.guard(), Guarded::NONE];
        // SAFETY: `src` is a valid slice; the destination was bounds-checked.
        unsafe { copy_long(src.as_ptr(), self.ptr(), len, &mappings, Stores::Cached) };
        len
    }

    /// Copies this slice into ordinary memory; `dst` must not be longer.
    pub fn read_into(&self, dst: &mut [u8]) -> usize {
        let len = self.len.min(dst.len());
        let mappings = [self.mem.guard(), Guarded::NONE];
        // SAFETY: `dst` is a valid mutable slice; the source was bounds-checked.
        unsafe { copy_long(self.ptr(), dst.as_mut_ptr(), len, &mappings, Stores::Cached) };
        len
    }

    /// Sends the slice's bytes on a connected socket (no intermediate buffer).
    pub fn send_to(&self, socket: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
        // SAFETY: the slice was bounds-checked against a mapping it keeps alive.
        unsafe { sys::send_all(socket.as_raw_fd(), self.ptr(), self.len) }
    }

    /// Fills the slice from a connected socket (no intermediate buffer).
    pub fn recv_from(&self, socket: &impl std::os::fd::AsRawFd) -> std::io::Result<()> {
        // SAFETY: the slice was bounds-checked against a mapping it keeps alive.
        unsafe { sys::recv_all(socket.as_raw_fd(), self.ptr(), self.len) }
    }

    /// The slice's bytes, borrowed.
    ///
    /// # Safety
    /// Nobody, in this process or a peer, may write the range while the borrow lives.
    pub unsafe fn as_bytes(&self) -> &[u8] {
        // SAFETY: the range was bounds-checked against a mapping this slice keeps alive;
        // the caller guarantees it is not written meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// Runs `fill` on the slice's bytes as a mutable slice (for writers that produce
    /// bytes in place, like a file read), and returns what it returns.
    pub fn fill_with<R>(&self, fill: impl FnOnce(&mut [u8]) -> R) -> R {
        guarded(&[self.mem.guard()], || {
            // Opaque inside the section, as in `read_with`.
            let start = std::hint::black_box(self.ptr());
            // SAFETY: the range was bounds-checked against a mapping this slice keeps
            // alive; as for `write_from`, the range is this slice's holder's to write.
            fill(unsafe { std::slice::from_raw_parts_mut(start, self.len) })
        })
    }

    /// Runs `read` on the slice's bytes (for readers that consume them in place, like
    /// a GPU driver copying them to device memory) under the same guard as every copy
    /// here: a page a peer takes away meanwhile reads as zeros instead of ending the
    /// process, and [`is_poisoned`](Self::is_poisoned) then says the bytes were
    /// meaningless.
    ///
    /// # Safety
    /// Nobody, in this process or a peer, may write the range while `read` runs.
    pub unsafe fn read_with<R>(&self, read: impl FnOnce(&[u8]) -> R) -> R {
        guarded(&[self.mem.guard()], || {
            // The pointer is made opaque inside the section, so that no read of the
            // bytes can be scheduled before the guard is in place.
            let start = std::hint::black_box(self.ptr());
            // SAFETY: the range was bounds-checked against a mapping this slice keeps
            // alive; the caller guarantees it is not written meanwhile.
            read(unsafe { std::slice::from_raw_parts(start, self.len) })
        })
    }

    /// True once the mapping this slice lies in was poisoned
    /// ([`SharedMemory::is_poisoned`]): copies into or out of it may have moved
    /// meaningless bytes.
    pub fn is_poisoned(&self) -> bool {
        self.mem.is_poisoned()
    }

    /// Copies this slice into a new vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        self.read_into(&mut out);
        out
    }

    /// A sub-range of this slice, or `None` when it is not wholly inside.
    pub fn sub(&self, offset: u64, len: u64) -> Option<MemSlice> {
        let start = u64::try_from(self.offset).ok()?.checked_add(offset)?;
        let end = offset.checked_add(len)?;
        if end > self.len as u64 {
            return None;
        }
        self.mem.slice(start, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn streamed_copies_move_every_byte_whatever_the_alignment_and_length() {
        const LEN: usize = 4 << 20;
        let size = LEN as u64;
        let src = Arc::new(SharedMemory::create("src", size, PageSize::Normal).expect("src"));
        let dst = Arc::new(SharedMemory::create("dst", size, PageSize::Normal).expect("dst"));
        let pattern: Vec<u8> = (0..LEN)
            .map(|i| (i.wrapping_mul(7) ^ (i >> 8)).to_le_bytes()[0])
            .collect();
        src.slice(0, size).expect("all").write_from(&pattern);
        // Short copies (cached), streamed ones with unaligned heads and tails, and one
        // long enough to be split across threads.
        let cases: [(usize, usize, usize); 5] = [
            (0, 0, 4096),
            (3, 5, STREAM_FROM - 1),
            (1, 63, STREAM_FROM + 65),
            (64, 128, 1 << 20),
            (17, 4093, (3 << 20) + 77),
        ];
        for (from, to, len) in cases {
            dst.slice(0, size).expect("all").write_from(&vec![0u8; LEN]);
            let source = src.slice(from as u64, len as u64).expect("source");
            let target = dst.slice(to as u64, len as u64).expect("target");
            assert_eq!(source.stream_to(&target), len);
            let mut back = vec![0u8; LEN];
            dst.slice(0, size).expect("all").read_into(&mut back);
            assert_eq!(
                &back[to..to + len],
                &pattern[from..from + len],
                "{from} {to} {len}"
            );
            assert!(
                back[..to].iter().all(|&b| b == 0),
                "before {from} {to} {len}"
            );
            assert!(
                back[to + len..].iter().all(|&b| b == 0),
                "after {from} {to} {len}"
            );
        }
    }

    /// 2 MiB hugepages that are free and not reserved, from `/proc/meminfo`.
    fn available_hugepages() -> u64 {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| {
            info.lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        field("HugePages_Free:").saturating_sub(field("HugePages_Rsvd:"))
    }

    #[test]
    fn a_peer_taking_hugepages_away_poisons_the_mapping_instead_of_ending_the_process() {
        const HUGE: u64 = 2 << 20;
        if available_hugepages() < 2 {
            eprintln!(
                "skipped: needs two free 2 MiB hugepages (echo 8 > /proc/sys/vm/nr_hugepages)"
            );
            return;
        }
        // The peer's memfd: two hugepages, sealed against shrinking, mapped here as a
        // received segment.
        let peer =
            SharedMemory::create_with("peer", 2 * HUGE, PageSize::Huge2M, true).expect("hugepages");
        let fd = peer.fd().expect("memfd").try_clone_to_owned().expect("dup");
        let ours = Arc::new(SharedMemory::map_received(fd, 2 * HUGE).expect("map"));
        let first = ours.slice(0, 4096).expect("in range");
        let second = ours.slice(HUGE, 4096).expect("in range");
        first.write_from(b"before");
        // The peer punches a hole in its first page and takes every free hugepage, so
        // that nothing can refill it.
        // SAFETY: fallocate on a valid descriptor.
        let punched = unsafe {
            libc::fallocate(
                peer.fd().expect("memfd").as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                HUGE as libc::off_t,
            )
        };
        assert_eq!(punched, 0, "{}", std::io::Error::last_os_error());
        let left = available_hugepages();
        let _hog = (left > 0).then(|| {
            SharedMemory::create_with("hog", left * HUGE, PageSize::Huge2M, true)
                .expect("the remaining hugepages")
        });

        // A reader consuming the bytes in place (a GPU driver copying them to device
        // memory on this thread) is guarded too: without it, SIGBUS ends the test.
        // SAFETY: nothing writes the range meanwhile.
        let sum =
            unsafe { first.read_with(|bytes| bytes.iter().map(|&b| u64::from(b)).sum::<u64>()) };
        assert_eq!(sum, 0, "the page taken away reads as zeros");
        assert!(first.is_poisoned() && ours.is_poisoned());
        // Without the guard this copy raises SIGBUS and the test binary dies.
        first.write_from(&[1u8; 4096]);
        let mut back = [0u8; 8];
        assert_eq!(
            first.read_into(&mut back),
            8,
            "the page is private memory now"
        );
        second.write_from(b"after");
        assert_eq!(second.to_vec()[..5], *b"after");
        assert!(
            !peer.is_poisoned(),
            "only the mapping that faulted is poisoned"
        );
    }

    #[test]
    fn create_seal_and_map_again() {
        let mem = Arc::new(SharedMemory::create("test", 10_000, PageSize::Normal).expect("create"));
        assert_eq!(mem.len(), 12_288, "rounded to pages");
        let dup = mem.fd().expect("memfd").try_clone_to_owned().expect("dup");
        let peer = Arc::new(SharedMemory::map_received(dup, 12_288).expect("map"));
        mem.slice(100, 5).expect("in range").write_from(b"hello");
        assert_eq!(peer.slice(100, 5).expect("in range").to_vec(), b"hello");
        assert!(mem.slice(12_000, 289).is_none());
        assert!(mem.slice(0, 0).is_none());
        assert!(mem.slice(u64::MAX, 2).is_none());
        assert!(
            nix::unistd::ftruncate(mem.fd().expect("memfd"), 10).is_err(),
            "sealed against shrinking"
        );
        let _ = mem.fd().expect("memfd").as_raw_fd();
    }

    #[test]
    fn borrowed_memory_is_used_in_place() {
        let mut buffer = vec![0u8; 64];
        // SAFETY: `buffer` outlives `mem` and every slice of it in this test.
        let mem = Arc::new(
            unsafe { SharedMemory::borrowed(buffer.as_mut_ptr() as u64, 64) }.expect("wrap"),
        );
        assert!(mem.is_borrowed() && mem.fd().is_none());
        mem.slice(8, 3).expect("in range").write_from(b"abc");
        assert!(mem.slice(60, 5).is_none());
        mem.prefault();
        drop(mem);
        assert_eq!(&buffer[8..11], b"abc");
        // SAFETY: never dereferenced: refused before wrapping.
        assert!(unsafe { SharedMemory::borrowed(0, 64) }.is_err());
    }

    #[test]
    fn rejects_unsealed_or_short_fds() {
        let plain = memfd::MemfdOptions::default()
            .create("plain")
            .expect("memfd");
        plain.as_file().set_len(4096).expect("size");
        let fd = OwnedFd::from(plain.into_file());
        assert!(matches!(
            SharedMemory::map_received(fd, 4096),
            Err(ShmError::NotSealed)
        ));

        let mem = SharedMemory::create("short", 4096, PageSize::Normal).expect("create");
        let dup = mem.fd().expect("memfd").try_clone_to_owned().expect("dup");
        assert!(matches!(
            SharedMemory::map_received(dup, 1 << 20),
            Err(ShmError::TooSmall { .. })
        ));
    }
}
