//! `rprof record ... wall`: every thread's time, on CPU or not, with the
//! reason it waits read from the thread's own memory, on every Ruby.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{go_pprof, label, record, record_with_env, Busy, Folded, Ruby, Target};

/// Seconds recorded.
const SECONDS: f64 = 3.0;

/// Whether a leaf frame is a state looked for.
type IsState = dyn Fn(&str) -> bool;

/// Whether a leaf frame is the wait looked for, of a request whose backend
/// listens on the port given.
type IsWait = dyn Fn(&str, u16) -> bool;

/// Microseconds of `f` (a thread's stacks) whose leaf is `state`.
fn in_state(f: &Folded, state: impl Fn(&str) -> bool) -> u64 {
    f.stacks
        .iter()
        .filter(|(s, _)| s.last().is_some_and(|l| state(l)))
        .map(|(_, n)| n)
        .sum()
}

/// Share of `f`'s time in `state` (leaf frame), in percent.
fn share(f: &Folded, state: impl Fn(&str) -> bool) -> f64 {
    100.0 * in_state(f, state) as f64 / f.total().max(1) as f64
}

/// The stacks of thread `name` of wall_states.rb: by its thread id, or on
/// Ruby 2.7 (no `Thread#native_thread_id`) by its name, which Ruby gives the
/// native thread too.
fn thread(run: &Folded, target: &common::Target, name: &str) -> Folded {
    match target.get(name) {
        "?" => {
            let prefix = format!("{} [", if name == "main" { "ruby" } else { name });
            Folded {
                stacks: run
                    .stacks
                    .iter()
                    .filter(|(s, _)| s[0].starts_with(&prefix))
                    .cloned()
                    .collect(),
            }
        }
        tid => run.of_thread(tid),
    }
}

/// How a wall_states.rb recording is made.
#[derive(Clone, Copy, PartialEq)]
enum Parked {
    Alone,
    /// Every CPU busy.
    Busy,
    /// With `--native --kernel`.
    Stitched,
    /// With an in-kernel counts table of 4 entries: most stacks' time is
    /// sent by their hash (RPROF_SAMPLE_BY_HASH), not counted in the kernel.
    FullTable,
}

/// The kernel frames of a `--kernel` stack, root first: those just before
/// its state (the leaf).
fn kernel_frames(s: &[String]) -> &[String] {
    let before = &s[..s.len().saturating_sub(1)];
    let n = before.iter().rev().take_while(|f| f.ends_with("_[k]")).count();
    &before[before.len() - n..]
}

/// Whether `s` ends, before its state, in the kernel frames of a system
/// call (root first: its entry, then `sys_NAME`) and, below those, native
/// frames, or the marker of a stack rprof read from userspace (which has
/// none).
fn stitched_to_the_call(s: &[String]) -> bool {
    let kernel = kernel_frames(s);
    let called = kernel.first().is_some_and(|k| k.starts_with("entry_SYSCALL"))
        && kernel.iter().any(|k| k.contains("sys_"));
    let below = s.len().checked_sub(kernel.len() + 2).map(|i| &s[i]);
    called
        && below.is_some_and(|f| {
            f.ends_with("_[n]") || f == "[native unwind stopped: stack read from userspace while blocked]"
        })
}

/// What a spinning thread's GVL waits are checked against: its stacks from
/// the recording's second second on (two epochs), and the microseconds the
/// other spinner (the GVL's holder) was ready to run but not running in the
/// first second.
struct Windows {
    later: Folded,
    holder_ready: u64,
}

/// A spinning thread's GVL waits, stitched (wall_states.rb): each ends in
/// the futex it sleeps on, below its native frames, walked as it left the
/// CPU. Only a wait under way when rprof attached has its stack read from
/// userspace, with no native frames: none after the recording's first
/// second, and no longer than the rest of the holder's time slice.
fn gvl_waits_stitched(f: &Folded, w: &Windows, report: &str) {
    let on_futex =
        |s: &[String]| stitched_to_the_call(s) && kernel_frames(s).iter().any(|k| k.contains("futex"));
    let native = |s: &[String]| s[s.len() - kernel_frames(s).len() - 2].ends_with("_[n]");
    let gvl_waits = |f: &Folded, walked: Option<bool>| -> u64 {
        f.stacks
            .iter()
            .filter(|(s, _)| s.last().is_some_and(|l| l == "[waiting for the GVL]"))
            .filter(|(s, _)| walked.is_none_or(|w| on_futex(s) && native(s) == w))
            .map(|(_, n)| n)
            .sum()
    };
    let (all, walked, read) = (
        gvl_waits(f, None),
        gvl_waits(f, Some(true)),
        gvl_waits(f, Some(false)),
    );
    let read_later = gvl_waits(&w.later, Some(false));
    eprintln!(
        "GVL waits: {walked} of {all} us walked, {read} us read from userspace ({read_later} after 1 s; \
         the holder ready {} us in 1 s)",
        w.holder_ready
    );
    assert!(all > 0, "{report} (never waiting for the GVL)");
    assert!(
        read_later == 0,
        "{report} ({read_later} us of GVL waits with no native frames after the first second, {read} us in all)"
    );
    // The wait under way at the start lasts the rest of the holder's 100 ms
    // time slice (Ruby's timer is wall time), and longer while the holder is
    // ready but not on a CPU. Measured: 87 ms at most idle or with burners
    // (4 runs of 2.7, 3.1 and 3.4), 94 ms idle and 99 ms with four burners
    // (the holder then ready 316 to 350 ms of the first second; 2026-11-27,
    // 3 runs of the three Rubies); 176 ms beside frames.rs (ci65) and 228
    // ms beside two more CPU-bound programs (ci57) failed a bound of 150 ms
    // that did not count the holder's wait for a CPU.
    assert!(
        read <= 150_000 + w.holder_ready,
        "{report} ({read} us of GVL waits with no native frames; the holder was ready, not running, {} us in the first second)",
        w.holder_ready
    );
    // Measured: walked and read add up to every GVL wait in 24 threads'
    // recordings (4 runs on 2.7, 3.1 and 3.4, one with both CPUs busy).
    assert!(
        walked * 100 >= (all - read) * 99,
        "{report} ({walked} of {all} us waiting for the GVL with native and kernel frames, {read} read from userspace)"
    );
}

/// The stacks of recording `raw` in a time window (`--from 1s`, `--to 1s`),
/// by thread.
fn window(raw: &str, dir: &std::path::Path, window: [&str; 2]) -> Folded {
    let out = dir.join("window.folded");
    let out = out.to_str().expect("utf8 path");
    let report = common::rprof(&["report", "-i", raw, window[0], window[1], "--threads", "-o", out]);
    assert!(
        report.status.success(),
        "rprof report: {}",
        String::from_utf8_lossy(&report.stderr)
    );
    Folded::parse(&std::fs::read_to_string(out).expect("report wrote"))
}

