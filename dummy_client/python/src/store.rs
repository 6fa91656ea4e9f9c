//! `_StoreBase`: the store calls for Python, over a [`DummyClient`] (dummy mode) or an
//! in-process real client (embedded mode).

use std::sync::RwLock;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict};

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::types::ReplicateConfig;
use mooncake_core::units::parse_size;
use mooncake_dummy_client::{BufferHandle, DummyClient, Health, TaskStatus};
use mooncake_real_client::{EmbeddedOptions, RealClientConfig};

use crate::config::PyReplicateConfig;
use crate::convert::{code, descriptor, flag, unit, value};

/// The default staging buffer when `setup()` is not told one.
const DEFAULT_LOCAL_BUFFER: u64 = 16 << 20;
/// The default shared pool of an embedded client.
const DEFAULT_POOL: u64 = 64 << 20;

fn log_error(py: Python<'_>, message: &str) {
    let logged = py
        .import("logging")
        .and_then(|logging| logging.call_method1("getLogger", ("mooncake",)))
        .and_then(|logger| logger.call_method1("error", (message,)));
    if logged.is_err() {
        eprintln!("mooncake: {message}");
    }
}

fn config_of(config: Option<PyRef<'_, PyReplicateConfig>>) -> ReplicateConfig {
    config.map(|c| c.inner.clone()).unwrap_or_default()
}

/// A size given as an int or a string such as `"4GB"`.
fn size_arg(value: Option<&Bound<'_, PyAny>>, default: u64) -> PyResult<u64> {
    let Some(value) = value.filter(|v| !v.is_none()) else {
        return Ok(default);
    };
    if let Ok(n) = value.extract::<u64>() {
        return Ok(n);
    }
    let text: String = value.str()?.extract()?;
    parse_size(&text).map_err(|e| PyValueError::new_err(e.to_string()))
}

fn string_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    match value.filter(|v| !v.is_none()) {
        Some(v) => Ok(Some(v.str()?.extract()?)),
        None => Ok(None),
    }
}

/// A store object's bytes in the dummy's shared pool, valid while this object lives.
#[pyclass(name = "_RawBuffer", module = "mooncake._store")]
pub struct PyBufferHandle {
    handle: Option<BufferHandle>,
}

#[pymethods]
impl PyBufferHandle {
    /// Address of the bytes (0 after `release()`).
    fn ptr(&self) -> u64 {
        self.handle.as_ref().map_or(0, BufferHandle::ptr)
    }

    /// Number of bytes.
    fn size(&self) -> u64 {
        self.handle.as_ref().map_or(0, BufferHandle::size)
    }

    fn __len__(&self) -> usize {
        self.handle.as_ref().map_or(0, BufferHandle::len)
    }

    /// A copy of the bytes.
    fn tobytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(
            py,
            self.handle.as_ref().map_or(&[][..], BufferHandle::as_slice),
        )
    }

    /// Returns the memory to the pool now (the handle becomes empty).
    fn release(&mut self) {
        self.handle = None;
    }
}

/// The store client behind `MooncakeDistributedStore`.
#[pyclass(name = "_StoreBase", subclass, module = "mooncake._store")]
pub struct PyStore {
    client: RwLock<Option<DummyClient>>,
}

impl PyStore {
    fn client(&self) -> Option<DummyClient> {
        self.client.read().ok().and_then(|c| c.clone())
    }

    /// Runs `op` on the client without the GIL; `fallback` when not set up.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        fallback: T,
        op: impl FnOnce(&DummyClient) -> T + Send,
    ) -> T {
        match self.client() {
            Some(client) => py.detach(move || op(&client)),
            None => fallback,
        }
    }

    /// [`with`](Self::with) for writes of Python bytes, which go through the local
    /// buffer as upstream's do: `INVALID_PARAMS` (logged once) when the store was set
    /// up with `local_buffer_size=0`.
    fn with_local_buffer(
        &self,
        py: Python<'_>,
        op: impl FnOnce(&DummyClient) -> i64 + Send,
    ) -> i64 {
        static NOTICE: std::sync::Once = std::sync::Once::new();
        match self.client() {
            Some(client) if client.local_buffer_size() == 0 => {
                NOTICE.call_once(|| {
                    log_error(py, "put of bytes needs the local buffer and this store has local_buffer_size=0 (as upstream, it fails with INVALID_PARAMS): give setup a local_buffer_size, or use put_from with registered memory");
                });
                code(ErrorCode::INVALID_PARAMS)
            }
            Some(client) => py.detach(move || op(&client)),
            None => not_ready(),
        }
    }

    fn install(&self, client: DummyClient) {
        if let Ok(mut slot) = self.client.write()
            && let Some(old) = slot.replace(client)
        {
            old.close();
        }
    }
}

