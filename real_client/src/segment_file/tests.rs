use super::*;

const SEGMENT: u64 = 1 << 20;

fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "mooncake-segment-file-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&dir);
    dir
}

fn write_value(file: &SegmentFile, offset: u64, value: &[u8]) -> Placement {
    let slice = file
        .memory()
        .slice(offset, value.len() as u64)
        .expect("inside the segment");
    slice.write_from(value);
    Placement {
        offset,
        len: (value.len() as u64).next_multiple_of(64),
        size: value.len() as u64,
        value_crc: crc32c(value),
    }
}

fn committed(found: Found) -> HashMap<String, Placement> {
    match found {
        Found::Kept { committed } => committed,
        Found::Fresh { reason } => panic!("expected a kept journal, got a fresh file ({reason:?})"),
    }
}

#[test]
fn a_reopened_file_has_the_bytes_and_the_journal_of_the_last_process() {
    let path = temp_path("reopen");
    let (file, found) = SegmentFile::open(&path, SEGMENT).expect("created");
    assert!(matches!(found, Found::Fresh { reason: None }));
    let generation = file.generation();
    let a = write_value(&file, 0, b"value of a");
    let b = write_value(&file, 4096, &[7u8; 3000]);
    file.record_committed("a", a);
    file.record_committed("b", b);
    file.record_committed("c", write_value(&file, 8192, b"c"));
    file.record_gone("c");
    drop(file);

    let (file, found) = SegmentFile::open(&path, SEGMENT).expect("reopened");
    assert_eq!(
        file.generation(),
        generation,
        "the same file keeps its generation"
    );
    let committed = committed(found);
    assert_eq!(committed.len(), 2);
    assert_eq!(committed["a"], a);
    assert_eq!(committed["b"], b);
    let bytes = file.memory().slice(4096, 3000).expect("inside").to_vec();
    assert_eq!(bytes, vec![7u8; 3000]);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_second_process_on_the_same_file_is_refused() {
    let path = temp_path("locked");
    let (_file, _) = SegmentFile::open(&path, SEGMENT).expect("created");
    let error = SegmentFile::open(&path, SEGMENT).expect_err("locked");
    assert!(matches!(error, SegmentFileError::InUse { .. }), "{error}");
    assert!(error.to_string().contains("--segment_path"));
    let _ = std::fs::remove_file(&path);
}

#[test]
fn another_segment_size_resets_the_file_and_says_why() {
    let path = temp_path("resized");
    let (file, _) = SegmentFile::open(&path, SEGMENT).expect("created");
    file.record_committed("a", write_value(&file, 0, b"a"));
    drop(file);
    let (file, found) = SegmentFile::open(&path, 2 * SEGMENT).expect("reset");
    let Found::Fresh {
        reason: Some(reason),
    } = found
    else {
        panic!("expected a reset, got {found:?}");
    };
    assert!(reason.contains("--global_segment_size"), "{reason}");
    assert_eq!(file.journaled_objects(), 0);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_damaged_header_resets_the_file() {
    let path = temp_path("damaged");
    let (file, _) = SegmentFile::open(&path, SEGMENT).expect("created");
    file.record_committed("a", write_value(&file, 0, b"a"));
    drop(file);
    let layout = Layout::for_segment(SEGMENT, 4096).expect("layout");
    let mut bytes = std::fs::read(&path).expect("read");
    bytes[usize::try_from(layout.segment_len).expect("fits") + 20] ^= 0xFF;
    std::fs::write(&path, bytes).expect("write");
    let (_, found) = SegmentFile::open(&path, SEGMENT).expect("reset");
    assert!(
        matches!(found, Found::Fresh { reason: Some(_) }),
        "{found:?}"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn the_journal_compacts_when_a_half_fills_and_keeps_only_live_objects() {
    let path = temp_path("compact");
    let (file, _) = SegmentFile::open(&path, SEGMENT).expect("created");
    let placement = write_value(&file, 0, b"x");
    // Far more records than one 4 MiB half holds: the same 16 keys again and again.
    for round in 0..60_000u64 {
        let key = format!("key-{}", round % 16);
        let at = Placement {
            offset: round % 16 * 64,
            ..placement
        };
        file.record_gone(&key);
        file.record_committed(&key, at);
    }
    file.record_gone("key-3");
    assert_eq!(file.unrecorded_commits(), 0);
    drop(file);
    let (_, found) = SegmentFile::open(&path, SEGMENT).expect("reopened");
    let committed = committed(found);
    assert_eq!(committed.len(), 15);
    assert!(!committed.contains_key("key-3"));
    assert_eq!(committed["key-5"].offset, 5 * 64);
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_full_journal_drops_new_commits_but_still_records_removals() {
    let path = temp_path("full");
    let (file, _) = SegmentFile::open(&path, SEGMENT).expect("created");
    let placement = write_value(&file, 0, b"x");
    let key_of = |i: u64| format!("{i:0>200}");
    // 240-byte records: a 4 MiB half holds 17 476 of them.
    let mut i = 0;
    while file.unrecorded_commits() == 0 {
        file.record_committed(&key_of(i), placement);
        i += 1;
        assert!(i < 100_000, "the journal never filled");
    }
    let kept = file.journaled_objects();
    file.record_gone(&key_of(0));
    assert_eq!(file.journaled_objects(), kept - 1);
    drop(file);
    let (_, found) = SegmentFile::open(&path, SEGMENT).expect("reopened");
    let committed = committed(found);
    assert_eq!(committed.len(), kept - 1);
    assert!(
        !committed.contains_key(&key_of(0)),
        "a removal is never lost"
    );
    assert!(
        !committed.contains_key(&key_of(i - 1)),
        "the commit that did not fit"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn recovery_drops_objects_whose_bytes_changed() {
    use mooncake_master::{Clock, MasterConfig, MasterService};
    let path = temp_path("recover");
    let (file, _) = SegmentFile::open(&path, SEGMENT).expect("created");
    let whole = write_value(&file, 0, &[1u8; 5000]);
    let torn = write_value(&file, 8192, &[2u8; 5000]);
    file.record_committed("whole", whole);
    file.record_committed("torn", torn);
    // A write into the object's space after its record (a crash mid-overwrite).
    write_value(&file, 8192 + 100, b"other bytes");
    drop(file);

    let (file, found) = SegmentFile::open(&path, SEGMENT).expect("reopened");
    let master = MasterService::new(MasterConfig::default(), Clock::System);
    let segment = master
        .mount_segment(
            "node",
            SEGMENT,
            mooncake_core::master_api::LOCAL_OWNER,
            "127.0.0.1:1",
            0,
        )
        .expect("mounted");
    let recovered = recover(&file, committed(found), &master, segment);
    assert_eq!(recovered.objects, 1);
    assert_eq!(recovered.bytes, 5000);
    assert_eq!(recovered.damaged, 1);
    assert!(master.exist("whole").expect("answers"));
    assert!(!master.exist("torn").expect("answers"));
    assert_eq!(
        file.journaled_objects(),
        1,
        "the damaged object is recorded gone"
    );
    let _ = std::fs::remove_file(&path);
}
