//! The recording loop: attach to a Ruby process, collect stacks until the
//! duration ends, Ctrl-C, or the target exits, and always write what was
//! collected, with counts of what was lost or failed.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use flamegraphs::{Frame, FrameKind, Profile, SvgOptions};
use serde::{Deserialize, Serialize};

use crate::bpf::{self, types, Probe, Record, Sample, Stats};
use crate::cli::Format;
use crate::error::UserError;
use crate::gc_time::{GcTime, SampleTime};
use crate::launch::{self, StopSignals};
use crate::process::Process;
use crate::processes::{Counts, Followed, ProcessId, Processes};
use crate::resolve::{self, NativeNames, RubyFrame, Unknown};
use crate::system;
use crate::target::RubyTarget;
use crate::unwind::{self, Unwinder};

/// Highest sampling frequency accepted.
pub const MAX_FREQUENCY: u64 = 100_000;
/// How often the in-kernel counts are collected.
const EPOCH: Duration = Duration::from_millis(500);
const POLL: Duration = Duration::from_millis(10);

pub enum Target {
    Pids(Vec<u32>),
    Command(Vec<String>),
}

pub enum EventSpec {
    Cpu {
        frequency: u64,
    },
    /// Tracepoints of the `syscalls` group, by their tracefs name (`sys_enter_getpid`).
    Syscalls(Vec<String>),
}

pub struct RecordConfig {
    pub target: Target,
    pub duration: Option<Duration>,
    pub event: EventSpec,
    pub output: Option<PathBuf>,
    pub format: Format,
    pub force_version: Option<String>,
    /// Run a launched command as root even under sudo.
    pub as_root: bool,
    /// Follow every process the targets fork, at any depth.
    pub subprocesses: bool,
    /// A root frame per process (`process PID:"command line"`), under its parent's.
    pub processes: bool,
    /// A frame per thread, under its process's.
    pub threads: bool,
    /// Native frames stitched with the Ruby ones.
    pub native: bool,
    /// Keep the interpreter's own native frames (no folding).
    pub native_all: bool,
    /// Kernel frames at the leaf.
    pub kernel: bool,
}

/// A recording as saved with `--format rprof`, re-rendered by `rprof report`.
#[derive(Serialize, Deserialize)]
pub struct Recording {
    pub rprof_version: String,
    pub pid: u32,
    pub ruby_version: String,
    pub event: String,
    pub samples: u64,
    pub lost: u64,
    pub failed: u64,
    pub profile: Profile,
}

