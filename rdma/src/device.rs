//! RDMA devices: listing them, choosing which to use, and one opened device with its
//! protection domain and port 1's address.

use std::ffi::{CStr, c_int};
use std::path::Path;

use crate::error::RdmaError;
use crate::library::{Verbs, verbs};
use crate::verbs::*;

/// The port every queue pair uses.
pub const PORT: u8 = 1;

/// Where sysfs says on which NUMA node a device sits.
const SYSFS: &str = "/sys/class/infiniband";

/// The names of the devices the library lists (empty when it lists none).
pub fn device_names() -> Result<Vec<String>, RdmaError> {
    let verbs = verbs()?;
    let mut count: c_int = 0;
    // SAFETY: the library fills `count` and returns a NULL-terminated array (or NULL).
    let list = unsafe { (verbs.get_device_list)(&mut count) };
    if list.is_null() {
        return Ok(Vec::new());
    }
    let mut names = Vec::new();
    for index in 0..usize::try_from(count).unwrap_or(0) {
        // SAFETY: `index < count` entries are valid device pointers.
        let device = unsafe { *list.add(index) };
        if device.is_null() {
            break;
        }
        names.push(device_name(verbs, device));
    }
    // SAFETY: the list came from get_device_list and is freed once.
    unsafe { (verbs.free_device_list)(list) };
    Ok(names)
}

fn device_name(verbs: &Verbs, device: *mut ibv_device) -> String {
    // SAFETY: a listed device has a NUL-terminated name.
    let name = unsafe { (verbs.get_device_name)(device) };
    if name.is_null() {
        return String::from("?");
    }
    // SAFETY: non-null and NUL-terminated.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

/// The devices to use: those named in `wanted` (`--rdma_devices`, every one must
/// exist), else those on the NUMA node this process runs on (all when none is, or
/// when sysfs does not say).
pub fn choose_devices(wanted: &[String]) -> Result<Vec<String>, RdmaError> {
    let listed = device_names()?;
    if listed.is_empty() {
        return Err(RdmaError::NoDevice(format!(
            "{} lists no device",
            crate::library::library_name()
        )));
    }
    if !wanted.is_empty() {
        if let Some(missing) = wanted.iter().find(|name| !listed.contains(name)) {
            return Err(RdmaError::NoDevice(format!(
                "--rdma_devices names {missing}, but the devices are {}",
                listed.join(", ")
            )));
        }
        return Ok(wanted.to_vec());
    }
    let here = current_numa_node();
    let near: Vec<String> = listed
        .iter()
        .filter(|name| here.is_some() && numa_node(name) == here)
        .cloned()
        .collect();
    Ok(if near.is_empty() { listed } else { near })
}

/// The NUMA node sysfs gives for device `name` (`None` when unknown).
fn numa_node(name: &str) -> Option<i64> {
    let path = Path::new(SYSFS).join(name).join("device/numa_node");
    let node: i64 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    (node >= 0).then_some(node)
}

/// The NUMA node of the CPU this thread runs on.
fn current_numa_node() -> Option<i64> {
    // SAFETY: no arguments; returns -1 on failure.
    let cpu = unsafe { libc::sched_getcpu() };
    let entries = std::fs::read_dir(format!("/sys/devices/system/cpu/cpu{cpu}")).ok()?;
    entries
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .find_map(|name| name.strip_prefix("node")?.parse().ok())
}

/// How to reach a port: what two queue pairs exchange to connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortAddress {
    /// The port's local identifier (InfiniBand).
    pub lid: u16,
    /// Its global identifier.
    pub gid: [u8; 16],
    /// The GID table index of `gid`.
    pub gid_index: u8,
    /// The active MTU (verbs' enum: 1 = 256 B ... 5 = 4096 B).
    pub mtu: u8,
}

/// An opened device with a protection domain; closed when dropped (after every
/// region and queue pair made on it, which hold it).
#[derive(Debug)]
pub struct Device {
    name: String,
    pub(crate) context: *mut ibv_context,
    pub(crate) pd: *mut ibv_pd,
    address: PortAddress,
    ethernet: bool,
}

