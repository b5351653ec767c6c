//! Compiles bpf/rprof.bpf.c and generates its libbpf-rs skeleton (with the Rust
//! types of every struct in bpf/rprof.h) into OUT_DIR.
use std::env;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

fn main() {
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("rprof.skel.rs");
    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets CARGO_CFG_TARGET_ARCH");
    let target_arch = match arch.as_str() {
        "x86_64" => "x86",
        "aarch64" => "arm64",
        other => other,
    };
    SkeletonBuilder::new()
        .source("bpf/rprof.bpf.c")
        .clang_args([
            "-Ibpf".to_string(),
            format!("-D__TARGET_ARCH_{target_arch}"),
            "-Wall".to_string(),
            "-O2".to_string(),
        ])
        .build_and_generate(&out)
        .expect("compiling bpf/rprof.bpf.c (needs clang and libbpf headers: run `make deps`)");
    println!("cargo:rerun-if-changed=bpf");
}
