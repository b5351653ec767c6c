//! Shared by the integration tests: start real Ruby programs (on the host or
//! in a cached Debian chroot), wait for their "ready" line, run rprof on them
//! and read what it wrote.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

pub const RPROF: &str = env!("CARGO_BIN_EXE_rprof");

/// The directory holding the Ruby test programs.
pub fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ruby")
}

fn cache_dir() -> PathBuf {
    std::env::var_os("RPROF_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/rprof"))
}

/// A Ruby to run test programs with.
#[derive(Debug, Clone)]
pub struct Ruby {
    /// "3.1", "2.7", "3.1-static", ...
    pub name: String,
    /// Chroot the program runs in, if any.
    pub root: Option<PathBuf>,
    /// The ruby executable (inside the chroot, if any).
    pub exe: String,
    /// Environment it runs with (`RUBYOPT=--yjit`, `RUBY_MN_THREADS=1`).
    pub env: Vec<(String, String)>,
}

impl Ruby {
    /// Debian 12's ruby on the host.
    pub fn host() -> Ruby {
        Ruby {
            name: "3.1".into(),
            root: None,
            exe: "ruby".into(),
            env: Vec::new(),
        }
    }

    /// A Ruby the suite covers, by name: "2.7", "3.1", "3.1-static", "3.3",
    /// "3.4", "3.3-yjit" (run with YJIT on). A missing one fails loudly (run scripts/setup-rubies.sh, which
    /// `make test` does): no test is skipped for want of a Ruby.
    pub fn named(name: &str) -> Ruby {
        let cache = cache_dir();
        let chroot = |exe: &str| {
            let root = cache.join(format!("chroot-{name}"));
            assert!(
                root.join(".rprof-ready").exists(),
                "Ruby {name} chroot missing at {}: run scripts/setup-rubies.sh {name}",
                root.display()
            );
            Ruby {
                name: name.into(),
                root: Some(root),
                exe: exe.into(),
                env: Vec::new(),
            }
        };
        match name {
            "3.1" => Ruby::host(),
            "3.1-static" | "3.3-yjit" | "3.3-fp" => {
                let exe = cache.join(format!("ruby-{name}/bin/ruby"));
                assert!(
                    exe.exists(),
                    "Ruby {name} missing at {}: run scripts/setup-rubies.sh {name}",
                    exe.display()
                );
                let env = if name == "3.3-yjit" {
                    vec![("RUBYOPT".to_string(), "--yjit".to_string())]
                } else {
                    Vec::new()
                };
                Ruby {
                    name: name.into(),
                    root: None,
                    exe: exe.display().to_string(),
                    env,
                }
            }
            "2.7" | "3.3" => chroot("ruby"),
            "3.4" => chroot("ruby3.4"),
            other => panic!("no Ruby named {other}"),
        }
    }

    /// The path of a test script as this Ruby sees it (copied into the
    /// chroot, with the files it names with `require_relative "NAME"`).
    pub fn script_path(&self, script: &str) -> String {
        let src = scripts_dir().join(script);
        match &self.root {
            None => src.display().to_string(),
            Some(root) => {
                let dir = root.join("tmp/rprof-tests");
                std::fs::create_dir_all(&dir).expect("create script dir in chroot");
                std::fs::copy(&src, dir.join(script)).expect("copy script into chroot");
                let text = std::fs::read_to_string(&src).expect("read script");
                for helper in text
                    .lines()
                    .filter_map(|l| l.strip_prefix("require_relative \"")?.strip_suffix('"'))
                {
                    let file = format!("{helper}.rb");
                    std::fs::copy(scripts_dir().join(&file), dir.join(&file))
                        .expect("copy helper into chroot");
                }
                format!("/tmp/rprof-tests/{script}")
            }
        }
    }

