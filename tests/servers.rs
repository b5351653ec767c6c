//! Real servers under load, recorded from their master with --subprocesses:
//! Debian's puma and unicorn serving a small Rack app (tests/ruby/app.ru)
//! under wrk, while workers die and masters re-exec themselves.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{attach, label, signal, Target};

const BOOT: Duration = Duration::from_secs(60);

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

/// `server -c CONFIG app.ru` (`-C` for puma) on `port`, once its master said "ready".
fn start(server: &str, config: &str, port: u16, dir: &Path) -> Target {
    let scripts = common::scripts_dir();
    Target::start(
        Command::new(server)
            .arg(if server == "puma" { "-C" } else { "-c" })
            .arg(scripts.join(config))
            .arg(scripts.join("app.ru"))
            .env("PORT", port.to_string())
            // No request log: unicorn's development mode writes one to stderr.
            .env("RACK_ENV", "none")
            .current_dir(dir),
    )
}

/// The PIDs of the next `n` workers the cluster says it booted.
fn workers(server: &mut Target, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| server.wait_line("worker ", BOOT)["worker ".len()..].to_string())
        .collect()
}

/// Samples in HotApp#handle by the process they came from.
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

/// Every worker served its share: at least 20 samples in the handler each.
fn assert_served(run: &common::Run, workers: &[&String]) -> BTreeMap<String, u64> {
    let by = handled_by_process(run);
    eprintln!("HotApp#handle samples by worker: {by:?}; {}", run.stderr.trim());
    for worker in workers {
        let n = by.get(worker.as_str()).copied().unwrap_or(0);
        assert!(
            n >= 20,
            "worker {worker}: {n} samples in HotApp#handle ({by:?}): {}",
            run.stderr
        );
    }
    by
}

/// The process frames, root first, of the stacks of `pid`.
fn lineages(run: &common::Run, pid: &str) -> Vec<Vec<String>> {
    let all: BTreeSet<Vec<String>> = run
        .folded
        .stacks
        .iter()
        .filter(|(stack, _)| common::process_of(stack) == Some(pid))
        .map(|(stack, _)| {
            stack
                .iter()
                .filter(|f| f.starts_with("process "))
                .map(|f| f.split(':').next().unwrap_or(f).to_string())
                .collect()
        })
        .collect();
    all.into_iter().collect()
}

/// A Puma cluster under load, recorded for 5 s from its master with
/// `--subprocesses --processes` and `args`, while a worker is killed and
/// re-forked: (the recording, the master, its first two workers, the replacement).
fn record_puma_with_a_killed_worker(args: &[&str]) -> (common::Run, u32, Vec<String>, String) {
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut puma = start("puma", "puma.rb", port, dir.path());
    let master = puma.pid;
    let first = workers(&mut puma, 2);
    // Attached to the running cluster: its workers exist already.
    let mut all = vec!["--subprocesses", "--processes", "-F", "499", "-d", "5"];
    all.extend_from_slice(args);
    let rprof = attach(master, &all);
    let mut wrk = load(port, 4);
    // A worker dies; Puma forks a replacement, which must be followed too.
    std::thread::sleep(Duration::from_millis(1500));
    signal(first[0].parse().expect("a pid"), libc::SIGKILL);
    let replacement = workers(&mut puma, 1).remove(0);
    let _ = wrk.wait();
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    (run, master, first, replacement)
}

#[test]
fn a_puma_cluster_is_followed_from_its_master_and_a_killed_worker_replaced() {
    let (run, master, first, replacement) = record_puma_with_a_killed_worker(&[]);
    let by = assert_served(&run, &[&first[0], &first[1], &replacement]);
    assert!(
        !by.contains_key("none") && !by.contains_key(&master.to_string()),
        "{by:?}"
    );
    // Every worker's stacks are under the master's process frame.
    for (stack, _) in &run.folded.stacks {
        assert!(stack[0].starts_with(&format!("process {master}:")), "{stack:?}");
    }
}

