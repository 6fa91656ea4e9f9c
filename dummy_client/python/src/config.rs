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

fn py_bool(value: bool) -> &'static str {
    if value { "True" } else { "False" }
}

/// Write options: replica count, pins and placement preferences.
#[pyclass(name = "ReplicateConfig", module = "mooncake.store", from_py_object)]
#[derive(Clone, Debug, Default)]
pub struct PyReplicateConfig {
    /// The Rust value.
    pub inner: ReplicateConfig,
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
    fn set_replica_num(&mut self, value: u32) {
        self.inner.replica_num = value;
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
    fn set_soft_pin_ttl_ms(&mut self, value: Option<u64>) {
        self.inner.soft_pin_ttl_ms = value;
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

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "ReplicateConfig(replica_num={}, soft_pin_action=SoftPinAction.{:?}, soft_pin_ttl_ms={}, with_hard_pin={}, preferred_segment={:?}, preferred_segments={:?}, prefer_alloc_in_same_node={})",
            c.replica_num,
            PySoftPinAction::from(c.soft_pin_action),
            c.soft_pin_ttl_ms
                .map_or("None".to_string(), |t| t.to_string()),
            py_bool(c.with_hard_pin),
            c.preferred_segment,
            c.preferred_segments,
            py_bool(c.prefer_alloc_in_same_node)
        )
    }

    fn __str__(&self) -> String {
        self.__repr__()
    }
}
