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
