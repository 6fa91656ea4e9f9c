//! Errors of device-memory calls.

/// A device-memory operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// No driver is loaded; the text says why.
    #[error("no GPU driver: {0}")]
    NoDriver(String),
    /// A driver call returned an error.
    #[error("{call} failed: {name} ({code})")]
    Call {
        /// The driver function.
        call: &'static str,
        /// The driver's error name (`CUDA_ERROR_…`, `hipError…`).
        name: String,
        /// The driver's error number.
        code: u32,
    },
    /// An argument was out of range (a length that does not fit, a null pointer).
    #[error("invalid argument: {0}")]
    Invalid(String),
}
