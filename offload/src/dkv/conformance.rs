//! The conformance suite every [`DkvClient`] passes: per-key results, reads into the
//! caller's buffers (whole or split), values given in two parts and large batches of
//! them, overwrite, delete, a complete paged scan
//! ([`check`]) and several threads at once ([`check_shared`]). What a store's capacity
//! means differs between stores, so each client's own tests cover it.
//! The crate's tests run it against the Redis client and the C plugin interface; a
//! vendor runs it against a new plugin the same way. It panics at the first broken
//! promise, naming it.

use super::{DkvClient, DkvError, GetInto, PutFrom, scan_all};

/// `len` bytes that differ per `seed` and position.
pub fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed ^ (i % 251).to_le_bytes()[0])
        .collect()
}

/// Checks the contract on `client`, using only keys under `ns/` (which must be
/// empty), and deletes what it wrote.
///
/// # Panics
/// At the first broken promise.
pub fn check(client: &dyn DkvClient, ns: &str) {
    let key = |name: &str| format!("{ns}/{name}").into_bytes();
    round_trips(client, &key);
    puts_from_parts(client, &key);
    scans(client, &key);
    assert!(
        scan_all(client, &key(""), 64).expect("scan").is_empty(),
        "keys left behind"
    );
}

/// Checks that `client` serves four threads at once (each its own keys under
/// `ns/`), and deletes what they wrote.
///
/// # Panics
/// At the first broken promise.
pub fn check_shared(client: &std::sync::Arc<dyn DkvClient>, ns: &str) {
    let workers: Vec<_> = (0..4u8)
        .map(|t| {
            let client = std::sync::Arc::clone(client);
            let ns = ns.to_string();
            std::thread::spawn(move || {
                for i in 0..100u32 {
                    let key = format!("{ns}/t{t}/{i}").into_bytes();
                    let v = value(t, 100 + i as usize);
                    assert_eq!(client.batch_put(&[(&key, &v)]), vec![Ok(())]);
                    let mut dest = vec![0u8; v.len()];
                    assert_eq!(
                        client.batch_get(&mut [GetInto::new(&key, &mut dest)]),
                        vec![Ok(v.len() as u64)]
                    );
                    assert_eq!(dest, v, "thread {t}, value {i}");
                    assert_eq!(client.batch_delete(&[&key]), vec![Ok(())]);
                }
            })
        })
        .collect();
    for worker in workers {
        assert!(worker.join().is_ok(), "a thread failed");
    }
}

/// Put, get (whole and split), exists, overwrite, delete.
fn round_trips(client: &dyn DkvClient, key: &dyn Fn(&str) -> Vec<u8>) {
    let (a, b, missing) = (key("a"), key("b"), key("missing"));
    let (va, vb) = (value(1, 70_000), value(2, 10));
    let put = client.batch_put(&[(&a, &va), (&b, &vb), (b"", b"x"), (&key("e"), b"")]);
    assert_eq!(put[..2], [Ok(()), Ok(())]);
    assert!(matches!(put[2], Err(DkvError::Invalid(_))), "empty key");
    assert!(matches!(put[3], Err(DkvError::Invalid(_))), "empty value");

    // Reads land in the caller's buffers, per key.
    let mut dest_a = vec![0u8; 80_000];
    let mut dest_b = [0u8; 5];
    let mut dest_m = [0u8; 5];
    let got = client.batch_get(&mut [
        GetInto::new(&a, &mut dest_a),
        GetInto::new(&b, &mut dest_b),
        GetInto::new(&missing, &mut dest_m),
    ]);
    assert_eq!(got[0], Ok(70_000));
    assert!(dest_a[..70_000] == va[..], "value read back");
    assert_eq!(got[1], Err(DkvError::TooSmall { need: 10, have: 5 }));
    assert_eq!(got[2], Err(DkvError::NotFound));
    // Split destinations: the first bytes in one buffer, the rest in another.
    let (mut head, mut body) = ([0u8; 24], vec![0u8; 69_976]);
    let got = client.batch_get(&mut [GetInto::split(&a, &mut head, &mut body)]);
    assert_eq!(got, vec![Ok(70_000)]);
    assert!(head[..] == va[..24] && body[..] == va[24..], "split read");
    let (mut head, mut body) = ([0u8; 8], [0u8; 1]);
    let got = client.batch_get(&mut [GetInto::split(&b, &mut head, &mut body)]);
    assert_eq!(got, vec![Err(DkvError::TooSmall { need: 10, have: 9 })]);
    assert_eq!(
        client.batch_exists(&[&a, &missing]),
        vec![Ok(true), Ok(false)]
    );

    // Overwrite replaces; delete removes (a missing key is fine).
    let va2 = value(3, 100);
    assert_eq!(client.batch_put(&[(&a, &va2)]), vec![Ok(())]);
    let mut dest = vec![0u8; 100];
    assert_eq!(
        client.batch_get(&mut [GetInto::new(&a, &mut dest)]),
        vec![Ok(100)]
    );
    assert_eq!(dest, va2);
    assert_eq!(client.batch_delete(&[&a, &b, &missing]), vec![Ok(()); 3]);
    assert_eq!(client.batch_exists(&[&a, &b]), vec![Ok(false), Ok(false)]);
}

