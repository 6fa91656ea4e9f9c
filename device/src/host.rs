//! Whether an address of this process is host memory the CPU may read, asked of the
//! kernel (`process_vm_readv` on this process) instead of touched: a device pointer,
//! an unmapped page or a `PROT_NONE` reservation answers `EFAULT` instead of crashing.

use std::io::IoSliceMut;

use nix::errno::Errno;
use nix::sys::uio::{RemoteIoVec, process_vm_readv};
use nix::unistd::Pid;

/// True when the bytes at `first` and `last` can be read by this process; false when
/// either is not readable memory; `None` when the kernel cannot tell (a seccomp filter
/// or a kernel without `process_vm_readv`).
pub fn is_readable(first: u64, last: u64) -> Option<bool> {
    for addr in [first, last] {
        match read_one(addr) {
            Ok(()) => {}
            Err(Errno::EFAULT) => return Some(false),
            Err(_) => return None,
        }
    }
    Some(true)
}

fn read_one(addr: u64) -> Result<(), Errno> {
    let base = usize::try_from(addr).map_err(|_| Errno::EFAULT)?;
    let mut byte = [0u8; 1];
    let mut local = [IoSliceMut::new(&mut byte)];
    let remote = [RemoteIoVec { base, len: 1 }];
    process_vm_readv(Pid::this(), &mut local, &remote).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heap_is_readable_and_a_reservation_is_not() {
        let heap = [1u8; 100];
        let start = heap.as_ptr() as u64;
        assert_eq!(is_readable(start, start + 99), Some(true));
        assert_eq!(is_readable(0, 0), Some(false));
        let len = std::num::NonZeroUsize::new(1 << 16).expect("non-zero");
        // SAFETY: a fresh anonymous reservation, never accessed, unmapped below.
        let reserved = unsafe {
            nix::sys::mman::mmap_anonymous(
                None,
                len,
                nix::sys::mman::ProtFlags::PROT_NONE,
                nix::sys::mman::MapFlags::MAP_PRIVATE,
            )
        }
        .expect("mmap");
        let addr = reserved.as_ptr() as u64;
        assert_eq!(is_readable(addr, addr + 10), Some(false));
        assert_eq!(
            is_readable(start, addr),
            Some(false),
            "last byte unreadable"
        );
        // SAFETY: the reservation made above, not used after this.
        unsafe { nix::sys::mman::munmap(reserved, len.get()) }.expect("munmap");
    }
}
