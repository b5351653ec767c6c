//! Bad input and missing system pieces: one clear line, a non-zero exit, no
//! panic, no hang, and nothing done to the target.

use crate::common;

use std::process::{Command, Output};

use common::{rprof, Ruby, Target, RPROF};

/// The single error line rprof printed, after checking it failed cleanly.
fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "rprof succeeded: {stderr}");
    assert!(!stderr.contains("panicked"), "rprof panicked: {stderr}");
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("rprof: error: "))
        .collect();
    assert_eq!(errors.len(), 1, "want exactly one error line: {stderr:?}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "want nothing but the error line: {stderr:?}"
    );
    errors[0].to_string()
}

#[test]
fn no_such_pid() {
    let line = error_line(&rprof(&["record", "-p", "4194303", "-d", "1"]));
    assert!(line.contains("no process with PID 4194303"), "{line}");
}

#[test]
fn not_a_ruby_process() {
    let target = Target::start(Command::new("sh").args(["-c", "echo ready; exec sleep 600"]));
    let line = error_line(&rprof(&["record", "-p", &target.pid.to_string(), "-d", "1"]));
    assert!(line.contains("is not a Ruby process"), "{line}");
    // A shell or supervisor that starts Rubies: the way to follow them.
    assert!(line.contains("add --subprocesses"), "{line}");
}

/// A Ruby that has ended but is not yet reaped (a zombie keeps its PID and
/// /proc entry, and no memory): said as ended, not as "not a Ruby".
#[test]
fn a_target_that_has_ended_is_said_to_have_ended() {
    let mut target = Ruby::host().spawn("short.rb", &["0"]);
    target.wait_line("burned ", std::time::Duration::from_secs(30));
    let zombie = (0..500).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(10));
        common::stat_fields(&format!("/proc/{}/stat", target.pid))[0] == "Z"
    });
    assert!(zombie, "short.rb did not end");
    let line = error_line(&rprof(&["record", "-p", &target.pid.to_string(), "-d", "1"]));
    assert!(
        line.contains(&format!(
            "process {} exited before rprof could attach to it",
            target.pid
        )),
        "{line}"
    );
}

/// A real process that looks like a Ruby rprof does not know: a C program
/// exporting `ruby_version` "9.9.0".
fn fake_ruby(dir: &std::path::Path) -> std::path::PathBuf {
    let src = dir.join("fake-ruby.c");
    std::fs::write(
        &src,
        "#include <stdio.h>\n#include <unistd.h>\n\
         const char ruby_version[] = \"9.9.0\";\n\
         int main(void) { printf(\"ready\\n\"); fflush(stdout); for (;;) pause(); }\n",
    )
    .expect("write fake ruby");
    let exe = dir.join("fake-ruby");
    let status = Command::new("cc")
        .arg("-rdynamic")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .status()
        .expect("run cc");
    assert!(status.success(), "cc failed");
    exe
}

#[test]
fn unsupported_ruby_version_names_the_supported_ones_and_the_way_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = Target::start(&mut Command::new(fake_ruby(dir.path())));
    let line = error_line(&rprof(&["record", "-p", &target.pid.to_string(), "-d", "1"]));
    assert!(line.contains("Ruby 9.9.0 is not supported"), "{line}");
    assert!(line.contains("2.7, 3.1, 3.2, 3.3, 3.4, 4.0"), "{line}");
    assert!(line.contains("--force-version 4.0"), "{line}");
}

#[test]
fn without_root_it_names_the_missing_capabilities() {
    let target = Ruby::host().spawn("idle.rb", &[]);
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
        ])
        .arg(RPROF)
        .args([
            "record",
            "-p",
            &target.pid.to_string(),
            "-d",
            "1",
            "-o",
            "/tmp/never-written.svg",
        ])
        .output()
        .expect("run setpriv");
    let line = error_line(&out);
    assert!(line.contains("CAP_BPF") && line.contains("CAP_PERFMON"), "{line}");
    assert!(line.contains("root"), "says how to fix it: {line}");
}

