//! `ReplicateConfig` and `SoftPinAction` for Python, with upstream's field names.

use pyo3::prelude::*;

use mooncake_core::types::{ReplicateConfig, SoftPinAction};

/// What a write does to the object's soft pin.
#[pyclass(
    name = "SoftPinAction",
    eq,
    eq_int,
    hash,
    frozen,
    module = "mooncake.store",
    from_py_object
)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[expect(clippy::upper_case_acronyms, reason = "upstream's Python names")]
pub enum PySoftPinAction {
    /// Keep the object's soft pin as it is.
    PRESERVE = 0,
    /// Pin the object against eviction for a TTL.
    ENABLE = 1,
    /// Remove the soft pin.
    DISABLE = 2,
}

impl From<PySoftPinAction> for SoftPinAction {
    fn from(action: PySoftPinAction) -> Self {
        match action {
            PySoftPinAction::PRESERVE => SoftPinAction::Preserve,
            PySoftPinAction::ENABLE => SoftPinAction::Enable,
            PySoftPinAction::DISABLE => SoftPinAction::Disable,
        }
    }
}

impl From<SoftPinAction> for PySoftPinAction {
    fn from(action: SoftPinAction) -> Self {
        match action {
            SoftPinAction::Preserve => PySoftPinAction::PRESERVE,
            SoftPinAction::Enable => PySoftPinAction::ENABLE,
            SoftPinAction::Disable => PySoftPinAction::DISABLE,
        }
    }
}

/// Write options: replica count, pins and placement preferences.
#[pyclass(name = "ReplicateConfig", module = "mooncake.store", from_py_object)]
#[derive(Clone, Debug, Default)]
pub struct PyReplicateConfig {
    /// The Rust value.
    pub inner: ReplicateConfig,
    /// Upstream's replica group ids (`None` until set); carried for engines that set
    /// them, placement does not use them.
    pub group_ids: Option<Vec<String>>,
    /// Upstream's `ObjectDataType` value of the object (0 = UNKNOWN).
    pub data_type: i64,
    /// Replicas on NVMe-oF targets (upstream; this store has no such tier).
    pub nof_replica_num: u64,
    /// Replicas on a distributed file system (upstream; this store has no such tier).
    pub dfs_replica_num: u64,
    /// Preferred NVMe-oF segments (upstream; this store has no such tier).
    pub preferred_nof_segments: Vec<String>,
}

/// Upstream raises `TypeError` (pybind11's conversion error) for a value of the wrong
/// type or sign; pyo3 would raise `OverflowError` for a negative integer.
fn unsigned_or_none(value: &Bound<'_, PyAny>, field: &str) -> PyResult<Option<u64>> {
    if value.is_none() {
        return Ok(None);
    }
    value.extract::<u64>().map(Some).map_err(|_| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "ReplicateConfig.{field}: expected a non-negative int or None, got {}",
            value
                .repr()
                .map_or_else(|_| "?".to_string(), |r| r.to_string())
        ))
    })
}

fn unsigned(value: &Bound<'_, PyAny>, field: &str) -> PyResult<u64> {
    unsigned_or_none(value, field)?.ok_or_else(|| {
        pyo3::exceptions::PyTypeError::new_err(format!(
            "ReplicateConfig.{field}: expected a non-negative int, got None"
        ))
    })
}

#[pymethods]
impl PyReplicateConfig {
    #[new]
    fn new() -> Self {
        PyReplicateConfig::default()
    }

    /// Number of memory replicas (on distinct segments, best effort).
    #[getter]
    fn replica_num(&self) -> u32 {
        self.inner.replica_num
    }

    #[setter]
    fn set_replica_num(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let n = unsigned(value, "replica_num")?;
        self.inner.replica_num = u32::try_from(n)
            .map_err(|_| pyo3::exceptions::PyTypeError::new_err("replica_num is too large"))?;
        Ok(())
    }

    /// Soft-pin change applied when the write completes.
    #[getter]
    fn soft_pin_action(&self) -> PySoftPinAction {
        self.inner.soft_pin_action.into()
    }

    #[setter]
    fn set_soft_pin_action(&mut self, value: PySoftPinAction) {
        self.inner.soft_pin_action = value.into();
    }

    /// Soft-pin TTL in milliseconds (`None`: the master's default).
    #[getter]
    fn soft_pin_ttl_ms(&self) -> Option<u64> {
        self.inner.soft_pin_ttl_ms
    }

    #[setter]
    fn set_soft_pin_ttl_ms(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.soft_pin_ttl_ms = unsigned_or_none(value, "soft_pin_ttl_ms")?;
        Ok(())
    }

    /// Replica group ids (upstream's field; `None` when unset).
    #[getter]
    fn group_ids(&self) -> Option<Vec<String>> {
        self.group_ids.clone()
    }

    #[setter]
    fn set_group_ids(&mut self, value: Option<Vec<String>>) {
        self.group_ids = value;
    }

