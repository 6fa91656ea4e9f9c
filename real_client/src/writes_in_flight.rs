//! Writes into this node's segment whose keys the master may already show readable
//! while their bytes are still being copied.
//!
//! A put into a reservation sends its commit to a remote master before its copy has
//! finished, so that the round trip and the copy overlap (see `Store::put_many`). Until
//! the copy is done, a reader that the master already pointed at those bytes must wait:
//! every read of this node's segment (a local copy, a peer's read through the transfer
//! server, the SSD tier's offload, a replication task) asks [`WritesInFlight::settle`]
//! first. With no write in flight that is one atomic load.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use mooncake_core::error::{CodeResult, ErrorCode};

/// Longest a read waits for a write in flight before it gives up with
/// `TRANSFER_FAIL` (a copy of the largest reserved value takes well under a millisecond;
/// this only bounds a writer that stopped making progress).
pub const MAX_SETTLE_WAIT: Duration = Duration::from_secs(5);

/// One write in flight: a range of the segment and whether its copy failed.
#[derive(Debug)]
struct Flight {
    ticket: u64,
    offset: u64,
    len: u64,
    failed: bool,
}

impl Flight {
    fn overlaps(&self, offset: u64, len: u64) -> bool {
        offset < self.offset.saturating_add(self.len) && self.offset < offset.saturating_add(len)
    }
}

/// The writes in flight in one segment.
#[derive(Debug, Default)]
pub struct WritesInFlight {
    /// How many ranges are held (read without the lock by readers' fast path).
    held: AtomicUsize,
    flights: Mutex<Vec<Flight>>,
    next_ticket: AtomicU64,
    changed: Condvar,
}

impl WritesInFlight {
    /// Holds `ranges` (`(offset, len)` of the segment) until the returned guard is
    /// dropped: reads overlapping them wait.
    pub fn hold(&self, ranges: impl IntoIterator<Item = (u64, u64)>) -> HeldWrites<'_> {
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let mut flights = self.flights.lock();
        let before = flights.len();
        flights.extend(ranges.into_iter().map(|(offset, len)| Flight {
            ticket,
            offset,
            len,
            failed: false,
        }));
        let count = flights.len() - before;
        self.held.fetch_add(count, Ordering::SeqCst);
        HeldWrites {
            writes: self,
            ticket,
        }
    }

    /// Returns once no write in flight overlaps `len` bytes at `offset`:
    /// `TRANSFER_FAIL` when one that did failed its copy (the bytes are not the
    /// object's), or did not finish within [`MAX_SETTLE_WAIT`].
    pub fn settle(&self, offset: u64, len: u64) -> CodeResult<()> {
        if self.held.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + MAX_SETTLE_WAIT;
        let mut flights = self.flights.lock();
        loop {
            let overlapping = flights.iter().find(|f| f.overlaps(offset, len));
            match overlapping {
                None => return Ok(()),
                Some(flight) if flight.failed => return Err(ErrorCode::TRANSFER_FAIL),
                Some(_) => {
                    if self.changed.wait_until(&mut flights, deadline).timed_out() {
                        tracing::warn!(
                            offset,
                            len,
                            "a read waited too long for a write into the same bytes"
                        );
                        return Err(ErrorCode::TRANSFER_FAIL);
                    }
                }
            }
        }
    }

    /// Ranges held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
}

/// Ranges held by one writer; released (waiting reads go on) when dropped.
#[derive(Debug)]
#[must_use = "the ranges are released when this is dropped"]
pub struct HeldWrites<'a> {
    writes: &'a WritesInFlight,
    ticket: u64,
}

impl HeldWrites<'_> {
    /// Marks the held ranges that overlap `len` bytes at `offset` as failed: reads
    /// waiting for them, or coming before this guard is dropped, fail instead of
    /// reading bytes that are not the object's.
    pub fn fail(&self, offset: u64, len: u64) {
        let mut flights = self.writes.flights.lock();
        for flight in flights.iter_mut() {
            if flight.ticket == self.ticket && flight.overlaps(offset, len) {
                flight.failed = true;
            }
        }
        drop(flights);
        self.writes.changed.notify_all();
    }
}

impl Drop for HeldWrites<'_> {
    fn drop(&mut self) {
        let mut flights = self.writes.flights.lock();
        let before = flights.len();
        flights.retain(|f| f.ticket != self.ticket);
        let released = before - flights.len();
        self.writes.held.fetch_sub(released, Ordering::SeqCst);
        drop(flights);
        self.writes.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_read_of_held_bytes_waits_for_the_writer_and_others_do_not() {
        let writes = Arc::new(WritesInFlight::default());
        let held = writes.hold([(4096, 4096)]);
        assert_eq!(writes.held(), 1);
        // Bytes next to the held range are read at once.
        writes.settle(0, 4096).expect("before the held range");
        writes.settle(8192, 100).expect("after the held range");
        let reader = {
            let writes = Arc::clone(&writes);
            std::thread::spawn(move || {
                let started = Instant::now();
                writes.settle(6000, 10).map(|()| started.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
        let waited = reader.join().expect("reader").expect("settled");
        assert!(waited >= Duration::from_millis(40), "waited {waited:?}");
        assert_eq!(writes.held(), 0);
    }

    #[test]
    fn a_read_of_bytes_whose_copy_failed_fails() {
        let writes = Arc::new(WritesInFlight::default());
        let held = writes.hold([(0, 100), (100, 100)]);
        let reader = {
            let writes = Arc::clone(&writes);
            std::thread::spawn(move || writes.settle(150, 10))
        };
        std::thread::sleep(Duration::from_millis(20));
        held.fail(100, 100);
        assert_eq!(
            reader.join().expect("reader"),
            Err(ErrorCode::TRANSFER_FAIL)
        );
        assert_eq!(writes.settle(120, 1), Err(ErrorCode::TRANSFER_FAIL));
        // The range that did not fail waits as before; released, both read.
        drop(held);
        writes.settle(0, 200).expect("released");
    }

    #[test]
    fn two_writers_release_only_their_own_ranges() {
        let writes = WritesInFlight::default();
        let first = writes.hold([(0, 10)]);
        let second = writes.hold([(20, 10)]);
        drop(first);
        assert_eq!(writes.held(), 1);
        writes.settle(0, 10).expect("first released");
        drop(second);
        assert_eq!(writes.held(), 0);
    }
}
