//! Following processes: several `-p`, and `--subprocesses`, where every
//! process a target forks is followed from its first instruction, named by
//! its own PID, and never mixed with another.

use crate::common;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{attach, attach_merged, label, Ruby, Run, Target};

const CHILDREN: [&str; 3] = ["alpha", "beta", "gamma"];

/// A forks.rb run under rprof: the run, the parent's PID, and each child's
/// PID and CPU time in its method (cpu and reuse modes).
struct Forks {
    run: Run,
    parent: u32,
    children: BTreeMap<String, u32>,
    burned: BTreeMap<String, f64>,
}

/// Runs forks.rb MODE under `rprof record -p PARENT --subprocesses ARGS`:
/// rprof attaches, then the script forks its three children; rprof ends when
/// they and the parent have.
fn record_forks(mode: &str, args: &[&str]) -> Forks {
    let mut target = Ruby::host().spawn("forks.rb", &[mode]);
    let mut all = vec!["--subprocesses"];
    all.extend_from_slice(args);
    let rprof = if all.contains(&"--merged") {
        all.retain(|a| *a != "--merged");
        attach_merged(target.pid, &all)
    } else {
        attach(target.pid, &all)
    };
    common::signal(target.pid, libc::SIGUSR1);
    let forked = target.wait_line("forked", Duration::from_secs(30));
    let children = forked
        .split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().expect("a pid")))
        .collect();
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let lines = target.all_lines("burned ", Duration::from_secs(30));
    Forks {
        run,
        parent: target.pid,
        children,
        burned: burned(lines.iter().map(String::as_str)),
    }
}

/// The CPU time each child burned in its method, from forks.rb's "burned
/// NAME=SECONDS" lines.
fn burned<'a>(lines: impl Iterator<Item = &'a str>) -> BTreeMap<String, f64> {
    lines
        .filter_map(|l| l.strip_prefix("burned ")?.split_once('='))
        .map(|(name, s)| (name.to_string(), s.parse().expect("seconds")))
        .collect()
}

/// The child method in a stack, if any; and panics if there are two.
fn child_of(stack: &[String]) -> Option<&'static str> {
    let found: Vec<&'static str> = CHILDREN
        .into_iter()
        .filter(|c| stack.iter().any(|f| label(f) == format!("Object#child_{c}")))
        .collect();
    assert!(found.len() <= 1, "a stack mixes children: {stack:?}");
    found.first().copied()
}

/// Samples per child method.
fn per_child(run: &Run) -> BTreeMap<&'static str, u64> {
    let mut per_child = BTreeMap::new();
    for (stack, n) in &run.folded.stacks {
        if let Some(child) = child_of(stack) {
            *per_child.entry(child).or_insert(0) += n;
        }
    }
    per_child
}

/// Each child burned up to 0.8 s of CPU (2 CPUs shared by 3, and whatever
/// else the machine runs), sampled at 499 Hz: its samples match that time.
fn assert_every_child_sampled(run: &Run, burned: &BTreeMap<String, f64>) {
    let per_child = per_child(run);
    for c in CHILDREN {
        let n = per_child.get(c).copied().unwrap_or(0);
        let cpu = *burned
            .get(c)
            .unwrap_or_else(|| panic!("{c} said nothing of its CPU time: {burned:?}"));
        common::assert_samples_match_cpu(n, cpu, 499.0, &format!("{c} ({per_child:?})"));
    }
}

#[test]
fn forked_children_are_followed_and_each_is_under_its_own_process() {
    let Forks {
        run,
        parent,
        children,
        burned,
    } = record_forks("cpu", &["-F", "499", "--processes"]);
    for (stack, _) in &run.folded.stacks {
        let Some(child) = child_of(stack) else { continue };
        let pid = children[child];
        assert!(
            stack[0].starts_with(&format!("process {parent}:\"")),
            "{child}'s stack not under its parent: {stack:?}"
        );
        assert!(
            stack[1].starts_with(&format!("process {pid}:\"")),
            "{child}'s stack not under its own PID {pid}: {stack:?}"
        );
    }
    assert_every_child_sampled(&run, &burned);
    assert!(
        run.stderr.contains("4 processes followed, 4 profiled, 4 ended"),
        "{}",
        run.stderr
    );
}

