//! Installing rprof on a production server: `make release` gives one
//! stripped binary that needs only glibc and a .deb with man pages and
//! completions; both work in a minimal Debian chroot with Ruby and no build
//! tools or libelf; the binary records without root with exactly the
//! capabilities README lists, and names the one missing.

use crate::common;

use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use common::{label, line, rprof, Folded, Ruby};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// `make release`, once per test run: dist/rprof and the .deb.
fn release() -> (PathBuf, PathBuf) {
    static DONE: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    DONE.get_or_init(|| {
        let out = Command::new("make")
            .arg("release")
            .current_dir(ROOT)
            .output()
            .expect("make");
        assert!(
            out.status.success(),
            "make release: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let deb = Path::new(ROOT).join(format!("dist/rprof_{}_amd64.deb", env!("CARGO_PKG_VERSION")));
        assert!(deb.exists(), "{}", deb.display());
        (Path::new(ROOT).join("dist/rprof"), deb)
    })
    .clone()
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("run");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("panicked"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn the_release_binary_is_stripped_and_needs_only_glibc() {
    let (bin, _) = release();
    let dynamic = run(Command::new("readelf").args(["-d", "-W"]).arg(&bin));
    let needed: Vec<String> = String::from_utf8_lossy(&dynamic.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| {
            l.rsplit_once('[')
                .map(|(_, n)| n.trim_end_matches(']').to_string())
        })
        .collect();
    for lib in &needed {
        assert!(
            ["libc.so.6", "libm.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2"].contains(&lib.as_str()),
            "{lib} is not part of every glibc system: {needed:?}"
        );
    }
    let sections = run(Command::new("readelf").args(["-S", "-W"]).arg(&bin));
    let sections = String::from_utf8_lossy(&sections.stdout);
    assert!(
        !sections.contains(".debug_info") && !sections.contains(".symtab"),
        "stripped"
    );
    let version = run(Command::new(&bin).arg("--version"));
    assert!(String::from_utf8_lossy(&version.stdout).contains("(commit "));
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let out = rprof(&["--version"]);
    assert!(out.status.success());
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_string();
    assert_eq!(head.len(), 12, "built from a git checkout");
    assert!(
        version.starts_with(&format!("rprof {} (commit {head}", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );
}

#[test]
fn man_pages_and_completions_come_from_the_command_line_itself() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = rprof(&["generate", "man", dir.path().to_str().expect("utf8")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for page in ["rprof.1", "rprof-record.1", "rprof-report.1", "rprof-diff.1"] {
        let shown = Command::new("man")
            .arg("-l")
            .arg(dir.path().join(page))
            .env("MANWIDTH", "100")
            .output()
            .expect("man (man-db)");
        let text = without_overstrike(&String::from_utf8_lossy(&shown.stdout));
        assert!(shown.status.success() && text.contains("NAME"), "{page}: {text}");
        if page == "rprof-record.1" {
            assert!(text.contains("--flight-recorder"), "{text}");
        }
    }
    for shell in ["bash", "zsh", "fish"] {
        let out = rprof(&["generate", "completions", shell]);
        let script = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && script.contains("flight-recorder"),
            "{shell}: {script}"
        );
    }
    let help = rprof(&["--help"]);
    assert!(
        !String::from_utf8_lossy(&help.stdout).contains("generate"),
        "hidden from --help"
    );
}

/// man's bold and underline as a terminal shows them: `N\x08N` is `N`.
fn without_overstrike(text: &str) -> String {
    let mut out: Vec<char> = Vec::with_capacity(text.len());
    for c in text.chars() {
        if c == '\u{8}' {
            out.pop();
        } else {
            out.push(c);
        }
    }
    out.into_iter().collect()
}

/// The server chroot of scripts/setup-rubies.sh: Debian 12 minbase with Ruby
/// and man-db, no build tools, no libelf.
fn server_chroot() -> PathBuf {
    let root = Path::new("/var/cache/rprof/chroot-server");
    assert!(
        root.join(".rprof-ready").exists(),
        "{} missing: run scripts/setup-rubies.sh server (make test does)",
        root.display()
    );
    root.to_path_buf()
}

/// `sh -c SCRIPT` in the server chroot, with its own /proc and the host's
/// /sys mounted in a mount namespace of its own.
fn in_chroot(root: &Path, script: &str) -> Output {
    let wrapped = format!(
        "mount -t proc proc {r}/proc && mount --rbind /sys {r}/sys && \
         chroot {r} /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root MANPAGER=cat MANWIDTH=100 sh -c '{script}'",
        r = root.display()
    );
    run(Command::new("unshare").args([
        "--mount",
        "--propagation",
        "private",
        "--fork",
        "sh",
        "-c",
        &wrapped,
    ]))
}

#[test]
fn the_release_binary_records_in_a_minimal_chroot_without_build_tools_or_libelf() {
    let (bin, _) = release();
    let root = server_chroot();
    std::fs::copy(&bin, root.join("usr/local/bin/rprof")).expect("copy the binary in");
    std::fs::copy(
        Path::new(ROOT).join("tests/ruby/server_work.rb"),
        root.join("tmp/work.rb"),
    )
    .expect("copy a script in");
    let _ = std::fs::remove_file(root.join("tmp/out.folded"));
    let out = in_chroot(
        &root,
        "rprof record -F 499 --format folded -o /tmp/out.folded -- ruby /tmp/work.rb 2>&1",
    );
    let _ = std::fs::remove_file(root.join("usr/local/bin/rprof"));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let folded = Folded::parse(&std::fs::read_to_string(root.join("tmp/out.folded")).expect("folded"));
    assert!(folded.total() > 50, "{said} {folded:?}");
    // server_work.rb's frames, at their lines: most samples in crunch, at
    // its loop.
    let in_crunch = folded.count(|f| label(f) == "Object#crunch" && line(f) == Some(6));
    assert!(in_crunch as f64 > folded.total() as f64 * 0.8, "{folded:?}");
    assert!(
        folded.count(|f| label(f) == "Object#serve" && line(f) == Some(12)) > 0,
        "{folded:?}"
    );
}

#[test]
fn the_deb_installs_a_working_rprof_with_its_man_page_and_agent_service_and_removes_cleanly() {
    let (_, deb) = release();
    let root = server_chroot();
    std::fs::copy(&deb, root.join("tmp/rprof.deb")).expect("copy the package in");
    let out = in_chroot(
        &root,
        "dpkg -r rprof >/dev/null 2>&1; dpkg -i /tmp/rprof.deb >/dev/null && rprof --version && \
         man rprof | head -5 && man rprof-record | head -5 && ls /usr/share/bash-completion/completions/rprof \
         /usr/share/zsh/vendor-completions/_rprof /usr/share/fish/vendor_completions.d/rprof.fish && \
         man rprof-agent | head -5 && grep -e ^ExecStart= -e ^CPUQuota= /lib/systemd/system/rprof-agent.service && \
         grep -h limits: /usr/share/doc/rprof/rprof-agent.daemonset.yaml && \
         grep ^RPROF_AGENT_ARGS= /etc/default/rprof-agent && \
         dpkg -P rprof >/dev/null && echo removed; dpkg -s rprof 2>&1 | head -1; \
         ls /usr/bin/rprof /usr/share/man/man1/rprof.1.gz /lib/systemd/system/rprof-agent.service \
         /etc/default/rprof-agent 2>&1",
    );
    // Words as man justifies them, one space apart.
    let said = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!("rprof {} (commit ", env!("CARGO_PKG_VERSION"))),
        "{said}{err}"
    );
    assert!(
        said.contains("rprof - A Ruby-aware sampling profiler"),
        "man rprof renders: {said}{err}"
    );
    assert!(
        said.contains("rprof-record - Record a profile"),
        "man rprof-record renders: {said}{err}"
    );
    assert!(
        said.contains("/usr/share/fish/vendor_completions.d/rprof.fish"),
        "{said}{err}"
    );
    // The agent's service, not enabled, and its settings (a conffile).
    assert!(
        said.contains("rprof-agent - Profile every Ruby process on this host"),
        "man rprof-agent renders: {said}{err}"
    );
    assert!(
        said.contains("ExecStart=/usr/bin/rprof agent $RPROF_AGENT_ARGS"),
        "{said}{err}"
    );
    assert!(
        said.contains("RPROF_AGENT_ARGS=\"--push http://localhost:4040\""),
        "{said}{err}"
    );
    // Its CPU limit, the same as a service and as a DaemonSet.
    assert!(
        said.contains("CPUQuota=20%") && said.contains("limits: {cpu: 200m,"),
        "{said}{err}"
    );
    assert!(said.contains("removed"), "{said}{err}");
    assert!(said.contains("package 'rprof' is not installed"), "{said}{err}");
    assert!(
        said.contains("cannot access '/usr/bin/rprof'")
            && said.contains("cannot access '/usr/share/man/man1/rprof.1.gz'")
            && said.contains("cannot access '/lib/systemd/system/rprof-agent.service'")
            && said.contains("cannot access '/etc/default/rprof-agent'"),
        "nothing left behind: {said}"
    );
}

/// The release binary with these file capabilities, run as `nobody` against
/// a Ruby running as root (`event`: extra arguments): its exit, and its
/// stderr. One that records does so until the Ruby has used 1.5 s of CPU
/// (however busy the machine), then gets Ctrl-C.
fn record_with_caps(caps: &str, pid: u32, out_dir: &Path, event: &[&str]) -> (bool, String) {
    let (bin, _) = release();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let copy = dir.path().join("rprof");
    std::fs::copy(&bin, &copy).expect("copy");
    let set = run(Command::new("setcap").arg(format!("{caps}+ep")).arg(&copy));
    assert!(
        set.status.success(),
        "setcap: {}",
        String::from_utf8_lossy(&set.stderr)
    );
    let mut child = Command::new("setpriv")
        .args(["--reuid=nobody", "--regid=nogroup", "--clear-groups"])
        .arg(&copy)
        .args([
            "record",
            "-p",
            &pid.to_string(),
            "-d",
            "120",
            "--format",
            "folded",
            "-o",
        ])
        .arg(out_dir.join("out.folded"))
        .args(event)
        .stderr(Stdio::piped())
        .spawn()
        .expect("run setpriv");
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
    let mut said = String::new();
    while stderr.read_line(&mut said).expect("rprof's stderr") > 0 {
        if said
            .lines()
            .last()
            .is_some_and(|l| l.starts_with("rprof: recording"))
        {
            common::wait_for("the Ruby", 100, common::used_cpu(pid, 1.5));
            common::signal(child.id(), libc::SIGINT);
            stderr.read_to_string(&mut said).expect("rprof's stderr");
            break;
        }
    }
    let status = child.wait().expect("rprof ends");
    assert!(!said.contains("panicked"), "{said}");
    (status.success(), said)
}

#[test]
fn without_root_the_capabilities_readme_lists_are_enough_and_a_missing_one_is_named() {
    let target = Ruby::named("3.3").spawn("threads.rb", &[]);
    let out_dir = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(out_dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    // README's line: setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep /usr/bin/rprof
    let (success, stderr) = record_with_caps(
        "cap_bpf,cap_perfmon,cap_sys_ptrace",
        target.pid,
        out_dir.path(),
        &[],
    );
    assert!(success, "{stderr}");
    let folded = Folded::parse(&std::fs::read_to_string(out_dir.path().join("out.folded")).expect("folded"));
    assert!(
        folded.count(|f| label(f) == "Object#alpha_work") > 20,
        "{folded:?}"
    );
    for (caps, missing) in [
        ("cap_perfmon,cap_sys_ptrace", "CAP_BPF"),
        ("cap_bpf,cap_sys_ptrace", "CAP_PERFMON"),
        ("cap_bpf,cap_perfmon", "CAP_SYS_PTRACE"),
    ] {
        let (success, stderr) = record_with_caps(caps, target.pid, out_dir.path(), &[]);
        assert!(!success, "{caps}: {stderr}");
        assert_eq!(
            stderr.lines().filter(|l| l.starts_with("rprof: error: ")).count(),
            1,
            "{stderr}"
        );
        assert!(stderr.contains(missing), "without {missing}: {stderr}");
    }
    // Syscall tracing reads tracefs, root's only: README's extra capability.
    let syscalls = Ruby::host().spawn("syscalls.rb", &["getpid"]);
    let getpid = ["syscall", "enter_getpid"];
    let three = "cap_bpf,cap_perfmon,cap_sys_ptrace";
    let (success, stderr) = record_with_caps(three, syscalls.pid, out_dir.path(), &getpid);
    assert!(!success && stderr.contains("CAP_DAC_READ_SEARCH"), "{stderr}");
    let four = "cap_bpf,cap_perfmon,cap_sys_ptrace,cap_dac_read_search";
    let (success, stderr) = record_with_caps(four, syscalls.pid, out_dir.path(), &getpid);
    assert!(success, "{stderr}");
    let folded = Folded::parse(&std::fs::read_to_string(out_dir.path().join("out.folded")).expect("folded"));
    assert!(folded.count(|f| f == "enter_getpid") > 100, "{folded:?}");
}
