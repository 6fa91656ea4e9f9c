//! Keeping the journal as the embedded master changes objects ([`SegmentJournal`]),
//! and giving a restarted master the objects found whole ([`recover`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mooncake_core::master_api::replication::ObjectImage;
use mooncake_master::{MasterService, ObjectObserver};
use mooncake_offload::checksum::crc32c;

use super::SegmentFile;
use super::journal::Placement;

/// Follows the embedded master's object changes and journals those of this node's
/// segment.
pub struct SegmentJournal {
    file: Arc<SegmentFile>,
    /// The segment's id at the master.
    segment: AtomicU64,
}

impl SegmentJournal {
    /// Journals the objects of segment `segment` (its id at the master) into `file`.
    pub fn new(file: Arc<SegmentFile>, segment: u64) -> Self {
        SegmentJournal {
            file,
            segment: AtomicU64::new(segment),
        }
    }

    fn checksum(&self, offset: u64, size: u64) -> Option<u32> {
        if size == 0 {
            return Some(crc32c(&[]));
        }
        let slice = self.file.memory().slice(offset, size)?;
        // SAFETY: the object is committed: its space is written by nobody until the
        // master frees it, which happens only after this record (the key's shard is
        // locked by the caller).
        Some(crc32c(unsafe { slice.as_bytes() }))
    }
}

impl ObjectObserver for SegmentJournal {
    fn object_changed(&self, key: &str, image: Option<&ObjectImage>) {
        let segment = self.segment.load(Ordering::Acquire);
        let here = image
            .and_then(|image| image.readable.as_ref())
            .and_then(|version| {
                let replica = version.replicas.iter().find(|r| r.segment == segment)?;
                Some((replica.offset, replica.len, version.size))
            });
        let Some((offset, len, size)) = here else {
            self.file.record_gone(key);
            return;
        };
        if self.file.is_recorded(key, offset, size) {
            return;
        }
        match self.checksum(offset, size) {
            Some(value_crc) => self.file.record_committed(
                key,
                Placement {
                    offset,
                    len,
                    size,
                    value_crc,
                },
            ),
            None => self.file.record_gone(key),
        }
    }
}

/// What a restart found in the segment file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Objects served again.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Objects whose bytes no longer match their checksum (or lie outside the segment):
    /// dropped, never served.
    pub damaged: u64,
    /// Objects the master would not take back (overlapping space, a key twice).
    pub refused: u64,
    /// How long checking and reinstalling took.
    pub elapsed: Duration,
}

/// Checks each object of `committed` against its checksum and installs the whole ones
/// in `master` as readable objects of segment `segment`; the journal records the
/// others as gone. Run before the node serves anyone.
pub fn recover(
    file: &SegmentFile,
    committed: HashMap<String, Placement>,
    master: &MasterService,
    segment: u64,
) -> Recovered {
    let started = Instant::now();
    let mut found = Recovered::default();
    // In offset order: the segment is read front to back.
    let mut objects: Vec<(String, Placement)> = committed.into_iter().collect();
    objects.sort_unstable_by_key(|(_, placement)| placement.offset);
    for (key, placement) in objects {
        if !is_whole(file, &placement) {
            found.damaged += 1;
            file.record_gone(&key);
            continue;
        }
        if master.adopt_object(
            &key,
            segment,
            placement.offset,
            placement.len,
            placement.size,
        ) {
            found.objects += 1;
            found.bytes += placement.size;
        } else {
            found.refused += 1;
            file.record_gone(&key);
        }
    }
    found.elapsed = started.elapsed();
    found
}

fn is_whole(file: &SegmentFile, placement: &Placement) -> bool {
    if placement.size > placement.len {
        return false;
    }
    if placement.size == 0 {
        return placement.value_crc == crc32c(&[]);
    }
    let Some(slice) = file.memory().slice(placement.offset, placement.size) else {
        return false;
    };
    // SAFETY: nobody writes the segment yet: the node serves no one during recovery.
    crc32c(unsafe { slice.as_bytes() }) == placement.value_crc
}
