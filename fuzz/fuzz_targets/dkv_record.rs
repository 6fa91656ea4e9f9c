//! The distributed-KV backend over a store that lists and returns whatever the input
//! says: recovery from its listing, then a read of every object indexed. A read that
//! succeeds returned the value of a whole record written for its key.
//!
//! Input: a script of keys, each an object of this node (its record whole, damaged,
//! replaced by other bytes or gone; listed with its true length or any), or a key
//! outside the node's prefix.

#![no_main]

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use mooncake_offload::dkv::scripted::{ScriptedKey, open_and_read_all};
use mooncake_offload::record::header;

const PREFIX: &str = "ns/node/";
/// The largest value read back; larger ones are read into a buffer too small.
const MAX_READ: usize = 1 << 16;

fn record(key: &str, value: &[u8]) -> Vec<u8> {
    let mut record = header(key.as_bytes(), value).to_vec();
    record.extend_from_slice(key.as_bytes());
    record.extend_from_slice(value);
    record
}

fn scripted_key(input: &mut Unstructured<'_>) -> Result<ScriptedKey> {
    let name: String = input.arbitrary()?;
    let value: Vec<u8> = input.arbitrary()?;
    let mut record = record(&name, &value);
    let stored = match input.int_in_range(0..=3u8)? {
        0 => Some(record),
        1 => {
            let at = input.choose_index(record.len())?;
            record[at] ^= input.int_in_range(1..=255u8)?;
            Some(record)
        }
        2 => Some(value),
        _ => None,
    };
    let true_len = stored.as_ref().map_or(0, |v| v.len() as u64);
    let listed_len = if input.arbitrary()? {
        input.arbitrary()?
    } else {
        true_len
    };
    let key = if input.arbitrary()? {
        format!("{PREFIX}{name}")
    } else {
        name
    };
    Ok(ScriptedKey {
        key: key.into_bytes(),
        listed_len,
        value: stored,
    })
}

fuzz_target!(|bytes: &[u8]| {
    let mut input = Unstructured::new(bytes);
    let mut script = Vec::new();
    while script.len() < 16 && !input.is_empty() {
        match scripted_key(&mut input) {
            Ok(key) => script.push(key),
            Err(_) => break,
        }
    }
    open_and_read_all(&script, PREFIX, MAX_READ);
});