    /// The object's `ObjectDataType` (upstream's field).
    #[getter]
    fn data_type<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let value = self.data_type.into_pyobject(py)?.into_any();
        match py
            .import("mooncake.store")
            .and_then(|m| m.getattr("ObjectDataType"))
        {
            Ok(kind) => kind.call1((value,)),
            Err(_) => Ok(value),
        }
    }

    #[setter]
    fn set_data_type(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        let number = value
            .call_method0("__int__")
            .and_then(|n| n.extract::<i64>())
            .map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(
                    "ReplicateConfig.data_type: expected an ObjectDataType",
                )
            })?;
        self.data_type = number;
        Ok(())
    }

    /// Replicas on NVMe-oF targets (accepted; this store has no NVMe-oF tier).
    #[getter]
    fn nof_replica_num(&self) -> u64 {
        self.nof_replica_num
    }

    #[setter]
    fn set_nof_replica_num(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.nof_replica_num = unsigned(value, "nof_replica_num")?;
        Ok(())
    }

    /// Replicas on a distributed file system (accepted; this store has no DFS tier).
    #[getter]
    fn dfs_replica_num(&self) -> u64 {
        self.dfs_replica_num
    }

    #[setter]
    fn set_dfs_replica_num(&mut self, value: &Bound<'_, PyAny>) -> PyResult<()> {
        self.dfs_replica_num = unsigned(value, "dfs_replica_num")?;
        Ok(())
    }

    /// Preferred NVMe-oF segments (accepted; this store has no NVMe-oF tier).
    #[getter]
    fn preferred_nof_segments(&self) -> Vec<String> {
        self.preferred_nof_segments.clone()
    }

    #[setter]
    fn set_preferred_nof_segments(&mut self, value: Vec<String>) {
        self.preferred_nof_segments = value;
    }

    /// Older spelling of `soft_pin_action == ENABLE`.
    #[getter]
    fn with_soft_pin(&self) -> bool {
        self.inner.soft_pin_action == SoftPinAction::Enable
    }

    #[setter]
    fn set_with_soft_pin(&mut self, value: bool) {
        self.inner.soft_pin_action = if value {
            SoftPinAction::Enable
        } else {
            SoftPinAction::Preserve
        };
    }

    /// Never evict the object.
    #[getter]
    fn with_hard_pin(&self) -> bool {
        self.inner.with_hard_pin
    }

    #[setter]
    fn set_with_hard_pin(&mut self, value: bool) {
        self.inner.with_hard_pin = value;
    }

    /// Preferred segment (`host:port`); when set, `preferred_segments` is ignored.
    #[getter]
    fn preferred_segment(&self) -> String {
        self.inner.preferred_segment.clone()
    }

    #[setter]
    fn set_preferred_segment(&mut self, value: String) {
        self.inner.preferred_segment = value;
    }

    /// Preferred segments, tried in order.
    #[getter]
    fn preferred_segments(&self) -> Vec<String> {
        self.inner.preferred_segments.clone()
    }

    #[setter]
    fn set_preferred_segments(&mut self, value: Vec<String>) {
        self.inner.preferred_segments = value;
    }

    /// Place the replica on the writer's own node when possible.
    #[getter]
    fn prefer_alloc_in_same_node(&self) -> bool {
        self.inner.prefer_alloc_in_same_node
    }

    #[setter]
    fn set_prefer_alloc_in_same_node(&mut self, value: bool) {
        self.inner.prefer_alloc_in_same_node = value;
    }

    /// Same as `str()` (upstream's text form).
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        self.__str__(py)
    }

    /// Upstream's text form (`ReplicateConfig: { replica_num: 1, ... }`).
    fn __str__(&self, py: Python<'_>) -> PyResult<String> {
        let c = &self.inner;
        let data_type = self
            .data_type(py)?
            .getattr("name")
            .and_then(|n| n.extract::<String>())
            .unwrap_or_else(|_| self.data_type.to_string());
        let mut text = format!(
            "ReplicateConfig: {{ replica_num: {}, nof_replica_num: {}, dfs_replica_num: {}, soft_pin_action: {:?}, soft_pin_ttl_ms: {}, with_hard_pin: {}, preferred_segments: [{}], preferred_nof_segments: [{}], prefer_alloc_in_same_node: {}, data_type: {}",
            c.replica_num,
            self.nof_replica_num,
            self.dfs_replica_num,
            PySoftPinAction::from(c.soft_pin_action),
            c.soft_pin_ttl_ms
                .map_or("default".to_string(), |t| t.to_string()),
            u8::from(c.with_hard_pin),
            c.preferred_segments.join(", "),
            self.preferred_nof_segments.join(", "),
            u8::from(c.prefer_alloc_in_same_node),
            data_type,
        );
        if !c.preferred_segment.is_empty() {
            text.push_str(&format!(", preferred_segment: {}", c.preferred_segment));
        }
        if let Some(groups) = &self.group_ids {
            text.push_str(&format!(", group_ids: [{}]", groups.join(", ")));
        }
        text.push_str(" }");
        Ok(text)
    }
}
