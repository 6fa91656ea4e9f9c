//! How one batched get reads its records.
//!
//! Records that lie in order in one file and are not in the page cache are streamed
//! straight from the device ([`DirectRun`]); any other record (and any the stream
//! cannot serve) is read through the page cache, the next ones hinted to the kernel
//! ([`ReadAhead`]). Either way each read leaves the value unchecked in its
//! destination, for [`ReadPlan::finish_read`] to check.

use crate::backend::{ReadPlan, StoreError, UncheckedRead};
use crate::direct_run::DirectRun;
use crate::read_ahead::ReadAhead;

/// The reads of one batch (see the module documentation).
pub struct BatchReader<'p> {
    direct: Option<DirectRun>,
    ahead: ReadAhead<'p>,
}

impl<'p> BatchReader<'p> {
    /// The reader of a batch reading `plans` in this order (`None`: an item with
    /// nothing to read).
    pub fn new(plans: Vec<Option<&'p ReadPlan>>) -> Self {
        match DirectRun::start(&plans) {
            Some(direct) => BatchReader {
                direct: Some(direct),
                ahead: ReadAhead::none(),
            },
            None => BatchReader {
                direct: None,
                ahead: ReadAhead::new(plans),
            },
        }
    }

    /// A reader that reads every record through the page cache, without hints (for
    /// comparing with [`new`](Self::new)).
    pub fn unaided() -> Self {
        BatchReader {
            direct: None,
            ahead: ReadAhead::none(),
        }
    }

    /// True when the batch's records are streamed from the device.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// Reads item `index` (whose plan is `plan`) as [`ReadPlan::read_unchecked`]
    /// does: the value into the start of `dest`, unchecked. A direct stream serves
    /// items read in order by one thread at a time (as the schedules of
    /// [`crate::parallel_reads`] read records that lie in order); any other item is
    /// read through the page cache.
    pub fn read_unchecked(
        &self,
        index: usize,
        plan: &ReadPlan,
        dest: &mut [u8],
    ) -> Result<UncheckedRead, StoreError> {
        if let Some(read) = self
            .direct
            .as_ref()
            .and_then(|run| run.read_unchecked(index, dest))
        {
            return Ok(read);
        }
        self.ahead.before_read(index);
        plan.read_unchecked(dest)
    }
}