/// Reads `key` into a new Python `bytes`, copied straight out of shared memory (the
/// GIL is taken only for that copy); `None` when the read fails.
fn get_as_bytes(client: &DummyClient, key: &str) -> Option<Py<PyBytes>> {
    client
        .get_with_or_in_place(
            key,
            |value| Python::attach(|py| PyBytes::new(py, value).unbind()),
            |size| get_in_place(client, key, size),
        )
        .ok()
}

/// Embedded mode: reads `key`, of `size` bytes, straight into a new `bytes` object,
/// lent to the real client of this process for the one copy. `None` (the caller takes
/// the staged path) when the object is not `size` bytes any more or the read failed.
fn get_in_place(client: &DummyClient, key: &str, size: u64) -> Option<Py<PyBytes>> {
    let len = isize::try_from(size).ok()?;
    let (bytes, buffer) = Python::attach(|py| {
        // SAFETY: a null source asks CPython for an uninitialised object of `len`
        // bytes; it is filled below before anyone else sees it.
        let object = unsafe { pyo3::ffi::PyBytes_FromStringAndSize(std::ptr::null(), len) };
        // SAFETY: a new reference, or null (then the error is taken and dropped).
        let object = unsafe { Bound::from_owned_ptr_or_err(py, object) }.ok()?;
        // SAFETY: `object` is a live bytes object of `len` bytes.
        let buffer = unsafe { pyo3::ffi::PyBytes_AsString(object.as_ptr()) } as u64;
        let bytes = object.cast_into::<PyBytes>().ok()?.unbind();
        Some((bytes, buffer))
    })?;
    // SAFETY: `buffer` is the storage of the new bytes object, which `bytes` keeps
    // alive until after the buffer is unregistered below.
    if buffer == 0 || unsafe { client.register_buffer(buffer, size) }.is_err() {
        return None;
    }
    // SAFETY: nobody else sees the bytes object before it is returned, filled.
    let read = unsafe { client.get_into(key, buffer, size) };
    let _ = client.unregister_buffer(buffer);
    match read {
        Ok(got) if got == size => Some(bytes),
        _ => None,
    }
}

fn not_ready() -> i64 {
    code(ErrorCode::RPC_FAIL)
}

fn not_ready_list(n: usize) -> Vec<i64> {
    vec![not_ready(); n]
}

#[pymethods]
impl PyStore {
    #[new]
    fn new() -> Self {
        PyStore {
            client: RwLock::new(None),
        }
    }

    /// Attaches to the real client at `server_address` (`host:port`, `unix:/path`,
    /// `/path` or `@name`; `MOONCAKE_CLIENT` when empty) with a shared pool of
    /// `mem_pool_size` bytes and a staging buffer of `local_buffer_size` bytes.
    /// Returns 0, or -1 with the reason logged.
    #[pyo3(signature = (mem_pool_size=None, local_buffer_size=None, server_address=None))]
    fn setup_dummy(
        &self,
        py: Python<'_>,
        mem_pool_size: Option<&Bound<'_, PyAny>>,
        local_buffer_size: Option<&Bound<'_, PyAny>>,
        server_address: Option<String>,
    ) -> PyResult<i64> {
        init_logging();
        let pool = size_arg(mem_pool_size, 0)?;
        let staging = size_arg(local_buffer_size, DEFAULT_LOCAL_BUFFER)?;
        let pool = if pool == 0 { DEFAULT_POOL } else { pool };
        let result =
            py.detach(move || DummyClient::setup_dummy(pool, staging, server_address.as_deref()));
        match result {
            Ok(client) => {
                self.install(client);
                Ok(0)
            }
            Err(error) => {
                log_error(py, &format!("setup_dummy failed: {error}"));
                Ok(-1)
            }
        }
    }

