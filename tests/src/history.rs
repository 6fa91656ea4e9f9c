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

use std::collections::BTreeMap;

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
pub fn check(events: &[Event]) -> Vec<Violation> {
    let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (index, event) in events.iter().enumerate() {
        by_key.entry(event.key.as_str()).or_default().push(index);
    }
    let mut found = Vec::new();
    for (key, indexes) in by_key {
        KeyHistory {
            key,
            events,
            indexes,
        }
        .check(&mut found);
    }
    found
}

/// The events of one key.
struct KeyHistory<'a> {
    key: &'a str,
    events: &'a [Event],
    indexes: Vec<usize>,
}

impl KeyHistory<'_> {
    fn each(&self) -> impl Iterator<Item = (usize, &Event)> + '_ {
        self.indexes.iter().map(|&i| (i, &self.events[i]))
    }

    fn check(&self, found: &mut Vec<Violation>) {
        for (read, event) in self.each() {
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

    /// The write of `value`, if any write of this key carried it.
    fn write_of(&self, value: ValueId) -> Option<(usize, &Event)> {
        self.each().find(|(_, e)| {
            matches!(e.op, Op::Put(v) | Op::Upsert(v) if v == value)
                && e.outcome.may_have_happened()
        })
    }

    fn check_value(&self, read: usize, event: &Event, value: ValueId, found: &mut Vec<Violation>) {
        let Some((_, write)) = self.write_of(value) else {
            found.push(Violation::NeverWritten {
                key: self.key.to_string(),
                read,
            });
            return;
        };
        let written_before = |at: u64| write.outcome == Outcome::Ok && write.returned < at;
        for (index, other) in self.each() {
            if other.outcome != Outcome::Ok || other.returned >= event.invoked {
                continue;
            }
            match other.op {
                Op::Upsert(newer) if newer != value && written_before(other.invoked) => {
                    found.push(Violation::StaleAfterUpsert {
                        key: self.key.to_string(),
                        upsert: index,
                        read,
                        value,
                    });
                    return;
                }
                Op::Remove if written_before(other.invoked) => {
                    found.push(Violation::ReadableAfterRemove {
                        key: self.key.to_string(),
                        remove: index,
                        read,
                        value,
                    });
                    return;
                }
                _ => {}
            }
        }
    }

    /// Whether `put` (acknowledged) may have stored nothing of its own: a put of a key
    /// another write of it is in progress for is acknowledged and leaves that write to
    /// decide (puts never overwrite), which may then fail.
    fn deferred(&self, index: usize, put: &Event) -> bool {
        matches!(put.op, Op::Put(_))
            && self.each().any(|(other, e)| {
                other != index
                    && matches!(e.op, Op::Put(_) | Op::Upsert(_))
                    && e.invoked < put.returned
                    && e.returned > put.invoked
            })
    }

    fn check_absent(&self, read: usize, event: &Event, found: &mut Vec<Violation>) {
        for (write, w) in self.each() {
            let acknowledged_write =
                matches!(w.op, Op::Put(_) | Op::Upsert(_)) && w.outcome == Outcome::Ok;
            if !acknowledged_write || w.returned >= event.invoked || self.deferred(write, w) {
                continue;
            }
            // Anything that may have removed the object since the write was invoked
            // explains its absence.
            let explained = self.each().any(|(_, e)| {
                let removes = match e.op {
                    Op::Remove => e.outcome.may_have_happened(),
                    Op::Evicted | Op::Expired => true,
                    _ => false,
                };
                removes && e.returned >= w.invoked && e.invoked <= event.returned
            });
            if !explained {
                found.push(Violation::LostWrite {
                    key: self.key.to_string(),
                    write,
                    read,
                });
                return;
            }
        }
    }
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
