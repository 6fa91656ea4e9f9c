//! The SSD tier's staging buffer: memory that disk reads served to peers land in
//! before they are sent, bounded by `MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES`.
//!
//! A read takes a [`StagedBytes`] lease on a block; the block returns to the pool only
//! when the lease is dropped (after the bytes were sent), so a slow reader never sees
//! its memory reused. When the pool is exhausted, new reads wait for a lease to end, at
//! most [`WAIT`]; a read larger than the whole pool runs alone. Blocks are kept for
//! reuse, so steady reads do not pay page faults for fresh memory.

use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use mooncake_core::error::{CodeResult, ErrorCode};

/// How long a read waits for staging memory before giving up (`BUFFER_OVERFLOW`).
pub const WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct Blocks {
    /// Bytes leased out.
    leased: u64,
    /// Blocks kept for reuse.
    free: Vec<Vec<u8>>,
    /// Bytes of the kept blocks.
    kept: u64,
}

/// The staging pool of one node.
#[derive(Debug)]
pub struct StagingPool {
    capacity: u64,
    blocks: Mutex<Blocks>,
    returned: Condvar,
}

/// A leased block of the pool holding one value; returned when dropped.
#[derive(Debug)]
pub struct StagedBytes<'a> {
    pool: &'a StagingPool,
    block: Vec<u8>,
    len: usize,
}

impl std::ops::Deref for StagedBytes<'_> {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.block[..self.len]
    }
}

impl std::ops::DerefMut for StagedBytes<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.block[..self.len]
    }
}

impl Drop for StagedBytes<'_> {
    fn drop(&mut self) {
        let block = std::mem::take(&mut self.block);
        let mut blocks = self.pool.blocks.lock();
        blocks.leased -= block.len() as u64;
        if blocks.leased + blocks.kept + block.len() as u64 <= self.pool.capacity {
            blocks.kept += block.len() as u64;
            blocks.free.push(block);
        }
        drop(blocks);
        self.pool.returned.notify_all();
    }
}

impl StagingPool {
    /// A pool of at most `capacity` bytes (leased and kept together).
    pub fn new(capacity: u64) -> Self {
        StagingPool {
            capacity,
            blocks: Mutex::new(Blocks::default()),
            returned: Condvar::new(),
        }
    }

    /// Bytes leased out now.
    #[cfg(test)]
    pub fn leased(&self) -> u64 {
        self.blocks.lock().leased
    }

    /// Leases a block of `len` bytes, waiting up to [`WAIT`] for room.
    pub fn lease(&self, len: u64) -> CodeResult<StagedBytes<'_>> {
        let size = usize::try_from(len).map_err(|_| ErrorCode::INVALID_PARAMS)?;
        let mut blocks = self.blocks.lock();
        let deadline = std::time::Instant::now() + WAIT;
        // Room when the lease fits next to the others, or when it runs alone.
        while blocks.leased > 0 && blocks.leased + len > self.capacity {
            if self.returned.wait_until(&mut blocks, deadline).timed_out() {
                return Err(ErrorCode::BUFFER_OVERFLOW);
            }
        }
        let block = match blocks.free.iter().position(|b| b.len() >= size) {
            Some(index) => {
                let block = blocks.free.swap_remove(index);
                blocks.kept -= block.len() as u64;
                block
            }
            None => {
                // Make room for a new block by dropping kept ones.
                while blocks.leased + blocks.kept + len > self.capacity {
                    let Some(old) = blocks.free.pop() else { break };
                    blocks.kept -= old.len() as u64;
                }
                vec![0u8; size]
            }
        };
        blocks.leased += block.len() as u64;
        Ok(StagedBytes {
            pool: self,
            block,
            len: size,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reused_only_after_their_lease_ends() {
        let pool = StagingPool::new(1 << 20);
        let mut first = pool.lease(600 << 10).expect("lease");
        first.fill(1);
        let address = first.as_ptr();
        // The pool cannot give the same memory while `first` lives.
        let second = pool.lease(300 << 10).expect("lease");
        assert_ne!(second.as_ptr(), address);
        assert!(first.iter().all(|b| *b == 1));
        drop(second);
        drop(first);
        assert_eq!(pool.leased(), 0);
        let again = pool.lease(500 << 10).expect("lease");
        assert_eq!(again.as_ptr(), address, "a returned block is reused");
        assert_eq!(again.len(), 500 << 10);
    }

    #[test]
    fn a_full_pool_makes_readers_wait_and_oversized_reads_run_alone() {
        let pool = std::sync::Arc::new(StagingPool::new(1 << 20));
        let held = pool.lease(900 << 10).expect("lease");
        let waiter = {
            let pool = std::sync::Arc::clone(&pool);
            std::thread::spawn(move || pool.lease(400 << 10).map(|b| b.len()))
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished(), "no room: the second reader waits");
        drop(held);
        assert_eq!(waiter.join().expect("join"), Ok(400 << 10));
        let big = pool.lease(4 << 20).expect("runs alone");
        assert_eq!(big.len(), 4 << 20);
    }
}