/// Every child's calls are counted under its own PID, exactly: the script's
/// 1,000, 2,000 and 3,000 calls, plus the same few that Ruby's fork makes in
/// every child. A child that makes its calls and exits within milliseconds
/// may be gone before rprof reads its code (seen in CI): its frames are then
/// `[unknown]` and counted as unreadable, never another child's, and its
/// count is still exact.
#[test]
fn syscall_mode_counts_every_childs_calls_exactly() {
    let Forks {
        run,
        parent,
        children,
        ..
    } = record_forks("getpid", &["syscall", "enter_getpid", "--processes"]);
    let mut per_pid: BTreeMap<u32, u64> = BTreeMap::new();
    let mut named = 0;
    for (stack, n) in &run.folded.stacks {
        assert!(stack[0].starts_with(&format!("process {parent}:\"")), "{stack:?}");
        // The parent's own calls have no child frame.
        let Some(pid) = common::process_of(stack)
            .and_then(|p| p.parse::<u32>().ok())
            .filter(|&p| p != parent)
        else {
            continue;
        };
        *per_pid.entry(pid).or_default() += n;
        if let Some(child) = child_of(stack) {
            assert_eq!(
                children[child], pid,
                "{child}'s frames under another PID: {stack:?}"
            );
            named += n;
        }
    }
    let calls: Vec<u64> = CHILDREN
        .iter()
        .map(|c| per_pid.get(&children[*c]).copied().unwrap_or(0))
        .collect();
    let by_fork = calls[0].wrapping_sub(1000);
    assert!(
        by_fork <= 10 && calls == [1000 + by_fork, 2000 + by_fork, 3000 + by_fork],
        "{calls:?} by PID: {}",
        run.stderr
    );
    assert_eq!(per_pid.len(), 3, "{per_pid:?}");
    // By name: exact, unless a child was gone before its code was read.
    if !run.stderr.contains("unreadable") {
        let want: BTreeMap<&str, u64> = [("alpha", 1000), ("beta", 2000), ("gamma", 3000)].into();
        assert_eq!(per_child(&run), want, "{}", run.stderr);
    }
    assert!(named <= 6000, "{named} named: {}", run.stderr);
}

#[test]
fn without_subprocesses_only_the_given_process_is_recorded() {
    let mut target = Ruby::host().spawn("forks.rb", &["cpu"]);
    let rprof = attach(target.pid, &["-F", "499"]);
    common::signal(target.pid, libc::SIGUSR1);
    target.wait_line("forked", Duration::from_secs(30));
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    assert!(
        run.folded.stacks.iter().all(|(s, _)| child_of(s).is_none()),
        "{:?}",
        run.folded.stacks
    );
}

#[test]
fn several_processes_in_one_profile() {
    let a = Ruby::host().spawn("short.rb", &["30"]);
    let b = Ruby::host().spawn("short.rb", &["30"]);
    let (run, cpu) = common::record_with_cpu(&[a.pid, b.pid], &["--processes", "-F", "499"], 1.0);
    assert!(run.success, "{}", run.stderr);
    for (pid, cpu) in [a.pid, b.pid].into_iter().zip(cpu) {
        let n: u64 = run
            .folded
            .stacks
            .iter()
            .filter(|(s, _)| s[0].starts_with(&format!("process {pid}:\"")))
            .filter(|(s, _)| s.iter().any(|f| label(f) == "Object#burn"))
            .map(|(_, n)| n)
            .sum();
        common::assert_samples_match_cpu(n, cpu, 499.0, &format!("process {pid}"));
    }
}

#[test]
fn a_shell_master_is_followed_and_the_ruby_it_starts_is_profiled() {
    // A shell that, once told, starts a Ruby (fork, then exec) that forks three children.
    let script = common::scripts_dir().join("forks.rb");
    let mut shell = Target::start(
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo ready; read go; ruby {} cpu now; echo done",
                script.display()
            ))
            .stdin(Stdio::piped()),
    );
    let rprof = attach(shell.pid, &["--subprocesses", "--processes", "-F", "499"]);
    let mut stdin = shell.child.stdin.take().expect("stdin");
    stdin.write_all(b"go\n").expect("tell the shell");
    let forked = shell.wait_line("forked", Duration::from_secs(30));
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let burned = burned(
        shell
            .all_lines("burned ", Duration::from_secs(30))
            .iter()
            .map(String::as_str),
    );
    let children: BTreeMap<&str, &str> = forked
        .split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .collect();
    for (name, pid) in &children {
        let n: u64 = run
            .folded
            .stacks
            .iter()
            .filter(|(s, _)| child_of(s) == Some(name))
            .inspect(|(s, _)| {
                // shell -> ruby -> child, each under its parent.
                assert!(s[0].starts_with(&format!("process {}:\"sh", shell.pid)), "{s:?}");
                assert!(s[2].starts_with(&format!("process {pid}:")), "{s:?}");
            })
            .map(|(_, n)| n)
            .sum();
        let cpu = *burned.get(*name).expect("each child's CPU time");
        common::assert_samples_match_cpu(n, cpu, 499.0, &format!("{name}: {}", run.stderr));
    }
    // The shell, its Ruby, three children: all but the shell profiled.
    assert!(
        run.stderr.contains("5 processes followed, 4 profiled, 5 ended"),
        "{}",
        run.stderr
    );
}

