//! `rprof record ... syscall NAME`: every event, with the Ruby stack of the
//! thread that made the call, never the GVL holder's.

use crate::common;

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{label, record, record_with_env, rprof, Ruby, Target};

fn labels(stack: &[String]) -> Vec<&str> {
    stack.iter().map(|f| label(f)).collect()
}

fn has_chain(stack: &[String], chain: &[&str]) -> bool {
    let l = labels(stack);
    chain.iter().all(|c| l.contains(c))
}

fn no_foreign_ec(stderr: &str) {
    assert!(
        !stderr.contains("another thread"),
        "an EC of another thread was read: {stderr}"
    );
}

#[test]
fn a_syscall_made_without_the_gvl_is_charged_to_its_own_thread() {
    let target = Ruby::host().spawn("syscalls.rb", &["stat"]);
    let (caller, cruncher) = (
        target.get("syscaller").to_string(),
        target.get("cruncher").to_string(),
    );
    // Until it has used 2 s of CPU (the cruncher's), however busy the
    // machine.
    let run = common::record_cpu(
        "syscalls.rb",
        target.pid,
        (&["syscall", "enter_newfstatat"], &[]),
        2.0,
    );
    no_foreign_ec(&run.stderr);
    let mine = run.folded.of_thread(&caller);
    // The cruncher holds the GVL for whole timeslices (100 ms): the syscaller
    // gets it back about 10 times a second at worst (21 events in 2 s seen).
    assert!(
        mine.total() >= 10,
        "too few events of the syscalling thread: {:?}",
        run.folded.stacks
    );
    for (stack, n) in &run.folded.stacks {
        let l = labels(stack);
        assert!(
            !l.iter().any(|f| ["Object#a", "Object#b", "Object#c"].contains(f)),
            "{n} events blamed on the cruncher's code: {stack:?}"
        );
        assert_eq!(
            l.last(),
            Some(&"enter_newfstatat"),
            "the leaf names the syscall: {stack:?}"
        );
        if stack[0].ends_with(&format!("[{caller}]")) {
            assert!(
                has_chain(stack, &["Object#x", "Object#y", "Object#z", "File.exist?"]),
                "{stack:?}"
            );
        }
    }
    assert_eq!(
        run.folded.of_thread(&cruncher).total(),
        0,
        "the cruncher makes no newfstatat call"
    );
}

/// The id of the thread of `pid` named `name` (Ruby names its native
/// threads after Thread#name; a chroot's Ruby has no /proc of its own).
fn thread_named(pid: u32, name: &str) -> String {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("the target's threads")
        .flatten()
        .filter_map(|t| t.file_name().into_string().ok())
        .find(|tid| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).is_ok_and(|c| c.trim() == name)
        })
        .unwrap_or_else(|| panic!("no thread named {name} in {pid}"))
}

/// rprof stopped (SIGSTOP: it reads nothing, not the GC's clock either)
/// while the target runs a minor GC, makes system calls in that GC's time, then
/// runs a major GC: the events of the minor GC's time are named after the
/// major one, which rprof must know came after them. It knows from the
/// reading of the clock BPF made with their first record; without it, every
/// one of them was `[unknown]` ("collected before they could be read"), as
/// they were for 1-4% of the events when CPU burners starved rprof.
fn check_gc_unseen(r: &Ruby) {
    let mut target = r.spawn("gc_unseen.rb", &[]);
    let looper = thread_named(target.pid, "looper");
    let mut rprof = common::attach_with_env(
        target.pid,
        &["-d", "120", "syscall", "enter_clock_gettime"],
        &[("RPROF_SAY_NAMED", "1")],
    );
    rprof.wait_stderr(&format!("rprof: named a whole stack of thread {looper}"));
    // Continued however this test ends: a stopped rprof would keep its
    // programs attached through the tests after it.
    let stopped = common::Stopped::new(rprof.child.id());
    assert!(common::signal(target.pid, libc::SIGUSR1), "signalling the target");
    let gcs = target.wait_line("gcs", Duration::from_secs(30));
    drop(stopped);
    rprof.interrupt();
    let run = rprof.finish();
    // "gcs minor=COUNT,MAJORS major=COUNT,MAJORS": one minor GC, then one major.
    let counts: Vec<u64> = gcs
        .split(['=', ',', ' '])
        .filter_map(|w| w.parse().ok())
        .collect();
    assert!(
        counts.len() == 4 && counts[2] == counts[0] + 1 && counts[3] == counts[1] + 1,
        "Ruby {}: a minor GC then a major one: {gcs}",
        r.name
    );
    no_foreign_ec(&run.stderr);
    // The looper's code was named before rprof stopped, and its events in
    // the minor GC's time are about half of them (the other half come after
    // the major GC). What may stay `[unknown]` is code rprof had not read
    // before the major GC, which it cannot vouch for: the main thread's
    // calls around the GCs, and stacks caught while a frame is pushed (its
    // method-entry slot holding what the stack held before; 0 to 13 of 1.2
    // million events when the looper called getpid). Measured, 30 runs on
    // each Ruby: all of the looper's 0.83 to 1.75 million events named;
    // without the clock's readings from BPF, 33-58% unnamed (3 runs each).
    let mine = run.folded.of_thread(&looper);
    let named: u64 = mine
        .stacks
        .iter()
        .filter(|(stack, _)| {
            has_chain(
                stack,
                &["Object#x", "Object#y", "Object#z", "Process.clock_gettime"],
            )
        })
        .map(|(_, n)| n)
        .sum();
    eprintln!(
        "Ruby {}: {named} of the looper's {} events named",
        r.name,
        mine.total()
    );
    assert!(
        mine.total() > 0 && named * 1000 >= mine.total() * 999,
        "Ruby {}: {}: {:?}",
        r.name,
        run.stderr,
        mine.stacks
    );
}

