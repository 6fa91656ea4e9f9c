//! `MooncakeHostMemAllocator` and the allocator entry points upstream exports
//! (`get_alloc_func_addr`, `get_free_func_addr`): host memory that the real client can
//! map, so engine pools allocated with it are zero-copy in dummy mode.

use std::ffi::c_void;

use pyo3::prelude::*;

use mooncake_dummy_client::host_memory;

/// Allocates host memory shareable with the real client (upstream's class).
#[pyclass(name = "MooncakeHostMemAllocator", module = "mooncake.store")]
#[derive(Default)]
pub struct PyHostMemAllocator;

#[pymethods]
impl PyHostMemAllocator {
    #[new]
    fn new() -> Self {
        PyHostMemAllocator
    }

    /// Address of `size` bytes of shareable host memory, or 0 when it cannot be had
    /// (the reason is logged).
    fn alloc(&self, py: Python<'_>, size: u64) -> u64 {
        py.detach(|| allocate(size))
    }

    /// Frees memory from `alloc`: 0, or -1 when `ptr` is not an allocation.
    fn free(&self, ptr: u64) -> i64 {
        if host_memory::free(ptr) { 0 } else { -1 }
    }
}

fn allocate(size: u64) -> u64 {
    match host_memory::alloc(size) {
        Ok(addr) => addr,
        Err(error) => {
            tracing::error!(%error, size, "MooncakeHostMemAllocator: allocation failed");
            0
        }
    }
}

/// C entry point behind `get_alloc_func_addr()`: `void *alloc(size_t)`.
extern "C" fn host_alloc(size: usize) -> *mut c_void {
    allocate(size as u64) as *mut c_void
}

/// C entry point behind `get_free_func_addr()`: `void free(void *)`.
extern "C" fn host_free(ptr: *mut c_void) {
    host_memory::free(ptr as u64);
}

/// Address of a C function `void *alloc(size_t)` that allocates like
/// `MooncakeHostMemAllocator.alloc` (returns NULL on failure).
#[pyfunction]
pub fn get_alloc_func_addr() -> usize {
    host_alloc as extern "C" fn(usize) -> *mut c_void as usize
}

/// Address of a C function `void free(void *)` for memory from `get_alloc_func_addr`.
#[pyfunction]
pub fn get_free_func_addr() -> usize {
    host_free as extern "C" fn(*mut c_void) as usize
}
