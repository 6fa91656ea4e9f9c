//! Which transport moves this node's bytes to and from its peers: `--protocol`
//! (`MOONCAKE_PROTOCOL`, `protocol=` of `setup()`) is `tcp`, `rdma` or `auto`.
//!
//! `rdma` opens the devices of `--rdma_devices` (upstream's `device_names`), or those
//! nearest this process when none are named, through libibverbs loaded now (never at
//! program start, so the binary and the wheel run on machines without it); when there
//! is no library or no usable device it is refused with what was looked for and the
//! fix. `auto` takes RDMA when it would work, else TCP, and says once at startup which
//! one it took and why.

/// Where the kernel lists RDMA devices (named in messages for operators).
pub const RDMA_DEVICE_DIR: &str = "/sys/class/infiniband";

/// The transport asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// TCP connections between the nodes' transfer engines.
    Tcp,
    /// One-sided RDMA reads and writes.
    Rdma,
    /// RDMA where a usable device exists, else TCP.
    Auto,
}

impl Protocol {
    /// Reads a `--protocol` value (lower case, as upstream spells them).
    pub fn parse(value: &str) -> Result<Protocol, String> {
        match value {
            "tcp" => Ok(Protocol::Tcp),
            "rdma" => Ok(Protocol::Rdma),
            "auto" => Ok(Protocol::Auto),
            other => Err(format!("{other:?}: expected tcp, rdma or auto")),
        }
    }
}

/// What [`choose`] took, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chosen {
    /// The RDMA devices to open; `None` for TCP.
    pub rdma_devices: Option<Vec<String>>,
    /// Why this transport (for the startup line).
    pub reason: String,
}

/// The transport for `protocol` with the devices `wanted` (`--rdma_devices`, empty:
/// choose); `find` lists the usable devices (`mooncake_rdma::choose_devices`).
pub fn choose(
    protocol: Protocol,
    wanted: &[String],
    find: impl FnOnce(&[String]) -> Result<Vec<String>, String>,
) -> Result<Chosen, String> {
    if protocol == Protocol::Tcp {
        return Ok(Chosen {
            rdma_devices: None,
            reason: "asked for".into(),
        });
    }
    match (protocol, find(wanted)) {
        (_, Ok(devices)) => Ok(Chosen {
            reason: format!("RDMA devices {}", devices.join(", ")),
            rdma_devices: Some(devices),
        }),
        (Protocol::Auto, Err(why)) => Ok(Chosen {
            rdma_devices: None,
            reason: format!("auto: TCP, since {why}"),
        }),
        (_, Err(why)) => Err(format!(
            "\"rdma\": {why} (devices under {RDMA_DEVICE_DIR}); use --protocol tcp (MOONCAKE_PROTOCOL=tcp, protocol=\"tcp\"), or auto to take RDMA where it is available"
        )),
    }
}

/// The usable RDMA devices among `wanted` (all nearby ones when empty), or why there
/// are none.
pub fn find_devices(wanted: &[String]) -> Result<Vec<String>, String> {
    mooncake_rdma::choose_devices(wanted).map_err(|error| error.to_string())
}

/// Splits a `--rdma_devices` list (`mlx5_0,mlx5_1`; upstream also takes spaces).
pub fn device_list(value: &str) -> Vec<String> {
    value
        .split([',', ' '])
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(String::from)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn none(_: &[String]) -> Result<Vec<String>, String> {
        Err("cannot load libibverbs.so.1".into())
    }

    fn two(wanted: &[String]) -> Result<Vec<String>, String> {
        Ok(if wanted.is_empty() {
            vec!["mlx5_0".into(), "mlx5_1".into()]
        } else {
            wanted.to_vec()
        })
    }

    #[test]
    fn values_are_upstreams_plus_auto() {
        assert_eq!(Protocol::parse("tcp"), Ok(Protocol::Tcp));
        assert_eq!(Protocol::parse("rdma"), Ok(Protocol::Rdma));
        assert_eq!(Protocol::parse("auto"), Ok(Protocol::Auto));
        let refused = Protocol::parse("TCP").expect_err("upper case is not upstream's");
        assert!(refused.contains("tcp, rdma or auto"), "{refused}");
    }

    #[test]
    fn rdma_without_a_device_names_what_was_looked_for_and_the_fix() {
        let error = choose(Protocol::Rdma, &[], none).expect_err("refused");
        assert!(error.contains("libibverbs.so.1"), "{error}");
        assert!(error.contains(RDMA_DEVICE_DIR), "{error}");
        assert!(error.contains("--protocol tcp"), "{error}");
    }

    #[test]
    fn rdma_with_devices_takes_them() {
        let chosen = choose(Protocol::Rdma, &[], two).expect("devices");
        assert_eq!(
            chosen.rdma_devices,
            Some(vec!["mlx5_0".into(), "mlx5_1".into()])
        );
        let chosen = choose(Protocol::Auto, &["mlx5_1".into()], two).expect("devices");
        assert_eq!(chosen.rdma_devices, Some(vec!["mlx5_1".into()]));
    }

    #[test]
    fn auto_falls_back_to_tcp_and_says_why() {
        let chosen = choose(Protocol::Auto, &[], none).expect("auto always runs");
        assert_eq!(chosen.rdma_devices, None);
        assert!(chosen.reason.contains("libibverbs"), "{chosen:?}");
        let chosen = choose(Protocol::Tcp, &[], two).expect("tcp");
        assert_eq!(chosen.rdma_devices, None, "tcp never opens devices");
    }

    #[test]
    fn device_lists_take_commas_and_spaces() {
        assert_eq!(
            device_list("mlx5_0, mlx5_1 mlx5_2,"),
            ["mlx5_0", "mlx5_1", "mlx5_2"]
        );
        assert!(device_list("").is_empty());
    }
}
