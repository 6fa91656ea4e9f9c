//! The device layer against the stand-in HIP runtime (see `common`).

mod common;

#[test]
fn device_layer_against_the_stand_in_hip_runtime() {
    common::exercise(mooncake_device::DeviceApi::Hip);
}
