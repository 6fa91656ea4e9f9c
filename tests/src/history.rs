//! A history checker: a small model of what the store promises
//! (`docs/eviction-and-leases.md`, "What a history may show"), applied to a recording of
//! operations and their results.
//!
//! A recording is a list of [`Event`]s: one per call a client made (its key, when it
//! was invoked and when it returned, on one clock, and what it answered) plus the
//! store's own logged events (an eviction, a lease or soft pin that lapsed) that explain
//! why an object may be gone. Values name themselves: a read answers the [`ValueId`] it
//! found in the bytes, or [`Read::Torn`] when the bytes are no value ever written
//! whole.
//!
//! The checker reports, per key:
//! * [`Violation::LostWrite`]: an acknowledged put or upsert whose key later reads
//!   absent, with no remove (acknowledged or in doubt), eviction or expiry since;
//! * [`Violation::NeverWritten`]: a read answering bytes no write of that key carried
//!   (or torn bytes);
//! * [`Violation::StaleAfterUpsert`]: a read, invoked after an upsert was acknowledged,
//!   answering a value whose write was acknowledged before that upsert was invoked;
//! * [`Violation::ReadableAfterRemove`]: a read, invoked after a remove was
//!   acknowledged, answering a value whose write was acknowledged before the remove was
//!   invoked.
//!
//! Writes whose outcome is unknown (the client died, the call failed in transport) may
//! or may not have happened: the checker accepts either.

use std::collections::{BTreeMap, HashMap, HashSet};

/// Identifies one written value of one key (embedded in its bytes by the writer).
pub type ValueId = u64;

/// What a read answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// The object is not stored.
    Absent,
    /// The bytes of one written value.
    Value(ValueId),
    /// Bytes that are no value written whole (torn or mixed).
    Torn,
}

/// One recorded call or store event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// A put of `value` (never replaces an existing object).
    Put(ValueId),
    /// An upsert of `value` (replaces the object once complete).
    Upsert(ValueId),
    /// A read and what it answered (when it answered).
    Get(Option<Read>),
    /// A remove.
    Remove,
    /// The store evicted the key's object (a logged event).
    Evicted,
    /// The object's lease or soft pin lapsed and the store dropped it (a logged event).
    Expired,
}

/// How a call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It succeeded.
    Ok,
    /// It failed with this code, and changed nothing.
    Failed(i32),
    /// Unknown: it may or may not have taken effect (a transport failure, a crash).
    Unknown,
}

/// One entry of a recording.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// The key.
    pub key: String,
    /// What was done.
    pub op: Op,
    /// When it was invoked (for store events: when it happened).
    pub invoked: u64,
    /// When it returned (for store events: the same as `invoked`).
    pub returned: u64,
    /// How it ended (store events: [`Outcome::Ok`]).
    pub outcome: Outcome,
}

/// A broken promise, with the events that show it (indexes into the recording).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// A read answered absent after a write was acknowledged, with nothing to explain it.
    LostWrite {
        /// The key.
        key: String,
        /// The acknowledged put or upsert.
        write: usize,
        /// The read that found nothing.
        read: usize,
    },
    /// A read answered bytes no write of the key carried (or torn bytes).
    NeverWritten {
        /// The key.
        key: String,
        /// The read.
        read: usize,
    },
    /// A read invoked after an upsert was acknowledged answered an older value.
    StaleAfterUpsert {
        /// The key.
        key: String,
        /// The acknowledged upsert.
        upsert: usize,
        /// The read.
        read: usize,
        /// The older value it answered.
        value: ValueId,
    },
    /// A read invoked after a remove was acknowledged answered a value written before it.
    ReadableAfterRemove {
        /// The key.
        key: String,
        /// The acknowledged remove.
        remove: usize,
        /// The read.
        read: usize,
        /// The value it answered.
        value: ValueId,
    },
}

/// Every broken promise in `events`, key by key, in order of the reads that show them.
/// Each key is checked in O(n log n) of its events, so a ten-minute recording of
/// hundreds of thousands of calls checks in seconds.
pub fn check(events: &[Event]) -> Vec<Violation> {
    let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (index, event) in events.iter().enumerate() {
        by_key.entry(event.key.as_str()).or_default().push(index);
    }
    let mut found = Vec::new();
    for (key, indexes) in by_key {
        KeyHistory::new(key, events, indexes).check(&mut found);
    }
    found
}

