//! The master's notion of time, injectable so lease and timeout logic is testable
//! without sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock: the system clock, or a manual one that tests advance by hand.
#[derive(Clone, Debug)]
pub enum Clock {
    /// `Instant::now()`.
    System,
    /// A fixed origin plus an offset that only [`Clock::advance`] moves.
    Manual {
        /// The instant that offset 0 stands for.
        origin: Instant,
        /// Nanoseconds elapsed since `origin`.
        offset_nanos: Arc<AtomicU64>,
    },
}

impl Clock {
    /// A manual clock starting now.
    pub fn manual() -> Self {
        Clock::Manual {
            origin: Instant::now(),
            offset_nanos: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The current instant.
    pub fn now(&self) -> Instant {
        match self {
            Clock::System => Instant::now(),
            Clock::Manual {
                origin,
                offset_nanos,
            } => *origin + Duration::from_nanos(offset_nanos.load(Ordering::Relaxed)),
        }
    }

    /// Moves a manual clock forward; no effect on the system clock.
    pub fn advance(&self, by: Duration) {
        if let Clock::Manual { offset_nanos, .. } = self {
            let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
            offset_nanos.fetch_add(nanos, Ordering::Relaxed);
        }
    }
}