    /// Runs a real client in this process (embedded mode). Takes upstream's positional
    /// arguments or one dict with upstream's keys. Returns 0, or -1 with the reason
    /// logged.
    #[pyo3(signature = (local_hostname, metadata_server=None, global_segment_size=None, local_buffer_size=None, protocol=None, rdma_devices=None, master_server_addr=None, engine=None, enable_ssd_offload=false, ssd_offload_path=None, tenant_id=None, enable_client_http_server=false, client_http_port=9300))]
    #[expect(clippy::too_many_arguments, reason = "upstream's positional signature")]
    fn setup(
        &self,
        py: Python<'_>,
        local_hostname: &Bound<'_, PyAny>,
        metadata_server: Option<&Bound<'_, PyAny>>,
        global_segment_size: Option<&Bound<'_, PyAny>>,
        local_buffer_size: Option<&Bound<'_, PyAny>>,
        protocol: Option<&Bound<'_, PyAny>>,
        rdma_devices: Option<&Bound<'_, PyAny>>,
        master_server_addr: Option<&Bound<'_, PyAny>>,
        engine: Option<&Bound<'_, PyAny>>,
        enable_ssd_offload: bool,
        ssd_offload_path: Option<&Bound<'_, PyAny>>,
        tenant_id: Option<&Bound<'_, PyAny>>,
        enable_client_http_server: bool,
        client_http_port: u16,
    ) -> PyResult<i64> {
        init_logging();
        let _ = engine;
        let settings = (|| -> PyResult<EmbeddedSettings> {
            Ok(if let Ok(dict) = local_hostname.cast::<PyDict>() {
                let get = |key: &str| dict.get_item(key).ok().flatten();
                let http = match get("enable_client_http_server") {
                    Some(v) => mooncake_core::flags::parse_bool(&v.str()?.extract::<String>()?)
                        .unwrap_or(false),
                    None => false,
                };
                let port = match get("client_http_port") {
                    Some(v) => v
                        .str()?
                        .extract::<String>()?
                        .trim()
                        .parse::<u16>()
                        .map_err(|_| {
                            PyValueError::new_err("client_http_port: expected a port number")
                        })?,
                    None => 9300,
                };
                EmbeddedSettings {
                    http_port: http.then_some(port),
                    host: string_arg(get("local_hostname").as_ref())?,
                    segment: size_arg(get("global_segment_size").as_ref(), 16 << 20)?,
                    staging: size_arg(get("local_buffer_size").as_ref(), DEFAULT_LOCAL_BUFFER)?,
                    protocol: string_arg(get("protocol").as_ref())?,
                    devices: string_arg(get("rdma_devices").as_ref())?,
                    master: string_arg(
                        get("master_server_addr")
                            .or_else(|| get("master_server_address"))
                            .as_ref(),
                    )?,
                    tenant: string_arg(get("tenant_id").as_ref())?,
                    offload_path: string_arg(get("ssd_offload_path").as_ref())?,
                    offload: match get("enable_ssd_offload") {
                        Some(v) if v.is_instance_of::<pyo3::types::PyString>() => {
                            let text: String = v.extract()?;
                            mooncake_core::flags::parse_bool(&text).ok_or_else(|| {
                                PyValueError::new_err(format!(
                                    "enable_ssd_offload: {text:?} is not a boolean"
                                ))
                            })?
                        }
                        Some(v) => v.is_truthy()?,
                        None => false,
                    },
                }
            } else {
                let _ = metadata_server;
                EmbeddedSettings {
                    http_port: enable_client_http_server.then_some(client_http_port),
                    host: string_arg(Some(local_hostname))?,
                    segment: size_arg(global_segment_size, 16 << 20)?,
                    staging: size_arg(local_buffer_size, DEFAULT_LOCAL_BUFFER)?,
                    protocol: string_arg(protocol)?,
                    devices: string_arg(rdma_devices)?,
                    master: string_arg(master_server_addr)?,
                    tenant: string_arg(tenant_id)?,
                    offload_path: string_arg(ssd_offload_path)?,
                    offload: enable_ssd_offload,
                }
            })
        })();
        // Upstream answers an unusable argument (a size such as "50%") with an error
        // code, not an exception.
        let settings = match settings {
            Ok(settings) => settings,
            Err(error) if error.is_instance_of::<PyValueError>(py) => {
                log_error(py, &format!("setup failed: {error}"));
                return Ok(-1);
            }
            Err(error) => return Err(error),
        };
        let config = match settings.to_config() {
            Ok(config) => config,
            Err(message) => {
                log_error(py, &format!("setup failed: {message}"));
                return Ok(-1);
            }
        };
        let staging = settings.staging;
        match py.detach(move || DummyClient::setup_embedded(config, DEFAULT_POOL, staging)) {
            Ok(client) => {
                self.install(client);
                Ok(0)
            }
            Err(error) => {
                log_error(py, &format!("setup failed: {error}"));
                Ok(-1)
            }
        }
    }

