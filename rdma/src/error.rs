//! What can go wrong with RDMA, said so an operator knows what to do.

/// An RDMA failure.
#[derive(Clone, Debug, thiserror::Error)]
pub enum RdmaError {
    /// libibverbs (or the library named instead) could not be loaded.
    #[error(
        "cannot load {library} ({reason}): install rdma-core's libibverbs1 and the provider of your NIC (ibverbs-providers), or use --protocol tcp"
    )]
    NoLibrary {
        /// The library looked for.
        library: String,
        /// Why it was not usable.
        reason: String,
    },
    /// The library lists no device, or none of those asked for.
    #[error("no usable RDMA device: {0}; check `ibv_devinfo`")]
    NoDevice(String),
    /// A verbs call failed.
    #[error("{call} failed on {device}: {reason}")]
    Call {
        /// The verbs call.
        call: &'static str,
        /// The device it was made on.
        device: String,
        /// errno's text, with the usual fix where there is one.
        reason: String,
    },
}

impl RdmaError {
    /// A failed `call` on `device`, with errno's text (and the memlock fix for
    /// ENOMEM from a registration).
    pub(crate) fn call(call: &'static str, device: &str) -> RdmaError {
        let error = std::io::Error::last_os_error();
        let mut reason = error.to_string();
        if call == "ibv_reg_mr" && error.raw_os_error() == Some(libc::ENOMEM) {
            reason.push_str(
                " (registered memory counts against RLIMIT_MEMLOCK: run with LimitMEMLOCK=infinity or ulimit -l unlimited)",
            );
        }
        RdmaError::Call {
            call,
            device: device.to_string(),
            reason,
        }
    }

    /// A failed `call` on `device` that returned the errno `code` itself.
    pub(crate) fn returned(call: &'static str, device: &str, code: i32) -> RdmaError {
        RdmaError::Call {
            call,
            device: device.to_string(),
            reason: std::io::Error::from_raw_os_error(code).to_string(),
        }
    }
}
