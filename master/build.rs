//! Nothing to generate: the build dependency on `protoc-bin-vendored` only makes cargo
//! fetch a protoc, which `tools/protoc` hands to the etcd client's build script on a
//! machine without protobuf-compiler (see `.cargo/config.toml`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
}