/// wall_states.rb on `ruby`: each parked thread waits in its state under its
/// own method, the two spinning threads share the GVL, and every thread's
/// time adds up to the recording's. Stitched, each wait ends in the kernel
/// frames of its call, and a wait rprof saw begin has its native frames.
fn parked_threads(ruby: &Ruby, how: Parked) {
    let target = ruby.spawn("wall_states.rb", &[]);
    let _busy = (how == Parked::Busy).then(Busy::start);
    let seconds = SECONDS.to_string();
    let mut args = vec!["-d", &seconds];
    // Stitched: the recording kept too, to look at its first second and
    // the rest apart.
    let dir = tempfile::tempdir().expect("tempdir");
    let raw = dir.path().join("rec.rprof");
    let raw = raw.to_str().expect("utf8 path");
    if how == Parked::Stitched {
        args.extend(["--native", "--kernel", "--raw", raw]);
    }
    args.push("wall");
    let env: &[(&str, &str)] = match how {
        Parked::FullTable => &[("RPROF_COUNTS_ENTRIES", "4")],
        _ => &[],
    };
    let run = record_with_env(target.pid, &args, env);
    assert!(run.success, "Ruby {}: {}", ruby.name, run.stderr);
    if how == Parked::FullTable {
        assert!(run.stderr.contains(" sent one by one"), "{}", run.stderr);
    }
    // Nothing counted is lost: no event, and no time counted to a stack
    // rprof had forgotten (a wait counted epochs after its walk).
    run.assert_nothing_lost(&format!("Ruby {}", ruby.name));
    let report = |what: &str, f: &Folded| {
        let lines: Vec<String> = f
            .stacks
            .iter()
            .map(|(s, n)| format!("{n} {}", s.join(";")))
            .collect();
        format!("Ruby {}: {what}:\n{}", ruby.name, lines.join("\n"))
    };
    let threads = [
        "cpu1",
        "cpu2",
        "sleeper",
        "reader",
        "selector",
        "netreader",
        "netserver",
        "unixreader",
        "unixserver",
        "acceptor",
        "holder",
        "locker",
        "popper",
        "main",
    ];
    let totals: Vec<f64> = threads
        .iter()
        .map(|n| thread(&run.folded, &target, n).total() as f64 / 1e6)
        .collect();
    eprintln!("Ruby {} totals (s): {totals:.3?}", ruby.name);
    for name in threads {
        let f = thread(&run.folded, &target, name);
        // Each thread was alive the whole recording: its time is the
        // recording's, on CPU or not (within 5%: rprof's start and end).
        let total = f.total() as f64 / 1e6;
        assert!(
            (total - SECONDS).abs() <= 0.05 * SECONDS,
            "{} (total {total:.3} s)",
            report(name, &f)
        );
    }
    // Each parked thread: 95% or more in its state, under its own method
    // (stitched: and in the kernel frames of its call).
    // What a blocked call waits on, too: `[blocked: CALL (OBJECT)]`.
    let blocked_on = |object: String| {
        move |l: &str| {
            [
                "read", "poll", "ppoll", "pselect6", "select", "recvfrom", "accept", "accept4",
            ]
            .iter()
            .any(|call| l == format!("[blocked: {call} ({object})]"))
        }
    };
    let on_pipe = blocked_on("pipe".to_string());
    let on_server = blocked_on(format!("socket 127.0.0.1:{}", target.get("server_port")));
    // The server's end: called by the port it was accepted on, not by the
    // client's passing port.
    let on_client = blocked_on(format!("socket accepted on port {}", target.get("server_port")));
    // Unix: the client's end is named by the path it is connected to (it
    // has none of its own: sock_diag gives its peer); the server's, by the
    // path it was accepted on.
    let on_unix = blocked_on(format!("unix socket connected to {}", target.get("unix_path")));
    let on_unix_client = blocked_on(format!("unix socket accepted on {}", target.get("unix_path")));
    let listening = blocked_on(format!("socket listening on port {}", target.get("idle_port")));
    let parked: [(&str, &str, &IsState); 12] = [
        ("sleeper", "Object#nap", &|l| l == "[sleeping]"),
        ("holder", "Object#hold", &|l| l == "[sleeping]"),
        ("reader", "Object#read_pipe", &on_pipe),
        ("selector", "Object#select_pipe", &on_pipe),
        ("netreader", "Object#read_socket", &on_server),
        ("netserver", "Object#read_client", &on_client),
        ("unixreader", "Object#read_unix", &on_unix),
        ("unixserver", "Object#serve_unix", &on_unix_client),
        ("acceptor", "Object#accept_one", &listening),
        ("locker", "Object#lock_mutex", &|l| l == "[waiting: Mutex#lock]"),
        ("popper", "Object#pop_queue", &|l| l == "[waiting: Queue#pop]"),
        ("main", "Object#join_all", &|l| l == "[waiting: Thread#join]"),
    ];
    for (name, method, state) in parked {
        let f = thread(&run.folded, &target, name);
        let under = f
            .stacks
            .iter()
            .filter(|(s, _)| s.last().is_some_and(|l| state(l)) && s.iter().any(|fr| label(fr) == method))
            .filter(|(s, _)| how != Parked::Stitched || stitched_to_the_call(s));
        let n: u64 = under.map(|(_, n)| n).sum();
        let pct = 100.0 * n as f64 / f.total().max(1) as f64;
        assert!(
            pct >= 95.0,
            "{} ({pct:.1}% in its state under {method})",
            report(name, &f)
        );
    }
    // The two spinning threads take turns with the GVL: each holds it about
    // half the time and waits for it the other half. Holding is running, or
    // ready while the kernel runs something else: on a busy machine (another
    // test's burners, CI's neighbours) a third of it can be the latter.
    // Measured: 47-53% holding, 47-53% GVL, idle and with burners (see the
    // closing note of issue 20).
    // Stitched: the recording's first second, and the rest.
    let windows = (how == Parked::Stitched).then(|| {
        (
            window(raw, dir.path(), ["--to", "1s"]),
            window(raw, dir.path(), ["--from", "1s"]),
        )
    });
    for name in ["cpu1", "cpu2"] {
        let f = thread(&run.folded, &target, name);
        let holding = share(&f, |l| l == "[running]" || l == "[runnable: CPU busy]");
        let gvl = share(&f, |l| l == "[waiting for the GVL]");
        assert!(
            (40.0..=60.0).contains(&holding) && (40.0..=60.0).contains(&gvl),
            "{} (holding {holding:.1}%, waiting for the GVL {gvl:.1}%)",
            report(name, &f)
        );
        let running = share(&f, |l| l == "[running]");
        assert!(running > 0.0, "{} (never running)", report(name, &f));
        eprintln!(
            "Ruby {} {name}: holding {holding:.1}% (running {running:.1}%), GVL {gvl:.1}%",
            ruby.name
        );
        if let Some((first, later)) = &windows {
            let other = if name == "cpu1" { "cpu2" } else { "cpu1" };
            let holder_ready = in_state(&thread(first, &target, other), |l| l == "[runnable: CPU busy]");
            let waits = Windows {
                later: thread(later, &target, name),
                holder_ready,
            };
            gvl_waits_stitched(&f, &waits, &report(name, &f));
        }
    }
}

#[test]
fn parked_threads_ruby_2_7() {
    parked_threads(&Ruby::named("2.7"), Parked::Alone);
}

#[test]
fn parked_threads_ruby_3_1() {
    parked_threads(&Ruby::host(), Parked::Alone);
}

#[test]
fn parked_threads_ruby_3_1_static() {
    parked_threads(&Ruby::named("3.1-static"), Parked::Alone);
}

#[test]
fn parked_threads_ruby_3_3() {
    parked_threads(&Ruby::named("3.3"), Parked::Alone);
}

#[test]
fn parked_threads_ruby_3_3_yjit() {
    parked_threads(&Ruby::named("3.3-yjit"), Parked::Alone);
}