mod events_of_a_gc_time_rprof_never_saw_keep_their_names {
    use super::*;

    #[test]
    fn ruby_2_7() {
        check_gc_unseen(&Ruby::named("2.7"))
    }

    #[test]
    fn ruby_3_1() {
        check_gc_unseen(&Ruby::host())
    }

    #[test]
    fn ruby_3_3() {
        check_gc_unseen(&Ruby::named("3.3"))
    }

    #[test]
    fn ruby_3_4() {
        check_gc_unseen(&Ruby::named("3.4"))
    }
}

#[test]
fn getpid_events_carry_the_stack_of_the_thread_that_made_them() {
    let target = Ruby::host().spawn("syscalls.rb", &["getpid"]);
    let (caller, cruncher) = (
        target.get("syscaller").to_string(),
        target.get("cruncher").to_string(),
    );
    // RPROF_VERIFY_EC=1: BPF also checks, for every event, that the EC it read
    // belongs to the thread that made the call (its rb_thread_t's native id is
    // that thread's pthread), and counts any that does not.
    let run = record_with_env(
        target.pid,
        &["-d", "2", "syscall", "enter_getpid"],
        &[("RPROF_VERIFY_EC", "1")],
    );
    assert!(run.success, "{}", run.stderr);
    no_foreign_ec(&run.stderr);
    let events = run.summary("events");
    assert!(
        run.stderr
            .contains(&format!("{events} checked to be the thread's own EC")),
        "every event's EC was checked: {}",
        run.stderr
    );
    let mut chained = 0;
    for (stack, n) in &run.folded.stacks {
        let l = labels(stack);
        let xyz = l.iter().any(|f| ["Object#x", "Object#y", "Object#z"].contains(f));
        let abc = l.iter().any(|f| ["Object#a", "Object#b", "Object#c"].contains(f));
        assert!(!(xyz && abc), "a stack mixes both threads: {stack:?}");
        if stack[0].ends_with(&format!("[{caller}]")) {
            assert!(
                !abc,
                "{n} of the syscaller's events carry the writer's stack: {stack:?}"
            );
            if has_chain(stack, &["Object#x", "Object#y", "Object#z", "Process.pid"]) {
                chained += n;
            }
        } else if stack[0].ends_with(&format!("[{cruncher}]")) {
            assert!(
                !xyz,
                "{n} of the writer's events carry the syscaller's stack: {stack:?}"
            );
        } else {
            assert!(
                !xyz && !abc,
                "Ruby frames under a thread that runs none: {stack:?}"
            );
        }
    }
    assert!(
        chained > 100,
        "few getpid events under x -> y -> z -> pid: {:?}",
        run.folded.stacks
    );
}

#[test]
fn a_target_pinned_to_another_cpu_is_traced() {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let cpu = (cpus - 1).to_string();
    assert!(cpus > 1, "this test needs a CPU other than 0");
    let ruby = Ruby::host();
    let mut cmd = Command::new("taskset");
    cmd.args(["-c", &cpu, &ruby.exe])
        .arg(ruby.script_path("syscalls.rb"))
        .arg("stat");
    let target = Target::start(&mut cmd);
    // Until it has used 2 s of CPU: pinned, it gets what that CPU's other
    // tasks leave.
    let run = common::record_cpu(
        "syscalls.rb, pinned",
        target.pid,
        (&["syscall", "enter_newfstatat"], &[]),
        2.0,
    );
    assert!(
        run.folded.of_thread(target.get("syscaller")).total() > 20,
        "{:?}",
        run.folded.stacks
    );
}

