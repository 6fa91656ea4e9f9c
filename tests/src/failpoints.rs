//! Switching the failpoints of running processes (a build with the `failpoints`
//! feature): each process started with [`FailpointFile::env`] reads the file whenever it
//! changes (`MOONCAKE_FAILPOINTS_FILE`, see `mooncake_core::failpoint`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

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
    /// ones not named off, and waits (at most 10 s) until a process following the file
    /// has applied it: each checks the file every 100 ms and acknowledges what it
    /// applied in `<file>.applied.<pid>`.
    pub fn set(&self, spec: &str) {
        let text = spec.replace(';', "\n");
        let next = self.0.with_extension("next");
        std::fs::write(&next, &text).expect("write the failpoints file");
        std::fs::rename(&next, &self.0).expect("replace the failpoints file");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && !self.acknowledged(&text) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// True when a process acknowledged applying `text`.
    fn acknowledged(&self, text: &str) -> bool {
        self.acknowledgements()
            .any(|path| std::fs::read_to_string(path).is_ok_and(|applied| applied == text))
    }

    /// The acknowledgement files of the processes following this file.
    fn acknowledgements(&self) -> impl Iterator<Item = PathBuf> {
        let prefix = format!("{}.applied.", self.file_name());
        let dir = self.0.parent().map(PathBuf::from).unwrap_or_default();
        std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter(move |entry| entry.file_name().to_string_lossy().starts_with(&prefix))
            .map(|entry| entry.path())
    }

    fn file_name(&self) -> String {
        self.0
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Switches every failpoint of the file off.
    pub fn clear(&self) {
        self.set("");
    }
}

impl Drop for FailpointFile {
    fn drop(&mut self) {
        for acknowledgement in self.acknowledgements().collect::<Vec<_>>() {
            let _ = std::fs::remove_file(acknowledgement);
        }
        let _ = std::fs::remove_file(&self.0);
    }
}