#[test]
fn a_puma_master_that_re_execs_itself_on_usr2_keeps_being_followed() {
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut puma = start("puma", "puma.rb", port, dir.path());
    let master = puma.pid;
    let before = workers(&mut puma, 2);
    let mut rprof = attach(master, &["--subprocesses", "--processes", "-F", "499"]);
    let _ = load(port, 2).wait();
    // USR2: Puma stops its workers and execs itself in place (same PID, a
    // new program), which boots again and forks new workers.
    signal(master, libc::SIGUSR2);
    let again = puma.wait_line("ready", BOOT);
    assert_eq!(again, format!("ready master={master}"));
    let after = workers(&mut puma, 2);
    let _ = load(port, 2).wait();
    assert!(
        rprof.child.try_wait().expect("rprof's status").is_none(),
        "rprof stopped when Puma re-exec'd"
    );
    rprof.interrupt();
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    assert_served(&run, &[&before[0], &before[1], &after[0], &after[1]]);
    // The new workers are under the same master.
    for worker in &after {
        let root = format!("process {master}");
        assert_eq!(lineages(&run, worker), [vec![root, format!("process {worker}")]]);
    }
}

/// Stops a server's master (and so its workers) when dropped.
struct Quit(u32);

impl Drop for Quit {
    fn drop(&mut self) {
        signal(self.0, libc::SIGKILL);
    }
}

#[test]
fn a_unicorn_cluster_is_followed_through_a_usr2_re_exec_and_its_old_master_quitting() {
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut unicorn = start("unicorn", "unicorn.rb", port, dir.path());
    let old_master = unicorn.pid;
    let old = workers(&mut unicorn, 2);
    let mut rprof = attach(old_master, &["--subprocesses", "--processes", "-F", "499"]);
    let _ = load(port, 2).wait();
    // USR2: the old master forks a child that execs a new master, which
    // forks its own workers; then QUIT ends the old master and its workers.
    signal(old_master, libc::SIGUSR2);
    let ready = unicorn.wait_line("ready", BOOT);
    let new_master: u32 = ready["ready master=".len()..].parse().expect("a pid");
    let _new = Quit(new_master);
    let new = workers(&mut unicorn, 2);
    signal(old_master, libc::SIGQUIT);
    let status = unicorn.child.wait().expect("the old master ends");
    assert!(status.success(), "old master: {status}");
    // Only the new workers serve now, and rprof still records them.
    let _ = load(port, 2).wait();
    assert!(
        rprof.child.try_wait().expect("rprof's status").is_none(),
        "rprof stopped when the old master quit"
    );
    rprof.interrupt();
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let by = assert_served(&run, &[&old[0], &old[1], &new[0], &new[1]]);
    for master in [old_master, new_master] {
        assert!(!by.contains_key(&master.to_string()), "{by:?}");
    }
    // The new master is the old one's child, its workers under it.
    let (old_root, new_root) = (format!("process {old_master}"), format!("process {new_master}"));
    for worker in &old {
        let own = format!("process {worker}");
        assert_eq!(lineages(&run, worker), [vec![old_root.clone(), own]]);
    }
    for worker in &new {
        let own = format!("process {worker}");
        assert_eq!(
            lineages(&run, worker),
            [vec![old_root.clone(), new_root.clone(), own]]
        );
    }
}

/// --native on a Puma cluster, from its master, while a worker is killed
/// and re-forked: every worker's stacks are stitched whole, from the
/// thread's start (`start_thread`) through its Ruby frames, the forked
/// workers sharing their master's unwind tables.
#[test]
fn a_puma_cluster_with_native_frames() {
    let (run, _, first, replacement) = record_puma_with_a_killed_worker(&["--native"]);
    assert_served(&run, &[&first[0], &first[1], &replacement]);
    for worker in [&first[0], &first[1], &replacement] {
        let (mut total, mut whole) = (0, 0);
        for (stack, n) in &run.folded.stacks {
            if common::process_of(stack) != Some(worker.as_str())
                || !stack.iter().any(|f| label(f) == "HotApp#handle")
            {
                continue;
            }
            total += n;
            // After the process and thread frames, the native part, down to
            // the thread's first Ruby frame.
            let natives: Vec<&String> = stack
                .iter()
                .skip_while(|f| f.starts_with("process ") || f.contains(" ["))
                .take_while(|f| f.ends_with("_[n]"))
                .collect();
            if natives.first().is_some_and(|f| *f == "clone3_[n]")
                && natives.iter().any(|f| *f == "start_thread_[n]")
                && !stack.iter().any(|f| f.contains("native unwind stopped"))
            {
                whole += n;
            }
        }
        assert!(
            total >= 20 && whole * 100 >= total * 95,
            "worker {worker}: {whole} of {total} HotApp#handle samples stitched from start_thread: {}",
            run.stderr
        );
    }
}
