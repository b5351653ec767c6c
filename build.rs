//! Compiles bpf/rprof.bpf.c and bpf/threads.bpf.c and generates their
//! libbpf-rs skeletons (with the Rust types of the structs of bpf/rprof.h
//! they use) into OUT_DIR; records the git commit for `rprof --version`.
use std::env;
use std::path::PathBuf;
use std::process::Command;

use libbpf_cargo::SkeletonBuilder;

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let arch = env::var("CARGO_CFG_TARGET_ARCH").expect("cargo sets CARGO_CFG_TARGET_ARCH");
    let target_arch = match arch.as_str() {
        "x86_64" => "x86",
        "aarch64" => "arm64",
        other => other,
    };
    // rprof.bpf.c, and threads.bpf.c: the layout proof's thread lister,
    // loaded on its own before rprof.bpf.c's programs (see its head).
    for name in ["rprof", "threads"] {
        let out = out_dir.join(format!("{name}.skel.rs"));
        SkeletonBuilder::new()
            .source(format!("bpf/{name}.bpf.c"))
            .clang_args([
                "-Ibpf".to_string(),
                format!("-D__TARGET_ARCH_{target_arch}"),
                "-Wall".to_string(),
                "-O2".to_string(),
                // Compare-and-swap and exchange (the wall sweep) need BPF ISA v3.
                "-mcpu=v3".to_string(),
            ])
            .build_and_generate(&out)
            .unwrap_or_else(|e| {
                panic!("compiling bpf/{name}.bpf.c (needs clang and libbpf headers: run `make deps`): {e}")
            });
    }
    println!("cargo:rerun-if-changed=bpf");
    println!("cargo:rustc-env=RPROF_COMMIT={}", git_commit());
}

/// The commit built, `-dirty` if the tree has changes; `unknown commit`
/// outside a git checkout.
fn git_commit() -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let Some(commit) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return "unknown commit".to_string();
    };
    // Rebuilt when HEAD moves (a commit, a checkout).
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        println!("cargo:rerun-if-changed={dir}/HEAD");
        println!("cargo:rerun-if-changed={dir}/index");
    }
    // Without refreshing the index: written by this script, the index looked
    // changed to the next build, which ran the script again and rebuilt rprof
    // (a fresh clone's first `git status` rewrites it).
    let dirty = git(&[
        "--no-optional-locks",
        "status",
        "--porcelain",
        "--untracked-files=no",
    ])
    .is_some_and(|s| !s.is_empty());
    format!("commit {commit}{}", if dirty { "-dirty" } else { "" })
}
