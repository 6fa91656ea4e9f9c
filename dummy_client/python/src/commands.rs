//! The `mooncake_master` and `mooncake_client` commands inside the extension module,
//! so that installing the Python package gives both commands without separate binaries.
//!
//! The console scripts (`mooncake/cli.py`, `mooncake/cli_client.py`) call these in the
//! interpreter's own process: the command's pid is the server's, and SIGINT or SIGTERM
//! stops it cleanly as they stop the binaries (the scripts put SIGINT back to its
//! default action first, so that the interpreter's handler does not also run).

use pyo3::prelude::*;

/// Runs `mooncake_master` with `argv` (without the program name) until SIGINT or
/// SIGTERM, without the GIL; returns the exit status.
#[pyfunction]
fn _run_master(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(move || mooncake_master::command::main(argv))
}

/// Runs `mooncake_client` with `argv` (without the program name) until SIGINT or
/// SIGTERM, without the GIL; returns the exit status.
#[pyfunction]
fn _run_client(py: Python<'_>, argv: Vec<String>) -> u8 {
    py.detach(move || mooncake_real_client::cli::main(argv))
}

/// Adds the command functions to the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_run_master, m)?)?;
    m.add_function(wrap_pyfunction!(_run_client, m)?)?;
    Ok(())
}