    /// This Ruby's interpreter with `args` (run in its chroot, if any).
    pub fn interpreter(&self, args: &[&str]) -> Command {
        let mut cmd = match &self.root {
            None => Command::new(&self.exe),
            Some(root) => {
                let mut c = Command::new("chroot");
                c.arg(root).arg(&self.exe);
                c
            }
        };
        cmd.args(args);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// This Ruby running a test script with `args`.
    pub fn command(&self, script: &str, args: &[&str]) -> Command {
        let path = self.script_path(script);
        let mut cmd = self.interpreter(&[&path]);
        cmd.args(args);
        cmd
    }

    /// Builds the tests' C extension (tests/ruby/native_ext) with this
    /// Ruby's own mkmf and compiler (in its chroot, if any); returns its
    /// directory as this Ruby sees it.
    pub fn build_native_ext(&self) -> String {
        let src = scripts_dir().join("native_ext");
        let (host_dir, seen_as) = match &self.root {
            Some(root) => (
                root.join("tmp/rprof-tests/native_ext"),
                "/tmp/rprof-tests/native_ext".to_string(),
            ),
            None => {
                let safe: String = self
                    .name
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '.' {
                            c
                        } else {
                            '-'
                        }
                    })
                    .collect();
                let dir = std::env::temp_dir().join(format!("rprof-native-ext-{safe}"));
                let seen = dir.display().to_string();
                (dir, seen)
            }
        };
        let _ = std::fs::remove_dir_all(&host_dir);
        std::fs::create_dir_all(&host_dir).expect("extension build directory");
        for f in ["rprof_native.c", "extconf.rb"] {
            std::fs::copy(src.join(f), host_dir.join(f)).expect("copy the extension's source");
        }
        let script = format!("cd '{seen_as}' && '{}' extconf.rb && make", self.exe);
        let mut cmd = match &self.root {
            Some(root) => {
                let mut c = Command::new("chroot");
                c.arg(root).args(["sh", "-c", &script]);
                c
            }
            None => {
                let mut c = Command::new("sh");
                c.args(["-c", &script]);
                c
            }
        };
        let out = cmd.output().expect("run mkmf");
        assert!(
            out.status.success(),
            "Ruby {}: building the C extension failed: {}{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        seen_as
    }

    /// Starts `script` and waits for it to print a line starting with "ready".
    pub fn spawn(&self, script: &str, args: &[&str]) -> Target {
        let mut cmd = self.command(script, args);
        Target::start(&mut cmd)
    }
}

/// A running program, killed when dropped.
pub struct Target {
    pub child: Child,
    pub pid: u32,
    /// The words after "ready" on its ready line, as key=value pairs.
    pub info: BTreeMap<String, String>,
    /// What it printed before its ready line.
    pub before_ready: Vec<String>,
    lines: mpsc::Receiver<String>,
}

impl Target {
    pub fn start(cmd: &mut Command) -> Target {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the target");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let pid = child.id();
        let mut target = Target {
            child,
            pid,
            info: BTreeMap::new(),
            before_ready: Vec::new(),
            lines: rx,
        };
        let ready = target.wait_line("ready", Duration::from_secs(60));
        target.info = ready
            .split_whitespace()
            .skip(1)
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        target
    }