    /// Disconnects (the real client releases this client's memory at once); later
    /// calls return errors. Returns 0.
    fn close(&self, py: Python<'_>) -> i64 {
        self.with(py, (), DummyClient::close);
        0
    }

    /// True when `ptr..ptr+size` is this client's shared memory or a registered buffer.
    fn _owns_memory(&self, ptr: u64, size: u64) -> bool {
        self.client().is_some_and(|c| c.owns_memory(ptr, size))
    }

    /// 0 healthy, 1 not set up or closed, 2 real client or master unreachable.
    fn health_check(&self, py: Python<'_>) -> i64 {
        self.with(py, Health::NotInitialized, DummyClient::health_check) as i64
    }

    /// The segment name of the real client (`host:port`).
    fn get_hostname(&self, py: Python<'_>) -> String {
        self.with(py, String::new(), DummyClient::get_hostname)
    }

    // ----- writes -----

    #[pyo3(signature = (key, value, config=None))]
    fn put(
        &self,
        py: Python<'_>,
        key: String,
        value: PyBackedBytes,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with_local_buffer(py, move |c| unit(c.put(&key, &value, &config)))
    }

    #[pyo3(signature = (key, *parts, config=None))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: String,
        parts: Vec<PyBackedBytes>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with_local_buffer(py, move |c| {
            let views: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            unit(c.put_parts(&key, &views, &config))
        })
    }

    #[pyo3(signature = (keys, values, config=None))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<PyBackedBytes>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with_local_buffer(py, move |c| {
            let views: Vec<&[u8]> = values.iter().map(|p| &p[..]).collect();
            first_error(c.put_batch(&keys, &views, &config))
        })
    }

    #[pyo3(signature = (key, value, config=None))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: String,
        value: PyBackedBytes,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with_local_buffer(py, move |c| unit(c.upsert(&key, &value, &config)))
    }

    #[pyo3(signature = (key, *parts, config=None))]
    fn upsert_parts(
        &self,
        py: Python<'_>,
        key: String,
        parts: Vec<PyBackedBytes>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with_local_buffer(py, move |c| {
            let views: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            unit(c.upsert_parts(&key, &views, &config))
        })
    }

    #[pyo3(signature = (keys, values, config=None))]
    fn upsert_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<PyBackedBytes>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with_local_buffer(py, move |c| {
            let views: Vec<&[u8]> = values.iter().map(|p| &p[..]).collect();
            first_error(c.upsert_batch(&keys, &views, &config))
        })
    }

    #[pyo3(signature = (key, buffer_ptr, size, config=None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: String,
        buffer_ptr: u64,
        size: u64,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with(py, not_ready(), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unit(unsafe { c.put_from(&key, buffer_ptr, size, &config) })
        })
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes, config=None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<u64>,
        sizes: Vec<u64>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> Vec<i64> {
        let config = config_of(config);
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unsafe { c.batch_put_from(&keys, &buffer_ptrs, &sizes, &config) }
                .into_iter()
                .map(unit)
                .collect()
        })
    }

    #[pyo3(signature = (key, buffer_ptr, size, config=None))]
    fn upsert_from(
        &self,
        py: Python<'_>,
        key: String,
        buffer_ptr: u64,
        size: u64,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with(py, not_ready(), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unit(unsafe { c.upsert_from(&key, buffer_ptr, size, &config) })
        })
    }

    #[pyo3(signature = (keys, buffer_ptrs, sizes, config=None))]
    fn batch_upsert_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<u64>,
        sizes: Vec<u64>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> Vec<i64> {
        let config = config_of(config);
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unsafe { c.batch_upsert_from(&keys, &buffer_ptrs, &sizes, &config) }
                .into_iter()
                .map(unit)
                .collect()
        })
    }

    #[pyo3(signature = (key, buffer_ptr, metadata_buffer_ptr, size, metadata_size, config=None))]
    #[expect(clippy::too_many_arguments, reason = "upstream's signature")]
    fn put_from_with_metadata(
        &self,
        py: Python<'_>,
        key: String,
        buffer_ptr: u64,
        metadata_buffer_ptr: u64,
        size: u64,
        metadata_size: u64,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> i64 {
        let config = config_of(config);
        self.with(py, not_ready(), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unit(unsafe {
                c.put_from_with_metadata(
                    &key,
                    buffer_ptr,
                    metadata_buffer_ptr,
                    size,
                    metadata_size,
                    &config,
                )
            })
        })
    }

    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config=None))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<u64>>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> Vec<i64> {
        let config = config_of(config);
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unsafe { c.batch_put_from_multi_buffers(&keys, &all_buffer_ptrs, &all_sizes, &config) }
                .into_iter()
                .map(unit)
                .collect()
        })
    }

    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config=None))]
    fn batch_upsert_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<u64>>,
        config: Option<PyRef<'_, PyReplicateConfig>>,
    ) -> Vec<i64> {
        let config = config_of(config);
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unsafe {
                c.batch_upsert_from_multi_buffers(&keys, &all_buffer_ptrs, &all_sizes, &config)
            }
            .into_iter()
            .map(unit)
            .collect()
        })
    }

    // ----- reads -----

    /// The object's bytes, or `b""` when it is missing (or on error).
    fn get<'py>(&self, py: Python<'py>, key: String) -> Bound<'py, PyBytes> {
        let value = self.with(py, None, move |c| get_as_bytes(c, &key));
        value.map_or_else(|| PyBytes::new(py, b""), |bytes| bytes.into_bound(py))
    }

    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> Vec<Bound<'py, PyBytes>> {
        let n = keys.len();
        let values: Vec<Option<Py<PyBytes>>> =
            self.with(py, (0..n).map(|_| None).collect(), move |c| {
                keys.iter().map(|key| get_as_bytes(c, key)).collect()
            });
        values
            .into_iter()
            .map(|v| v.map_or_else(|| PyBytes::new(py, b""), |bytes| bytes.into_bound(py)))
            .collect()
    }

    fn _get_buffer(&self, py: Python<'_>, key: String) -> Option<PyBufferHandle> {
        self.with(py, None, move |c| c.get_buffer(&key).ok())
            .map(|handle| PyBufferHandle {
                handle: Some(handle),
            })
    }

    fn _batch_get_buffer(&self, py: Python<'_>, keys: Vec<String>) -> Vec<Option<PyBufferHandle>> {
        let n = keys.len();
        let handles = self.with(py, (0..n).map(|_| None).collect(), move |c| {
            c.batch_get_buffer(&keys)
                .into_iter()
                .map(Result::ok)
                .collect::<Vec<_>>()
        });
        handles
            .into_iter()
            .map(|h| {
                h.map(|handle| PyBufferHandle {
                    handle: Some(handle),
                })
            })
            .collect()
    }

    fn get_into(&self, py: Python<'_>, key: String, buffer_ptr: u64, size: u64) -> i64 {
        self.with(py, not_ready(), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            value(unsafe { c.get_into(&key, buffer_ptr, size) })
        })
    }

    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<u64>,
        sizes: Vec<u64>,
    ) -> Vec<i64> {
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unsafe { c.batch_get_into(&keys, &buffer_ptrs, &sizes) }
                .into_iter()
                .map(value)
                .collect()
        })
    }

    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node=false))]
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<u64>>,
        all_sizes: Vec<Vec<u64>>,
        prefer_alloc_in_same_node: bool,
    ) -> Vec<i64> {
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unsafe {
                c.batch_get_into_multi_buffers(
                    &keys,
                    &all_buffer_ptrs,
                    &all_sizes,
                    prefer_alloc_in_same_node,
                )
            }
            .into_iter()
            .map(value)
            .collect()
        })
    }

    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffer_ptrs: Vec<u64>,
        keys: Vec<Vec<String>>,
        dst_offsets: Vec<Vec<Vec<u64>>>,
        src_offsets: Vec<Vec<Vec<u64>>>,
        sizes: Vec<Vec<Vec<u64>>>,
    ) -> Vec<Vec<Vec<i64>>> {
        let fallback: Vec<Vec<Vec<i64>>> = keys
            .iter()
            .enumerate()
            .map(|(b, ks)| {
                (0..ks.len())
                    .map(|k| {
                        not_ready_list(
                            dst_offsets
                                .get(b)
                                .and_then(|d| d.get(k))
                                .map_or(0, Vec::len),
                        )
                    })
                    .collect()
            })
            .collect();
        self.with(py, fallback, move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unsafe { c.get_into_ranges(&buffer_ptrs, &keys, &dst_offsets, &src_offsets, &sizes) }
                .into_iter()
                .map(|per_key| {
                    per_key
                        .into_iter()
                        .map(|per_fragment| per_fragment.into_iter().map(value).collect())
                        .collect()
                })
                .collect()
        })
    }

    // ----- queries and removal -----

    fn is_exist(&self, py: Python<'_>, key: String) -> i64 {
        self.with(py, not_ready(), move |c| flag(c.is_exist(&key)))
    }

    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i64> {
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            c.batch_is_exist(&keys).into_iter().map(flag).collect()
        })
    }

    fn get_size(&self, py: Python<'_>, key: String) -> i64 {
        self.with(py, not_ready(), move |c| value(c.get_size(&key)))
    }

    /// Replica descriptors of `key` as dicts (`[]` when missing).
    fn get_replica_desc<'py>(
        &self,
        py: Python<'py>,
        key: String,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let replicas = self.with(py, Vec::new(), move |c| {
            c.get_replica_desc(&key).unwrap_or_default()
        });
        replicas.iter().map(|r| descriptor(py, r)).collect()
    }

    /// `{key: [descriptor, ...]}` for the keys that exist.
    fn batch_get_replica_desc<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let asked = keys.clone();
        let results = self.with(py, Vec::new(), move |c| c.batch_get_replica_desc(&keys));
        let out = PyDict::new(py);
        for (key, result) in asked.iter().zip(results) {
            if let Ok(replicas) = result {
                let list: PyResult<Vec<_>> = replicas.iter().map(|r| descriptor(py, r)).collect();
                out.set_item(key, list?)?;
            }
        }
        Ok(out)
    }

    #[pyo3(signature = (key, force=false))]
    fn remove(&self, py: Python<'_>, key: String, force: bool) -> i64 {
        self.with(py, not_ready(), move |c| unit(c.remove(&key, force)))
    }

    #[pyo3(signature = (keys, force=false))]
    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i64> {
        let n = keys.len();
        self.with(py, not_ready_list(n), move |c| {
            c.batch_remove(&keys, force).into_iter().map(unit).collect()
        })
    }

    /// Clears the objects among `keys` that nobody read or wrote for one lease TTL:
    /// their memory replicas on the segment `segment_name`, or (empty) whole. Returns
    /// the keys cleared.
    #[pyo3(signature = (keys, segment_name=String::new()))]
    fn batch_replica_clear(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        segment_name: String,
    ) -> Vec<String> {
        self.with(py, Vec::new(), move |c| {
            let segment = (!segment_name.is_empty()).then_some(segment_name.as_str());
            let results = c.clear_replicas(&keys, segment);
            keys.into_iter()
                .zip(results)
                .filter_map(|(key, result)| result.is_ok().then_some(key))
                .collect()
        })
    }

    #[pyo3(signature = (regex_pattern, force=false))]
    fn remove_by_regex(&self, py: Python<'_>, regex_pattern: String, force: bool) -> i64 {
        self.with(py, not_ready(), move |c| {
            value(c.remove_by_regex(&regex_pattern, force))
        })
    }

    #[pyo3(signature = (force=false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        self.with(py, not_ready(), move |c| value(c.remove_all(force)))
    }

    /// `(task id as int or None, code)`.
    fn _create_copy_task(
        &self,
        py: Python<'_>,
        key: String,
        targets: Vec<String>,
    ) -> (Option<u128>, i64) {
        task_result(self.with(py, Err(ErrorCode::RPC_FAIL), move |c| {
            c.create_copy_task(&key, &targets)
        }))
    }

    /// `(task id as int or None, code)`.
    fn _create_move_task(
        &self,
        py: Python<'_>,
        key: String,
        source: String,
        target: String,
    ) -> (Option<u128>, i64) {
        task_result(self.with(py, Err(ErrorCode::RPC_FAIL), move |c| {
            c.create_move_task(&key, &source, &target)
        }))
    }

    /// `(dict or None, code)`.
    fn _query_task<'py>(
        &self,
        py: Python<'py>,
        id: u128,
    ) -> PyResult<(Option<Bound<'py, PyDict>>, i64)> {
        match self.with(py, Err(ErrorCode::RPC_FAIL), move |c| c.query_task(id)) {
            Ok(info) => {
                let dict = PyDict::new(py);
                dict.set_item("id", info.id)?;
                dict.set_item("type", format!("{:?}", info.kind).to_lowercase())?;
                dict.set_item("key", info.key)?;
                dict.set_item("targets", info.targets)?;
                let (status, error) = match info.status {
                    TaskStatus::Pending => ("pending", 0),
                    TaskStatus::Running => ("running", 0),
                    TaskStatus::Success => ("success", 0),
                    TaskStatus::Failed(code) => ("failed", code),
                };
                dict.set_item("status", status)?;
                dict.set_item("error_code", error)?;
                Ok((Some(dict), 0))
            }
            Err(error) => Ok((None, code(error))),
        }
    }

    // ----- memory -----

    /// Address of `size` bytes of shared memory (zero-copy buffers), or 0.
    fn alloc_from_mem_pool(&self, py: Python<'_>, size: u64) -> u64 {
        self.with(py, 0, move |c| c.alloc_from_mem_pool(size))
    }

    fn free_to_mem_pool(&self, py: Python<'_>, ptr: u64) -> i64 {
        self.with(py, not_ready(), move |c| unit(c.free_to_mem_pool(ptr)))
    }

    fn register_buffer(&self, py: Python<'_>, buffer_ptr: u64, size: u64) -> i64 {
        self.with(py, not_ready(), move |c| {
            // SAFETY: upstream's API takes integer pointers: the application promises that
            // they name memory valid for the call (a registered buffer stays valid until it
            // is unregistered), used by nobody else meanwhile, as with upstream's wheel.
            unit(unsafe { c.register_buffer(buffer_ptr, size) })
        })
    }

    fn unregister_buffer(&self, py: Python<'_>, buffer_ptr: u64) -> i64 {
        self.with(py, not_ready(), move |c| {
            unit(c.unregister_buffer(buffer_ptr))
        })
    }

    /// The real client's status as a JSON string (dummies, memory, objects).
    fn _status_json(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let report = self.with(py, Err(ErrorCode::RPC_FAIL), DummyClient::status);
        match report {
            Ok(report) => Ok(Some(status_json(&report))),
            Err(_) => Ok(None),
        }
    }
}

fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    });
}

fn first_error(results: Vec<CodeResult<()>>) -> i64 {
    results.into_iter().find_map(Result::err).map_or(0, code)
}

fn task_result(result: CodeResult<u128>) -> (Option<u128>, i64) {
    match result {
        Ok(id) => (Some(id), 0),
        Err(error) => (None, code(error)),
    }
}

fn status_json(report: &mooncake_core::protocol::rpc::StatusReport) -> String {
    let dummies: Vec<serde_json::Value> = report
        .dummies
        .iter()
        .map(|d| {
            serde_json::json!({
                "pid": d.pid, "uid": d.uid, "name": d.name,
                "segments": d.segments, "mapped_bytes": d.mapped_bytes,
                "declared_ranges": d.declared_ranges, "cross_memory": d.cross_memory,
                "device_buffers": d.device_buffers,
            })
        })
        .collect();
    let segments: Vec<serde_json::Value> = report
        .master
        .segments
        .iter()
        .map(|s| serde_json::json!({"id": s.id, "name": s.name, "capacity": s.capacity, "used": s.used}))
        .collect();
    serde_json::json!({
        "pid": report.pid,
        "instance_id": format!("{:032x}", report.instance_id),
        "segment_name": report.segment_name,
        "uptime_secs": report.uptime_secs,
        "mapped_bytes": report.mapped_bytes,
        "dummies": dummies,
        "objects": report.master.objects,
        "writes_in_progress": report.master.writes_in_progress,
        "reserved_writes": report.master.reserved_writes,
        "segments": segments,
        "remote_disk_reads": report.remote_disk_reads,
        "master": report.master_at,
        "segment_bytes": report.segment_bytes,
        "segment_resident_bytes": report.segment_resident_bytes,
        "staged_bytes": report.staged_bytes,
        "read_cache_hits": report.read_cache_hits,
        "reserved_puts": report.reserved_puts,
        "device_handles": report.device_handles,
        "segment_pinned_bytes": report.segment_pinned_bytes,
        "taken_over": report.taken_over.as_ref().map(|taken| serde_json::json!({
            "from_pid": taken.from_pid,
            "segment_bytes": taken.segment_bytes,
            "objects": taken.objects,
            "took_ms": taken.took_ms,
            "at_unix_secs": taken.at_unix_secs,
        })),
        "copied_through_staging_bytes": mooncake_dummy_client::copied_through_staging_bytes(),
    })
    .to_string()
}

