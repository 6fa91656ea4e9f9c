//! The stand-in CUDA driver for tests on machines without a GPU
//! (`fake_cuda/fake_cuda.c`): device memory the CPU cannot touch, streams that copy
//! only when synchronized, IPC handles between processes, and every call able to fail
//! on request (see the source for the rules it enforces).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The C source of the stand-in driver.
pub const SOURCE: &str = include_str!("../fake_cuda/fake_cuda.c");

/// Compiles the stand-in driver into `dir/libcuda.so` with the system's C compiler
/// (`CC`, else `cc`) and returns its path. Reuses a library built from the same source.
pub fn build(dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let library = dir.join("libcuda.so");
    let source = dir.join("fake_cuda.c");
    let unchanged = std::fs::read_to_string(&source).is_ok_and(|s| s == SOURCE);
    if unchanged && library.exists() {
        return Ok(library);
    }
    std::fs::write(&source, SOURCE)?;
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let partial = dir.join(format!("libcuda.so.{}", std::process::id()));
    let status = Command::new(compiler)
        .args(["-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so", "-o"])
        .arg(&partial)
        .arg(&source)
        .status()?;
    if !status.success() {
        return Err(std::io::Error::other(format!(
            "compiling the stand-in CUDA driver failed: {status}"
        )));
    }
    std::fs::rename(&partial, &library)?;
    Ok(library)
}