    /// Waits for a line starting with `prefix` and returns it.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> String {
        loop {
            match self.lines.recv_timeout(timeout) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(line) => self.before_ready.push(line),
                Err(_) => {
                    let status = self.child.try_wait();
                    panic!("target {} printed no line starting with {prefix:?} in {timeout:?} (status {status:?})", self.pid)
                }
            }
        }
    }

    /// The last line starting with `prefix` it has printed and no call has
    /// returned yet; waits for one if there is none.
    pub fn latest_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let mut latest = None;
        while let Ok(line) = self.lines.try_recv() {
            if line.starts_with(prefix) {
                latest = Some(line);
            } else {
                self.before_ready.push(line);
            }
        }
        latest.unwrap_or_else(|| self.wait_line(prefix, timeout))
    }

    /// Every line starting with `prefix` it printed, once its output is
    /// closed (it and every process it forked have ended).
    pub fn all_lines(&mut self, prefix: &str, timeout: Duration) -> Vec<String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => self.before_ready.push(line),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    panic!("target {} kept its output open for {timeout:?}", self.pid)
                }
            }
        }
        self.before_ready
            .iter()
            .filter(|l| l.starts_with(prefix))
            .cloned()
            .collect()
    }

    pub fn get(&self, key: &str) -> &str {
        self.info
            .get(key)
            .unwrap_or_else(|| panic!("ready line has no {key}=: {:?}", self.info))
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn rprof(args: &[&str]) -> Output {
    Command::new(RPROF).args(args).output().expect("run rprof")
}

/// Stacks from a folded file: frames root first, with counts.
#[derive(Debug, Default)]
pub struct Folded {
    pub stacks: Vec<(Vec<String>, u64)>,
}

impl Folded {
    /// The `n` heaviest stacks, a line each ("COUNT frame;frame;..."), for
    /// a failing assertion to show.
    pub fn heaviest(&self, n: usize) -> String {
        let mut lines: Vec<(u64, String)> = self.stacks.iter().map(|(s, c)| (*c, s.join(";"))).collect();
        lines.sort_by_key(|l| std::cmp::Reverse(l.0));
        let top: Vec<String> = lines.iter().take(n).map(|(c, s)| format!("{c} {s}")).collect();
        top.join("\n")
    }

    /// Frames labelled `frame_label` in each stack whose leaf is labelled `leaf`.
    pub fn depths(&self, frame_label: &str, leaf: &str) -> Vec<usize> {
        self.stacks
            .iter()
            .filter(|(s, _)| s.last().is_some_and(|f| label(f) == leaf))
            .map(|(s, _)| s.iter().filter(|f| label(f) == frame_label).count())
            .collect()
    }

    pub fn parse(text: &str) -> Folded {
        let stacks = text
            .lines()
            .filter(|l| !l.is_empty())
            .map(|l| {
                let (stack, count) = l.rsplit_once(' ').expect("folded line has a count");
                (
                    stack.split(';').map(str::to_string).collect(),
                    count.parse().expect("count"),
                )
            })
            .collect();
        Folded { stacks }
    }

    pub fn total(&self) -> u64 {
        self.stacks.iter().map(|(_, n)| n).sum()
    }

    /// Samples whose stack has a frame satisfying `pred`.
    pub fn count(&self, pred: impl Fn(&str) -> bool) -> u64 {
        self.stacks
            .iter()
            .filter(|(s, _)| s.iter().any(|f| pred(f)))
            .map(|(_, n)| n)
            .sum()
    }

    /// Samples of the thread whose root frame ends with `[tid]`.
    pub fn of_thread(&self, tid: &str) -> Folded {
        let suffix = format!("[{tid}]");
        self.only(|s| s[0].ends_with(&suffix))
    }

    /// The stacks that `keep` keeps.
    pub fn only(&self, keep: impl Fn(&[String]) -> bool) -> Folded {
        Folded {
            stacks: self.stacks.iter().filter(|(s, _)| keep(s)).cloned().collect(),
        }
    }
}

/// A frame's label: "label (path:line)" or "label (path)" (no line known)
/// -> "label" (labels may hold parentheses themselves: "block (2 levels) in
/// x (a.rb:3)").
pub fn label(frame: &str) -> &str {
    match frame.strip_suffix(')').and_then(|f| f.rsplit_once(" (")) {
        Some((l, loc)) if loc.contains(':') || loc.contains('/') || loc.ends_with(".rb") => l,
        _ => frame,
    }
}

/// A frame's line number, if it has one.
pub fn line(frame: &str) -> Option<u32> {
    let loc = frame.rsplit_once(" (")?.1.strip_suffix(')')?;
    loc.rsplit_once(':')?.1.parse().ok()
}

/// What rprof printed and wrote.
pub struct Run {
    pub folded: Folded,
    pub stderr: String,
    /// What a command rprof started printed (empty for `-p`).
    pub stdout: String,
    pub success: bool,
    pub code: Option<i32>,
}

impl Run {
    /// Nothing counted was lost: no event, and (`wall`) no time counted to
    /// a stack rprof had forgotten (the summary's `N ms lost`).
    pub fn assert_nothing_lost(&self, what: &str) {
        assert_eq!(self.summary("lost"), 0, "{what}: {}", self.stderr);
        assert!(!self.stderr.contains(" ms lost"), "{what}: {}", self.stderr);
    }

    /// A number from the summary line, e.g. `run.summary("lost")`, or from
    /// its notes in brackets (`run.summary("sent")`).
    pub fn summary(&self, what: &str) -> u64 {
        let line = self
            .stderr
            .lines()
            .find(|l| {
                [" samples, ", " events, ", " allocations, ", " switches, "]
                    .iter()
                    .any(|unit| l.contains(unit))
            })
            .unwrap_or_else(|| panic!("no summary line in {:?}", self.stderr));
        let words: Vec<&str> = line
            .split([',', ' ', ':', ';', '(', ')'])
            .filter(|w| !w.is_empty())
            .collect();
        let at = words
            .iter()
            .position(|w| *w == what)
            .unwrap_or_else(|| panic!("no {what} in {line:?}"));
        words[at - 1]
            .parse()
            .unwrap_or_else(|_| panic!("no number before {what} in {line:?}"))
    }
}

/// The PID of the innermost process frame of a stack (`process PID:"..."`):
/// the process the sample came from, with --processes.
pub fn process_of(stack: &[String]) -> Option<&str> {
    stack
        .iter()
        .rfind(|f| f.starts_with("process "))
        .and_then(|f| f["process ".len()..].split(':').next())
}

/// Sends `sig` to `pid`; whether it was sent (a process that ended gets
/// none, which most callers do not mind).
pub fn signal(pid: u32, sig: libc::c_int) -> bool {
    // SAFETY: kill only sends a signal.
    unsafe { libc::kill(pid as libc::pid_t, sig) == 0 }
}

/// A process this test stopped (SIGSTOP), continued when dropped.
pub struct Stopped(u32);

impl Stopped {
    pub fn new(pid: u32) -> Stopped {
        // A signal that failed silently would let a test pass untested.
        assert!(signal(pid, libc::SIGSTOP), "stopping {pid}");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(self.0, libc::SIGCONT);
    }
}

/// The processes whose parent is `pid`, now.
pub fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&child| {
            let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).unwrap_or_default();
            // The parent is the second field after the command name.
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok())
                == Some(pid)
        })
        .collect()
}

