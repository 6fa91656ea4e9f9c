//! A dummy client process for tests: attaches to the real client named by its first
//! argument with a pool of the size given second, prints `ready`, then waits forever
//! (until the test kills it).

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
            "dummy_holder_object",
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
    loop {
        std::thread::park();
    }
}
