//! The device layer against a stand-in driver (CUDA, or HIP over the same stand-in):
//! classification, copies through streams, IPC handles, pinning, and an error from
//! every driver call we make. Each interface has its own test binary (a driver is
//! loaded once per process), which runs [`exercise`] in one test, in order.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::os::fd::AsRawFd;

use mooncake_device::driver::{self, Driver, IPC_HANDLE_LEN};
use mooncake_device::{DeviceApi, DeviceError, MemoryKind, classify, cuda, fake, hip};

/// The names of the driver calls of one interface, as errors name them.
struct Names {
    create_stream: &'static str,
    copy_to_host: &'static str,
    synchronize: &'static str,
    enter: &'static str,
    pointer_attribute: &'static str,
    address_range: &'static str,
    export: &'static str,
    open: &'static str,
    close: &'static str,
    pin: &'static str,
    unpin: &'static str,
    /// Calls made the first time a device is used.
    first_use: &'static [&'static str],
}

const CUDA: Names = Names {
    create_stream: "cuStreamCreate",
    copy_to_host: "cuMemcpyDtoHAsync_v2",
    synchronize: "cuStreamSynchronize",
    enter: "cuCtxPushCurrent_v2",
    pointer_attribute: "cuPointerGetAttribute",
    address_range: "cuMemGetAddressRange_v2",
    export: "cuIpcGetMemHandle",
    open: "cuIpcOpenMemHandle_v2",
    close: "cuIpcCloseMemHandle",
    pin: "cuMemHostRegister_v2",
    unpin: "cuMemHostUnregister",
    first_use: &["cuDeviceGet", "cuDevicePrimaryCtxRetain"],
};

const HIP: Names = Names {
    create_stream: "hipStreamCreateWithFlags",
    copy_to_host: "hipMemcpyDtoHAsync",
    synchronize: "hipStreamSynchronize",
    enter: "hipSetDevice",
    pointer_attribute: "hipPointerGetAttribute",
    address_range: "hipMemGetAddressRange",
    export: "hipIpcGetMemHandle",
    open: "hipIpcOpenMemHandle",
    close: "hipIpcCloseMemHandle",
    pin: "hipHostRegister",
    unpin: "hipHostUnregister",
    first_use: &["hipGetDevice"],
};

fn c(name: &str) -> std::ffi::CString {
    std::ffi::CString::new(name).expect("a call name")
}

type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type Free = unsafe extern "C" fn(u64) -> c_int;
type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type SetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type Count = unsafe extern "C" fn() -> c_int;
type Bytes = unsafe extern "C" fn() -> u64;
type Fail = unsafe extern "C" fn(*const c_char);

/// The test's own handle on the stand-in driver (the same library the device layer
/// loads), for allocating device memory and reading its counters.
struct Fake {
    library: libloading::Library,
}

impl Fake {
    fn symbol<T: Copy>(&self, name: &str) -> T {
        // SAFETY: the names and types match fake_cuda.c.
        unsafe { *self.library.get::<T>(name.as_bytes()).expect(name) }
    }

    fn make_current(&self) {
        let mut context = std::ptr::null_mut();
        let retain = self.symbol::<Retain>("cuDevicePrimaryCtxRetain");
        // SAFETY: valid out-pointer; device 0 exists.
        let retained = unsafe { retain(&mut context, 0) };
        assert_eq!(retained, 0);
        let set_current = self.symbol::<SetCurrent>("cuCtxSetCurrent");
        // SAFETY: the context just retained.
        let set = unsafe { set_current(context) };
        assert_eq!(set, 0);
    }

    fn alloc(&self, len: usize) -> u64 {
        let mut ptr = 0;
        let alloc = self.symbol::<Alloc>("cuMemAlloc_v2");
        // SAFETY: valid out-pointer.
        let allocated = unsafe { alloc(&mut ptr, len) };
        assert_eq!(allocated, 0);
        ptr
    }

    fn free(&self, ptr: u64) {
        // SAFETY: an allocation of `alloc`.
        assert_eq!(unsafe { self.symbol::<Free>("cuMemFree_v2")(ptr) }, 0);
    }

    fn fail(&self, names: &CStr) {
        // SAFETY: a valid C string.
        unsafe { self.symbol::<Fail>("fake_cuda_fail")(names.as_ptr()) }
    }

    fn fail_call(&self, name: &str) {
        self.fail(&c(name));
    }

    fn open_handles(&self) -> c_int {
        // SAFETY: no arguments.
        unsafe { self.symbol::<Count>("fake_cuda_open_ipc_handles")() }
    }

