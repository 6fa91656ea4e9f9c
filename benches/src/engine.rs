//! `--sections engine`: KV-cache page movement as SGLang HiCache and vLLM do it.
//!
//! The engine owns a host KV pool of [`POOL`] bytes, split into [`LAYERS`] layer regions,
//! and registers it once with `register_buffer`. A key is one token block: one page per
//! layer, each in its own layer region at a scattered slot, so a key's value is
//! [`LAYERS`] page-sized buffers far apart in the pool. Keys move in batches of
//! [`BATCH`] with `batch_put_from_multi_buffers` (offload the whole pool) and
//! `batch_get_into_multi_buffers` (load it back into the same pages).
//!
//! It runs against the embedded real client (a heap pool, lent to the in-process
//! client: zero copy) and against a `mooncake_client` in another process, once with the
//! pool from the dummy's host-memory allocator (`MooncakeHostMemAllocator`: mapped by
//! the real client, zero copy) and once with a heap pool (declared to the real client,
//! which copies it once across processes; or, when it may not read this process, copied
//! through the dummy's staging buffer: the heading says which). Each figure is printed
//! next to memcpy of the same pages in the same round.

use mooncake_dummy_client::{DummyClient, host_memory};

use crate::workload::{Form, PageAligned, Reference, Workload, measure, size_label};

/// Bytes of the host KV pool.
const POOL: u64 = 256 << 20;

/// Layers in the pool: one page of each per key.
const LAYERS: u64 = 4;

/// Keys per call.
const BATCH: usize = 32;

/// Page sizes measured.
const PAGES: [u64; 3] = [64 << 10, 256 << 10, 2 << 20];

/// Staging buffer of the dummy client (Python's default `local_buffer_size`).
const STAGING: u64 = 16 << 20;

/// Odd, so `slot * STRIDE % slots` visits every slot once (slots are a power of two).
const STRIDE: u64 = 7919;

/// Every slot of the pool once: key `k` holds page `k * STRIDE % slots` of each layer.
fn workload(page: u64, mode: &str) -> Workload {
    let layer_bytes = POOL / LAYERS;
    let slots = layer_bytes / page;
    let parts = (0..slots)
        .map(|k| {
            let slot = k * STRIDE % slots;
            (0..LAYERS)
                .map(|layer| (layer * layer_bytes + slot * page, page))
                .collect()
        })
        .collect();
    Workload {
        tag: format!("engine-{mode}-{page}"),
        what: format!("{BATCH} keys × {LAYERS} × {} pages", size_label(page)),
        form: Form::MultiBuffers,
        parts,
        batch: BATCH,
    }
}

fn heap(bytes: u64) -> Result<Vec<u8>, String> {
    Ok(vec![
        0x5au8;
        usize::try_from(bytes).map_err(|e| e.to_string())?
    ])
}

/// Registers `POOL` bytes at `base`, measures every page size, unregisters, prints.
fn measure_pool(
    client: &DummyClient,
    base: u64,
    shadow: &mut [u8],
    mode: &str,
    repeats: usize,
) -> Result<(), String> {
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(base, POOL) }
        .map_err(|c| format!("register_buffer ({mode}): {c}"))?;
    let workloads: Vec<Workload> = PAGES.iter().map(|&page| workload(page, mode)).collect();
    let mut reference = Reference {
        region: shadow,
        segment: PageAligned::new(POOL)?,
    };
    let path = declared_path(client);
    let table = measure(client, base, &mut reference, &workloads, repeats);
    let _ = client.unregister_buffer(base);
    println!(
        "\nengine, {mode}{path}: a {} pool in {LAYERS} layers, registered once, medians of {repeats}",
        size_label(POOL)
    );
    table?.print();
    Ok(())
}

/// How the real client moves this process's declared memory, as its status says
/// (empty when nothing is declared).
fn declared_path(client: &DummyClient) -> String {
    let me = client.status().ok().and_then(|status| {
        status
            .dummies
            .into_iter()
            .find(|d| d.pid == std::process::id() && d.declared_ranges > 0)
    });
    match me {
        Some(d) if d.cross_memory => " (copied once by the real client: cross-memory)".into(),
        Some(_) => format!(
            " (copied through the {} staging buffer: the real client may not read this process)",
            size_label(STAGING)
        ),
        None => String::new(),
    }
}

/// Embedded mode: a real client in this process, a heap pool lent to it.
pub fn embedded(repeats: usize, segment: &str) -> Result<(), String> {
    let client = crate::embedded::start(segment)?;
    let mut pool = heap(POOL)?;
    let base = pool.as_mut_ptr() as u64;
    let result = measure_pool(
        &client,
        base,
        &mut pool,
        "embedded real client, heap pool (zero copy)",
        repeats,
    );
    client.close();
    result
}

/// Dummy mode against the `mooncake_client` at `address`: the pool from the
/// host-memory allocator, then a heap pool.
pub fn dummy(repeats: usize, address: &str) -> Result<(), String> {
    let client = DummyClient::setup_dummy(16 << 20, STAGING, Some(address))
        .map_err(|e| format!("connecting to {address}: {e}"))?;
    // The allocator's memory is reached by address only; the memcpy reference runs on
    // page-aligned heap memory with the same layout.
    let mut shadow = PageAligned::new(POOL)?;
    let base = host_memory::alloc(POOL).map_err(|e| format!("host memory: {e}"))?;
    let zero_copy = measure_pool(
        &client,
        base,
        shadow.as_mut_slice(),
        "dummy, pool from the host-memory allocator (zero copy)",
        repeats,
    );
    host_memory::free(base);
    drop(shadow);
    zero_copy?;
    let mut pool = heap(POOL)?;
    let base = pool.as_mut_ptr() as u64;
    let copied = measure_pool(&client, base, &mut pool, "dummy, heap pool", repeats);
    client.close();
    copied
}