/// Records until the duration ends, a stop signal, or the target exits.
/// Returns the exit status of the command rprof started, once it has ended.
pub fn record(cfg: RecordConfig) -> Result<Option<ExitStatus>> {
    system::check_privileges()?;
    system::check_btf()?;
    if let EventSpec::Cpu { frequency } = cfg.event {
        if frequency == 0 || frequency > MAX_FREQUENCY {
            return Err(UserError::BadFrequency {
                given: frequency,
                max: MAX_FREQUENCY,
            }
            .into());
        }
    }
    if let EventSpec::Syscalls(_) = cfg.event {
        system::tracefs()?;
    }

    let native_rows = cfg.native.then(|| {
        // RPROF_UNWIND_ROWS: room for more (or fewer) table rows in BPF.
        std::env::var("RPROF_UNWIND_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(unwind::DEFAULT_ROWS)
    });
    let mut probe = Probe::load(bpf::Options {
        native_rows,
        kernel: cfg.kernel,
    })?;
    let signals = StopSignals::install()?;
    let unwinder = native_rows.map(Unwinder::new);
    let mut processes = Processes::new(cfg.force_version.clone(), cfg.processes, unwinder);
    if cfg.subprocesses {
        probe.attach_process_tracking()?;
    }
    let event_names: Vec<String> = match &cfg.event {
        EventSpec::Cpu { .. } => vec!["cpu".to_string()],
        EventSpec::Syscalls(names) => names.clone(),
    };
    let mut collector = Collector::new(event_names.clone(), cfg.processes, cfg.threads);
    if cfg.native || cfg.kernel {
        collector.native = Some((NativeNames::default(), cfg.native_all));
    }
    let mut child = None;
    let mut roots = Vec::new();
    match &cfg.target {
        Target::Pids(pids) => {
            for &pid in pids {
                roots.push(add_root(&mut probe, &mut processes, pid, &cfg)?);
            }
            if cfg.subprocesses {
                for &pid in pids {
                    processes.adopt_descendants(&mut probe, pid)?;
                }
            }
        }
        Target::Command(argv) if cfg.subprocesses => {
            // Follow rprof's own forks while it starts the command, so the
            // command is followed from its first instruction.
            let me = Process::open(std::process::id())?;
            let my_start = me.start_ticks().context("reading rprof's own start time")?;
            probe.follow(me.pid, my_start)?;
            let c = launch::spawn(argv, cfg.as_root)?;
            signals.forward_to(c.id());
            probe.unfollow(me.pid);
            roots.push(format!("{} (pid {})", argv.join(" "), c.id()));
            child = Some(c);
        }
        Target::Command(argv) => {
            let (c, t) = launch(argv, &cfg, &signals)?;
            roots.push(describe(&t));
            processes.add_root(&mut probe, t, false)?;
            child = Some(c);
        }
    }
    let first_pid = match (&cfg.target, &child) {
        (_, Some(c)) => c.id(),
        (Target::Pids(pids), None) => pids[0],
        (Target::Command(_), None) => 0,
    };
    collector.warm(&processes, cfg.kernel);
    match &cfg.event {
        EventSpec::Cpu { frequency } => probe.attach_cpu_clock(*frequency)?,
        EventSpec::Syscalls(names) => {
            for (i, name) in names.iter().enumerate() {
                probe.attach_tracepoint("syscalls", name, i as u32 + 1)?;
            }
        }
    }

    let what = match &cfg.event {
        EventSpec::Cpu { frequency } => format!("sampling at {frequency} Hz"),
        EventSpec::Syscalls(names) => format!("tracing {}", names.join(", ")),
    };
    eprintln!(
        "rprof: recording {} {}{}, {what}; {}",
        if roots.len() == 1 { "process" } else { "processes" },
        roots.join(", "),
        if cfg.subprocesses {
            " and every process forked from it"
        } else {
            ""
        },
        match cfg.duration {
            Some(d) => format!("for {:.1}s (Ctrl-C to stop early)", d.as_secs_f64()),
            None => "Ctrl-C to stop".to_string(),
        }
    );

    let started = Instant::now();
    let mut epoch_started = Instant::now();
    // An error while recording still writes what was collected before it.
    let mut recording_error = None;
    loop {
        let step = (|| -> Result<bool> {
            let mut records = Vec::new();
            probe.poll(POLL, |r| records.push(r))?;
            for r in records {
                collector.on_record(r, &mut processes, &mut probe)?;
            }
            processes.inspect_pending(&mut probe)?;
            collector.warm(&processes, cfg.kernel);
            for f in processes.all() {
                if let Some(ruby) = &mut f.ruby {
                    ruby.resolver.tick();
                }
            }
            collector.retry(false, &mut processes);
            let command_ended = child
                .as_mut()
                .is_some_and(|c: &mut Child| matches!(c.try_wait(), Ok(Some(_))));
            if signals.stopped()
                || cfg.duration.is_some_and(|d| started.elapsed() >= d)
                || command_ended
                || (child.is_none() && !processes.any_alive())
            {
                return Ok(true);
            }
            if epoch_started.elapsed() >= EPOCH {
                collector.close_epoch(&mut probe, &mut processes, false)?;
                processes.sweep_ended(&mut probe, |f, u| collector.flush(f, u));
                processes.refresh_threads(&mut probe)?;
                epoch_started = Instant::now();
            }
            Ok(false)
        })();
        match step {
            Ok(false) => {}
            Ok(true) => break,
            Err(e) => {
                recording_error = Some(e);
                break;
            }
        }
    }
    probe.detach();
    if let Err(e) = collector.close_epoch(&mut probe, &mut processes, true) {
        recording_error.get_or_insert(e);
    }
    let stats = probe.stats().unwrap_or_default();
    let ruby_version = Vec::from_iter(processes.ruby_versions.iter().cloned()).join(", ");
    for f in processes.all() {
        probe.remove_process(f.id.pid);
    }
    let pid = first_pid;

    let output = cfg
        .output
        .clone()
        .unwrap_or_else(|| default_output(pid, cfg.format));
    let recording = collector.finish(pid, ruby_version, &stats, event_names.join(","));
    write_output(&recording, &output, cfg.format)?;
    let counts = cfg.subprocesses.then_some(processes.counts);
    let no_room = processes.native.as_ref().map_or(0, |u| u.no_room);
    print_summary(
        &recording,
        &stats,
        &collector,
        counts,
        no_room,
        &output,
        started.elapsed(),
    );
    if let Some(e) = recording_error {
        return Err(e.context("recording stopped early (what was collected is written)"));
    }
    let Some(mut c) = child else { return Ok(None) };
    if let Ok(Some(status)) = c.try_wait() {
        return Ok(Some(status));
    }
    if signals.stopped() {
        // The command got the signal too: wait for it as a shell would.
        return c.wait().map(Some).context("waiting for the command to exit");
    }
    eprintln!(
        "rprof: {} (pid {pid}) is still running",
        cfg_command_name(&cfg.target)
    );
    Ok(None)
}

/// `PID (exe, Ruby X.Y.Z)`, as the first line names a target.
fn describe(t: &RubyTarget) -> String {
    format!("{} ({}, Ruby {})", t.process.pid, t.process.exe_name(), t.version)
}

/// Starts profiling process `pid` given with -p. Under --subprocesses a
/// process that is not a Ruby rprof can read (a shell, a supervisor) is
/// followed, and its Ruby children are profiled.
fn add_root(probe: &mut Probe, processes: &mut Processes, pid: u32, cfg: &RecordConfig) -> Result<String> {
    match RubyTarget::inspect(pid, cfg.force_version.as_deref()) {
        Ok(t) => {
            let name = describe(&t);
            processes.add_root(probe, t, cfg.subprocesses)?;
            Ok(name)
        }
        Err(e)
            if cfg.subprocesses
                && matches!(e.downcast_ref::<UserError>(), Some(UserError::NotRuby { .. })) =>
        {
            let process = Process::open(pid)?;
            let start_ticks = process.start_ticks().ok_or(UserError::NoSuchProcess { pid })?;
            processes.add_followed_root(probe, ProcessId { pid, start_ticks })?;
            Ok(format!(
                "{pid} ({}, not Ruby: its children are followed)",
                process.exe_name()
            ))
        }
        Err(e) => Err(e),
    }
}

fn cfg_command_name(t: &Target) -> String {
    match t {
        Target::Command(argv) => argv.join(" "),
        Target::Pids(pids) => pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
    }
}

/// Starts the command and waits until its Ruby VM can be read.
fn launch(argv: &[String], cfg: &RecordConfig, signals: &StopSignals) -> Result<(Child, RubyTarget)> {
    let mut child = launch::spawn(argv, cfg.as_root)?;
    let pid = child.id();
    signals.forward_to(pid);
    let prog = &argv[0];
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match RubyTarget::inspect(pid, cfg.force_version.as_deref()) {
            Ok(t) if t.ready() => return Ok((child, t)),
            Ok(_) => {}
            Err(e) => {
                let user = e.downcast_ref::<UserError>();
                if matches!(user, Some(UserError::UnsupportedVersion(_))) || Instant::now() > deadline {
                    let _ = child.kill();
                    return Err(e);
                }
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(anyhow::Error::from(UserError::TargetGone { pid }))
                .with_context(|| format!("{prog} exited with {status}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Turns BPF's records and counts into a profile.
struct Collector {
    events: Vec<String>,
    /// A root frame per process.
    process_frames: bool,
    /// A frame per thread.
    thread_frames: bool,
    /// Resolved stacks by hash, with the generation they were last used in
    /// and whether a frame in them is unknown.
    stacks: HashMap<u64, (Vec<Frame>, u64, bool)>,
    generation: u64,
    profile: Profile,
    /// Counted events whose stack never reached userspace (ring buffer full).
    undelivered: u64,
    /// Frames shown as `[unknown]`, counted once per stack that has them, by reason.
    unknown_frames: HashMap<Unknown, u64>,
    /// Samples (events) with an `[unknown]` frame.
    unknown_samples: u64,
    /// Records waiting for the GC to stand still.
    deferred: Vec<Sample>,
    /// Records of processes rprof could not follow (a fork report lost).
    unfollowed: u64,
    /// Counts of closed epochs whose record still waits (see `close_epoch`).
    waiting_counts: HashMap<u64, u64>,
    /// Tests: say on stderr when the first stack is named whole
    /// (`RPROF_SAY_NAMED=1`), so that they can starve rprof from then on.
    say_named: bool,
    /// --native/--kernel: what names native frames, and whether to keep the
    /// interpreter's own (--native-all).
    native: Option<(NativeNames, bool)>,
    /// Ruby frames named whole, by what they are (see `name_ruby`); emptied
    /// every epoch.
    named_ruby: HashMap<u64, Rc<Vec<RubyFrame>>>,
}

impl Collector {
    fn new(events: Vec<String>, process_frames: bool, thread_frames: bool) -> Self {
        Self {
            events,
            process_frames,
            thread_frames,
            stacks: HashMap::new(),
            generation: 0,
            profile: Profile::default(),
            undelivered: 0,
            unknown_frames: HashMap::new(),
            unknown_samples: 0,
            deferred: Vec::new(),
            unfollowed: 0,
            waiting_counts: HashMap::new(),
            say_named: std::env::var_os("RPROF_SAY_NAMED").is_some(),
            native: None,
            named_ruby: HashMap::new(),
        }
    }

    /// Loads the native symbols of new files before their samples need them.
    fn warm(&mut self, processes: &Processes, kernel: bool) {
        if let (Some((names, _)), Some(unwinder)) = (&mut self.native, &processes.native) {
            names.warm(unwinder, kernel);
        }
    }

    /// A record from BPF: a stack, or a change in the followed processes.
    fn on_record(&mut self, r: Record, processes: &mut Processes, probe: &mut Probe) -> Result<()> {
        match r {
            Record::Sample(s) => {
                // Code loaded after rprof read the process's mappings.
                if s.header.native_stop == types::rprof_native_stop::RPROF_NATIVE_NO_MAPPING.0 {
                    processes.rescan_native(probe, s.header.pid);
                }
                match processes.get_with_native(s.header.pid, s.header.start_ticks) {
                    Some((f, unwinder)) => self.add_sample(s, f, unwinder, false),
                    None => self.unfollowed += 1,
                }
            }
            // An ending process's waiting records are named now, with what is known.
            Record::Process(e) => processes.on_event(probe, &e, |f, u| self.flush(f, u))?,
        }
        Ok(())
    }

    /// Tries again the records that met a busy GC, once their GC stands
    /// still (or for good, `now`).
    fn retry(&mut self, now: bool, processes: &mut Processes) {
        for s in std::mem::take(&mut self.deferred) {
            match processes.get_with_native(s.header.pid, s.header.start_ticks) {
                Some((f, unwinder)) => {
                    let settled = f.ruby.as_mut().is_some_and(|r| r.resolver.settled());
                    if now || settled {
                        self.add_sample(s, f, unwinder, true);
                    } else {
                        self.deferred.push(s);
                    }
                }
                None => self.unfollowed += 1,
            }
        }
    }

    /// Names for good the waiting records of `f`, which is ending.
    fn flush(&mut self, f: &mut Followed, unwinder: Option<&Unwinder>) {
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|s| s.header.pid == f.id.pid && s.header.start_ticks == f.id.start_ticks);
        self.deferred = rest;
        for s in mine {
            self.add_sample(s, f, unwinder, true);
        }
    }

    /// A record of process `f`. If the GC was busy while its frames were
    /// read, it waits (unless `last_try`) for the GC to stand still.
    fn add_sample(&mut self, s: Sample, f: &mut Followed, unwinder: Option<&Unwinder>, last_try: bool) {
        let (stack, unknown) = self.build_stack(&s, f, unwinder);
        if !last_try && unknown.contains(&Unknown::GcBusy) {
            self.deferred.push(s);
            return;
        }
        if s.has(types::rprof_sample_flags::RPROF_SAMPLE_DIRECT) {
            self.count_unknown(&unknown);
            self.unknown_samples += u64::from(!unknown.is_empty());
            self.profile.add(&stack, 1);
            return;
        }
        // The same hash means the same frames at the same GC time, so the same
        // objects: if an earlier reading named them all, it stands.
        if !unknown.is_empty() {
            if let Some((_, gen, false)) = self.stacks.get_mut(&s.header.hash) {
                *gen = self.generation;
                return;
            }
        }
        self.count_unknown(&unknown);
        // Counted in an epoch that closed while this record waited.
        if let Some(n) = self.waiting_counts.remove(&s.header.hash) {
            self.profile.add(&stack, n);
            if !unknown.is_empty() {
                self.unknown_samples += n;
            }
        }
        if self.say_named && unknown.is_empty() {
            eprintln!("rprof: named a whole stack");
            self.say_named = false;
        }
        self.stacks
            .insert(s.header.hash, (stack, self.generation, !unknown.is_empty()));
    }

    fn count_unknown(&mut self, unknown: &[Unknown]) {
        for u in unknown {
            *self.unknown_frames.entry(*u).or_default() += 1;
        }
    }

    /// Root first: processes, thread, [truncated], Ruby frames, then the traced event;
    /// and why frames could not be named.
    fn build_stack(
        &mut self,
        s: &Sample,
        f: &mut Followed,
        unwinder: Option<&Unwinder>,
    ) -> (Vec<Frame>, Vec<Unknown>) {
        let h = &s.header;
        let comm: Vec<u8> = h.comm.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let mut stack = Vec::with_capacity(s.frames.len() + 4);
        if self.process_frames {
            stack.extend(f.frames().into_iter().map(Frame::process));
        }
        let Some(ruby) = f.ruby.as_mut() else {
            stack.push(Frame::marker("[process not profiled]"));
            return (stack, Vec::new());
        };
        let resolver = &mut ruby.resolver;
        // An M:N Ruby thread moves between native threads: name it, not them.
        if self.thread_frames {
            stack.push(Frame::thread(if h.ruby_thread != 0 {
                resolver.ruby_thread(h.ruby_thread)
            } else {
                format!("{} [{}]", String::from_utf8_lossy(&comm), h.tid)
            }));
        }
        if s.has(types::rprof_sample_flags::RPROF_SAMPLE_READ_FAILED) {
            stack.push(Frame::marker("[failed to read the Ruby stack]"));
        } else if s.has(types::rprof_sample_flags::RPROF_SAMPLE_FOREIGN_EC) {
            stack.push(Frame::marker("[GVL released: Ruby stack unknown]"));
        }
        if s.has(types::rprof_sample_flags::RPROF_SAMPLE_TRUNCATED) {
            stack.push(Frame::marker("[truncated]"));
        }
        let (ruby, unknown) = self.name_ruby(s, resolver, unwinder);
        match &mut self.native {
            Some((names, all)) => stack.extend(resolve::stitched(
                names,
                unwinder,
                h.pid,
                &ruby,
                &s.native,
                h.native_stop,
                &s.kernel,
                *all,
            )),
            None => stack.extend(ruby.iter().rev().filter_map(|r| r.frame.clone())),
        }
        // A thread running no Ruby: without its thread frame (or native
        // frames), say so.
        if !self.thread_frames
            && s.frames.is_empty()
            && s.native.is_empty()
            && !stack.iter().any(|f| f.kind == FrameKind::Marker)
        {
            stack.push(Frame::marker("[no Ruby frames]"));
        }
        if h.event > 0 {
            let name = self
                .events
                .get(h.event as usize - 1)
                .map(|n| n.strip_prefix("sys_").unwrap_or(n).to_string())
                .unwrap_or_else(|| format!("event {}", h.event));
            stack.push(Frame::event(name));
        }
        (stack, unknown)
    }

    /// The sample's Ruby frames, named, leaf first, and why any could not be.
    /// Samples that differ only in their native frames (most, with --native)
    /// have the same Ruby frames at the same GC time, so the same objects:
    /// one naming serves them all, however late the later ones are read.
    fn name_ruby(
        &mut self,
        s: &Sample,
        resolver: &mut crate::resolve::Resolver,
        unwinder: Option<&Unwinder>,
    ) -> (Rc<Vec<RubyFrame>>, Vec<Unknown>) {
        use std::hash::{Hash, Hasher};
        let h = &s.header;
        let mut key = std::collections::hash_map::DefaultHasher::new();
        let time_flags = types::rprof_sample_flags::RPROF_SAMPLE_GC_EDGE.0
            | types::rprof_sample_flags::RPROF_SAMPLE_GC_MOVING.0;
        (h.pid, h.start_ticks, h.gc_time, h.flags & time_flags).hash(&mut key);
        for f in &s.frames {
            (f.iseq, f.pc, f.cme, f.flags).hash(&mut key);
        }
        let key = key.finish();
        if let Some(named) = self.named_ruby.get(&key) {
            return (named.clone(), Vec::new());
        }
        let time = if s.has(types::rprof_sample_flags::RPROF_SAMPLE_GC_EDGE) {
            SampleTime::at_edge(GcTime(h.gc_time))
        } else {
            SampleTime::at(GcTime(h.gc_time))
        };
        let frames = if s.has(types::rprof_sample_flags::RPROF_SAMPLE_GC_MOVING) {
            resolver.moving_stack(&s.frames, time)
        } else {
            resolver.stack(&s.frames, time)
        };
        let mut unknown = Vec::new();
        let mut ruby = Vec::with_capacity(frames.len());
        for (named, raw) in frames.into_iter().zip(&s.frames) {
            let frame = match named {
                Ok(frame) => Some(frame),
                Err(Unknown::NotAFrame) => None,
                Err(why) => {
                    unknown.push(why);
                    Some(Frame::marker("[unknown]"))
                }
            };
            // A C method's function, where its native frames start.
            let cfunc = (raw.iseq == 0).then(|| {
                let at = resolver.cfunc(raw.cme, time)?;
                let code = unwinder?.locate(h.pid, at)?;
                Some((code.file, code.vaddr))
            });
            ruby.push(RubyFrame {
                frame,
                finish: raw.flags & types::rprof_frame_flags::RPROF_FRAME_FINISH.0 != 0,
                cfunc,
            });
        }
        let ruby = Rc::new(ruby);
        if unknown.is_empty() {
            self.named_ruby.insert(key, ruby.clone());
        }
        (ruby, unknown)
    }

    /// Adds the closed epoch's counts to the profile. A stack still waiting
    /// for its GC to stand still keeps its count until it is named, unless
    /// this is the `last` epoch.
    fn close_epoch(&mut self, probe: &mut Probe, processes: &mut Processes, last: bool) -> Result<()> {
        let (records, counts) = probe.close_epoch()?;
        for r in records {
            self.on_record(r, processes, probe)?;
        }
        self.retry(last, processes);
        for (hash, n) in counts {
            match self.stacks.get_mut(&hash) {
                Some((stack, gen, unknown)) => {
                    *gen = self.generation;
                    self.profile.add(stack, n);
                    if *unknown {
                        self.unknown_samples += n;
                    }
                }
                None if self.deferred.iter().any(|s| s.header.hash == hash) => {
                    *self.waiting_counts.entry(hash).or_default() += n;
                }
                None => self.undelivered += n,
            }
        }
        if last {
            self.undelivered += self.waiting_counts.drain().map(|(_, n)| n).sum::<u64>();
        }
        self.named_ruby.clear();
        // Each epoch re-sends the stacks it sees: older ones can go.
        let keep = self.generation.saturating_sub(1);
        self.stacks.retain(|_, (_, gen, _)| *gen >= keep);
        self.generation += 1;
        Ok(())
    }

    fn finish(&self, pid: u32, ruby_version: String, stats: &Stats, event: String) -> Recording {
        Recording {
            rprof_version: env!("CARGO_PKG_VERSION").to_string(),
            pid,
            ruby_version,
            event,
            samples: stats.events,
            lost: stats.lost + self.undelivered,
            failed: stats.read_failed,
            profile: self.profile.clone(),
        }
    }
}

fn print_summary(
    r: &Recording,
    stats: &Stats,
    c: &Collector,
    followed: Option<Counts>,
    tables_without_room: u64,
    output: &Path,
    elapsed: Duration,
) {
    let mut notes = Vec::new();
    if let Some(n) = followed {
        notes.push(format!(
            "{} processes followed, {} profiled, {} ended",
            n.followed, n.profiled, n.ended
        ));
    }
    if stats.not_profiled > 0 {
        notes.push(format!(
            "{} in followed processes not profiled (not Ruby, or before their Ruby was up)",
            stats.not_profiled
        ));
    }
    if stats.other_process > 0 {
        notes.push(format!(
            "{} of processes that reused a target's PID, ignored",
            stats.other_process
        ));
    }
    if stats.process_lost + c.unfollowed > 0 {
        notes.push(format!(
            "{} process reports lost to a full ring buffer, {} samples of processes not followed",
            stats.process_lost, c.unfollowed
        ));
    }
    if stats.truncated > 0 {
        notes.push(format!("{} truncated at the root", stats.truncated));
    }
    if !c.unknown_frames.is_empty() {
        let mut why: Vec<_> = c.unknown_frames.iter().collect();
        why.sort();
        let why: Vec<String> = why.iter().map(|(u, n)| format!("{n} {u}")).collect();
        notes.push(format!(
            "{} with [unknown] frames: {}",
            c.unknown_samples,
            why.join(", ")
        ));
    }
    if stats.no_ec > 0 {
        notes.push(format!("{} in threads running no Ruby", stats.no_ec));
    }
    let stopped: u64 = stats.native_stops.iter().skip(1).sum();
    if stopped > 0 {
        let why: Vec<String> = stats
            .native_stops
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| format!("{n} {}", resolve::native_stop_name(i)))
            .collect();
        notes.push(format!(
            "native stacks: {} whole, {stopped} stopped early ({})",
            stats.native_stops[0],
            why.join(", ")
        ));
    }
    if tables_without_room > 0 {
        notes.push(format!(
            "{tables_without_room} files without room for their unwind table (raise RPROF_UNWIND_ROWS)"
        ));
    }
    if stats.agg_full > 0 {
        notes.push(format!(
            "{} sent one by one: the in-kernel counts table was full",
            stats.agg_full
        ));
    }
    if stats.verified > 0 && !r.ruby_version.starts_with("2.") {
        notes.push(format!("{} checked to be the thread's own EC", stats.verified));
    }
    if stats.foreign_ec > 0 {
        notes.push(if r.ruby_version.starts_with("2.") {
            format!("{} without the GVL", stats.foreign_ec)
        } else {
            format!(
                "{} skipped: the EC read belonged to another thread",
                stats.foreign_ec
            )
        });
    }
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join(", "))
    };
    let unit = if r.event == "cpu" { "samples" } else { "events" };
    eprintln!(
        "rprof: {} {unit}, {} lost, {} failed in {:.1}s{notes}; wrote {}",
        r.samples,
        r.lost,
        r.failed,
        elapsed.as_secs_f64(),
        output.display()
    );
}

pub fn write_output(r: &Recording, output: &Path, format: Format) -> Result<()> {
    let file = File::create(output).with_context(|| format!("creating {}", output.display()))?;
    let mut w = BufWriter::new(file);
    match format {
        Format::Svg | Format::Flame => {
            let opts = SvgOptions {
                title: format!("rprof: process {} (Ruby {}), {}", r.pid, r.ruby_version, r.event),
                subtitle: Some(format!(
                    "{} samples, {} lost, {} failed",
                    r.samples, r.lost, r.failed
                )),
                count_name: if r.event == "cpu" { "samples" } else { "events" }.to_string(),
                icicle: format == Format::Svg,
            };
            r.profile.write_svg(&mut w, &opts)?;
        }
        Format::Folded => r.profile.write_folded(&mut w)?,
        Format::Rprof => serde_json::to_writer(&mut w, r).context("writing the recording")?,
    }
    w.flush().with_context(|| format!("writing {}", output.display()))
}

pub fn read_recording(path: &Path) -> Result<Recording> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    serde_json::from_reader(std::io::BufReader::new(file)).with_context(|| {
        format!(
            "{} is not an rprof recording (written with --format rprof)",
            path.display()
        )
    })
}

fn default_output(pid: u32, format: Format) -> PathBuf {
    PathBuf::from(format!(
        "rprof-{pid}-{}.{}",
        local_timestamp(),
        format.extension()
    ))
}

/// YYYYmmdd-HHMMSS in local time.
fn local_timestamp() -> String {
    // SAFETY: time(NULL) and localtime_r with a zeroed tm we own.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&now, &mut tm);
        format!(
            "{:04}{:02}{:02}-{:02}{:02}{:02}",
            tm.tm_year + 1900,
            tm.tm_mon + 1,
            tm.tm_mday,
            tm.tm_hour,
            tm.tm_min,
            tm.tm_sec
        )
    }
}
