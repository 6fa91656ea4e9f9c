//! The hard-pin quota of one dummy. Hard-pinned objects are never evicted, so without a
//! bound one dummy could fill the cluster's memory for good; each dummy may hold at
//! most `--max_hard_pinned_bytes_per_dummy` of them (further hard-pinned puts fail with
//! `NO_AVAILABLE_HANDLE`). Removed objects stop counting: when the quota looks full, the
//! keys are checked with the master first.

use std::collections::HashMap;

/// The hard-pinned objects one dummy wrote (by key, with their sizes) and the bytes of
/// its hard-pinned puts in progress.
#[derive(Debug, Default)]
pub struct HardPins {
    sizes: HashMap<String, u64>,
    /// Sum of `sizes`.
    stored: u64,
    /// Bytes of puts admitted and not finished.
    reserved: u64,
}

impl HardPins {
    /// Bytes counted against the quota.
    pub fn bytes(&self) -> u64 {
        self.stored.saturating_add(self.reserved)
    }

    /// Reserves `bytes` for a put when they fit under `limit`; false otherwise.
    pub fn reserve(&mut self, bytes: u64, limit: u64) -> bool {
        let fits = self.bytes().saturating_add(bytes) <= limit;
        if fits {
            self.reserved = self.reserved.saturating_add(bytes);
        }
        fits
    }

    /// Ends a put that reserved `reserved` bytes; `written` are the `(key, size)` pairs
    /// it stored (a key written again counts once, at its new size).
    pub fn finish(&mut self, reserved: u64, written: impl IntoIterator<Item = (String, u64)>) {
        self.reserved = self.reserved.saturating_sub(reserved);
        for (key, size) in written {
            let old = self.sizes.insert(key, size).unwrap_or(0);
            self.stored = self.stored.saturating_sub(old).saturating_add(size);
        }
    }

    /// Stops counting `key` (the object is gone).
    pub fn forget(&mut self, key: &str) {
        if let Some(size) = self.sizes.remove(key) {
            self.stored = self.stored.saturating_sub(size);
        }
    }

    /// The keys counted.
    pub fn keys(&self) -> Vec<String> {
        self.sizes.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::HardPins;

    #[test]
    fn reservations_and_writes_count_until_forgotten() {
        let mut pins = HardPins::default();
        assert!(pins.reserve(60, 100));
        assert!(!pins.reserve(50, 100), "60 reserved + 50 > 100");
        pins.finish(60, [("a".to_string(), 60)]);
        assert_eq!(pins.bytes(), 60);
        pins.finish(0, [("a".to_string(), 30)]);
        assert_eq!(pins.bytes(), 30, "a key written again counts once");
        assert!(pins.reserve(70, 100));
        pins.finish(70, Vec::new());
        assert_eq!(pins.bytes(), 30, "a failed put frees its reservation");
        pins.forget("a");
        assert_eq!(pins.bytes(), 0);
        assert!(pins.keys().is_empty());
    }
}