    fn pinned_bytes(&self) -> u64 {
        // SAFETY: no arguments.
        unsafe { self.symbol::<Bytes>("fake_cuda_pinned_bytes")() }
    }
}

fn write_device(driver: &Driver, ptr: u64, bytes: &[u8]) {
    // SAFETY: `bytes` is readable; `ptr..+len` is a live fake allocation.
    unsafe { driver.copy_from_host(0, bytes.as_ptr(), ptr, bytes.len() as u64) }
        .expect("copy to the device");
}

fn read_device(driver: &Driver, ptr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: `out` is writable; `ptr..+len` is a live fake allocation.
    unsafe { driver.copy_to_host(0, ptr, out.as_mut_ptr(), len as u64) }
        .expect("copy from the device");
    out
}

/// The whole device layer against the stand-in driver of `api`.
pub fn exercise(api: DeviceApi) {
    let dir = std::env::temp_dir().join(format!("mooncake-fake-{api}-{}", std::process::id()));
    let (library, variable, names) = match api {
        DeviceApi::Cuda => (fake::build(&dir), cuda::LIBRARY_ENV, &CUDA),
        DeviceApi::Hip => (fake::build_hip(&dir), hip::LIBRARY_ENV, &HIP),
    };
    let library = library.expect("build the stand-in driver");
    // SAFETY: set before any thread of this test reads the environment.
    unsafe { std::env::set_var(variable, &library) };
    // SAFETY: the stand-in driver; its initializers do nothing.
    let loaded = unsafe { libloading::Library::new(&library) };
    let fake = Fake {
        library: loaded.expect("load"),
    };

    // Host memory is recognized without a driver.
    let heap = vec![5u8; 4096];
    assert_eq!(classify(heap.as_ptr() as u64, 4096), MemoryKind::Host);
    assert!(!driver::is_loaded(api));

    let driver = driver::driver(api).expect("the stand-in driver loads");
    assert_eq!(driver.device_count(), 2);
    fake.make_current();
    let ptr = fake.alloc(1 << 20);

    // Device memory is classified, with its allocation; a range past it is refused.
    let MemoryKind::Device(allocation) = classify(ptr + 4096, 8192) else {
        panic!("device memory must be classified as device memory");
    };
    assert_eq!(
        (
            allocation.api,
            allocation.device,
            allocation.base,
            allocation.len
        ),
        (api, 0, ptr, 1 << 20)
    );
    assert!(
        matches!(classify(ptr + 4096, 1 << 20), MemoryKind::Unreachable(why) if why.contains("runs past"))
    );
    assert!(matches!(classify(8, 16), MemoryKind::Unreachable(_)));
    assert!(matches!(classify(ptr, 0), MemoryKind::Unreachable(_)));

    // A stream that cannot be created fails the copy, naming the call.
    fake.fail_call(names.create_stream);
    let mut out = [0u8; 8];
    // SAFETY: `out` is writable; `ptr` is a live allocation.
    let copy = unsafe { driver.copy_to_host(0, ptr, out.as_mut_ptr(), 8) };
    assert!(
        matches!(copy, Err(DeviceError::Call { call, .. }) if call == names.create_stream),
        "{copy:?}"
    );
    fake.fail(c"");

    // Copies complete before the call returns (the stand-in runs a stream's copies
    // only when it is synchronized).
    let pattern: Vec<u8> = (0..65536u32).map(|i| (i % 251) as u8).collect();
    write_device(driver, ptr + 100, &pattern);
    assert_eq!(read_device(driver, ptr + 100, pattern.len()), pattern);

    // Pinning and unpinning host memory.
    let mut host = vec![0u8; 1 << 16];
    // SAFETY: `host` outlives the guard.
    let pinned = unsafe { driver.pin(host.as_mut_ptr(), host.len() as u64) }.expect("pin");
    assert_eq!(fake.pinned_bytes(), 1 << 16);
    // SAFETY: as above.
    let again = unsafe { driver.pin(host.as_mut_ptr(), 10) };
    assert!(matches!(again, Err(DeviceError::Call { call, .. }) if call == names.pin));
    drop(pinned);
    assert_eq!(fake.pinned_bytes(), 0);

    ipc_between_processes(driver, &fake);
    every_call_can_fail(driver, &fake, ptr, names);
    fake.free(ptr);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A handle of the stand-in driver naming `fd` of process `pid`.
fn handle_of(pid: u32, fd: i32, len: u64) -> [u8; IPC_HANDLE_LEN] {
    let mut handle = [0u8; IPC_HANDLE_LEN];
    handle[..8].copy_from_slice(b"FAKECUDA");
    handle[8..12].copy_from_slice(&(pid as i32).to_ne_bytes());
    handle[12..16].copy_from_slice(&fd.to_ne_bytes());
    handle[16..24].copy_from_slice(&len.to_ne_bytes());
    handle
}

/// Opens an allocation held by another process (a child that inherited its memfd),
/// copies through it, refuses a second open of the same handle, and closes on drop.
fn ipc_between_processes(driver: &'static Driver, fake: &Fake) {
    let memfd = memfd_with(b"exported bytes");
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn a holder");
    let handle = handle_of(child.id(), memfd.as_raw_fd(), 4096);
    let opened = driver.open(0, &handle).expect("open the handle");
    assert_eq!(driver::open_handles(), 1);
    assert_eq!(fake.open_handles(), 1);
    assert_eq!(&read_device(driver, opened.ptr(), 14), b"exported bytes");
    let second = driver.open(0, &handle);
    assert!(
        matches!(second, Err(DeviceError::Call { ref name, .. })
            if name.to_lowercase().replace('_', "").contains("alreadymapped")),
        "{second:?}"
    );
    assert!(driver.open(7, &handle).is_err(), "no device 7");
    let own = driver.export(0, opened.ptr());
    assert!(own.is_err(), "an opened allocation is not exported again");
    drop(opened);
    assert_eq!(driver::open_handles(), 0);
    assert_eq!(fake.open_handles(), 0);
    let _ = child.kill();
    let _ = child.wait();
}

/// A memfd of one page holding `bytes`, inherited by children (no close-on-exec).
fn memfd_with(bytes: &[u8]) -> std::fs::File {
    let fd = nix::sys::memfd::memfd_create(c"holder", nix::sys::memfd::MFdFlags::empty())
        .expect("memfd");
    let file = std::fs::File::from(fd);
    file.set_len(4096).expect("size");
    std::os::unix::fs::FileExt::write_at(&file, bytes, 0).expect("write");
    file
}

/// Every driver call the device layer makes, failing in turn, gives an error naming
/// it, never a crash, and the next call works again.
fn every_call_can_fail(driver: &'static Driver, fake: &Fake, ptr: u64, names: &Names) {
    let calls = [
        names.enter,
        names.copy_to_host,
        names.synchronize,
        names.pointer_attribute,
        names.address_range,
        names.export,
    ];
    for name in calls {
        fake.fail_call(name);
        let mut out = [0u8; 16];
        // SAFETY: `out` is writable; `ptr` is a live allocation.
        let copy = unsafe { driver.copy_to_host(0, ptr, out.as_mut_ptr(), 16) };
        let classified = driver.allocation_of(ptr);
        let exported = driver.export(0, ptr);
        let named = |e: &DeviceError| matches!(e, DeviceError::Call { call, .. } if *call == name);
        let failed = [copy.err(), classified.err(), exported.err()];
        assert!(failed.iter().flatten().any(named), "{name}: {failed:?}");
        fake.fail(c"");
        assert!(driver.allocation_of(ptr).expect("works again").is_some());
    }
    let memfd = memfd_with(b"x");
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .expect("spawn");
    for name in [names.open, names.pin] {
        fake.fail_call(name);
        let handle = handle_of(child.id(), memfd.as_raw_fd(), 4096);
        assert!(driver.open(0, &handle).is_err() || name != names.open);
        let mut host = vec![0u8; 64];
        // SAFETY: `host` outlives the guard.
        let pinned = unsafe { driver.pin(host.as_mut_ptr(), 64) };
        assert!(pinned.is_err() || name != names.pin);
        fake.fail(c"");
    }
    assert_eq!(fake.open_handles(), 0, "nothing left open");

    // Closing and unpinning that fail are logged; the guards still drop cleanly.
    let handle = handle_of(child.id(), memfd.as_raw_fd(), 4096);
    let opened = driver.open(0, &handle).expect("open");
    fake.fail_call(names.close);
    drop(opened);
    fake.fail(c"");
    assert_eq!(driver::open_handles(), 0, "counted as closed");
    let mut host = vec![0u8; 64];
    // SAFETY: `host` outlives the guard.
    let pinned = unsafe { driver.pin(host.as_mut_ptr(), 64) }.expect("pin");
    fake.fail_call(names.unpin);
    drop(pinned);
    fake.fail(c"");

    // The first use of a device retains its context: each step can fail, naming it,
    // and the next attempt starts again.
    for &name in names.first_use {
        fake.fail_call(name);
        let exported = driver.export(1, ptr);
        fake.fail(c"");
        assert!(
            matches!(&exported, Err(DeviceError::Call { call, .. }) if *call == name),
            "{name}: {exported:?}"
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}
