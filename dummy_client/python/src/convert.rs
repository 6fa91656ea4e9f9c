//! Conversions between Rust results and upstream's Python return values.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use mooncake_core::error::{CodeResult, ErrorCode, ToRet};
use mooncake_core::types::{ReplicaDescriptor, ReplicaLocation, ReplicaStatus};

/// `0` or the negative code.
pub fn unit(result: CodeResult<()>) -> i64 {
    result.to_ret()
}

/// The value or the negative code.
pub fn value(result: CodeResult<u64>) -> i64 {
    result.to_ret()
}

/// `1`/`0` or the negative code.
pub fn flag(result: CodeResult<bool>) -> i64 {
    match result {
        Ok(present) => i64::from(present),
        Err(code) => i64::from(code.as_i32()),
    }
}

/// The negative value of a code.
pub fn code(code: ErrorCode) -> i64 {
    i64::from(code.as_i32())
}

/// A replica descriptor as a dict: `type` (`memory` or `local_disk`), `segment_name`,
/// `endpoint`, `size`, `status`, and for memory `segment_id` and `offset`.
pub fn descriptor<'py>(
    py: Python<'py>,
    replica: &ReplicaDescriptor,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    match &replica.location {
        ReplicaLocation::Memory {
            segment,
            segment_name,
            offset,
            endpoint,
        } => {
            dict.set_item("type", "memory")?;
            dict.set_item("segment_name", segment_name)?;
            dict.set_item("segment_id", segment)?;
            dict.set_item("offset", offset)?;
            dict.set_item("endpoint", endpoint)?;
        }
        ReplicaLocation::Disk {
            segment_name,
            endpoint,
        } => {
            dict.set_item("type", "local_disk")?;
            dict.set_item("segment_name", segment_name)?;
            dict.set_item("endpoint", endpoint)?;
        }
    }
    dict.set_item("size", replica.size)?;
    let status = match replica.status {
        ReplicaStatus::Processing => "processing",
        ReplicaStatus::Complete => "complete",
    };
    dict.set_item("status", status)?;
    Ok(dict)
}