#[test]
fn parked_threads_ruby_3_4() {
    parked_threads(&Ruby::named("3.4"), Parked::Alone);
}

/// With `--native --kernel`: every wait ends in the kernel frames of its
/// system call, below its native frames where rprof saw the wait begin.
#[test]
fn parked_threads_stitched_ruby_2_7() {
    parked_threads(&Ruby::named("2.7"), Parked::Stitched);
}

#[test]
fn parked_threads_stitched_ruby_3_1() {
    parked_threads(&Ruby::host(), Parked::Stitched);
}

#[test]
fn parked_threads_stitched_ruby_3_4() {
    parked_threads(&Ruby::named("3.4"), Parked::Stitched);
}

/// Every CPU busy: the spinning threads are preempted while they hold the
/// GVL (`[runnable: CPU busy]`), and the parked ones still wait where they do.
#[test]
fn parked_threads_on_a_busy_machine() {
    parked_threads(&Ruby::host(), Parked::Busy);
}

/// A full counts table loses no time: what BPF cannot count there it sends
/// by the stack's hash (before, 25 of 30 threads' seconds were lost).
#[test]
fn parked_threads_with_the_counts_table_full() {
    parked_threads(&Ruby::host(), Parked::FullTable);
}

/// How sigwait.rb's waiter waits: in a poll (`wait_readable`) or a select
/// (`IO.select`).
#[derive(Clone, Copy, PartialEq)]
enum Waiter {
    Poll,
    Select,
}

/// The descriptors in the select sets (read, write) at `sets` of `nfds`
/// descriptors, read from the memory of `pid` (as the kernel reads them);
/// None if they cannot be read.
fn selected_count(pid: u32, nfds: u64, sets: [u64; 2]) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("the target's memory");
    let mut union = vec![0u8; nfds.div_ceil(64) as usize * 8];
    for set in sets.into_iter().filter(|&a| a != 0) {
        let mut bytes = vec![0u8; union.len()];
        mem.read_exact_at(&mut bytes, set).ok()?;
        union.iter_mut().zip(bytes).for_each(|(u, b)| *u |= b);
    }
    Some(union.iter().map(|b| u64::from(b.count_ones())).sum())
}

/// sigwait.rb's waiter once it waits `how`: its thread id, and how many
/// descriptors it waits on (read from /proc: the chroots of other Rubies have
/// none, and 2.7 has no `Thread#native_thread_id`).
fn waiter_waiting(pid: u32, how: Waiter) -> (String, u64) {
    let calls: &[&str] = match how {
        Waiter::Poll => &["7", "271"],
        Waiter::Select => &["23", "270"],
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the target's threads");
        for task in tasks.map_while(Result::ok) {
            let path = task.path();
            let comm = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
            let call = std::fs::read_to_string(path.join("syscall")).unwrap_or_default();
            let words: Vec<&str> = call.split_whitespace().collect();
            if comm.trim_end() != "waiter" || !words.first().is_some_and(|w| calls.contains(w)) {
                continue;
            }
            let arg =
                |i: usize| u64::from_str_radix(words[i].trim_start_matches("0x"), 16).expect("an argument");
            let n = match how {
                Waiter::Poll => Some(arg(2)),
                Waiter::Select => selected_count(pid, arg(1), [arg(2), arg(3)]),
            };
            // The sets were read during this very call (a byte may have
            // ended it since the call was read): else, looked at again.
            if let Some(n) =
                n.filter(|_| std::fs::read_to_string(path.join("syscall")).is_ok_and(|a| a == call))
            {
                return (task.file_name().to_string_lossy().into_owned(), n);
            }
        }
        assert!(Instant::now() < deadline, "sigwait.rb's waiter never waited");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// On Ruby 2.7-3.2 the thread holding the VM's signal eventfd polls it
/// beside the descriptor it waits on (`nfds` 2, else 1), or selects it: its
/// waits still name the socket, the first (under way at attach: read from
/// userspace) and the later ones (seen begin: walked in BPF). Once they
/// named nothing (seen on wall_states.rb's acceptor, whichever thread took
/// the eventfd).
fn waits_beside_the_signal_fd(ruby: &Ruby, nfds: u64, how: Waiter) {
    let target = ruby.spawn(
        "sigwait.rb",
        if how == Waiter::Select { &["select"] } else { &[] },
    );
    let (tid, polled) = waiter_waiting(target.pid, how);
    assert_eq!(
        polled, nfds,
        "Ruby {}: the waiter waits on {polled} descriptors",
        ruby.name
    );
    let woken = switches(target.pid, &tid);
    let run = record(target.pid, &["-d", "3", "wall"]);
    let woken = switches(target.pid, &tid) - woken;
    assert!(run.success, "Ruby {}: {}", ruby.name, run.stderr);
    let f = run.folded.of_thread(&tid);
    let report = format!("Ruby {}: waiter, {woken} switches:\n{}", ruby.name, stacks_of(&f));
    let socket = format!("(socket 127.0.0.1:{})", target.get("peer_port"));
    // Its waits: a leaf `[blocked: poll...` or `[blocked: ppoll...` (not
    // the odd microseconds it blocks on a futex of Ruby's own).
    let calls: &[&str] = match how {
        Waiter::Poll => &["[blocked: poll", "[blocked: ppoll"],
        Waiter::Select => &["[blocked: select", "[blocked: pselect6"],
    };
    let blocked = in_state(&f, |l| calls.iter().any(|call| l.starts_with(call)));
    let named = in_state(&f, |l| {
        calls
            .iter()
            .any(|call| l.strip_prefix(call) == Some(&format!(" {socket}]")))
    });
    // A byte every 0.3 s wakes it: about 10 waits begun while rprof
    // records, walked. (Whether a woken waiter then waits for the GVL
    // depends on who is quicker: the main thread releases it to write.)
    // Measured: 10 switches in 3 s with a CPU busy, 23 idle.
    assert!(blocked >= 1_000_000 && woken >= 5, "{report}");
    assert_eq!(named, blocked, "{report} (waited without naming the socket)");
}

#[test]
fn waits_beside_the_signal_fd_ruby_2_7() {
    waits_beside_the_signal_fd(&Ruby::named("2.7"), 2, Waiter::Poll);
}

#[test]
fn waits_beside_the_signal_fd_ruby_3_1() {
    waits_beside_the_signal_fd(&Ruby::host(), 2, Waiter::Poll);
}

/// 3.3 on have no signal eventfd.
#[test]
fn waits_beside_the_signal_fd_ruby_3_4() {
    waits_beside_the_signal_fd(&Ruby::named("3.4"), 1, Waiter::Poll);
}

/// IO.select: the eventfd in the read set beside the socket.
#[test]
fn selects_beside_the_signal_fd_ruby_3_1() {
    waits_beside_the_signal_fd(&Ruby::host(), 2, Waiter::Select);
}

/// IO.select on 3.4: the socket alone.
#[test]
fn selects_ruby_3_4() {
    waits_beside_the_signal_fd(&Ruby::named("3.4"), 1, Waiter::Select);
}

/// Waits on Unix sockets that begin while rprof records, walked in BPF:
/// each named by the path it listens on, was accepted on or is bound to,
/// else (a client's end) by the path of the socket it is connected to.
/// Among them the server's end of a new connection each time, accepted
/// after rprof read the namespace's tables: 5ef7cc8's binary named 96% of
/// its time only `(unix socket)`.
#[test]
fn unix_socket_waits_walked_as_they_begin() {
    let target = Ruby::host().spawn("unix_waits.rb", &[]);
    let run = record(target.pid, &["-d", "2", "wall"]);
    assert!(run.success, "{}", run.stderr);
    // About 100 waits of 20 ms: most of the 2 s, every one named.
    // Measured 1.98-1.99 s each, idle and beside four CPU burners.
    assert_unix_waits_named(&run, &target);
}

/// The same waits under way before rprof looks, in a network namespace of
/// their own (as in a container): their stacks and sockets are read from
/// userspace, and a client's peer from sock_diag, in that namespace.
#[test]
fn unix_socket_waits_under_way_in_another_network_namespace() {
    let ruby = Ruby::host();
    let mut cmd = Command::new("unshare");
    cmd.args(["--net", &ruby.exe, &ruby.script_path("unix_waits.rb"), "parked"]);
    let target = Target::start(&mut cmd);
    let netns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).expect("a network namespace");
    assert_ne!(netns(&target.pid.to_string()), netns("self"));
    // Each thread in its poll before rprof starts.
    let names: Vec<&str> = unix_waits(&target).iter().map(|(name, _, _)| *name).collect();
    wait_in_call(&target, &names, &[271]);
    let run = record(target.pid, &["-d", "2", "wall"]);
    assert!(run.success, "{}", run.stderr);
    assert_unix_waits_named(&run, &target);
}

/// unix_waits.rb's threads: name, method, and what its waits are on.
fn unix_waits(target: &Target) -> [(&'static str, &'static str, String); 6] {
    let path = target.get("path");
    let fresh = target.get("fresh_path");
    let bound = target.get("bound_path");
    [
        (
            "listener",
            "Object#wait_listening",
            format!("unix socket listening on {path}"),
        ),
        (
            "accepted",
            "Object#wait_accepted",
            format!("unix socket accepted on {path}"),
        ),
        (
            "client",
            "Object#wait_client",
            format!("unix socket connected to {path}"),
        ),
        (
            "fresh",
            "Object#wait_fresh",
            format!("unix socket accepted on {fresh}"),
        ),
        (
            "bound",
            "Object#wait_bound",
            format!("unix socket bound to {bound}"),
        ),
        (
            "dgramclient",
            "Object#wait_dgram_client",
            format!("unix socket connected to {bound}"),
        ),
    ]
}

/// Every thread of unix_waits.rb polled most of a 2 s recording, every
/// poll named by its socket, under its method.
fn assert_unix_waits_named(run: &common::Run, target: &Target) {
    for (name, method, object) in unix_waits(target) {
        let f = run.folded.of_thread(target.get(name));
        let report = format!("{name}:\n{}", stacks_of(&f));
        // Its polls (not the odd microseconds it blocks on a futex of
        // Ruby's own).
        let blocked = in_state(&f, |l| l.starts_with("[blocked: ppoll"));
        let named = f
            .stacks
            .iter()
            .filter(|(s, _)| {
                s.last()
                    .is_some_and(|l| l == &format!("[blocked: ppoll ({object})]"))
                    && s.iter().any(|fr| label(fr) == method)
            })
            .map(|(_, n)| n)
            .sum::<u64>();
        eprintln!("{name}: {blocked} us in ppoll, {named} named");
        assert!(blocked >= 1_500_000, "{report}");
        assert_eq!(named, blocked, "{report}");
    }
}

/// Waits on a lock file (`flock`), a terminal and a child's output, begun
/// while rprof records (walked in BPF): each named by the path its
/// descriptor has, the pipe by the child at its other end.
#[test]
fn file_device_and_pipe_waits_walked_as_they_begin() {
    let mut target = Ruby::host().spawn("file_waits.rb", &[]);
    let _lock = Removed(target.get("lock_path").into());
    let rprof = common::attach(target.pid, &["-d", "2", "wall"]);
    // SAFETY: kill only sends a signal.
    assert_eq!(unsafe { libc::kill(target.pid as i32, libc::SIGUSR1) }, 0);
    let started = target.wait_line("started ", Duration::from_secs(10));
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let tid = |name: &str| {
        started
            .split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} in {started:?}"))
            .to_string()
    };
    // Begun just after rprof started: most of the 2 s (measured 1.99-2.00
    // s, idle and beside four CPU burners), at least 1 s.
    assert_file_waits_named(&run, &target, tid, 1_000_000);
}