/// Values given as a head and a body are stored as one value: a batch of 40 MiB (which
/// a client may spread over connections) with invalid items among the valid ones,
/// read back in one batch, whole and split.
fn puts_from_parts(client: &dyn DkvClient, key: &dyn Fn(&str) -> Vec<u8>) {
    let names: Vec<Vec<u8>> = (0..40).map(|i| key(&format!("parts/{i}"))).collect();
    let heads: Vec<Vec<u8>> = (0..40u8)
        .map(|i| value(i, usize::from(i % 3) * 20))
        .collect();
    let bodies: Vec<Vec<u8>> = (0..40u8)
        .map(|i| value(i.wrapping_add(100), (1 << 20) + usize::from(i)))
        .collect();
    let mut items: Vec<PutFrom<'_>> = names
        .iter()
        .zip(heads.iter().zip(&bodies))
        .map(|(key, (head, body))| PutFrom { key, head, body })
        .collect();
    items.insert(
        7,
        PutFrom {
            key: b"",
            head: b"h",
            body: b"b",
        },
    );
    items.insert(
        30,
        PutFrom {
            key: &names[0][..],
            head: b"",
            body: b"",
        },
    );
    let put = client.batch_put_from(&items);
    assert_eq!(put.len(), 42);
    assert!(matches!(put[7], Err(DkvError::Invalid(_))), "empty key");
    assert!(matches!(put[30], Err(DkvError::Invalid(_))), "empty value");
    assert!(
        put.iter()
            .enumerate()
            .all(|(at, result)| at == 7 || at == 30 || result.is_ok()),
        "{put:?}"
    );
    let mut dests: Vec<Vec<u8>> = bodies.iter().map(|b| vec![0u8; b.len() + 60]).collect();
    let mut gets: Vec<GetInto<'_>> = names
        .iter()
        .zip(dests.iter_mut())
        .map(|(key, dest)| GetInto::new(key, dest))
        .collect();
    let got = client.batch_get(&mut gets);
    for (i, result) in got.iter().enumerate() {
        let whole = [&heads[i][..], &bodies[i][..]].concat();
        assert_eq!(*result, Ok(whole.len() as u64), "value {i}");
        assert!(dests[i][..whole.len()] == whole[..], "value {i} read back");
    }
    let (mut head, mut body) = (vec![0u8; 24], vec![0u8; (1 << 20) + 16]);
    let got = client.batch_get(&mut [GetInto::split(&names[1], &mut head, &mut body)]);
    let whole = [&heads[1][..], &bodies[1][..]].concat();
    assert_eq!(got, vec![Ok(whole.len() as u64)]);
    assert!(head[..] == whole[..24] && body[..whole.len() - 24] == whole[24..]);
    let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    assert!(client.batch_delete(&keys).iter().all(Result::is_ok));
}

/// Paged scans list every key under a prefix, whatever the page size.
fn scans(client: &dyn DkvClient, key: &dyn Fn(&str) -> Vec<u8>) {
    // Scan: every key under the prefix, once, whatever the page size.
    let names: Vec<Vec<u8>> = (0..250).map(|i| key(&format!("scan/{i:03}"))).collect();
    let values: Vec<Vec<u8>> = (0..250u8).map(|i| value(i, 1 + usize::from(i))).collect();
    let items: Vec<(&[u8], &[u8])> = names
        .iter()
        .map(Vec::as_slice)
        .zip(values.iter().map(Vec::as_slice))
        .collect();
    assert!(client.batch_put(&items).iter().all(Result::is_ok));
    for page in [1, 7, 64, 1000] {
        let mut found = scan_all(client, &key("scan/"), page).expect("scan");
        found.sort();
        assert_eq!(found.len(), 250, "page {page}");
        for (i, (name, len)) in found.iter().enumerate() {
            assert_eq!(name, &names[i]);
            assert_eq!(*len, 1 + i as u64);
        }
    }
    // Glob characters in a prefix are plain characters.
    let star = key("st*r/1");
    assert_eq!(client.batch_put(&[(&star, b"v")]), vec![Ok(())]);
    assert_eq!(
        scan_all(client, &key("st*r/"), 10).expect("scan"),
        vec![(star.clone(), 1)]
    );
    assert!(scan_all(client, &key("s*/"), 10).expect("scan").is_empty());
    let others = scan_all(client, &key("nothing-here/"), 10).expect("scan");
    assert!(others.is_empty());
    let mut keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    keys.push(star.as_slice());
    assert!(client.batch_delete(&keys).iter().all(Result::is_ok));
}