/// Records `pid` with `args` (and `env` for rprof) until `enough` says the
/// target has run what the test needs (polled every 20 ms; `Err` says how
/// far it got), for at most `limit` seconds (`what` names the target in the
/// failure): tests of a busy machine wait for the premise of their bounds,
/// not for a time that an idle machine needs. The recording must succeed.
pub fn record_until(
    what: &str,
    pid: u32,
    (args, env): (&[&str], &[(&str, &str)]),
    limit: u64,
    enough: impl FnMut() -> Result<(), String>,
) -> Run {
    stop_when(what, attach_with_env(pid, args, env), limit, enough)
}

/// Interrupts a recording once `enough` says so (at most `limit` s of wall
/// time); it must have succeeded.
pub fn stop_when(what: &str, rprof: Attached, limit: u64, enough: impl FnMut() -> Result<(), String>) -> Run {
    wait_for(what, limit, enough);
    stopped(what, rprof)
}

/// Ctrl-C, and what rprof recorded (it must end well).
pub fn stopped(what: &str, rprof: Attached) -> Run {
    rprof.interrupt();
    let run = rprof.finish();
    assert!(run.success, "{what}: {}", run.stderr);
    run
}

/// Waits until `enough` says so, at most `limit` s; what it says otherwise
/// is the failure's message.
pub fn wait_for(what: &str, limit: u64, mut enough: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(limit);
    while let Err(so_far) = enough() {
        assert!(Instant::now() < deadline, "{what}: in {limit} s, {so_far}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `record_until` the process has used `cpu` seconds of CPU (at most 100 s
/// of wall time).
pub fn record_cpu(what: &str, pid: u32, (args, env): (&[&str], &[(&str, &str)]), cpu: f64) -> Run {
    let mut all = vec!["-d", "120"];
    all.extend_from_slice(args);
    record_until(what, pid, (&all, env), 100, used_cpu(pid, cpu))
}

/// For `stop_when`: has process `pid` used `cpu` seconds of CPU since the
/// first call (just after rprof said it records: what it used while rprof
/// started gave no samples)?
pub fn used_cpu(pid: u32, cpu: f64) -> impl FnMut() -> Result<(), String> {
    let mut start = None;
    move || {
        let start = *start.get_or_insert_with(|| cpu_seconds(pid));
        let used = cpu_seconds(pid) - start;
        (used >= cpu)
            .then_some(())
            .ok_or_else(|| format!("it used {used:.2} s of CPU"))
    }
}

/// `record_until` each of the process's `n` busiest threads has used `cpu`
/// seconds of CPU since the recording began (at most 100 s of wall time):
/// for bounds on what each of several CPU-bound threads gets, which on a
/// busy machine share what the process gets unevenly.
pub fn record_threads_cpu(what: &str, pid: u32, args: &[&str], n: usize, cpu: f64) -> Run {
    let mut all = vec!["-d", "120"];
    all.extend_from_slice(args);
    // From the first call, once rprof records (see `used_cpu`).
    let mut start = None;
    record_until(what, pid, (&all, &[]), 100, || {
        let start = start.get_or_insert_with(|| threads_cpu_seconds(pid));
        let mut used: Vec<f64> = threads_cpu_seconds(pid)
            .iter()
            .map(|(tid, now)| now - start.get(tid).copied().unwrap_or(0.0))
            .collect();
        used.sort_by(|a, b| b.total_cmp(a));
        used.truncate(n);
        (used.len() == n && used.iter().all(|&u| u >= cpu))
            .then_some(())
            .ok_or_else(|| format!("its {n} busiest threads used {used:.2?} s of CPU"))
    })
}

/// The CPU seconds each live thread of a process has used so far, by
/// thread id.
pub fn threads_cpu_seconds(pid: u32) -> BTreeMap<String, f64> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap_or_else(|e| panic!("the threads of process {pid}: {e}"))
        .flatten()
        .filter_map(|t| t.file_name().into_string().ok())
        // A thread that ended since the listing has no stat to read.
        .filter_map(|tid| Some((tid.clone(), read_thread_cpu_seconds(pid, &tid)?)))
        .collect()
}

/// The CPU time a live process has used so far, all its threads (ended ones
/// too), in seconds: the kernel's own count, in nanoseconds.
pub fn cpu_seconds(pid: u32) -> f64 {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: only asks for the id of the process's CPU-time clock.
    let rc = unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) };
    assert_eq!(rc, 0, "the CPU clock of process {pid}");
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "the CPU time of process {pid}");
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// How much CPU a live process uses from now on.
pub struct CpuWatch {
    pid: u32,
    cpu: f64,
    began: Instant,
}

