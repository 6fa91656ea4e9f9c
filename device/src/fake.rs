//! The stand-in GPU drivers for tests on machines without a GPU: a CUDA driver
//! (`fake_cuda/fake_cuda.c`) and a HIP runtime over it (`fake_cuda/fake_hip.c`, built
//! together with the former): device memory the CPU cannot touch, streams that copy
//! only when synchronized, IPC handles between processes, and every call able to fail
//! on request (see the sources for the rules they enforce).

use std::path::{Path, PathBuf};
use std::process::Command;

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
    std::fs::create_dir_all(dir)?;
    let library = dir.join(soname);
    let source = dir.join(format!("{soname}.c"));
    let unchanged = std::fs::read_to_string(&source).is_ok_and(|s| s == code);
    if unchanged && library.exists() {
        return Ok(library);
    }
    std::fs::write(&source, &code)?;
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let partial = dir.join(format!("{soname}.{}", std::process::id()));
    let status = Command::new(compiler)
        // -Bsymbolic: calls inside the library stay inside it, whatever else is loaded.
        .args(["-O2", "-shared", "-fPIC", "-Wl,-Bsymbolic"])
        .arg(format!("-Wl,-soname,{soname}"))
        .arg("-o")
        .arg(&partial)
        .arg(&source)
        .status()?;
    if !status.success() {
        return Err(std::io::Error::other(format!(
            "compiling the stand-in {soname} failed: {status}"
        )));
    }
    std::fs::rename(&partial, &library)?;
    Ok(library)
}