#[test]
fn by_default_processes_and_threads_are_merged_into_one_wide_frame() {
    // Three children, each its own process and thread, all forked from the
    // same line: by default their stacks share that one root frame.
    let Forks { run, .. } = record_forks("cpu", &["-F", "499", "--merged"]);
    let roots: std::collections::BTreeSet<&str> = run
        .folded
        .stacks
        .iter()
        .filter(|(s, _)| child_of(s).is_some())
        .map(|(s, _)| s[0].as_str())
        .collect();
    assert_eq!(roots.len(), 1, "{roots:?}");
    let root = roots.iter().next().copied().unwrap_or_default();
    assert!(root.starts_with("<main> ("), "{root}");
}

#[test]
fn a_launched_shell_and_the_rubies_it_starts_are_followed() {
    let script = common::scripts_dir().join("forks.rb");
    let shell = format!("ruby {} cpu now; exit 4", script.display());
    let run = common::record_args(&["--subprocesses", "-F", "499", "--", "sh", "-c", &shell]);
    assert_eq!(run.code, Some(4), "{}", run.stderr);
    assert_every_child_sampled(&run, &burned(run.stdout.lines()));
    // Ruby starting up before rprof could read it: counted, not dropped.
    assert!(
        run.stderr.contains("in followed processes not profiled"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("5 processes followed, 4 profiled, 5 ended"),
        "{}",
        run.stderr
    );
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("rprof's status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS")
}

#[test]
fn a_storm_of_2000_short_lived_children_each_under_its_own_identity_in_flat_memory() {
    let mut storm = Ruby::host().spawn("storm.rb", &["2000", "10"]);
    let rprof = attach(storm.pid, &["--subprocesses", "--processes", "-F", "499"]);
    common::signal(storm.pid, libc::SIGUSR1);
    storm.wait_line("progress 100", Duration::from_secs(60));
    let early = rss_kib(rprof.child.id());
    let line = storm.wait_line("children", Duration::from_secs(300));
    let late = rss_kib(rprof.child.id());
    // Measured while recording: the storm exits (and rprof renders) after.
    common::signal(storm.pid, libc::SIGUSR1);
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let children: std::collections::BTreeSet<&str> = line["children ".len()..].split(',').collect();
    assert_eq!(children.len(), 2000);
    let mut sampled = BTreeMap::new();
    for (stack, n) in &run.folded.stacks {
        if !stack.iter().any(|f| label(f) == "Object#storm_child") {
            continue;
        }
        // The innermost process frame: the child itself, never another.
        let pid = common::process_of(stack).unwrap_or("none");
        assert!(children.contains(pid), "storm_child under {pid}: {stack:?}");
        *sampled.entry(pid.to_string()).or_insert(0u64) += n;
    }
    // 25 ms of CPU each at 499 Hz: about 12 samples a child, none of them
    // waiting for rprof (a child inherits its parent's recipe in BPF), and
    // a child's first sample always counts (cpu_sample_weight). (With 50 ms
    // a child, the test burnt 100 s of CPU, 55 s of its suite's 79.)
    assert!(
        sampled.len() >= 1980,
        "{} of 2000 children sampled: {}",
        sampled.len(),
        run.stderr
    );
    assert!(
        late * 10 <= early * 11,
        "rprof's RSS grew from {early} KiB after 100 children to {late} KiB after 2000"
    );
    eprintln!(
        "{} of 2000 children sampled; rprof RSS {early} KiB after 100, {late} KiB after 2000; {}",
        sampled.len(),
        run.stderr.trim()
    );
}

/// Starts named.rb NAME with PID `pid`, which must be free: the kernel gives
/// the next fork the PID after `ns_last_pid` (root may set it).
fn start_with_pid(name: &str, pid: u32) -> Option<Target> {
    for _ in 0..20 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
        let target = Target::start(&mut Ruby::host().command("named.rb", &[name, "30"]));
        if target.pid == pid {
            return Some(target);
        }
    }
    None
}

