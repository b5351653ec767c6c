//! `rprof record -- CMD`: rprof stands in for the command. Its output passes
//! through, its exit status becomes rprof's, a stop signal sent to rprof
//! reaches it, and under sudo it runs as the user who ran sudo.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};

use common::{label, Folded};

/// `rprof record -F 499 --format folded -o TMP [EXTRA] -- ruby launched.rb MODE`.
fn launch(mode: &str, extra: &[&str], env: &[(&str, &str)]) -> (Output, Folded) {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("launch.folded");
    let output = Command::new(common::RPROF)
        .args(["record", "-F", "499", "--format", "folded", "-o"])
        .arg(&out)
        .args(extra)
        .args(["--", "ruby"])
        .arg(common::scripts_dir().join("launched.rb"))
        .arg(mode)
        .envs(env.iter().copied())
        .output()
        .expect("run rprof");
    let folded = Folded::parse(&std::fs::read_to_string(&out).unwrap_or_default());
    (output, folded)
}

fn burned(folded: &Folded) -> u64 {
    folded.count(|f| label(f) == "Object#burn")
}

#[test]
fn the_command_exit_status_becomes_rprofs_and_its_output_passes_through() {
    let (output, folded) = launch("exit3", &[], &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("tick 3\n"), "{stdout:?}");
    // rprof's recording thread runs ahead of the programs it profiles
    // (system::favour_recording_thread); the command it starts does not.
    assert!(stdout.contains("nice 0\n"), "{stdout:?}");
    // 0.6 s of CPU at 499 Hz, less the start.
    assert!(burned(&folded) > 150, "{stderr}");
}

#[test]
fn a_command_killed_by_a_signal_gives_128_plus_the_signal() {
    let (output, folded) = launch("kill", &[], &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(128 + 9), "{stderr}");
    assert!(burned(&folded) > 150, "{stderr}{:#?}", folded.stacks);
}

#[test]
fn sigterm_to_rprof_stops_the_command_and_the_profile_is_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("launch.folded");
    let mut rprof = Command::new(common::RPROF)
        .args(["record", "-F", "499", "--format", "folded", "-o"])
        .arg(&out)
        .args(["--", "ruby"])
        .arg(common::scripts_dir().join("launched.rb"))
        .arg("forever")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rprof");
    let mut stderr = BufReader::new(rprof.stderr.take().expect("stderr"));
    let mut line = String::new();
    stderr.read_line(&mut line).expect("rprof announces itself");
    assert!(line.contains("recording"), "{line}");
    // Two ticks after recording began: at least 0.2 s of CPU under rprof.
    let mut stdout = BufReader::new(rprof.stdout.take().expect("stdout"));
    let mut ticks = 0;
    while ticks < 2 {
        line.clear();
        assert!(
            stdout.read_line(&mut line).expect("read") > 0,
            "the command ended early"
        );
        ticks += usize::from(line.starts_with("tick"));
    }
    // SAFETY: kill only sends a signal.
    unsafe { libc::kill(rprof.id() as libc::pid_t, libc::SIGTERM) };
    let status = rprof.wait().expect("rprof exits");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut rest).expect("stderr");
    // Ruby dies of the SIGTERM rprof passed on: 128 + 15, as a shell says.
    assert_eq!(status.code(), Some(128 + 15), "{rest}");
    let folded = Folded::parse(&std::fs::read_to_string(&out).expect("profile written"));
    assert!(burned(&folded) > 50, "{rest}");
}

#[test]
fn under_sudo_the_command_runs_as_the_user_who_ran_sudo_unless_root_is_asked() {
    // SAFETY: geteuid cannot fail.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test needs root (CI runs as root)"
    );
    let sudo = [
        ("SUDO_UID", "65534"),
        ("SUDO_GID", "65534"),
        ("SUDO_USER", "nobody"),
    ];
    let (output, folded) = launch("exit3", &[], &sudo);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("user uid=65534 gid=65534 home=/nonexistent"),
        "{stdout:?}"
    );
    assert_eq!(output.status.code(), Some(3));
    assert!(
        burned(&folded) > 150,
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let (output, _) = launch("exit3", &["--root"], &sudo);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("user uid=0 gid=0"), "{stdout:?}");
}