/// The same waits under way before rprof looks: stack and descriptor read
/// from userspace.
#[test]
fn file_device_and_pipe_waits_under_way() {
    let target = Ruby::host().spawn("file_waits.rb", &["parked"]);
    let _lock = Removed(target.get("lock_path").into());
    // flock (73), the terminal's and pipe's ppoll (271), poll (7) or
    // read (0), and the select's pselect6 (270) or select (23).
    wait_in_call(
        &target,
        &[
            "flocker",
            "ttyreader",
            "popenreader",
            "selector",
            "pipelinereader",
        ],
        &[73, 271, 7, 0, 270, 23],
    );
    let run = record(target.pid, &["-d", "2", "wall"]);
    assert!(run.success, "{}", run.stderr);
    assert_file_waits_named(&run, &target, |name| target.get(name).to_string(), 1_900_000);
}

/// Waits until each of `target`'s threads `names` is blocked in one of the
/// system calls `calls` (x86-64 numbers), for up to 10 s.
fn wait_in_call(target: &Target, names: &[&str], calls: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    for name in names {
        let syscall = format!("/proc/{}/task/{}/syscall", target.pid, target.get(name));
        let in_call = || {
            std::fs::read_to_string(&syscall).is_ok_and(|s| {
                s.split_whitespace()
                    .next()
                    .and_then(|n| n.parse().ok())
                    .is_some_and(|n: u32| calls.contains(&n))
            })
        };
        while !in_call() {
            assert!(Instant::now() < deadline, "{name} is not in {calls:?} after 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// A file removed when dropped.
struct Removed(std::path::PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The process of `target`'s pipeline (file_waits.rb) that writes the pipe
/// it reads: the one of the shell's commands whose output the pipe is (the
/// shell holds it too).
fn pipeline_writer(target: &Target) -> String {
    let pipe = std::fs::read_link(format!("/proc/{}/fd/{}", target.pid, target.get("pipeline_fd")))
        .expect("the pipeline's pipe");
    let shell: u32 = target.get("pipeline_pid").parse().expect("a pid");
    let writers: Vec<u32> = common::children_of(shell)
        .into_iter()
        .filter(|c| std::fs::read_link(format!("/proc/{c}/fd/1")).is_ok_and(|l| l == pipe))
        .collect();
    assert_eq!(writers.len(), 1, "the pipeline's writers: {writers:?}");
    writers[0].to_string()
}

/// file_waits.rb's five threads (their ids by `tid`) blocked at least
/// `at_least` us, every wait named by its object, under its method.
fn assert_file_waits_named(run: &common::Run, target: &Target, tid: impl Fn(&str) -> String, at_least: u64) {
    let lock = target.get("lock_path");
    let tty = target.get("tty_path");
    let child = target.get("child_pid");
    for (name, method, calls, object) in [
        (
            "flocker",
            "Object#wait_flock",
            &["flock"][..],
            format!("file {lock}"),
        ),
        (
            "ttyreader",
            "Object#read_tty",
            &["ppoll", "poll", "read"][..],
            format!("device {tty}"),
        ),
        (
            "popenreader",
            "Object#read_child",
            &["ppoll", "poll", "read"][..],
            format!("pipe with cat [{child}]"),
        ),
        (
            "selector",
            "Object#select_child",
            &["pselect6", "select"][..],
            format!("pipe with cat [{child}]"),
        ),
        (
            "pipelinereader",
            "Object#read_pipeline",
            &["ppoll", "poll", "read"][..],
            format!("pipe with cat [{}]", pipeline_writer(target)),
        ),
    ] {
        let f = run.folded.of_thread(&tid(name));
        let report = format!("{name}:\n{}", stacks_of(&f));
        let blocked = in_state(&f, |l| {
            calls.iter().any(|c| l.starts_with(&format!("[blocked: {c} (")))
        });
        let named = f
            .stacks
            .iter()
            .filter(|(s, _)| {
                s.last()
                    .is_some_and(|l| calls.iter().any(|c| l == &format!("[blocked: {c} ({object})]")))
                    && s.iter().any(|fr| label(fr) == method)
            })
            .map(|(_, n)| n)
            .sum::<u64>();
        eprintln!("{name}: {blocked} us blocked, {named} named");
        assert!(blocked >= at_least, "{report}");
        assert_eq!(named, blocked, "{report}");
    }
}

/// A backend that answers each connection's byte with one, `delay` later.
fn slow_backend(delay: Duration) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a backend port");
    let port = listener.local_addr().expect("its address").port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let mut b = [0u8];
                if conn.read_exact(&mut b).is_ok() {
                    std::thread::sleep(delay);
                    let _ = conn.write_all(&b);
                }
            });
        }
    });
    port
}