/// Settings of an embedded real client gathered from `setup()`'s arguments.
struct EmbeddedSettings {
    http_port: Option<u16>,
    host: Option<String>,
    segment: u64,
    staging: u64,
    protocol: Option<String>,
    devices: Option<String>,
    master: Option<String>,
    tenant: Option<String>,
    offload: bool,
    offload_path: Option<String>,
}

/// Upstream's range for the port an embedded store picks when `local_hostname` names
/// none (its segment name is `host:port`).
const EMBEDDED_PORTS: std::ops::Range<u16> = 12_300..14_300;

/// Ports taken by the embedded stores of this process, so that two `setup()` stores
/// never share a segment name.
static EMBEDDED_PORTS_TAKEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());

/// Splits `host:port` (a port given by the application) from a bare host.
fn split_host_port(text: &str) -> (String, Option<u16>) {
    let text = text.trim();
    if let Some(rest) = text.strip_prefix('[')
        && let Some((host, port)) = rest.split_once("]:")
        && let Ok(port) = port.parse::<u16>()
    {
        return (host.to_string(), Some(port));
    }
    match text.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') => match port.parse::<u16>() {
            Ok(port) => (host.to_string(), Some(port)),
            Err(_) => (text.to_string(), None),
        },
        _ => (text.to_string(), None),
    }
}