/// Events sorted by one time, each with the largest other time of it and the events
/// before it: answers "of the events whose `sort` time is below `t`, which has the
/// largest `max` time" in O(log n).
struct PrefixMax {
    /// `sort` times, ascending.
    keys: Vec<u64>,
    /// For each prefix `..=i`: the largest `max` time and its event.
    best: Vec<(u64, usize)>,
}

impl PrefixMax {
    /// Over `(sort, max, event)` triples.
    fn new(mut items: Vec<(u64, u64, usize)>) -> Self {
        items.sort_unstable();
        let mut best: Vec<(u64, usize)> = Vec::with_capacity(items.len());
        for &(_, max, event) in &items {
            let next = match best.last() {
                Some(&(top, at)) if top >= max => (top, at),
                _ => (max, event),
            };
            best.push(next);
        }
        PrefixMax {
            keys: items.iter().map(|&(sort, _, _)| sort).collect(),
            best,
        }
    }

    /// Of the events whose `sort` time is below `limit` (or at most `limit` when
    /// `inclusive`), the largest `max` time and its event.
    fn before(&self, limit: u64, inclusive: bool) -> Option<(u64, usize)> {
        let count = self
            .keys
            .partition_point(|&k| if inclusive { k <= limit } else { k < limit });
        count.checked_sub(1).map(|last| self.best[last])
    }
}

/// The events of one key, and what the checks look up in them.
struct KeyHistory<'a> {
    key: &'a str,
    events: &'a [Event],
    indexes: Vec<usize>,
    /// The write (that may have happened) of each value.
    writes: HashMap<ValueId, usize>,
    /// Acknowledged upserts and removes by return time, largest invocation time first:
    /// what a later read may not see past.
    overwrites: PrefixMax,
    /// Acknowledged writes that stored their own value, by return time, largest
    /// invocation time first.
    stored: PrefixMax,
    /// Everything that may have removed the object, by invocation time, latest return
    /// time first.
    removals: PrefixMax,
}

impl<'a> KeyHistory<'a> {
    fn new(key: &'a str, events: &'a [Event], indexes: Vec<usize>) -> Self {
        let each = || indexes.iter().map(|&i| (i, &events[i]));
        let writes = each()
            .filter_map(|(i, e)| match e.op {
                Op::Put(v) | Op::Upsert(v) if e.outcome.may_have_happened() => Some((v, i)),
                _ => None,
            })
            .collect();
        let overwrites = PrefixMax::new(
            each()
                .filter(|(_, e)| {
                    e.outcome == Outcome::Ok && matches!(e.op, Op::Upsert(_) | Op::Remove)
                })
                .map(|(i, e)| (e.returned, e.invoked, i))
                .collect(),
        );
        let deferred = deferred_puts(events, &indexes);
        let stored = PrefixMax::new(
            each()
                .filter(|(i, e)| {
                    e.outcome == Outcome::Ok
                        && matches!(e.op, Op::Put(_) | Op::Upsert(_))
                        && !deferred.contains(i)
                })
                .map(|(i, e)| (e.returned, e.invoked, i))
                .collect(),
        );
        let removals = PrefixMax::new(
            each()
                .filter(|(_, e)| match e.op {
                    Op::Remove => e.outcome.may_have_happened(),
                    Op::Evicted | Op::Expired => true,
                    _ => false,
                })
                .map(|(i, e)| (e.invoked, e.returned, i))
                .collect(),
        );
        KeyHistory {
            key,
            events,
            indexes,
            writes,
            overwrites,
            stored,
            removals,
        }
    }

    fn check(&self, found: &mut Vec<Violation>) {
        for &read in &self.indexes {
            let event = &self.events[read];
            let Op::Get(Some(answer)) = event.op else {
                continue;
            };
            if event.outcome != Outcome::Ok {
                continue;
            }
            match answer {
                Read::Torn => found.push(Violation::NeverWritten {
                    key: self.key.to_string(),
                    read,
                }),
                Read::Value(value) => self.check_value(read, event, value, found),
                Read::Absent => self.check_absent(read, event, found),
            }
        }
    }