// SAFETY: verbs objects may be used from any thread (libibverbs is thread safe); the
// pointers are only freed in Drop.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    /// Opens device `name`, allocates its protection domain and reads port 1.
    pub fn open(name: &str) -> Result<Device, RdmaError> {
        let verbs = verbs()?;
        let mut count: c_int = 0;
        // SAFETY: as in `device_names`.
        let list = unsafe { (verbs.get_device_list)(&mut count) };
        if list.is_null() {
            return Err(RdmaError::NoDevice(format!("{name} is not listed")));
        }
        let mut context = std::ptr::null_mut();
        for index in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY: `index < count`.
            let device = unsafe { *list.add(index) };
            if !device.is_null() && device_name(verbs, device) == name {
                // SAFETY: a listed device, opened before the list is freed.
                context = unsafe { (verbs.open_device)(device) };
                if context.is_null() {
                    let error = RdmaError::call("ibv_open_device", name);
                    // SAFETY: freed once.
                    unsafe { (verbs.free_device_list)(list) };
                    return Err(error);
                }
                break;
            }
        }
        // SAFETY: freed once; an opened context stays valid.
        unsafe { (verbs.free_device_list)(list) };
        if context.is_null() {
            return Err(RdmaError::NoDevice(format!("{name} is not listed")));
        }
        let mut device = Device {
            name: name.to_string(),
            context,
            pd: std::ptr::null_mut(),
            address: PortAddress {
                lid: 0,
                gid: [0; 16],
                gid_index: 0,
                mtu: 0,
            },
            ethernet: false,
        };
        // SAFETY: an open context.
        device.pd = unsafe { (verbs.alloc_pd)(context) };
        if device.pd.is_null() {
            return Err(RdmaError::call("ibv_alloc_pd", name));
        }
        device.read_port(verbs)?;
        Ok(device)
    }

    fn read_port(&mut self, verbs: &Verbs) -> Result<(), RdmaError> {
        let mut port = ibv_port_attr::default();
        // SAFETY: an open context and a buffer of the compat layout.
        let code = unsafe { (verbs.query_port)(self.context, PORT, &mut port) };
        if code != 0 {
            return Err(RdmaError::returned("ibv_query_port", &self.name, code));
        }
        if port.state != IBV_PORT_ACTIVE {
            return Err(RdmaError::NoDevice(format!(
                "port {PORT} of {} is not active (state {}); check the cable and `ibv_devinfo`",
                self.name, port.state
            )));
        }
        self.ethernet = port.link_layer == IBV_LINK_LAYER_ETHERNET;
        let gid_index = self.gid_index(verbs, port.gid_tbl_len);
        let mut gid = ibv_gid::default();
        // SAFETY: an open context; the index is inside the table.
        let code =
            unsafe { (verbs.query_gid)(self.context, PORT, c_int::from(gid_index), &mut gid) };
        if code != 0 {
            return Err(RdmaError::returned("ibv_query_gid", &self.name, code));
        }
        self.address = PortAddress {
            lid: port.lid,
            gid: gid.raw,
            gid_index,
            mtu: u8::try_from(port.active_mtu).unwrap_or(3),
        };
        Ok(())
    }

    /// The GID index to use: `MC_GID_INDEX` when set (upstream's variable), else on
    /// RoCE the first IPv4-mapped GID (RoCE v2 over IPv4, what a routed network
    /// needs), else 0.
    fn gid_index(&self, verbs: &Verbs, table_len: c_int) -> u8 {
        if let Some(index) = std::env::var("MC_GID_INDEX")
            .ok()
            .and_then(|v| v.parse::<u8>().ok())
        {
            return index;
        }
        if !self.ethernet {
            return 0;
        }
        (0..table_len.clamp(0, 256))
            .find(|index| {
                let mut gid = ibv_gid::default();
                // SAFETY: an open context; the index is inside the table.
                let code = unsafe { (verbs.query_gid)(self.context, PORT, *index, &mut gid) };
                code == 0
                    && gid.raw[..10].iter().all(|b| *b == 0)
                    && gid.raw[10..12] == [0xff, 0xff]
            })
            .and_then(|index| u8::try_from(index).ok())
            .unwrap_or(0)
    }

    /// The device's name (`mlx5_0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How peers reach port 1.
    pub fn address(&self) -> PortAddress {
        self.address
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        let Ok(verbs) = verbs() else { return };
        if !self.pd.is_null() {
            // SAFETY: every region and queue pair on it is gone (they hold the device).
            unsafe { (verbs.dealloc_pd)(self.pd) };
        }
        // SAFETY: opened by us, closed once.
        unsafe { (verbs.close_device)(self.context) };
    }
}