#[test]
fn a_reused_pid_is_another_process_whose_samples_never_join_the_old_ones() {
    let a = Ruby::host().spawn("named.rb", &["alpha", "30"]);
    let c = Ruby::host().spawn("named.rb", &["gamma", "30"]);
    let (pa, pc) = (a.pid.to_string(), c.pid.to_string());
    let rprof = attach(a.pid, &["-p", &pc, "-F", "499"]);
    let (alpha_cpu, gamma_cpu) = (common::cpu_seconds(a.pid), common::cpu_seconds(c.pid));
    // alpha ends (and is reaped); a new process gets its PID and runs beta.
    std::thread::sleep(Duration::from_millis(1000));
    let reused = a.pid;
    let alpha_cpu = common::cpu_seconds(a.pid) - alpha_cpu;
    drop(a);
    let b = start_with_pid("beta", reused).expect("the old PID for the new process");
    std::thread::sleep(Duration::from_millis(1500));
    // Stopped before gamma's CPU is read and rprof stops: neither runs on,
    // unsampled, while rprof ends.
    let stopped = [common::Stopped::new(c.pid), common::Stopped::new(b.pid)];
    let gamma_cpu = common::cpu_seconds(c.pid) - gamma_cpu;
    rprof.interrupt();
    let run = rprof.finish();
    drop(stopped);
    drop(b);
    assert!(run.success, "{}", run.stderr);
    let count = |name: &str| run.folded.count(|f| label(f) == format!("Object#burn_{name}"));
    common::assert_samples_match_cpu(count("alpha"), alpha_cpu, 499.0, "alpha");
    common::assert_samples_match_cpu(count("gamma"), gamma_cpu, 499.0, "gamma");
    assert_eq!(
        count("beta"),
        0,
        "process {pa}'s PID reused: {:?}",
        run.folded.stacks
    );
    assert!(
        run.stderr.contains("reused a target's PID, ignored"),
        "{}",
        run.stderr
    );
}

/// A fork of a Ruby that collected for longer than the fork has run (a
/// young Puma worker of a master that booted an app): its GC clock, its
/// parent's at the fork, is more than its own CPU time, and that is no sign
/// of a wrong layout. Attached to directly, and found running under its
/// parent with --subprocesses, it is profiled from the recording's start.
/// Before, `-p CHILD` refused it, and --subprocesses left it out (the
/// worker of a Puma cluster whose master had collected for 32 ms, one
/// attach in ten).
#[test]
fn a_fork_whose_gc_clock_is_its_parents_is_profiled() {
    let target = Ruby::host().spawn("gc_then_fork.rb", &[]);
    let child = target.get("child").to_string();
    let gc_ms: u64 = target.get("gc_ms").parse().expect("ms");
    assert!(gc_ms >= 300, "the parent collected for {gc_ms} ms");
    let alone = common::record(child.parse().expect("a pid"), &["-d", "1", "wall"]);
    assert!(alone.success, "-p {child}: {}", alone.stderr);
    let both = common::record(target.pid, &["--subprocesses", "--processes", "-d", "1", "wall"]);
    assert!(both.success, "{}", both.stderr);
    for (what, run) in [("-p CHILD", &alone), ("--subprocesses", &both)] {
        assert!(!run.stderr.contains("refused"), "{what}: {}", run.stderr);
        // Its one thread, seen from the recording's start.
        let seen: u64 = run
            .folded
            .stacks
            .iter()
            .filter(|(s, _)| what == "-p CHILD" || common::process_of(s) == Some(child.as_str()))
            .map(|(_, n)| n)
            .sum();
        let s = seen as f64 / 1e6;
        assert!(
            (s - 1.0).abs() <= 0.05,
            "{what}: the child's {s:.3} s of 1: {}",
            run.stderr
        );
    }
}

