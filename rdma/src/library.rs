//! libibverbs, loaded the first time RDMA is asked for (never at program start): the
//! binary and the wheel run the same on machines without it.
//!
//! `MOONCAKE_IBVERBS_LIBRARY` names another library to load (a path, or a name the
//! dynamic linker finds); tests point it at the stand-in provider
//! ([`crate::fake`]).

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use crate::error::RdmaError;
use crate::verbs::*;

/// The library loaded when `MOONCAKE_IBVERBS_LIBRARY` is not set.
pub const DEFAULT_LIBRARY: &str = "libibverbs.so.1";
/// The variable that names another library.
pub const LIBRARY_VARIABLE: &str = "MOONCAKE_IBVERBS_LIBRARY";

/// The verbs calls we make, resolved from the loaded library.
#[derive(Debug)]
pub(crate) struct Verbs {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut c_void,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    pub wc_status_str: unsafe extern "C" fn(c_int) -> *const c_char,
    /// Keeps the calls above valid.
    _library: libloading::Library,
}

static VERBS: OnceLock<Result<Verbs, RdmaError>> = OnceLock::new();

/// The loaded library (loaded on first call); the error says which library was
/// looked for and why it could not be used.
pub(crate) fn verbs() -> Result<&'static Verbs, RdmaError> {
    VERBS.get_or_init(load).as_ref().map_err(Clone::clone)
}

/// The library that is (or would be) loaded.
pub fn library_name() -> String {
    std::env::var(LIBRARY_VARIABLE).unwrap_or_else(|_| DEFAULT_LIBRARY.to_string())
}

fn load() -> Result<Verbs, RdmaError> {
    let name = library_name();
    // SAFETY: loading runs the library's initializers; libibverbs' (and the stand-in's)
    // only register providers.
    let library =
        unsafe { libloading::Library::new(&name) }.map_err(|error| RdmaError::NoLibrary {
            library: name.clone(),
            reason: error.to_string(),
        })?;
    macro_rules! resolve {
        ($symbol:literal) => {{
            let found = {
                // SAFETY: the symbol is declared with the signature verbs.h gives it.
                unsafe { library.get(concat!($symbol, "\0").as_bytes()) }
            };
            let symbol = found.map_err(|error| RdmaError::NoLibrary {
                library: name.clone(),
                reason: format!("{}: {error}", $symbol),
            })?;
            *symbol
        }};
    }
    Ok(Verbs {
        get_device_list: resolve!("ibv_get_device_list"),
        free_device_list: resolve!("ibv_free_device_list"),
        get_device_name: resolve!("ibv_get_device_name"),
        open_device: resolve!("ibv_open_device"),
        close_device: resolve!("ibv_close_device"),
        query_port: resolve!("ibv_query_port"),
        query_gid: resolve!("ibv_query_gid"),
        alloc_pd: resolve!("ibv_alloc_pd"),
        dealloc_pd: resolve!("ibv_dealloc_pd"),
        reg_mr: resolve!("ibv_reg_mr"),
        dereg_mr: resolve!("ibv_dereg_mr"),
        create_cq: resolve!("ibv_create_cq"),
        destroy_cq: resolve!("ibv_destroy_cq"),
        create_qp: resolve!("ibv_create_qp"),
        modify_qp: resolve!("ibv_modify_qp"),
        destroy_qp: resolve!("ibv_destroy_qp"),
        wc_status_str: resolve!("ibv_wc_status_str"),
        _library: library,
    })
}

impl Verbs {
    /// The text of a completion status.
    pub fn status_text(&self, status: c_int) -> String {
        // SAFETY: the library returns a static string for any status.
        let text = unsafe { (self.wc_status_str)(status) };
        if text.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}