/// Debian's puma with `config` (from tests/ruby) serving wall_app.ru, its
/// handler's backend on port `backend`, once its master said "ready".
fn puma(config: &str, backend: u16) -> (Target, u16) {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let scripts = common::scripts_dir();
    let server = Target::start(
        Command::new("puma")
            .arg("-C")
            .arg(scripts.join(config))
            .arg(scripts.join("wall_app.ru"))
            .env("PORT", port.to_string())
            .env("BACKEND_PORT", backend.to_string())
            .env("RACK_ENV", "none"),
    );
    (server, port)
}

/// The handler burns 30 ms of CPU, then waits 70 ms (`path`: on the backend,
/// or asleep), one request at a time (wrk, one connection): of the handler's
/// time running vs in its wait, 30/70 within 5 points, and the wait is under
/// the method that waits. (Time ready to run but not running, on a busy
/// machine, is neither: the 30 ms are of CPU time.)
fn handler_shares(path: &str, waits: &str, in_wait: &IsWait, busy: bool) {
    let backend = slow_backend(Duration::from_millis(70));
    let (mut server, port) = puma("puma_single.rb", backend);
    server.wait_line("* Listening", Duration::from_secs(60));
    let mut wrk = Command::new("wrk")
        // Longer than any recording below (rprof's start may take seconds on
        // a busy machine); stopped once it has ended.
        .args(["-t", "1", "-c", "1", "-d", "100s"])
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .stdout(Stdio::null())
        .spawn()
        .expect("start wrk (apt-get install wrk)");
    std::thread::sleep(Duration::from_secs(1)); // the first requests
    let _busy = busy.then(Busy::start);
    let run = record(server.pid, &["-d", "3", "wall"]);
    let _ = wrk.kill();
    let _ = wrk.wait();
    assert!(run.success, "{}", run.stderr);
    // A wait on wrk's connection is called by the port Puma accepted it on,
    // not by wrk's passing port; the backend, by its address.
    let sockets: Vec<&String> = run
        .folded
        .stacks
        .iter()
        .filter_map(|(s, _)| s.last())
        .filter(|l| l.contains("(socket "))
        .collect();
    let (accepted, backend_at) = (
        format!("(socket accepted on port {port})]"),
        format!("(socket 127.0.0.1:{backend})]"),
    );
    assert!(
        sockets
            .iter()
            .all(|l| l.ends_with(&accepted) || l.ends_with(&backend_at)),
        "{sockets:?}"
    );
    eprintln!("{path}: socket waits {sockets:?}");
    let handler = Folded {
        stacks: run
            .folded
            .stacks
            .iter()
            .filter(|(s, _)| s.iter().any(|f| label(f) == "WallApp#call"))
            .cloned()
            .collect(),
    };
    let on_cpu = in_state(&handler, |l| l == "[running]");
    let waiting: u64 = handler
        .stacks
        .iter()
        .filter(|(s, _)| s.last().is_some_and(|l| in_wait(l, backend)) && s.iter().any(|f| label(f) == waits))
        .map(|(_, n)| n)
        .sum();
    let share = 100.0 * on_cpu as f64 / (on_cpu + waiting).max(1) as f64;
    let lines: Vec<String> = handler
        .stacks
        .iter()
        .map(|(s, n)| format!("{n} {}", s.join(";")))
        .collect();
    eprintln!(
        "{path}: running {share:.1}% of {:.3} s",
        (on_cpu + waiting) as f64 / 1e6
    );
    // Requests in the 3 s: each is 30 ms running and 70 ms waiting, so a few
    // give the share. Measured 2.9-3.0 s of them idle, 1.1-1.8 s with every
    // CPU busy (wrk and Puma get less of it); at least 5 are asked.
    assert!(
        (on_cpu + waiting) as f64 / 1e6 >= 0.5 && (25.0..=35.0).contains(&share),
        "{path}: running {share:.1}% of the handler's time (30% expected):\n{}",
        lines.join("\n")
    );
}

#[test]
fn a_puma_handler_waiting_on_a_backend() {
    handler_shares(
        "/backend",
        "WallApp#fetch",
        &|l, backend| {
            // What it waits on, too: the backend's socket, by its address.
            ["read", "poll", "ppoll", "recvfrom"]
                .iter()
                .any(|call| l == format!("[blocked: {call} (socket 127.0.0.1:{backend})]"))
        },
        false,
    );
}

#[test]
fn a_puma_handler_sleeping() {
    handler_shares("/sleep", "WallApp#nap", &|l, _| l == "[sleeping]", false);
}

/// Every CPU busy besides: the handler is often ready but not running.
#[test]
fn a_puma_handler_on_a_busy_machine() {
    handler_shares("/sleep", "WallApp#nap", &|l, _| l == "[sleeping]", true);
}