#[test]
fn a_ruby_in_its_own_pid_and_mount_namespaces_is_followed_by_host_pid() {
    // As in a container: Debian 13's Ruby in its own root, PID 1 of a new
    // PID namespace, forking three children there.
    let ruby = Ruby::named("3.3");
    let root = ruby.root.clone().expect("a chroot Ruby");
    let script = ruby.script_path("forks.rb");
    let run = common::record_args(&[
        "--subprocesses",
        "--processes",
        "-F",
        "499",
        "--",
        "unshare",
        "--pid",
        "--mount",
        "--fork",
        "chroot",
        root.to_str().expect("utf8"),
        &ruby.exe,
        &script,
        "cpu",
        "now",
    ]);
    assert!(run.success, "{}", run.stderr);
    assert_every_child_sampled(&run, &burned(run.stdout.lines()));
    let mut pids: BTreeMap<&str, std::collections::BTreeSet<&str>> = BTreeMap::new();
    for (stack, _) in &run.folded.stacks {
        let Some(child) = child_of(stack) else { continue };
        // unshare -> the namespace's PID 1 (chroot, then ruby) -> the child.
        assert!(
            stack[0].starts_with("process ") && stack[0].contains(":\"unshare"),
            "{stack:?}"
        );
        assert!(stack[1].contains("forks.rb cpu now"), "{stack:?}");
        assert!(stack[2].starts_with("process "), "{stack:?}");
        let parent = common::process_of(&stack[..2]).expect("a process frame");
        assert_ne!(parent, "1", "named by its PID in the namespace: {stack:?}");
        pids.entry(child)
            .or_default()
            .insert(common::process_of(&stack[..3]).expect("a pid"));
    }
    // Each child under one PID of its own.
    let all: std::collections::BTreeSet<_> = pids.values().flatten().collect();
    assert!(pids.values().all(|p| p.len() == 1) && all.len() == 3, "{pids:?}");
    assert!(
        run.stderr.contains("5 processes followed, 4 profiled, 5 ended"),
        "{}",
        run.stderr
    );
}

#[test]
fn a_followed_process_on_a_pid_an_earlier_one_had_gets_a_frame_of_its_own() {
    // alpha ends, then beta is forked on its PID: two processes, one PID.
    let Forks {
        run,
        parent,
        children,
        burned,
    } = record_forks("reuse", &["-F", "499", "--processes"]);
    let pid = children["alpha"];
    assert_eq!(children["beta"], pid, "beta was not forked on alpha's PID");
    for (stack, _) in &run.folded.stacks {
        let want = match child_of(stack) {
            Some("alpha") => format!("process {pid}:\""),
            Some("beta") => format!("process {pid}#2:\""),
            _ => continue,
        };
        assert!(stack[0].starts_with(&format!("process {parent}:\"")), "{stack:?}");
        assert!(stack[1].starts_with(&want), "{stack:?}");
    }
    assert_every_child_sampled(&run, &burned);
}

/// `--all`: a Ruby running before rprof and one started while it records
/// (another Ruby version, from its chroot) are profiled, each under its own
/// process with its hot method; a busy shell started meanwhile is looked
/// at and let go, never profiled.
#[test]
fn every_ruby_on_the_host_now_and_as_they_start() {
    let before = Ruby::host().spawn("shift.rb", &[]);
    let rprof = common::record_in_background(&["--all", "--processes", "-d", "4"], &[]);
    let after = Ruby::named("3.4").spawn("ratio.rb", &[]);
    let shell = Target::start(
        Command::new("sh")
            .arg("-c")
            .arg("echo ready; while :; do :; done"),
    );
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let under = |pid: u32, method: &str| -> u64 {
        run.folded
            .stacks
            .iter()
            .filter(|(s, _)| s.iter().any(|f| f.starts_with(&format!("process {pid}:"))))
            .filter(|(s, _)| s.iter().any(|f| label(f) == method))
            .map(|(_, n)| n)
            .sum()
    };
    // Each burns a CPU for seconds at 99 Hz: hundreds of samples; one is
    // enough to say it was found, and under its own process.
    assert!(under(before.pid, "Object#first_phase") > 0, "{}", run.stderr);
    assert!(under(after.pid, "Object#thrice") > 0, "{}", run.stderr);
    assert!(
        !run.folded.stacks.iter().any(|(s, _)| s
            .iter()
            .any(|f| f.starts_with(&format!("process {}:", shell.pid)))),
        "the shell was profiled"
    );
}