/// A port of [`EMBEDDED_PORTS`] that no other embedded store of this process uses and
/// that is free on this host, marked taken.
fn pick_embedded_port() -> Option<u16> {
    let mut taken = EMBEDDED_PORTS_TAKEN.lock().ok()?;
    let span = u32::from(EMBEDDED_PORTS.end - EMBEDDED_PORTS.start);
    let start = std::process::id() % span;
    let port = (0..span)
        .map(|i| EMBEDDED_PORTS.start + u16::try_from((start + i) % span).unwrap_or(0))
        .find(|port| {
            !taken.contains(port) && std::net::TcpListener::bind(("0.0.0.0", *port)).is_ok()
        })?;
    taken.push(port);
    Some(port)
}

impl EmbeddedSettings {
    fn to_config(&self) -> Result<RealClientConfig, String> {
        let master = match self.master.as_deref().map(str::trim) {
            None | Some("" | "embedded") => "embedded".to_string(),
            Some(other) => other.to_string(),
        };
        let (host, given_port) = split_host_port(self.host.as_deref().unwrap_or("localhost"));
        let host = if host.is_empty() {
            "localhost".to_string()
        } else {
            host
        };
        let port = match given_port {
            Some(port) => port,
            None => pick_embedded_port().ok_or_else(|| {
                format!(
                    "no free port in {}..{} for this store's segment name; give local_hostname as host:port",
                    EMBEDDED_PORTS.start, EMBEDDED_PORTS.end
                )
            })?,
        };
        let options = EmbeddedOptions {
            host,
            port,
            global_segment_size: self.segment,
            master_address: master,
            protocol: self.protocol.clone().unwrap_or_else(|| "tcp".into()),
            rdma_devices: self.devices.clone().unwrap_or_default(),
            tenant_id: self.tenant.clone(),
            enable_offload: self.offload,
            offload_path: self.offload_path.clone(),
            http_port: self.http_port,
        };
        let config = RealClientConfig::embedded(options).map_err(|e| e.to_string())?;
        Ok(config)
    }
}