/// pprof: a `wall` sample type in nanoseconds whose total is every thread's
/// time, and a `state` label on each sample.
#[test]
fn wall_in_pprof() {
    let target = Ruby::host().spawn("wall_states.rb", &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let pb = dir.path().join("wall.pb.gz");
    let pid = target.pid.to_string();
    let out = common::rprof(&[
        "record",
        "-p",
        &pid,
        "-d",
        "2",
        "-o",
        pb.to_str().expect("utf8"),
        "wall",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let raw = go_pprof(&pb, &["-raw"]);
    assert!(raw.contains("wall/nanoseconds"), "{raw}");
    let tags = go_pprof(&pb, &["-tags"]);
    for state in [
        "[sleeping]",
        "[waiting: Queue#pop]",
        "[waiting for the GVL]",
        "[running]",
    ] {
        assert!(tags.contains(state), "no state {state} among the labels: {tags}");
    }
    // Fourteen threads alive for the whole 2 s.
    let total: f64 = raw
        .lines()
        .skip_while(|l| !l.starts_with("Samples:"))
        .skip(2)
        .take_while(|l| !l.starts_with("Locations"))
        .filter_map(|l| {
            l.split_whitespace()
                .next()?
                .strip_suffix(':')?
                .parse::<f64>()
                .ok()
        })
        .sum();
    assert!(
        (total / 1e9 - 28.0).abs() <= 0.05 * 28.0,
        "{total} ns in all: {raw}"
    );
}

/// CLOCK_BOOTTIME in seconds: the clock of the start times /proc gives.
fn boot_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// When each thread of `pid` started (boot_seconds), by thread id: field 22
/// of its stat, in clock ticks.
fn thread_starts(pid: &str) -> std::collections::BTreeMap<String, f64> {
    // SAFETY: sysconf only reads a constant.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap_or_else(|e| panic!("threads of {pid}: {e}"))
        .filter_map(|t| t.ok()?.file_name().into_string().ok())
        .filter_map(|tid| {
            let fields = common::stat_fields(&format!("/proc/{pid}/task/{tid}/stat"));
            Some((tid, fields.get(19)?.parse::<f64>().ok()? / tick))
        })
        .collect()
}

/// Microseconds of each thread of process `pid` (the innermost process
/// frame), by thread id (the thread frame's "[TID]").
fn per_thread(run: &common::Run, pid: &str) -> std::collections::BTreeMap<String, u64> {
    let mut threads = std::collections::BTreeMap::new();
    for (stack, n) in &run.folded.stacks {
        if common::process_of(stack) != Some(pid) {
            continue;
        }
        let frame = stack
            .iter()
            .find(|f| !f.starts_with("process "))
            .expect("a thread frame");
        let tid = frame
            .rsplit_once('[')
            .and_then(|(_, t)| t.strip_suffix(']'))
            .unwrap_or_else(|| panic!("no thread id in {frame:?}"));
        *threads.entry(tid.to_string()).or_default() += n;
    }
    threads
}

/// A Puma cluster (2 workers, 2 threads each) under no load, recorded from
/// its master with --subprocesses for 4 s, while a worker is killed 1 s in
/// and Puma forks a replacement: every thread of every process is there,
/// the idle ones too, each for the time it lived while rprof recorded (the
/// killed worker's to its death, the replacement's from its threads' start,
/// the rest the whole recording), within 5% of the recording as the issue
/// asks of the parked threads.
#[test]
fn every_thread_of_a_puma_cluster_whose_worker_is_killed_and_replaced() {
    const RECORDED: f64 = 4.0;
    let (mut server, _) = puma("puma.rb", 1);
    let workers: Vec<String> = (0..2)
        .map(|_| server.wait_line("worker ", Duration::from_secs(60))["worker ".len()..].to_string())
        .collect();
    let rprof = common::attach(server.pid, &["--subprocesses", "--processes", "-d", "4", "wall"]);
    let begun = boot_seconds();
    // The scenario's own time, not a wait for readiness: the worker dies 1 s in.
    std::thread::sleep(Duration::from_secs(1));
    let victim = workers[0].clone();
    let victim_threads = thread_starts(&victim);
    let died = boot_seconds();
    assert!(common::signal(victim.parse().expect("a pid"), libc::SIGKILL));
    let replacement = server.wait_line("worker ", Duration::from_secs(60))["worker ".len()..].to_string();
    // The threads alive near the recording's end (the replacement's pool
    // starts after it says it booted).
    let left = begun + RECORDED - 0.5 - boot_seconds();
    std::thread::sleep(Duration::from_secs_f64(left.max(0.0)));
    let master = server.pid.to_string();
    let lived: Vec<(String, std::collections::BTreeMap<String, f64>, f64)> = vec![
        (victim, victim_threads, died),
        (workers[1].clone(), thread_starts(&workers[1]), f64::MAX),
        (replacement.clone(), thread_starts(&replacement), f64::MAX),
        (master.clone(), thread_starts(&master), f64::MAX),
    ];
    let run = rprof.finish();
    assert!(run.success, "{}", run.stderr);
    let end = begun + RECORDED;
    for (pid, starts, death) in &lived {
        let got = per_thread(&run, pid);
        eprintln!("process {pid}: threads (us) {got:?}, started {starts:?}");
        if pid != &master {
            assert!(starts.len() >= 3, "worker {pid}: threads {starts:?}");
        }
        // Nor any thread /proc did not list (as the test this replaced
        // checked every thread recorded): Puma starts none after it boots.
        let unlisted: Vec<&String> = got.keys().filter(|t| !starts.contains_key(*t)).collect();
        assert!(
            unlisted.is_empty(),
            "process {pid}: threads {unlisted:?} recorded, not in /proc: {got:?}"
        );
        for (tid, start) in starts {
            let want = end.min(*death) - start.max(begun);
            let s = got.get(tid).copied().unwrap_or(0) as f64 / 1e6;
            assert!(
                (s - want).abs() <= 0.05 * RECORDED,
                "process {pid}: thread {tid}: {s:.3} s, lived {want:.3} s of the recording: {got:?}: {}",
                run.stderr
            );
        }
    }
}

/// 1,000 threads asleep since before rprof started: every one is read once
/// from userspace and shown asleep in its method for the whole recording.
#[test]
fn a_thousand_idle_threads() {
    a_thousand_idle_threads_on(&Ruby::host());
}

/// Ruby 2.7 finds a thread's EC in the VM's thread list: read once a sweep
/// (once per thread, the first sweep took 3 s here, and every thread's
/// total came out at 6 s for 3).
#[test]
fn a_thousand_idle_threads_ruby_2_7() {
    a_thousand_idle_threads_on(&Ruby::named("2.7"));
}

fn a_thousand_idle_threads_on(ruby: &Ruby) {
    let target = ruby.spawn("many_threads.rb", &["1000"]);
    let run = record(target.pid, &["-d", "3", "wall"]);
    assert!(run.success, "{}", run.stderr);
    let mut threads: std::collections::BTreeMap<&str, (u64, u64)> = Default::default();
    for (stack, n) in &run.folded.stacks {
        let t = threads.entry(stack[0].as_str()).or_default();
        t.0 += n;
        if stack.last().is_some_and(|l| l == "[sleeping]") && stack.iter().any(|f| label(f) == "Object#idle")
        {
            t.1 += n;
        }
    }
    let asleep = threads
        .values()
        .filter(|(total, idle)| (*total as f64 / 1e6 - 3.0).abs() <= 0.15 && *idle * 100 >= total * 99)
        .count();
    assert!(
        asleep >= 1000,
        "{asleep} of {} threads asleep for 3 s in Object#idle: {}",
        threads.len(),
        run.stderr
    );
}

/// `f`'s stacks, a line each, for an assertion's message.
fn stacks_of(f: &Folded) -> String {
    let lines: Vec<String> = f
        .stacks
        .iter()
        .map(|(s, n)| format!("{n} {}", s.join(";")))
        .collect();
    lines.join("\n")
}

/// Context switches of thread `tid` of `pid` so far.
fn switches(pid: u32, tid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).unwrap_or_default();
    status
        .lines()
        .filter(|l| l.contains("ctxt_switches:"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
        .sum()
}

/// A storm of short waits (wall_storm.rb): too many to walk each one's
/// stack, so a sample is walked; the pinger's time still adds up, and splits
/// between its two methods as its own clock says (wait_b's waits are a
/// quarter of the calls, and longer: a sample by count would miss).
fn short_waits(pinned: bool) {
    let mut target = Ruby::host().spawn("wall_storm.rb", &[]);
    if pinned {
        // On one CPU the two threads hand it to each other directly.
        let pinning = Command::new("taskset")
            .args(["-a", "-p", "-c", "0", &target.pid.to_string()])
            .output()
            .expect("run taskset");
        assert!(pinning.status.success(), "taskset: {pinning:?}");
    }
    let pinger = target.get("pinger").to_string();
    // The pinger's own totals around the recording (printed every 0.1 s).
    let ns = |times: &str, key: &str| -> f64 {
        times
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {times}"))
    };
    let recording = common::attach(target.pid, &["-d", "3", "-F", "999", "wall"]);
    let times_before = target.latest_line("times", Duration::from_secs(5));
    let (before, started) = (switches(target.pid, &pinger), std::time::Instant::now());
    let run = recording.finish();
    let rate = (switches(target.pid, &pinger) - before) as f64 / started.elapsed().as_secs_f64();
    assert!(run.success, "{}", run.stderr);
    let times_after = target.latest_line("times", Duration::from_secs(5));
    let (a_ns, b_ns) = (
        ns(&times_after, "a=") - ns(&times_before, "a="),
        ns(&times_after, "b=") - ns(&times_before, "b="),
    );
    let truth_a = 100.0 * a_ns / (a_ns + b_ns);
    let f = run.folded.of_thread(&pinger);
    let report = stacks_of(&f);
    // Fewer than this many switches a second, every wait would be walked.
    assert!(
        rate >= 5_000.0,
        "the pinger switched {rate:.0} times a second: no storm\n{report}"
    );
    let total = f.total() as f64 / 1e6;
    assert!(
        (total - 3.0).abs() <= 0.15,
        "pinger's total {total:.3} s\n{report}"
    );
    let time_in = |method: &str| -> u64 {
        f.stacks
            .iter()
            .filter(|(s, _)| s.iter().any(|fr| label(fr) == method))
            .map(|(_, n)| n)
            .sum()
    };
    let (a, b) = (time_in("Object#wait_a"), time_in("Object#wait_b"));
    let share_a = 100.0 * a as f64 / (a + b).max(1) as f64;
    let unsampled: u64 = f
        .stacks
        .iter()
        .filter(|(s, _)| s.iter().any(|fr| fr == "[short waits: stack not sampled]"))
        .map(|(_, n)| n)
        .sum();
    let unsampled = 100.0 * unsampled as f64 / f.total().max(1) as f64;
    eprintln!(
        "short waits (pinned {pinned}): {rate:.0} switches/s, total {total:.3} s, under wait_a {share_a:.1}% (its clock: {truth_a:.1}%), unsampled {unsampled:.2}%"
    );
    assert!(
        (share_a - truth_a).abs() <= 5.0,
        "{share_a:.1}% of the time under wait_a, by its own clock {truth_a:.1}%\n{report}"
    );
}

#[test]
fn short_waits_sampled_in_proportion() {
    short_waits(false);
}

#[test]
fn short_waits_on_one_cpu() {
    short_waits(true);
}

/// A job system (wall_jobs.rb): five threads whose CPU comes mostly in
/// short bursts after waits (decoding a query's rows, parsing a reply)
/// beside longer crunching. Each method's share of the running time is its
/// share by the threads' own CPU clocks. The jobs run ten times as fast as
/// the Sidekiq jobs they stand for, at 999 Hz: bursts as short beside the
/// sampling period as those are at 99 Hz, with ten times the samples (at
/// 99 Hz, 10 s of them vary by 1.5 points). Measured over 5 s: within 0.2 to
/// 1.5 points; giving a burst's time to the next sample's stack was 5.6 to
/// 9 points off (the decoding given to the crunching).
#[test]
fn running_time_stays_with_the_method_that_ran() {
    let mut target = Ruby::host().spawn("wall_jobs.rb", &["0.1"]);
    let methods = ["Object#query_db", "Object#http_call", "Object#crunch"];
    let cpu = |line: &str| -> Vec<f64> {
        let field = |key: &str| -> f64 {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
                .unwrap_or_else(|| panic!("no {key} in {line}"))
        };
        methods.iter().map(|m| field(&m["Object#".len()..])).collect()
    };
    let recording = common::attach(target.pid, &["-d", "5", "-F", "999", "wall"]);
    let before = cpu(&target.latest_line("cpu", Duration::from_secs(5)));
    let run = recording.finish();
    assert!(run.success, "{}", run.stderr);
    let after = cpu(&target.latest_line("cpu", Duration::from_secs(5)));
    let truth: Vec<f64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    let running: Vec<f64> = methods
        .iter()
        .map(|method| {
            let us: u64 = run
                .folded
                .stacks
                .iter()
                .filter(|(s, _)| {
                    s.last().is_some_and(|l| l == "[running]") && s.iter().any(|fr| label(fr) == *method)
                })
                .map(|(_, n)| n)
                .sum();
            us as f64
        })
        .collect();
    let share = |v: &[f64], i: usize| 100.0 * v[i] / v.iter().sum::<f64>().max(1.0);
    let report: Vec<String> = methods
        .iter()
        .enumerate()
        .map(|(i, m)| {
            format!(
                "{m} {:.1}% (its clock {:.1}%)",
                share(&running, i),
                share(&truth, i)
            )
        })
        .collect();
    eprintln!("running time by method: {}", report.join(", "));
    for (i, method) in methods.iter().enumerate() {
        assert!(
            (share(&running, i) - share(&truth, i)).abs() <= 3.0,
            "{method}'s share of the running time is not its CPU clock's: {}\n{}",
            report.join(", "),
            stacks_of(&run.folded)
        );
    }
}

/// A program that exits during the recording (exits.rb): each of its
/// threads counts the time it was recorded, not its life again as it ends.
#[test]
fn a_program_that_exits() {
    let target = Ruby::host().spawn("exits.rb", &[]);
    let run = record(target.pid, &["wall"]);
    assert!(run.success, "{}", run.stderr);
    let seconds: f64 = run
        .stderr
        .split(" in ")
        .nth(1)
        .and_then(|rest| rest.split('s').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no duration in: {}", run.stderr));
    let mut threads: std::collections::BTreeMap<&str, u64> = Default::default();
    for (stack, n) in &run.folded.stacks {
        *threads.entry(stack[0].as_str()).or_default() += n;
    }
    eprintln!("a program that exits: {seconds} s recorded, threads (us): {threads:?}");
    let spinner = format!("[{}]", target.get("spinner"));
    assert!(
        threads.keys().any(|t| t.ends_with(&spinner)),
        "no spinner {spinner} in {threads:?}"
    );
    for (thread, us) in &threads {
        let s = *us as f64 / 1e6;
        // The summary's duration is rounded to 0.1 s.
        assert!(
            s <= seconds + 0.1,
            "{thread}: {s:.3} s of a {seconds} s recording: {threads:?}"
        );
    }
}

/// A detach that takes seconds (a busy kernel's, stood in for by
/// RPROF_DETACH_DELAY_MS) adds nothing: every thread's time is the
/// recording's, on CPU or not. Before BPF stopped counting at the stop, two
/// `wall` recordings of storms side by side gave a thread 3.6, 5.5 and 15.8 s
/// of a 3 s recording.
#[test]
fn a_slow_detach_adds_nothing() {
    let target = Ruby::host().spawn("wall_states.rb", &[]);
    let run = common::attach_with_env(
        target.pid,
        &["-d", "2", "wall"],
        &[("RPROF_DETACH_DELAY_MS", "1500")],
    )
    .finish();
    assert!(run.success, "{}", run.stderr);
    for name in ["cpu1", "sleeper", "reader", "locker", "main"] {
        let total = thread(&run.folded, &target, name).total() as f64 / 1e6;
        // As parked_threads: within 5% of the recording (rprof's start).
        assert!(
            (total - 2.0).abs() <= 0.1,
            "{name}: {total:.3} s of a 2 s recording"
        );
    }
}

/// `wall --kernel`: a wait's stack ends in the kernel frames of the call
/// that blocked (wall_storm.rb's pinger, whose waits begin while rprof
/// records: their stacks are walked as the thread leaves the CPU).
#[test]
fn kernel_frames_of_the_blocking_call() {
    let target = Ruby::host().spawn("wall_storm.rb", &[]);
    let run = record(target.pid, &["-d", "2", "--kernel", "wall"]);
    assert!(run.success, "{}", run.stderr);
    let f = run.folded.of_thread(target.get("pinger"));
    let report = stacks_of(&f);
    // The frames between the Ruby method and the state: the kernel's.
    let kernel_of = |s: &[String]| -> Vec<String> {
        s.iter()
            .rev()
            .skip(1)
            .take_while(|fr| fr.ends_with("_[k]"))
            .map(|fr| fr.trim_end_matches("_[k]").to_string())
            .collect()
    };
    let (mut blocked, mut with_call) = (0u64, 0u64);
    for (s, n) in &f.stacks {
        let Some(state) = s.last() else { continue };
        let call = match state.as_str() {
            "[blocked: poll (pipe)]" | "[blocked: ppoll (pipe)]" => "poll",
            "[blocked: read (pipe)]" => "read",
            _ => continue,
        };
        blocked += n;
        let kernel = kernel_of(s);
        // Root first: the system call's entry, then the call itself.
        if kernel.last().is_some_and(|k| k.starts_with("entry_SYSCALL"))
            && kernel.iter().any(|k| k.contains(&format!("sys_{call}")))
        {
            with_call += n;
        }
    }
    assert!(
        blocked > 500_000,
        "the pinger blocked on its pipe for {blocked} us:\n{report}"
    );
    eprintln!(
        "kernel frames: {:.2}% of {blocked} us blocked on the pipe",
        100.0 * with_call as f64 / blocked as f64
    );
    // Measured: 99.91-99.95% in 4 runs (the rest: waits whose stack rprof
    // read from userspace, which has no kernel frames).
    assert!(
        with_call * 100 >= blocked * 95,
        "{with_call} of {blocked} us blocked with the call's kernel frames:\n{report}"
    );
}

/// A thread that runs in one method and always leaves the CPU in another
/// (run_then_sleep.rb): its running time is where it ran, which CPU samples
/// find, not where it blocks (counting each slice to the stack it left the
/// CPU in put most of it under `rest`).
#[test]
fn running_time_where_it_ran() {
    let target = Ruby::host().spawn("run_then_sleep.rb", &[]);
    // Until the worker has run 1.5 s, however busy the machine (a fixed 3 s
    // needs it to get half a CPU for the bound below).
    let run = common::record_threads_cpu("run_then_sleep.rb", target.pid, &["wall"], 1, 1.5);
    let f = run.folded.of_thread(target.get("worker"));
    let report = stacks_of(&f);
    let running_in = |method: &str| -> u64 {
        f.stacks
            .iter()
            .filter(|(s, _)| {
                s.last().is_some_and(|l| l == "[running]") && s.iter().any(|fr| label(fr) == method)
            })
            .map(|(_, n)| n)
            .sum()
    };
    let (work, rest) = (running_in("Object#work"), running_in("Object#rest"));
    let share = 100.0 * work as f64 / (work + rest).max(1) as f64;
    eprintln!("running time where it ran: {share:.1}% in work ({work} us), {rest} us in rest");
    // The thread spends 5 ms in work for each sleep; sleep's own Ruby code
    // runs for microseconds.
    assert!(work > 1_000_000, "{work} us running in work:\n{report}");
    assert!(
        share >= 90.0,
        "{share:.1}% of the running time in work:\n{report}"
    );
}

/// speedscope: a thread's profile is in time order, half a second (an
/// epoch) at a time. phases.rb's worker sleeps 1.5 s in `first`, then 1.5 s
/// in `second`, over and over: in its samples, in file order, the two
/// methods alternate in runs of at most a phase. Every phase holds a whole
/// epoch of its own (epochs are 0.5 s, a little more on a busy machine), so
/// two phases of one method never merge, whatever the order within the
/// epochs they share; a profile in stack order would have one run of each,
/// of about 2.5 s.
#[test]
fn speedscope_thread_in_time_order() {
    let target = Ruby::host().spawn("phases.rb", &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("wall.speedscope.json");
    let out = json.to_str().expect("utf-8 path");
    let pid = target.pid.to_string();
    let run = Command::new(common::RPROF)
        .args(["record", "-p", &pid, "-d", "5", "-o", out, "wall"])
        .output()
        .expect("run rprof");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("json")).expect("json");
    let frames: Vec<&str> = doc["shared"]["frames"]
        .as_array()
        .expect("frames")
        .iter()
        .map(|f| f["name"].as_str().expect("frame name"))
        .collect();
    let worker = format!("[{}]", target.get("worker"));
    let profile = doc["profiles"]
        .as_array()
        .expect("profiles")
        .iter()
        .find(|p| p["name"].as_str().is_some_and(|n| n.ends_with(&worker)))
        .expect("the worker's profile");
    let weights = profile["weights"].as_array().expect("weights");
    // (method, ns) runs, in file order.
    let mut runs: Vec<(&str, u64)> = Vec::new();
    for (sample, w) in profile["samples"]
        .as_array()
        .expect("samples")
        .iter()
        .zip(weights)
    {
        let names: Vec<&str> = sample
            .as_array()
            .expect("sample")
            .iter()
            .map(|i| frames[i.as_u64().expect("index") as usize])
            .collect();
        let Some(method) = ["Object#first", "Object#second"]
            .into_iter()
            .find(|m| names.iter().any(|n| n.starts_with(m)))
        else {
            continue;
        };
        let ns = w.as_u64().expect("weight");
        match runs.last_mut() {
            Some((m, total)) if *m == method => *total += ns,
            _ => runs.push((method, ns)),
        }
    }
    let report = format!(
        "runs (method, ms): {:?}",
        runs.iter()
            .map(|(m, ns)| (*m, ns / 1_000_000))
            .collect::<Vec<_>>()
    );
    eprintln!("{report}");
    // 5 s of 1.5 s phases: 4 or 5 runs, the first and last partial.
    assert!(runs.len() >= 4, "{report}");
    // A run is at most a phase: 1.5 s and the sleep's wakeup.
    assert!(runs.iter().all(|(_, ns)| *ns <= 1_600_000_000), "{report}");
}
