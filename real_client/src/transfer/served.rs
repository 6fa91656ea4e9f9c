//! The segment a real client serves to its peers, whatever transport reaches it.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use mooncake_shm::SharedMemory;

use crate::writes_in_flight::WritesInFlight;

/// What the server serves: the segment and its current id at the master (it changes
/// when the segment is mounted again).
#[derive(Debug)]
pub struct ServedSegment {
    /// The memory.
    pub memory: Arc<SharedMemory>,
    /// Current segment id (0 while not mounted).
    pub id: AtomicU64,
    /// False for a pure client (`--global_segment_size=0`): it mounts nothing and
    /// every object it writes lives on other nodes.
    pub contributes: bool,
    /// The segment's name at the master (disk-read grants name it).
    pub name: String,
    /// Writes whose keys may be readable before their bytes are copied: every read of
    /// the memory settles with them first.
    pub writes: WritesInFlight,
    /// The file the segment lives in (`--segment_path`), with the journal of its
    /// objects; `None` for a segment in a memfd.
    pub file: Option<Arc<crate::segment_file::SegmentFile>>,
}

impl ServedSegment {
    /// The segment file's generation (0 for a memfd, whose memory dies with the
    /// process).
    pub fn generation(&self) -> u128 {
        self.file.as_ref().map_or(0, |file| file.generation())
    }
}