impl CpuWatch {
    pub fn start(pid: u32) -> CpuWatch {
        CpuWatch {
            pid,
            cpu: cpu_seconds(pid),
            began: Instant::now(),
        }
    }

    /// How many CPUs' worth it has used since `start`, on average.
    pub fn cpus(&self) -> f64 {
        self.seconds() / self.began.elapsed().as_secs_f64()
    }

    /// The CPU seconds it has used since `start`.
    pub fn seconds(&self) -> f64 {
        cpu_seconds(self.pid) - self.cpu
    }
}

/// Each watched process stopped (continued when its guard drops) and the
/// CPU seconds it used since its watch began: final while it stays stopped,
/// so a profiler stopped after this has sampled no CPU time beyond it.
pub fn stop_and_read(watches: &[CpuWatch]) -> (Vec<Stopped>, Vec<f64>) {
    let stopped = watches.iter().map(|w| Stopped::new(w.pid)).collect();
    (stopped, watches.iter().map(CpuWatch::seconds).collect())
}

/// The CPU time one thread of a live process has used so far, in seconds
/// (/proc's utime + stime, in clock ticks of 10 ms).
pub fn thread_cpu_seconds(pid: u32, tid: &str) -> f64 {
    read_thread_cpu_seconds(pid, tid).unwrap_or_else(|| panic!("the CPU time of thread {tid} of {pid}"))
}

/// `thread_cpu_seconds`, or None if the thread is gone.
fn read_thread_cpu_seconds(pid: u32, tid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a constant.
    Some(ticks as f64 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64)
}

