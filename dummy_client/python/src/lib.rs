//! The `mooncake._store` extension module: the dummy client (and the embedded real
//! client) for Python. `mooncake/store.py` wraps it into the upstream-compatible
//! `MooncakeDistributedStore` (adding tensor helpers and the buffer protocol).
//!
//! Every call that waits for the real client releases the GIL. Values follow
//! upstream's conventions: `0` or a positive value on success, the negative error code
//! on failure; batch calls return one entry per input.

mod commands;
mod config;
mod convert;
mod host_memory;
mod store;

use pyo3::prelude::*;

/// mimalloc for every allocation of this module (Python's own objects keep CPython's
/// allocator): each call builds and frees many small buffers (keys, ranges, results), and
/// the embedded real client more, where glibc's allocator spends a tenth of the time
/// consolidating its free lists.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The extension module.
#[pymodule]
fn _store(m: &Bound<'_, PyModule>) -> PyResult<()> {
    commands::register(m)?;
    m.add_class::<config::PyReplicateConfig>()?;
    m.add_class::<config::PySoftPinAction>()?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<store::PyBufferHandle>()?;
    m.add_class::<host_memory::PyHostMemAllocator>()?;
    m.add_function(wrap_pyfunction!(host_memory::get_alloc_func_addr, m)?)?;
    m.add_function(wrap_pyfunction!(host_memory::get_free_func_addr, m)?)?;
    m.add(
        "PROTOCOL_VERSION",
        mooncake_core::protocol::PROTOCOL_VERSION,
    )?;
    let codes = pyo3::types::PyDict::new(m.py());
    for code in mooncake_core::ErrorCode::ALL {
        codes.set_item(code.name(), code.as_i32())?;
    }
    m.add("ERROR_CODES", codes)?;
    Ok(())
}
