//! The checker catches each kind of broken promise, and accepts what the store may do.

use super::*;

/// A call of `key` invoked at `invoked` that returned at `returned`.
fn call(key: &str, op: Op, invoked: u64, returned: u64, outcome: Outcome) -> Event {
    Event {
        key: key.to_string(),
        op,
        invoked,
        returned,
        outcome,
    }
}

fn ok(key: &str, op: Op, invoked: u64, returned: u64) -> Event {
    call(key, op, invoked, returned, Outcome::Ok)
}

fn read(key: &str, answer: Read, invoked: u64, returned: u64) -> Event {
    ok(key, Op::Get(Some(answer)), invoked, returned)
}

#[test]
fn a_clean_history_has_no_violation() {
    let events = vec![
        ok("k", Op::Put(1), 0, 10),
        read("k", Read::Value(1), 11, 12),
        ok("k", Op::Upsert(2), 13, 20),
        read("k", Read::Value(2), 21, 22),
        ok("k", Op::Remove, 23, 24),
        read("k", Read::Absent, 25, 26),
        ok("other", Op::Put(7), 0, 5),
        // A read concurrent with an upsert may see either value.
        ok("other", Op::Upsert(8), 6, 30),
        read("other", Read::Value(7), 10, 12),
        read("other", Read::Value(8), 13, 14),
    ];
    assert_eq!(check(&events), vec![]);
}

#[test]
fn an_acknowledged_put_that_reads_absent_is_lost() {
    let events = vec![ok("k", Op::Put(1), 0, 10), read("k", Read::Absent, 11, 12)];
    assert_eq!(
        check(&events),
        vec![Violation::LostWrite {
            key: "k".into(),
            write: 0,
            read: 1
        }]
    );
}

#[test]
fn eviction_expiry_and_removes_in_doubt_explain_an_absence() {
    for cause in [
        ok("k", Op::Evicted, 11, 11),
        ok("k", Op::Expired, 11, 11),
        call("k", Op::Remove, 11, 12, Outcome::Unknown),
    ] {
        let events = vec![
            ok("k", Op::Put(1), 0, 10),
            cause,
            read("k", Read::Absent, 13, 14),
        ];
        assert_eq!(check(&events), vec![], "{events:?}");
    }
    // A remove that failed removed nothing.
    let events = vec![
        ok("k", Op::Put(1), 0, 10),
        call("k", Op::Remove, 11, 12, Outcome::Failed(-706)),
        read("k", Read::Absent, 13, 14),
    ];
    assert!(matches!(check(&events)[..], [Violation::LostWrite { .. }]));
}

#[test]
fn bytes_nobody_wrote_or_torn_bytes_are_reported() {
    let events = vec![
        ok("k", Op::Put(1), 0, 10),
        read("k", Read::Value(99), 11, 12),
        read("k", Read::Torn, 13, 14),
        // A write that failed carried nothing readable.
        call("k", Op::Upsert(5), 15, 16, Outcome::Failed(-800)),
        read("k", Read::Value(5), 17, 18),
    ];
    assert_eq!(
        check(&events),
        vec![
            Violation::NeverWritten {
                key: "k".into(),
                read: 1
            },
            Violation::NeverWritten {
                key: "k".into(),
                read: 2
            },
            Violation::NeverWritten {
                key: "k".into(),
                read: 4
            },
        ]
    );
}

#[test]
fn a_write_in_doubt_may_be_read() {
    let events = vec![
        call("k", Op::Put(3), 0, 10, Outcome::Unknown),
        read("k", Read::Value(3), 11, 12),
    ];
    assert_eq!(check(&events), vec![]);
}

#[test]
fn the_old_value_after_an_acknowledged_upsert_is_stale() {
    let events = vec![
        ok("k", Op::Put(1), 0, 10),
        ok("k", Op::Upsert(2), 11, 20),
        read("k", Read::Value(1), 21, 22),
    ];
    assert_eq!(
        check(&events),
        vec![Violation::StaleAfterUpsert {
            key: "k".into(),
            upsert: 1,
            read: 2,
            value: 1
        }]
    );
}

#[test]
fn a_key_readable_after_an_acknowledged_remove_is_reported() {
    let events = vec![
        ok("k", Op::Put(1), 0, 10),
        ok("k", Op::Remove, 11, 12),
        read("k", Read::Value(1), 13, 14),
        // Written again after the remove: readable, rightly.
        ok("k", Op::Put(2), 15, 16),
        read("k", Read::Value(2), 17, 18),
    ];
    assert_eq!(
        check(&events),
        vec![Violation::ReadableAfterRemove {
            key: "k".into(),
            remove: 1,
            read: 2,
            value: 1
        }]
    );
}

#[test]
fn a_put_overlapping_another_write_that_failed_may_leave_the_key_absent() {
    let events = vec![
        // A put in progress whose writer died.
        call("k", Op::Put(1), 0, 50, Outcome::Unknown),
        // A put acknowledged meanwhile: it deferred to the write in progress.
        ok("k", Op::Put(2), 10, 20),
        read("k", Read::Absent, 60, 61),
    ];
    assert_eq!(check(&events), vec![]);
    // Alone, the same acknowledged put may not vanish.
    let alone = vec![ok("k", Op::Put(2), 10, 20), read("k", Read::Absent, 60, 61)];
    assert_eq!(check(&alone).len(), 1);
}