/// The fields of a /proc stat file after the command name (which may hold
/// spaces and parentheses): the state first (field 3 of proc(5)).
pub fn stat_fields(path: &str) -> Vec<String> {
    let stat = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    stat.rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// What sampling at `hz` must give a target that used `cpu` seconds of CPU
/// while rprof recorded: a sample on every CPU every 1/hz s lands on the
/// target as often as it runs, so about cpu * hz, whatever else the machine
/// runs. When the target shares a CPU, whether a tick finds it running is a
/// coin toss: a binomial count, whose standard deviation is at most the
/// square root of the expected count; so the count is held to within 4 of
/// those, plus SAMPLES_SLACK of the expected count for the edges of the
/// window (the test reads the CPU time just after rprof says it records and
/// just after rprof ends). Measured (2026-11-25, the 24 assertions of the
/// tests calling this, once idle and once with `nice -n 0 sh -c 'while :;
/// do :; done'`): samples / expected 0.940 to 1.045, and `(samples -
/// expected) / sqrt(expected)` -1.02 to 0.61. A profile that loses or
/// doubles samples on a busy machine fails; one on a machine too busy to
/// run the target at all fails by saying so.
/// The kernel's CPU time runs short for a target that shares its CPU with
/// rprof: each wakeup of rprof that preempts it charges rprof from the
/// wakeup on, though the target runs until the switch (README, "A thread's
/// samples above its CPU time"). ci95 failed `sampling_at_10_khz_works` at
/// 1.098 (target at 0.72 of a CPU); with the target and rprof pinned to
/// one CPU at 10 kHz, 1.069 to 1.073 while rprof woke every 50-200 µs, and
/// 1.024 to 1.029 since it wakes every 100-400 µs at most (2026-11-28).
pub fn assert_samples_match_cpu(samples: u64, cpu: f64, hz: f64, what: &str) {
    let expected = cpu * hz;
    let sd = expected.sqrt();
    eprintln!(
        "{what}: {samples} samples for {cpu:.3} s of CPU at {hz} Hz: {:.3} of {expected:.0}, z {:.2}",
        samples as f64 / expected,
        (samples as f64 - expected) / sd
    );
    assert!(
        expected >= 50.0,
        "{what}: the target got only {cpu:.3} s of CPU while rprof recorded, too little to judge"
    );
    let low = expected * (1.0 - SAMPLES_SLACK) - 4.0 * sd;
    let high = expected * (1.0 + SAMPLES_SLACK) + 4.0 * sd;
    assert!(
        (low..=high).contains(&(samples as f64)),
        "{what}: {samples} samples, where {cpu:.3} s of CPU at {hz} Hz gives {expected:.0} \
         ({low:.0} to {high:.0})"
    );
}

/// The edges of a measured window, as a share of its expected samples (see
/// `assert_samples_match_cpu`).
pub const SAMPLES_SLACK: f64 = 0.05;

/// `attach` to several live targets for `seconds`, each with the CPU time
/// it used from rprof's "recording" line (its sampling has begun) to its
/// stop: the targets are stopped (SIGSTOP) before their CPU time is read and
/// rprof is stopped, so that none runs, unsampled, while rprof ends.
pub fn record_with_cpu(pids: &[u32], args: &[&str], seconds: f64) -> (Run, Vec<f64>) {
    let others: Vec<String> = pids[1..].iter().map(|p| p.to_string()).collect();
    let mut all: Vec<&str> = others.iter().flat_map(|p| ["-p", p.as_str()]).collect();
    all.extend_from_slice(args);
    let rprof = attach(pids[0], &all);
    let watches: Vec<CpuWatch> = pids.iter().map(|&p| CpuWatch::start(p)).collect();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let (stopped, cpu) = stop_and_read(&watches);
    rprof.interrupt();
    let run = rprof.finish();
    drop(stopped);
    (run, cpu)
}

/// Runs `rprof record -p PID ARGS... --format folded -o TMP` and reads the result.
pub fn record(pid: u32, args: &[&str]) -> Run {
    record_with_env(pid, args, &[])
}

/// `record`, with extra environment variables for rprof.
pub fn record_with_env(pid: u32, args: &[&str], env: &[(&str, &str)]) -> Run {
    let pid = pid.to_string();
    let mut all = vec!["-p", &pid];
    all.extend_from_slice(args);
    run_record(&all, env)
}

/// The layout file of Ruby `minor` ("3.3").
pub fn layout_text(minor: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("ruby-structs/layouts/{minor}.toml"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Processes burning every CPU, as on a saturated production box, until dropped.
pub struct Busy(Vec<Child>);

impl Busy {
    pub fn start() -> Self {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        Busy(
            (0..cpus)
                .map(|_| {
                    Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .expect("start a CPU burner")
                })
                .collect(),
        )
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `record`, and once rprof records, the machine saturated and rprof put at
/// the lowest CPU priority, so that it reads the target's memory late, often
/// GCs after the samples. (Starved from its start, rprof reads its first
/// records only after several GCs and cannot name what it has not read
/// before them: README, "Code churn".) Until the target has used `cpu`
/// seconds of CPU from then on.
pub fn record_starved(pid: u32, args: &[&str], cpu: f64) -> Run {
    let mut all = vec!["-d", "120"];
    all.extend_from_slice(args);
    let mut rprof = attach_with_env(pid, &all, &[("RPROF_SAY_NAMED", "1")]);
    rprof.wait_stderr("rprof: named a whole stack");
    renice_all(rprof.child.id(), 19);
    let busy = Busy::start();
    let what = format!("process {pid}, starved");
    wait_for(&what, 100, used_cpu(pid, cpu));
    // The burners end with the recording. Left to the end of the test, they
    // kept rprof (at nice 19) from seeing the interrupt for 5 to 80 s, and
    // from writing its output (2026-11-28: 8 to 84 s a test, a third of
    // frames.rs's time): more of the same starved recording, past what the
    // test asked for.
    drop(busy);
    stopped(&what, rprof)
}

/// Every thread of process `pid` (rprof) at nice `nice`.
fn renice_all(pid: u32, nice: i32) {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("rprof's threads") {
        let tid: libc::id_t = task
            .expect("a thread")
            .file_name()
            .to_str()
            .and_then(|t| t.parse().ok())
            .expect("a tid");
        // SAFETY: changes only the scheduling priority of one of rprof's threads.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
        assert_eq!(rc, 0, "renice rprof's thread {tid}");
    }
}

/// `rprof record --format folded -o TMP ARGS...`, the targets in ARGS.
pub fn record_args(args: &[&str]) -> Run {
    run_record(args, &[])
}

fn run_record(args: &[&str], env: &[(&str, &str)]) -> Run {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out.folded");
    // The tests look at each thread's stacks: a thread frame at their root.
    let mut all = vec![
        "record",
        "--threads",
        "--format",
        "folded",
        "-o",
        out.to_str().expect("utf8"),
    ];
    all.extend_from_slice(args);
    let output = Command::new(RPROF)
        .args(&all)
        .envs(env.iter().copied())
        .output()
        .expect("run rprof");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "rprof panicked: {stderr}");
    let folded = std::fs::read_to_string(&out)
        .map(|t| Folded::parse(&t))
        .unwrap_or_default();
    Run {
        folded,
        stderr,
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        success: output.status.success(),
        code: output.status.code(),
    }
}

/// `rprof record -p PID --format folded -o TMP ARGS...` running in the
/// background, once it has said it is recording.
pub struct Attached {
    pub child: Child,
    stderr: BufReader<std::process::ChildStderr>,
    /// Its stderr up to "recording".
    said: String,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

pub fn attach(pid: u32, args: &[&str]) -> Attached {
    attach_with_env(pid, args, &[])
}

pub fn attach_with_env(pid: u32, args: &[&str], env: &[(&str, &str)]) -> Attached {
    let mut all = vec!["--threads"];
    all.extend_from_slice(args);
    attach_merged_with_env(pid, &all, env)
}

/// `attach`, with rprof's default frames: threads merged.
pub fn attach_merged(pid: u32, args: &[&str]) -> Attached {
    attach_merged_with_env(pid, args, &[])
}

fn attach_merged_with_env(pid: u32, args: &[&str], env: &[(&str, &str)]) -> Attached {
    let mut all = vec!["-p".to_string(), pid.to_string()];
    all.extend(args.iter().map(|a| a.to_string()));
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    record_in_background(&all, env)
}

/// `rprof record --format folded ARGS...` in the background, once it has
/// said it records.
pub fn record_in_background(args: &[&str], env: &[(&str, &str)]) -> Attached {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out.folded");
    let file = out.to_str().expect("utf8 path").to_string();
    let mut all = vec!["record", "--format", "folded", "-o", &file];
    all.extend_from_slice(args);
    start_recording(&all, env, out, dir)
}

/// `rprof ARGS...` (a recording) in the background, once it has said it
/// records; `out` in `dir` is where its folded stacks are, if anywhere.
pub fn start_recording(
    args: &[&str],
    env: &[(&str, &str)],
    out: PathBuf,
    dir: tempfile::TempDir,
) -> Attached {
    start_command(Command::new(RPROF).args(args).envs(env.iter().copied()), out, dir)
}

/// `attach_with_env`, rprof started at nice `nice` (as `nice -n NICE rprof`).
pub fn attach_at_nice(pid: u32, args: &[&str], env: &[(&str, &str)], nice: i32) -> Attached {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("out.folded");
    let file = out.to_str().expect("utf8 path").to_string();
    let pid = pid.to_string();
    let nice = nice.to_string();
    let mut cmd = Command::new("nice");
    cmd.args(["-n", &nice, RPROF, "record", "--format", "folded", "-o", &file])
        .args(["-p", &pid, "--threads"])
        .args(args)
        .envs(env.iter().copied());
    start_command(&mut cmd, out, dir)
}

/// `cmd` (an rprof recording) started, once it has said it records.
fn start_command(cmd: &mut Command, out: PathBuf, dir: tempfile::TempDir) -> Attached {
    let mut child = cmd.stderr(Stdio::piped()).spawn().expect("start rprof");
    let mut stderr = BufReader::new(child.stderr.take().expect("stderr"));
    // What rprof says before the line that it records (RPROF_SAY_TABLES,
    // say) is kept for the run's stderr; that line is not.
    let mut said = String::new();
    loop {
        let mut line = String::new();
        let n = stderr.read_line(&mut line).expect("rprof announces itself");
        assert!(n > 0, "rprof ended before recording: {said}");
        if line.contains("recording") {
            break;
        }
        said.push_str(&line);
    }
    Attached {
        child,
        stderr,
        said,
        out,
        _dir: dir,
    }
}

impl Attached {
    /// Waits for rprof to print a line starting with `prefix` on stderr.
    pub fn wait_stderr(&mut self, prefix: &str) {
        let mut line = String::new();
        while !line.starts_with(prefix) {
            line.clear();
            let n = self.stderr.read_line(&mut line).expect("rprof's stderr");
            assert!(n > 0, "rprof ended without printing {prefix:?}");
        }
    }

    /// Ctrl-C.
    pub fn interrupt(&self) {
        // SAFETY: sending SIGINT to a child we started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
    }

    /// Waits for rprof to end and reads what it printed and wrote.
    pub fn finish(mut self) -> Run {
        let status = self.child.wait().expect("rprof ends");
        let mut stderr = std::mem::take(&mut self.said);
        std::io::Read::read_to_string(&mut self.stderr, &mut stderr).expect("stderr");
        assert!(!stderr.contains("panicked"), "rprof panicked: {stderr}");
        let folded = std::fs::read_to_string(&self.out)
            .map(|t| Folded::parse(&t))
            .unwrap_or_default();
        Run {
            folded,
            stderr,
            stdout: String::new(),
            success: status.success(),
            code: status.code(),
        }
    }
}

/// diff_work.rb N on the host's Ruby, recorded into `out` (a `.rprof` file)
/// until it has used `cpu` seconds of CPU, with `args` last (`-F 499 cpu`):
/// shares of a number of samples that does not depend on how busy the
/// machine is.
pub fn record_diff_work(n: &str, cpu: f64, out: &Path, args: &[&str]) {
    let target = Ruby::host().spawn("diff_work.rb", &[n]);
    let file = out.to_str().expect("utf8 path");
    let mut all = vec!["--format", "rprof", "-o", file];
    all.extend_from_slice(args);
    record_cpu_to(&format!("diff_work.rb {n}"), target.pid, &all, cpu);
}

/// `rprof record -p PID ARGS...`, whose ARGS say where its output goes, until
/// the process has used `cpu` seconds of CPU; it must succeed.
pub fn record_cpu_to(what: &str, pid: u32, args: &[&str], cpu: f64) -> Run {
    let pid_arg = pid.to_string();
    let mut all = vec!["record", "-p", &pid_arg, "-d", "120"];
    all.extend_from_slice(args);
    let dir = tempfile::tempdir().expect("tempdir");
    let rprof = start_recording(&all, &[], dir.path().join("none"), dir);
    let run = stop_when(what, rprof, 100, used_cpu(pid, cpu));
    assert!(!run.stderr.contains("panicked"), "{what}: {}", run.stderr);
    run
}

/// `go tool pprof ARGS FILE`, which must succeed; its output.
pub fn go_pprof(file: &Path, args: &[&str]) -> String {
    let out = Command::new("go")
        .args(["tool", "pprof"])
        .args(args)
        .arg(file)
        .env("HOME", std::env::temp_dir())
        .output()
        .expect("go tool pprof (Debian's golang-go; make test installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "go tool pprof failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}