/// Starts count.rb with N, records enter_getppid until it exits, and returns
/// the recording: it made exactly N getppid calls.
fn count_run(n: u64) -> common::Run {
    count_run_from(n, 1, &[])
}

/// `count_run`, with the calls made from `sites` methods in turn and rprof
/// given `env`.
fn count_run_from(n: u64, sites: u64, env: &[(&str, &str)]) -> common::Run {
    let ruby = Ruby::host();
    let mut cmd = ruby.command("count.rb", &[&n.to_string(), &sites.to_string()]);
    cmd.stdin(Stdio::piped());
    let mut target = Target::start(&mut cmd);
    let rprof = common::attach_with_env(target.pid, &["syscall", "enter_getppid"], env);
    // Attached: let the target make its calls.
    let mut stdin = target.child.stdin.take().expect("stdin");
    writeln!(stdin, "go").expect("send go");
    let done = target.wait_line("done", Duration::from_secs(120));
    assert_eq!(done, format!("done {n}"));
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    run
}

#[test]
fn every_event_is_counted_or_reported_lost() {
    let n = 300_000;
    let run = count_run(n);
    let folded = &run.folded;
    let recorded = folded.count(|f| f == "enter_getppid");
    let lost = run.summary("lost");
    assert_eq!(run.summary("events"), n, "{}", run.stderr);
    assert_eq!(
        recorded + lost,
        n,
        "recorded {recorded} + lost {lost} != made {n}"
    );
    assert_eq!(lost, 0, "nothing should be lost at this rate: {}", run.stderr);
    let in_loop = folded.count(|f| label(f) == "Object#call_ppid");
    assert!(
        in_loop as f64 >= 0.99 * n as f64,
        "{in_loop} of {n} events under call_ppid: {:?}",
        folded.stacks
    );
}

#[test]
fn events_sent_one_by_one_when_the_kernel_counts_table_is_full_are_all_counted() {
    // 64 stacks, a table of 8 entries: most events find no room to be
    // counted in the kernel and are sent on their own (RPROF_SAMPLE_DIRECT).
    let (n, sites) = (32_000, 64);
    let run = count_run_from(n, sites, &[("RPROF_COUNTS_ENTRIES", "8")]);
    let one_by_one = run.summary("sent");
    assert!(
        one_by_one > n / 2,
        "{one_by_one} of {n} sent one by one: {}",
        run.stderr
    );
    assert_eq!(run.summary("events"), n, "{}", run.stderr);
    assert_eq!(run.summary("lost"), 0, "{}", run.stderr);
    // Each method's calls, exactly, under its own name.
    for k in 0..sites {
        let site = format!("Object#site_{k}");
        let counted = run.folded.count(|f| label(f) == site);
        assert_eq!(counted, n / sites, "{site}: {:?}", run.folded.stacks);
    }
    assert_eq!(run.folded.count(|f| f == "enter_getppid"), n);
}

#[test]
fn syscall_list_names_tracepoints() {
    let out = rprof(&["record", "syscall", "--list"]);
    assert!(out.status.success());
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(list.lines().any(|l| l == "enter_getpid"), "{list}");
    assert!(list.lines().any(|l| l == "exit_read"), "{list}");
}

#[test]
fn a_thread_without_a_ruby_ec_is_shown_by_its_name_alone() {
    // Ruby 3.3 runs a timer thread with no execution context; it waits in
    // epoll while the two Ruby threads share the GVL.
    let target = Ruby::named("3.3").spawn("threads.rb", &[]);
    let ruby_threads = [target.get("alpha"), target.get("beta"), target.get("main")];
    let run = record(target.pid, &["-d", "2", "syscall", "enter_epoll_wait"]);
    assert!(run.success, "{}", run.stderr);
    let mut native = 0;
    for (stack, n) in &run.folded.stacks {
        let tid = stack[0]
            .rsplit_once('[')
            .map(|(_, t)| t.trim_end_matches(']'))
            .unwrap_or("");
        if ruby_threads.contains(&tid) {
            continue;
        }
        assert_eq!(
            stack.len(),
            2,
            "a thread without EC has no Ruby frames: {stack:?}"
        );
        assert_eq!(stack[1], "enter_epoll_wait");
        native += n;
    }
    assert!(
        native > 0,
        "the timer thread's epoll_wait calls: {:?}",
        run.folded.stacks
    );
    assert!(
        run.stderr.contains("in threads running no Ruby"),
        "{}",
        run.stderr
    );
}
