//! Real servers under load, recorded from their master with --subprocesses:
//! Debian's puma serving a small Rack app (tests/ruby/app.ru) under wrk.

mod common;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{attach, label, Target};

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// `wrk` against the app for `seconds`, in the background.
fn load(port: u16, seconds: u32) -> std::process::Child {
    Command::new("wrk")
        .args(["-t", "2", "-c", "4", "-d", &format!("{seconds}s")])
        .arg(format!("http://127.0.0.1:{port}/"))
        .stdout(Stdio::null())
        .spawn()
        .expect("start wrk (apt-get install wrk)")
}

/// Samples in HotApp#handle by the process frame they are under.
fn handled_by_process(run: &common::Run) -> BTreeMap<String, u64> {
    let mut by = BTreeMap::new();
    for (stack, n) in &run.folded.stacks {
        if !stack.iter().any(|f| label(f) == "HotApp#handle") {
            continue;
        }
        let worker = common::process_of(stack).unwrap_or("none").to_string();
        *by.entry(worker).or_insert(0) += n;
    }
    by
}

#[test]
fn a_puma_cluster_is_followed_from_its_master_and_a_killed_worker_replaced() {
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let scripts = common::scripts_dir();
    let mut puma = Target::start(
        Command::new("puma")
            .arg("-C")
            .arg(scripts.join("puma.rb"))
            .arg(scripts.join("app.ru"))
            .env("PORT", port.to_string())
            .current_dir(dir.path()),
    );
    let master = puma.pid;
    let first: Vec<String> = (0..2)
        .map(|_| puma.wait_line("worker", Duration::from_secs(60))[7..].to_string())
        .collect();
    // Attached to the running cluster: its workers exist already.
    let rprof = attach(master, &["--subprocesses", "--processes", "-F", "499", "-d", "5"]);
    let mut wrk = load(port, 4);
    // A worker dies; Puma forks a replacement, which must be followed too.
    std::thread::sleep(Duration::from_millis(1500));
    let killed: u32 = first[0].parse().expect("a pid");
    // SAFETY: kill only sends a signal.
    unsafe { libc::kill(killed as libc::pid_t, libc::SIGKILL) };
    let replacement = puma.wait_line("worker", Duration::from_secs(30))[7..].to_string();
    let _ = wrk.wait();
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let by = handled_by_process(&run);
    eprintln!("HotApp#handle samples by worker: {by:?}; {}", run.stderr.trim());
    for worker in [&first[0], &first[1], &replacement] {
        let n = by.get(worker.as_str()).copied().unwrap_or(0);
        assert!(
            n >= 20,
            "worker {worker}: {n} samples in HotApp#handle ({by:?}): {}",
            run.stderr
        );
    }
    assert!(
        !by.contains_key("none") && !by.contains_key(&master.to_string()),
        "{by:?}"
    );
    // Every worker's stacks are under the master's process frame.
    for (stack, _) in &run.folded.stacks {
        assert!(stack[0].starts_with(&format!("process {master}:")), "{stack:?}");
    }
}