/// Runs rprof in a private mount namespace where `hide` (directories) are covered by empty tmpfs.
fn with_hidden(hide: &[&str], args: &[&str]) -> Output {
    let mut script = String::from("set -e; ");
    for dir in hide {
        script.push_str(&format!("if [ -d {dir} ]; then mount -t tmpfs none {dir}; fi; "));
    }
    script.push_str("exec \"$@\"");
    Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &script,
            "sh",
            RPROF,
        ])
        .args(args)
        .output()
        .expect("run unshare")
}

#[test]
fn without_kernel_btf_it_says_what_the_kernel_needs() {
    let target = Ruby::host().spawn("idle.rb", &[]);
    let out = with_hidden(
        &["/sys/kernel/btf"],
        &["record", "-p", &target.pid.to_string(), "-d", "1"],
    );
    let line = error_line(&out);
    assert!(
        line.contains("BTF") && line.contains("CONFIG_DEBUG_INFO_BTF"),
        "{line}"
    );
}

#[test]
fn without_tracefs_syscall_tracing_says_how_to_mount_it() {
    let target = Ruby::host().spawn("idle.rb", &[]);
    let out = with_hidden(
        &["/sys/kernel/tracing", "/sys/kernel/debug"],
        &[
            "record",
            "-p",
            &target.pid.to_string(),
            "-d",
            "1",
            "syscall",
            "enter_getpid",
        ],
    );
    let line = error_line(&out);
    assert!(
        line.contains("tracefs") && line.contains("mount -t tracefs"),
        "{line}"
    );
}

#[test]
fn unknown_syscall_suggests_close_names() {
    let target = Ruby::host().spawn("idle.rb", &[]);
    let line = error_line(&rprof(&[
        "record",
        "-p",
        &target.pid.to_string(),
        "syscall",
        "enter_getpd",
    ]));
    assert!(
        line.contains("unknown system call tracepoint \"enter_getpd\""),
        "{line}"
    );
    assert!(line.contains("enter_getpid"), "{line}");
}

#[test]
fn out_of_range_frequency() {
    let target = Ruby::host().spawn("idle.rb", &[]);
    let line = error_line(&rprof(&["record", "-p", &target.pid.to_string(), "-F", "0"]));
    assert!(line.contains("-F/--frequency"), "{line}");
}

#[test]
fn nothing_to_profile() {
    let line = error_line(&rprof(&["record", "-d", "1"]));
    assert!(line.contains("-p PID"), "{line}");
}

/// --force-version picks the layout; the proof still decides whether it
/// fits (tests/layouts.rs: another minor version's is refused).
#[test]
fn force_version_picks_the_layout_the_proof_decides() {
    let target = Ruby::named("3.4").spawn("ratio.rb", &[]);
    // Until it has used 1 s of CPU (about 75 samples in thrice), however
    // busy the machine.
    let run = common::record_cpu("ratio.rb", target.pid, (&["--force-version", "3.4"], &[]), 1.0);
    assert!(
        run.stderr.contains("with the Ruby 3.4 layout (--force-version)"),
        "{}",
        run.stderr
    );
    assert!(
        run.folded
            .count(|f| f.contains("thrice (/tmp/rprof-tests/ratio.rb:4)"))
            > 10,
        "{:?}",
        run.folded.stacks
    );
    let line = error_line(&rprof(&[
        "record",
        "-p",
        &target.pid.to_string(),
        "--force-version",
        "three",
    ]));
    assert!(line.contains("--force-version \"three\""), "{line}");
}

#[test]
fn an_output_that_cannot_be_written_is_said_before_recording() {
    let target = Ruby::host().spawn("idle.rb", &[]);
    let out = rprof(&[
        "record",
        "-p",
        &target.pid.to_string(),
        "-d",
        "5",
        "-o",
        "/nonexistent/dir/out.svg",
    ]);
    let line = error_line(&out);
    assert!(line.contains("creating /nonexistent/dir/out.svg"), "{line}");
    let out = rprof(&["report", "-i", "/nonexistent/rec.rprof"]);
    assert!(error_line(&out).contains("reading /nonexistent/rec.rprof"));
}