    /// A read of `value`: some write carried it, and no upsert or remove acknowledged
    /// before the read was invoked was invoked after that write was acknowledged.
    fn check_value(&self, read: usize, event: &Event, value: ValueId, found: &mut Vec<Violation>) {
        let Some(&written) = self.writes.get(&value) else {
            found.push(Violation::NeverWritten {
                key: self.key.to_string(),
                read,
            });
            return;
        };
        let write = &self.events[written];
        if write.outcome != Outcome::Ok {
            return;
        }
        let Some((invoked, later)) = self.overwrites.before(event.invoked, false) else {
            return;
        };
        if invoked <= write.returned {
            return;
        }
        let key = self.key.to_string();
        found.push(match self.events[later].op {
            Op::Remove => Violation::ReadableAfterRemove {
                key,
                remove: later,
                read,
                value,
            },
            _ => Violation::StaleAfterUpsert {
                key,
                upsert: later,
                read,
                value,
            },
        });
    }

    /// A read answering absent: every write acknowledged before it was invoked (that
    /// stored its own value) is explained by something that may have removed the
    /// object, invoked before the read returned and returning after the write was
    /// invoked.
    fn check_absent(&self, read: usize, event: &Event, found: &mut Vec<Violation>) {
        let Some((invoked, write)) = self.stored.before(event.invoked, false) else {
            return;
        };
        let removed_since = self
            .removals
            .before(event.returned, true)
            .is_some_and(|(returned, _)| returned >= invoked);
        if !removed_since {
            found.push(Violation::LostWrite {
                key: self.key.to_string(),
                write,
                read,
            });
        }
    }
}

/// How long a write whose outcome is unknown may stay in progress at the master after
/// it was invoked (its writer may be gone): until the master discards it, at
/// `--put_start_discard_timeout_sec` (30 s by default).
pub const UNFINISHED_WRITE_US: u64 = 30_000_000;

/// When write `e` may still be in progress at the master: when it returned, or for a
/// write whose outcome is unknown, until the master discards it.
fn in_progress_until(e: &Event) -> u64 {
    if e.outcome == Outcome::Unknown {
        e.returned
            .max(e.invoked.saturating_add(UNFINISHED_WRITE_US))
    } else {
        e.returned
    }
}

/// The acknowledged puts that may have stored nothing of their own: a put of a key
/// another write of it is in progress for is acknowledged and leaves that write to
/// decide (puts never overwrite), which may then fail. A put is deferred when another
/// put or upsert may be in progress while it runs: one overlapping it in time, or one
/// whose outcome is unknown invoked less than [`UNFINISHED_WRITE_US`] before it.
fn deferred_puts(events: &[Event], indexes: &[usize]) -> HashSet<usize> {
    let mut writes: Vec<(u64, u64, usize)> = indexes
        .iter()
        .map(|&i| (i, &events[i]))
        .filter(|(_, e)| matches!(e.op, Op::Put(_) | Op::Upsert(_)))
        .map(|(i, e)| (e.invoked, in_progress_until(e), i))
        .collect();
    writes.sort_unstable();
    // The two latest return times among the writes invoked so far (a write must not
    // count itself).
    let mut top: Vec<[(u64, usize); 2]> = Vec::with_capacity(writes.len());
    for &(_, returned, i) in &writes {
        let mut pair = top.last().copied().unwrap_or([(0, usize::MAX); 2]);
        if returned > pair[0].0 {
            pair = [(returned, i), pair[0]];
        } else if returned > pair[1].0 {
            pair[1] = (returned, i);
        }
        top.push(pair);
    }
    writes
        .iter()
        .filter(|&&(_, _, i)| matches!(events[i].op, Op::Put(_)))
        .filter(|&&(invoked, _, i)| {
            let returned = events[i].returned;
            let before = writes.partition_point(|&(other, _, _)| other < returned);
            before.checked_sub(1).is_some_and(|last| {
                top[last]
                    .iter()
                    .any(|&(end, other)| other != i && other != usize::MAX && end > invoked)
            })
        })
        .map(|&(_, _, i)| i)
        .collect()
}

impl Outcome {
    /// Whether the call may have taken effect: it succeeded, or its outcome is unknown
    /// (a failed call changed nothing).
    fn may_have_happened(self) -> bool {
        !matches!(self, Outcome::Failed(_))
    }
}

#[cfg(test)]
mod tests;
