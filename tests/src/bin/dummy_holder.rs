//! A dummy client process for tests: attaches to the real client named by its first
//! argument with a pool of the size given second, prints `ready`, then waits forever
//! (until the test kills it), or with a third argument `busy` puts, reads and removes
//! keys of its own (`busy/<pid>/<n>`) without a pause, so that a kill lands mid-call.

use std::io::Write;

use mooncake_dummy_client::{DummyClient, ReplicateConfig};

fn main() {
    let mut args = std::env::args().skip(1);
    let address = args.next().unwrap_or_default();
    let pool: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1 << 20);
    let client = match DummyClient::setup_dummy(pool, 1 << 20, Some(&address)) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("dummy_holder: {error}");
            std::process::exit(2);
        }
    };
    let ptr = client.alloc_from_mem_pool(4096);
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    let stored = unsafe {
        client.put_from(
            &format!("dummy_holder_object/{}", std::process::id()),
            ptr,
            4096,
            &ReplicateConfig::default(),
        )
    };
    if ptr == 0 || stored.is_err() {
        eprintln!("dummy_holder: cannot use the pool: {stored:?}");
        std::process::exit(2);
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    if args.next().as_deref() == Some("busy") {
        keep_busy(&client, ptr);
    }
    loop {
        std::thread::park();
    }
}

/// Calls without a pause until killed: puts from, reads into and removes 4 KiB at
/// `block` (a pool block of this client) under eight keys of its own.
fn keep_busy(client: &DummyClient, block: u64) {
    let config = ReplicateConfig::default();
    for n in 0u64.. {
        let key = format!("busy/{}/{}", std::process::id(), n % 8);
        // SAFETY: `block` is 4 KiB of this client's pool, used by this thread only.
        unsafe {
            let _ = client.put_from(&key, block, 4096, &config);
            let _ = client.get_into(&key, block, 4096);
        }
        if n % 3 == 0 {
            let _ = client.remove(&key, true);
        }
    }
}
