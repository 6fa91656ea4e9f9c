//! Which transport moves this node's bytes to and from its peers: `--protocol`
//! (`MOONCAKE_PROTOCOL`, `protocol=` of `setup()`) is `tcp`, `rdma` or `auto`.
//!
//! This build's transfer engine moves bytes over TCP. `rdma` is therefore refused with
//! a message that says what was looked for (RDMA devices under
//! [`RDMA_DEVICE_DIR`]) and what to use instead; `auto` takes RDMA where a usable
//! device and transport exist, else TCP, and says once at startup which one it took
//! and why. Looking for devices reads sysfs only: nothing is loaded, so the binary and
//! the wheel run the same on machines with and without `libibverbs`.

use std::path::Path;

/// Where the kernel lists RDMA devices (one entry per device: `mlx5_0`, `rxe0`, ...).
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

/// The RDMA devices the kernel lists under `dir`, sorted (none when it does not exist).
pub fn rdma_devices(dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    names
}

/// The transport this build runs for `protocol` on a machine with `devices`: TCP, with
/// the reason when `auto` chose it; an error that names what was looked for and the
/// fix when RDMA was asked for.
pub fn choose(protocol: Protocol, devices: &[String]) -> Result<Chosen, String> {
    let found = if devices.is_empty() {
        format!("no RDMA device found (looked for entries in {RDMA_DEVICE_DIR})")
    } else {
        format!(
            "RDMA devices found ({}), but this build's transfer engine moves bytes over TCP only",
            devices.join(", ")
        )
    };
    match protocol {
        Protocol::Tcp => Ok(Chosen {
            reason: "asked for".into(),
        }),
        Protocol::Auto => Ok(Chosen { reason: found }),
        Protocol::Rdma => Err(format!(
            "\"rdma\": {found}; use --protocol tcp (MOONCAKE_PROTOCOL=tcp, protocol=\"tcp\"), or auto to take RDMA where it is available"
        )),
    }
}

/// What [`choose`] took: always TCP in this build, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chosen {
    /// Why this transport (for the startup line).
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let error = choose(Protocol::Rdma, &[]).expect_err("refused");
        assert!(error.contains(RDMA_DEVICE_DIR), "{error}");
        assert!(error.contains("--protocol tcp"), "{error}");
        let error = choose(Protocol::Rdma, &["mlx5_0".into()]).expect_err("refused");
        assert!(
            error.contains("mlx5_0") && error.contains("TCP only"),
            "{error}"
        );
    }

    #[test]
    fn auto_takes_tcp_and_says_why() {
        let chosen = choose(Protocol::Auto, &[]).expect("auto always runs");
        assert!(chosen.reason.contains("no RDMA device"), "{chosen:?}");
        let chosen = choose(Protocol::Auto, &["rxe0".into()]).expect("auto always runs");
        assert!(chosen.reason.contains("rxe0"), "{chosen:?}");
    }

    #[test]
    fn devices_are_the_entries_of_the_directory() {
        let dir = std::env::temp_dir().join(format!("mooncake-ib-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("mlx5_1")).expect("dir");
        std::fs::create_dir_all(dir.join("mlx5_0")).expect("dir");
        assert_eq!(rdma_devices(&dir), ["mlx5_0", "mlx5_1"]);
        std::fs::remove_dir_all(&dir).expect("cleanup");
        assert!(rdma_devices(&dir).is_empty());
    }
}
