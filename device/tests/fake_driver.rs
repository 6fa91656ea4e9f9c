//! The device layer against the stand-in CUDA driver (see `common`).

mod common;

#[test]
fn device_layer_against_the_stand_in_cuda_driver() {
    common::exercise(mooncake_device::DeviceApi::Cuda);
}
