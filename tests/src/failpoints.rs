//! Switching the failpoints of running processes (a build with the `failpoints`
//! feature): each process started with [`FailpointFile::env`] reads the file whenever it
//! changes (`MOONCAKE_FAILPOINTS_FILE`, see `mooncake_core::failpoint`).

use std::path::PathBuf;
use std::time::Duration;

/// A failpoints file, removed on drop.
#[derive(Debug)]
pub struct FailpointFile(PathBuf);

impl Default for FailpointFile {
    fn default() -> Self {
        Self::new()
    }
}

impl FailpointFile {
    /// An empty file (every failpoint off) with a name of its own.
    pub fn new() -> Self {
        let path = std::env::temp_dir().join(format!(
            "mooncake-failpoints-{}-{}",
            std::process::id(),
            crate::unique_port()
        ));
        std::fs::write(&path, "").expect("write the failpoints file");
        FailpointFile(path)
    }

    /// The environment variable that makes a process follow this file.
    pub fn env(&self) -> (&'static str, &str) {
        (
            "MOONCAKE_FAILPOINTS_FILE",
            self.0.to_str().expect("utf-8 path"),
        )
    }

    /// Sets the failpoints to `spec` (`name=actions` entries separated by `;`), the
    /// ones not named off, and waits until the processes have read it.
    pub fn set(&self, spec: &str) {
        let next = self.0.with_extension("next");
        std::fs::write(&next, spec.replace(';', "\n")).expect("write the failpoints file");
        std::fs::rename(&next, &self.0).expect("replace the failpoints file");
        // Each process checks the file every 100 ms.
        std::thread::sleep(Duration::from_millis(400));
    }

    /// Switches every failpoint of the file off.
    pub fn clear(&self) {
        self.set("");
    }
}

impl Drop for FailpointFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
