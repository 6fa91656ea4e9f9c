//! Stand-in native libraries for tests on machines without the hardware: a C source
//! compiled with the system's C compiler into a shared library that the code under
//! test loads in place of the vendor's (the CUDA driver, HIP, libibverbs).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Compiles `code` into `dir/<soname>` with `CC` (else `cc`) and returns its path.
/// Reuses a library built from the same source; builds into a private file first, so
/// concurrent test processes never load a half-written library.
pub fn compile(dir: &Path, soname: &str, code: &str) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let library = dir.join(soname);
    let source = dir.join(format!("{soname}.c"));
    let unchanged = std::fs::read_to_string(&source).is_ok_and(|s| s == code);
    if unchanged && library.exists() {
        return Ok(library);
    }
    let private_source = dir.join(format!("{soname}.{}.c", std::process::id()));
    std::fs::write(&private_source, code)?;
    let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let partial = dir.join(format!("{soname}.{}", std::process::id()));
    let status = Command::new(compiler)
        // -Bsymbolic: calls inside the library stay inside it, whatever else is loaded.
        .args(["-O2", "-shared", "-fPIC", "-Wl,-Bsymbolic"])
        .arg(format!("-Wl,-soname,{soname}"))
        .arg("-o")
        .arg(&partial)
        .arg(&private_source)
        .arg("-lpthread")
        .status()?;
    if !status.success() {
        return Err(std::io::Error::other(format!(
            "compiling the stand-in {soname} failed: {status}"
        )));
    }
    std::fs::rename(&partial, &library)?;
    std::fs::rename(&private_source, &source)?;
    Ok(library)
}
