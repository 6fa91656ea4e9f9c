//! The stand-in GPU drivers for tests on machines without a GPU: a CUDA driver
//! (`fake_cuda/fake_cuda.c`) and a HIP runtime over it (`fake_cuda/fake_hip.c`, built
//! together with the former): device memory the CPU cannot touch, streams that copy
//! only when synchronized, IPC handles between processes, and every call able to fail
//! on request (see the sources for the rules they enforce).

use std::path::{Path, PathBuf};

/// The C source of the stand-in CUDA driver.
pub const SOURCE: &str = include_str!("../fake_cuda/fake_cuda.c");

/// The HIP runtime calls, appended to [`SOURCE`] for the stand-in HIP runtime.
pub const HIP_SOURCE: &str = include_str!("../fake_cuda/fake_hip.c");

/// Compiles the stand-in CUDA driver into `dir/libcuda.so` with the system's C
/// compiler (`CC`, else `cc`) and returns its path. Reuses a library built from the
/// same source.
pub fn build(dir: &Path) -> std::io::Result<PathBuf> {
    compile(dir, "libcuda.so", SOURCE.to_string())
}

/// Compiles the stand-in HIP runtime into `dir/libamdhip64.so`, as [`build`].
pub fn build_hip(dir: &Path) -> std::io::Result<PathBuf> {
    compile(dir, "libamdhip64.so", format!("{SOURCE}\n{HIP_SOURCE}"))
}

fn compile(dir: &Path, soname: &str, code: String) -> std::io::Result<PathBuf> {
    mooncake_core::stand_in::compile(dir, soname, &code)
}