/// The promises read word for word, one event against every other (O(n³) per key): the
/// reference the indexed checker must agree with.
fn reads_breaking_a_promise(events: &[Event]) -> Vec<(usize, &'static str)> {
    let writes = |e: &Event| matches!(e.op, Op::Put(_) | Op::Upsert(_));
    let same_key = |a: &Event, b: &Event| a.key == b.key;
    let deferred = |i: usize, put: &Event| {
        matches!(put.op, Op::Put(_))
            && events.iter().enumerate().any(|(j, e)| {
                j != i
                    && same_key(e, put)
                    && writes(e)
                    && e.invoked < put.returned
                    && in_progress_until(e) > put.invoked
            })
    };
    let mut found = Vec::new();
    for (r, read) in events.iter().enumerate() {
        let (Op::Get(Some(answer)), Outcome::Ok) = (&read.op, read.outcome) else {
            continue;
        };
        match *answer {
            Read::Torn => found.push((r, "never written")),
            Read::Value(v) => {
                let write = events.iter().find(|e| {
                    same_key(e, read)
                        && matches!(e.op, Op::Put(x) | Op::Upsert(x) if x == v)
                        && e.outcome.may_have_happened()
                });
                let Some(write) = write else {
                    found.push((r, "never written"));
                    continue;
                };
                let stale = events.iter().any(|o| {
                    same_key(o, read)
                        && o.outcome == Outcome::Ok
                        && o.returned < read.invoked
                        && matches!(o.op, Op::Upsert(_) | Op::Remove)
                        && write.outcome == Outcome::Ok
                        && write.returned < o.invoked
                });
                if stale {
                    found.push((r, "stale"));
                }
            }
            Read::Absent => {
                let lost = events.iter().enumerate().any(|(i, w)| {
                    same_key(w, read)
                        && writes(w)
                        && w.outcome == Outcome::Ok
                        && w.returned < read.invoked
                        && !deferred(i, w)
                        && !events.iter().any(|e| {
                            let removes = match e.op {
                                Op::Remove => e.outcome.may_have_happened(),
                                Op::Evicted | Op::Expired => true,
                                _ => false,
                            };
                            same_key(e, read)
                                && removes
                                && e.returned >= w.invoked
                                && e.invoked <= read.returned
                        })
                });
                if lost {
                    found.push((r, "lost"));
                }
            }
        }
    }
    found
}

fn kind(violation: &Violation) -> (usize, &'static str) {
    match violation {
        Violation::LostWrite { read, .. } => (*read, "lost"),
        Violation::NeverWritten { read, .. } => (*read, "never written"),
        Violation::StaleAfterUpsert { read, .. } | Violation::ReadableAfterRemove { read, .. } => {
            (*read, "stale")
        }
    }
}

/// A random history of two keys: overlapping calls of every kind and outcome, reads
/// answering values written, absent, unknown values or torn bytes.
fn random_history(seed: u64, len: usize) -> Vec<Event> {
    let mut state = seed | 1;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let mut events = Vec::with_capacity(len);
    for id in 0..len as u64 {
        let key = if next(2) == 0 { "a" } else { "b" };
        let invoked = next(200);
        let returned = invoked + 1 + next(30);
        let outcome = match next(6) {
            0 => Outcome::Unknown,
            1 => Outcome::Failed(-1),
            _ => Outcome::Ok,
        };
        let op = match next(8) {
            0 | 1 => Op::Put(id),
            2 => Op::Upsert(id),
            3 => Op::Remove,
            4 => Op::Evicted,
            _ => Op::Get(Some(match next(5) {
                0 => Read::Absent,
                1 => Read::Torn,
                _ => Read::Value(next(len as u64 + 3)),
            })),
        };
        events.push(call(key, op, invoked, returned, outcome));
    }
    events
}

#[test]
fn the_indexed_checker_agrees_with_the_promises_read_word_for_word() {
    let mut kinds = std::collections::BTreeSet::new();
    for seed in 1..400u64 {
        let events = random_history(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15), 60);
        let mut fast: Vec<_> = check(&events).iter().map(kind).collect();
        fast.sort_unstable();
        let mut slow = reads_breaking_a_promise(&events);
        slow.sort_unstable();
        assert_eq!(fast, slow, "seed {seed}: {events:#?}");
        kinds.extend(fast.iter().map(|(_, kind)| *kind));
    }
    assert_eq!(
        kinds.len(),
        3,
        "the random histories break every promise: {kinds:?}"
    );
}

#[test]
fn a_write_in_doubt_defers_puts_until_the_master_discards_it() {
    let lost = |gap: u64| {
        let events = vec![
            call("k", Op::Put(1), 0, 10, Outcome::Unknown),
            ok("k", Op::Put(2), 10 + gap, 20 + gap),
            read("k", Read::Absent, 30 + gap, 40 + gap),
        ];
        check(&events)
    };
    assert_eq!(
        lost(1_000_000),
        vec![],
        "a write in doubt may still be in progress"
    );
    assert_eq!(
        lost(UNFINISHED_WRITE_US).len(),
        1,
        "the master discarded the write in doubt: the put stored its own value"
    );
}
