//! The recording loop: attach to a Ruby process, collect stacks until the
//! duration ends, Ctrl-C, or the target exits, and always write what was
//! collected, with counts of what was lost or failed.

use std::collections::HashMap;
use std::fs::File;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use flamegraphs::{Frame, FrameKind, ProcessInfo, ThreadInfo};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::bpf::{self, types, Probe, Record, Sample, Stats};
use crate::cli::Format;
use crate::error::UserError;
use crate::gc_time::{GcTime, SampleTime};
use crate::heap_log::HeapLog;
use crate::launch::{self, StopSignals};
use crate::pace::{Every, Pace};
use crate::process::Process;
use crate::processes::{self, Counts, Followed, ProcessId, Processes};
use crate::proof;
use crate::recording::continuous::{FlightRecorder, PartOutput, Rotation};
use crate::recording::{
    self, file, write_output, Counted, EpochCounts, Event, Header, Output, RenderOptions, Summary,
    ThreadEntry,
};
use crate::resolve::{self, NativeNames, RubyFrame, Unknown};
use crate::system;
use crate::target::RubyTarget;
use crate::unwind::{self, Unwinder};

/// Highest sampling frequency accepted.
pub const MAX_FREQUENCY: u64 = 100_000;
/// How often the in-kernel counts are collected.
const EPOCH: Duration = Duration::from_millis(500);

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

/// Recording without end, in bounded memory.
#[derive(Debug, Clone, Copy)]
pub enum Continuous {
    /// One profile per interval, the newest `keep` kept.
    Rotate { every: Duration, keep: Option<usize> },
    /// The last `window`, written on SIGUSR2 and at the end.
    FlightRecorder { window: Duration },
}

pub struct RecordConfig {
    pub target: Target,
    pub duration: Option<Duration>,
    pub event: EventSpec,
    /// A file, or with `continuous`, a directory.
    pub output: Option<PathBuf>,
    pub format: Option<Format>,
    /// Also stream the recording into this file.
    pub raw: Option<PathBuf>,
    pub continuous: Option<Continuous>,
    /// No progress line.
    pub quiet: bool,
    pub force_version: Option<String>,
    /// Run a launched command as root even under sudo.
    pub as_root: bool,
    /// Follow every process the targets fork, at any depth.
    pub subprocesses: bool,
    /// How the output is drawn: split by process, by thread; summary by line.
    pub render: RenderOptions,
    /// Native frames stitched with the Ruby ones.
    pub native: bool,
    /// Keep the interpreter's own native frames (no folding).
    pub native_all: bool,
    /// Kernel frames at the leaf.
    pub kernel: bool,
}

/// Where the epochs of a recording go as they close.
struct Sinks {
    /// The recording's file(s): --raw, `--format rprof`, or a temporary file
    /// the output is rendered from at the end.
    streams: Vec<file::Writer>,
    /// --raw, said among what was written; `streams[0]` when given.
    raw: Option<PathBuf>,
    rotation: Option<Rotation>,
    flight: Option<FlightRecorder>,
    /// RPROF_HEAP_LOG: rprof's own heap, epoch by epoch.
    heap: Option<HeapLog>,
    /// The stream the output is rendered from, if not written by then.
    render_from: Option<usize>,
}

impl Sinks {
    fn epoch(&mut self, counts: &EpochCounts, totals: &Summary, progress: &Progress) -> Result<()> {
        for (i, s) in self.streams.iter_mut().enumerate().filter(|(_, s)| !s.broken()) {
            if let Err(e) = s.epoch(counts) {
                let e = anyhow::Error::from(e).context(format!("writing {}", s.name));
                // --raw (the first stream) is a copy: the recording goes on without it.
                if i == 0 && self.raw.is_some() {
                    progress.say(&format!(
                        "rprof: warning: {e:#}; it ends at its last complete epoch, the recording goes on"
                    ));
                    continue;
                }
                return Err(e);
            }
        }
        if let Some(r) = &mut self.rotation {
            if let Some(path) = r.epoch(counts, totals)? {
                progress.say(&format!("rprof: wrote {}", path.display()));
            }
        }
        if let Some(f) = &mut self.flight {
            f.epoch(counts, totals)?;
        }
        if let Some(h) = &mut self.heap {
            h.epoch(Duration::from_nanos(counts.end_ns))?;
        }
        Ok(())
    }
}

/// The live line on a terminal: elapsed, samples, lost, failed, processes.
struct Progress(ProgressBar);

impl Progress {
    fn new(quiet: bool) -> Self {
        if quiet || !std::io::stderr().is_terminal() {
            return Progress(ProgressBar::hidden());
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(4));
        if let Ok(style) = ProgressStyle::with_template("{spinner} rprof: recording {elapsed_precise}: {msg}")
        {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(250));
        Progress(bar)
    }

    fn update(&self, totals: &Summary, unit: &str, followed: Option<Counts>) {
        let mut msg = format!(
            "{} {unit}, {} lost, {} failed",
            totals.samples, totals.lost, totals.failed
        );
        if let Some(n) = followed {
            msg.push_str(&format!(", {} processes followed", n.followed));
        }
        self.0.set_message(msg);
    }

    /// A line above the progress line.
    fn say(&self, line: &str) {
        self.0.suspend(|| eprintln!("{line}"));
    }

    fn finish(&self) {
        self.0.finish_and_clear();
    }
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
    let format = output_format(&cfg)?;

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
    let mut processes = Processes::new(cfg.force_version.clone(), unwinder);
    if cfg.subprocesses {
        probe.attach_process_tracking()?;
    }
    let event_names: Vec<String> = match &cfg.event {
        EventSpec::Cpu { .. } => vec!["cpu".to_string()],
        EventSpec::Syscalls(names) => names.clone(),
    };
    let mut collector = Collector::new(event_names.clone());
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
            let (mut c, t) = launch(argv, &cfg, &signals)?;
            roots.push(describe(&t));
            // Its VM is still booting: the proof waits for its main thread.
            if let Err(e) = processes.add_root(&mut probe, t, false, processes::BOOT_PROOF) {
                let _ = c.kill();
                return Err(e);
            }
            child = Some(c);
        }
    }
    let first_pid = match (&cfg.target, &child) {
        (_, Some(c)) => c.id(),
        (Target::Pids(pids), None) => pids[0],
        (Target::Command(_), None) => 0,
    };
    collector.warm(&processes, cfg.kernel);
    let header = Header {
        rprof_version: env!("CARGO_PKG_VERSION").to_string(),
        event: match &cfg.event {
            EventSpec::Cpu { frequency } => Event::Cpu {
                frequency: *frequency,
            },
            EventSpec::Syscalls(names) => Event::Syscalls(names.clone()),
        },
        started_ns: recording::unix_now_ns(),
        target: format!(
            "{} {}{}",
            if roots.len() == 1 { "process" } else { "processes" },
            roots.join(", "),
            if cfg.subprocesses {
                " and its subprocesses"
            } else {
                ""
            }
        ),
    };
    let output = output_path(&cfg, format, first_pid, header.started_ns);
    let mut sinks = open_sinks(&cfg, &header, format, &output, first_pid)?;
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
    let until = match (cfg.duration, cfg.continuous) {
        (Some(d), _) => format!("for {:.1}s (Ctrl-C to stop early)", d.as_secs_f64()),
        (None, Some(Continuous::FlightRecorder { .. })) => {
            format!(
                "Ctrl-C to stop, `kill -USR2 {}` to write the window",
                std::process::id()
            )
        }
        (None, _) => "Ctrl-C to stop".to_string(),
    };
    eprintln!(
        "rprof: recording {} {}{}, {what}; {until}",
        if roots.len() == 1 { "process" } else { "processes" },
        roots.join(", "),
        if cfg.subprocesses {
            " and every process forked from it"
        } else {
            ""
        },
    );

    let progress = Progress::new(cfg.quiet);
    let unit = header.event.unit().count_name();
    let started = Instant::now();
    let mut epoch_started = Instant::now();
    let totals =
        |probe: &Probe, c: &Collector| c.totals(&probe.stats().unwrap_or_default(), started.elapsed());
    // An error while recording still writes what was collected before it.
    let mut recording_error = None;
    system::favour_recording_thread();
    let mut pace = Pace::new(match cfg.event {
        EventSpec::Cpu { frequency } => Duration::from_secs(1) / frequency.max(1) as u32,
        // Traced events come whenever the target makes them, not at ticks.
        EventSpec::Syscalls(_) => Duration::from_millis(2),
    });
    // Exits come as records; this is for a target that ends otherwise (a
    // PID rprof follows without its exit, an exec).
    let mut liveness = Every::new(Duration::from_millis(20));
    let time_is_up =
        |signals: &StopSignals| signals.stopped() || cfg.duration.is_some_and(|d| started.elapsed() >= d);
    loop {
        let step = (|| -> Result<bool> {
            pace.sleep();
            // A batch at most, and no further once time is up: a starved
            // rprof still stops when asked (the rest is read at the end).
            let mut read = 0;
            while read < bpf::BATCH && !time_is_up(&signals) {
                let Some(r) = probe.next_record()? else { break };
                collector.on_record(r, &mut processes, &mut probe)?;
                read += 1;
            }
            pace.read(read, read == bpf::BATCH);
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
            if time_is_up(&signals)
                || command_ended
                || (child.is_none() && liveness.due() && !processes.any_alive())
            {
                return Ok(true);
            }
            if epoch_started.elapsed() >= EPOCH {
                let counts = collector.close_epoch(&mut probe, &mut processes, false, started.elapsed())?;
                let totals = totals(&probe, &collector);
                sinks.epoch(&counts, &totals, &progress)?;
                progress.update(&totals, unit, cfg.subprocesses.then_some(processes.counts));
                processes.sweep_ended(&mut probe, |f, u| collector.flush(f, u));
                processes.refresh_threads(&mut probe)?;
                epoch_started = Instant::now();
            }
            if signals.take_write_request() {
                if let Some(f) = &sinks.flight {
                    if let Some(path) = f.write(&totals(&probe, &collector))? {
                        progress.say(&format!("rprof: wrote {}", path.display()));
                    }
                }
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
    // What was recorded: a starved rprof may take a while to name the rest.
    let recorded = started.elapsed();
    match collector.close_epoch(&mut probe, &mut processes, true, recorded) {
        Ok(counts) => {
            let totals = collector.totals(&probe.stats().unwrap_or_default(), recorded);
            if let Err(e) = sinks.epoch(&counts, &totals, &progress) {
                recording_error.get_or_insert(e);
            }
        }
        Err(e) => {
            recording_error.get_or_insert(e);
        }
    }
    progress.finish();
    let stats = probe.stats().unwrap_or_default();
    let summary = collector.totals(&stats, recorded);
    let ruby_version = Vec::from_iter(processes.ruby_versions.iter().cloned()).join(", ");
    for f in processes.all() {
        probe.remove_process(f.id.pid);
    }

    let written = finish_sinks(&mut sinks, &summary, &output, format, &cfg.render);
    let counts = cfg.subprocesses.then_some(processes.counts);
    let no_room = processes.native.as_ref().map_or(0, |u| u.no_room);
    print_summary(
        &summary,
        &ruby_version,
        unit,
        &stats,
        &collector,
        counts,
        no_room,
        &written.0,
    );
    for why in &processes.refused {
        eprintln!("rprof: not profiled: {why}");
    }
    let unnamed = processes
        .counts
        .refused
        .saturating_sub(processes.refused.len() as u64);
    if unnamed > 0 {
        eprintln!("rprof: not profiled: {unnamed} more processes whose Ruby the layout does not fit");
    }
    match (recording_error, written) {
        (Some(e), (written, _)) => {
            let what = if written.is_empty() {
                ""
            } else {
                " (what was collected is written)"
            };
            return Err(e.context(format!("recording stopped early{what}")));
        }
        (None, (_, Some(e))) => return Err(e),
        (None, (_, None)) => {}
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
        "rprof: {} (pid {}) is still running",
        cfg_command_name(&cfg.target),
        first_pid
    );
    Ok(None)
}

/// The format asked for, or the output's extension's, or svg.
fn output_format(cfg: &RecordConfig) -> Result<Format> {
    // With --rotate or --flight-recorder, -o names a directory.
    let file = cfg.output.as_deref().filter(|_| cfg.continuous.is_none());
    Ok(Format::for_output(cfg.format, file)?)
}

/// The output file; or with --rotate and --flight-recorder, the directory.
fn output_path(cfg: &RecordConfig, format: Format, pid: u32, started_ns: u64) -> Output {
    match (&cfg.output, cfg.continuous, format) {
        (Some(p), None, _) => Output::from_path(p),
        (Some(p), Some(_), _) => Output::File(p.clone()),
        (None, Some(_), _) => Output::File(PathBuf::from(".")),
        (None, None, Format::Summary) => Output::Stdout,
        (None, None, _) => Output::File(PathBuf::from(format!(
            "rprof-{pid}-{}.{}",
            recording::timestamp(started_ns),
            format.extension()
        ))),
    }
}

/// A new recording file, readable too: the output is rendered from it.
fn create(path: &Path) -> Result<File> {
    File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))
}

/// Opens what the epochs go to: files first, so that a path that cannot be
/// written fails before recording starts.
fn open_sinks(
    cfg: &RecordConfig,
    header: &Header,
    format: Format,
    output: &Output,
    pid: u32,
) -> Result<Sinks> {
    let mut sinks = Sinks {
        streams: Vec::new(),
        raw: cfg.raw.clone(),
        rotation: None,
        flight: None,
        heap: HeapLog::from_env()?,
        render_from: None,
    };
    if let Some(raw) = &cfg.raw {
        sinks.streams.push(
            file::Writer::new(create(raw)?, raw.display().to_string(), header)
                .with_context(|| format!("writing {}", raw.display()))?,
        );
    }
    match (cfg.continuous, output) {
        (Some(c), Output::File(dir)) => {
            if dir.exists() && !dir.is_dir() {
                anyhow::bail!(
                    "{} is a file: with --rotate or --flight-recorder, -o names the directory the profiles go to",
                    dir.display()
                );
            }
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            let out = PartOutput {
                dir: dir.clone(),
                pid,
                format,
                options: cfg.render.clone(),
            };
            match c {
                Continuous::Rotate { every, keep } => {
                    sinks.rotation = Some(Rotation::new(out, every, keep, header.clone()))
                }
                Continuous::FlightRecorder { window } => {
                    sinks.flight = Some(FlightRecorder::new(out, window, header.clone()))
                }
            }
        }
        (_, Output::File(path)) if format == Format::Rprof => {
            sinks.streams.push(
                file::Writer::new(create(path)?, path.display().to_string(), header)
                    .with_context(|| format!("writing {}", path.display()))?,
            );
        }
        (_, output) => {
            // A file that cannot be written is said now, not after recording.
            if let Output::File(path) = output {
                let probe = recording::temporary_name(path);
                File::create(&probe).with_context(|| format!("creating {}", path.display()))?;
                let _ = std::fs::remove_file(&probe);
            }
            // Counts wait on disk, not in memory, however long the recording.
            let tmp = tempfile::tempfile().context("creating a temporary file for the recording")?;
            sinks.streams.push(
                file::Writer::new(tmp, "the temporary recording".to_string(), header)
                    .context("writing the temporary recording")?,
            );
            sinks.render_from = Some(sinks.streams.len() - 1);
        }
    }
    Ok(sinks)
}

/// Ends the streams with the summary and writes what is still to be
/// written; returns what was written, and the first thing that could not be.
fn finish_sinks(
    sinks: &mut Sinks,
    summary: &Summary,
    output: &Output,
    format: Format,
    render: &RenderOptions,
) -> (Vec<String>, Option<anyhow::Error>) {
    let mut written: Vec<String> = sinks.raw.iter().map(|p| p.display().to_string()).collect();
    let mut first_error = None;
    // A stream whose write failed has said so already (it stopped the recording).
    for s in sinks.streams.iter_mut().filter(|s| !s.broken()) {
        if let Err(e) = s.finish(summary) {
            let name = s.name.clone();
            first_error.get_or_insert(anyhow::Error::from(e).context(format!("ending {name}")));
        }
    }
    if let Some(r) = &mut sinks.rotation {
        match r.finish(summary) {
            Ok(Some(path)) => written.push(path.display().to_string()),
            Ok(None) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(f) = &sinks.flight {
        match f.write(summary) {
            Ok(Some(path)) => written.push(path.display().to_string()),
            Ok(None) => {}
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    match sinks.render_from {
        Some(i) => {
            // Rendered from the file, as `report` would: the same formats
            // from the same bytes.
            let rendered = sinks.streams[i].read_back().and_then(|bytes| {
                let read = file::parse(&bytes).context("reading the recording back")?;
                write_output(&read.recording, output, format, render)
            });
            match rendered {
                Ok(()) => written.push(output.to_string()),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        None if sinks.rotation.is_none() && sinks.flight.is_none() => written.push(output.to_string()),
        None => {}
    }
    (written, first_error)
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
            processes.add_root(probe, t, cfg.subprocesses, proof::ATTEMPTS_FOR)?;
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
    /// Resolved stacks by hash, with their thread, the generation they were
    /// last used in and whether a frame in them is unknown.
    stacks: HashMap<u64, CachedStack>,
    generation: u64,
    /// The counts of the epoch open, by stack hash.
    current: HashMap<u64, Counted>,
    /// When the epoch open started, since the recording did.
    epoch_start: Duration,
    /// Each process as the recording describes it, made at its first sample
    /// (workers rename themselves after the fork).
    process_info: HashMap<ProcessId, Rc<ProcessInfo>>,
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
    fn new(events: Vec<String>) -> Self {
        Self {
            events,
            stacks: HashMap::new(),
            generation: 0,
            current: HashMap::new(),
            epoch_start: Duration::ZERO,
            process_info: HashMap::new(),
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
        let (thread, stack, unknown) = self.build_stack(&s, f, unwinder);
        if !last_try && unknown.contains(&Unknown::GcBusy) {
            self.deferred.push(s);
            return;
        }
        let hash = s.header.hash;
        if s.has(types::rprof_sample_flags::RPROF_SAMPLE_DIRECT) {
            self.count_unknown(&unknown);
            self.unknown_samples += u64::from(!unknown.is_empty());
            self.count(hash, &thread, &Rc::new(stack), 1);
            return;
        }
        // The same hash means the same frames at the same GC time, so the same
        // objects: if an earlier reading named them all, it stands.
        if !unknown.is_empty() {
            if let Some(cached) = self.stacks.get_mut(&hash).filter(|c| !c.unknown) {
                cached.generation = self.generation;
                return;
            }
        }
        self.count_unknown(&unknown);
        let stack = Rc::new(stack);
        // Counted in an epoch that closed while this record waited.
        if let Some(n) = self.waiting_counts.remove(&hash) {
            self.count(hash, &thread, &stack, n);
            if !unknown.is_empty() {
                self.unknown_samples += n;
            }
        }
        if self.say_named && unknown.is_empty() {
            eprintln!("rprof: named a whole stack");
            self.say_named = false;
        }
        self.stacks.insert(
            hash,
            CachedStack {
                thread,
                frames: stack,
                generation: self.generation,
                unknown: !unknown.is_empty(),
            },
        );
    }

    /// Adds `n` events of this stack to the epoch open.
    fn count(&mut self, hash: u64, thread: &Rc<ThreadEntry>, stack: &Rc<Vec<Frame>>, n: u64) {
        self.current
            .entry(hash)
            .or_insert_with(|| (thread.clone(), stack.clone(), 0))
            .2 += n;
    }

    /// The recording's counts so far.
    fn totals(&self, stats: &Stats, elapsed: Duration) -> Summary {
        Summary {
            samples: stats.events,
            lost: stats.lost + self.undelivered,
            failed: stats.read_failed,
            unknown: self.unknown_samples,
            duration_ns: elapsed.as_nanos() as u64,
        }
    }

    /// The process of a sample as the recording describes it.
    fn process_info(&mut self, f: &mut Followed) -> Rc<ProcessInfo> {
        if let Some(p) = self.process_info.get(&f.id) {
            return p.clone();
        }
        let mut frames = f.frames();
        let label = frames.pop().unwrap_or_default();
        let process = Process { pid: f.id.pid };
        let p = Rc::new(ProcessInfo {
            pid: f.id.pid,
            started: system::start_time(f.id.start_ticks),
            command: process.command_line(),
            runtime: f
                .ruby
                .as_ref()
                .map(|r| format!("Ruby {}", r.target.version))
                .unwrap_or_default(),
            label,
            parents: frames,
        });
        self.process_info.insert(f.id, p.clone());
        p
    }

    fn count_unknown(&mut self, unknown: &[Unknown]) {
        for u in unknown {
            *self.unknown_frames.entry(*u).or_default() += 1;
        }
    }

    /// The sample's thread; its stack, root first: [truncated], Ruby frames,
    /// then the traced event; and why frames could not be named.
    fn build_stack(
        &mut self,
        s: &Sample,
        f: &mut Followed,
        unwinder: Option<&Unwinder>,
    ) -> (Rc<ThreadEntry>, Vec<Frame>, Vec<Unknown>) {
        let h = &s.header;
        let comm: Vec<u8> = h.comm.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let comm = String::from_utf8_lossy(&comm).into_owned();
        let process = self.process_info(f);
        let mut stack = Vec::with_capacity(s.frames.len() + 4);
        let native_thread = |process| ThreadEntry {
            process,
            thread: ThreadInfo {
                process: 0,
                tid: h.tid,
                label: format!("{comm} [{}]", h.tid),
                name: comm.clone(),
            },
        };
        let Some(ruby) = f.ruby.as_mut() else {
            stack.push(Frame::marker("[process not profiled]"));
            return (Rc::new(native_thread(process)), stack, Vec::new());
        };
        let resolver = &mut ruby.resolver;
        // An M:N Ruby thread moves between native threads: name it, not them.
        let thread = Rc::new(if h.ruby_thread != 0 {
            let label = resolver.ruby_thread(h.ruby_thread);
            ThreadEntry {
                process,
                thread: ThreadInfo {
                    process: 0,
                    tid: 0,
                    name: label.clone(),
                    label,
                },
            }
        } else {
            native_thread(process)
        });
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
        // A thread running no Ruby (nor native frames): said by its thread
        // frame, or this one.
        if s.frames.is_empty() && s.native.is_empty() && !stack.iter().any(|f| f.kind == FrameKind::Marker) {
            stack.push(Frame::marker(recording::NO_RUBY_FRAMES));
        }
        if h.event > 0 {
            let name = self
                .events
                .get(h.event as usize - 1)
                .map(|n| n.strip_prefix("sys_").unwrap_or(n).to_string())
                .unwrap_or_else(|| format!("event {}", h.event));
            stack.push(Frame::event(name));
        }
        (thread, stack, unknown)
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
    fn close_epoch(
        &mut self,
        probe: &mut Probe,
        processes: &mut Processes,
        last: bool,
        now: Duration,
    ) -> Result<EpochCounts> {
        let closed = probe.switch_epoch()?;
        let settled = Instant::now() + bpf::EPOCH_SETTLE;
        // Its records, before its counts: a count finds its stack named.
        // New records are named while the old epoch settles, not after; then
        // what was written up to then, and no more (targets may write faster
        // than a starved rprof reads).
        let mut mark = None;
        loop {
            let mut records = Vec::new();
            let wait = settled.saturating_duration_since(Instant::now());
            probe.poll(wait.max(bpf::EPOCH_SETTLE / 2), |r| records.push(r))?;
            for r in records {
                self.on_record(r, processes, probe)?;
            }
            if mark.is_none() && Instant::now() >= settled {
                mark = Some(probe.written()?);
            }
            if let Some(mark) = mark {
                if !probe.unread_before(mark)? {
                    break;
                }
            }
        }
        let counts = probe.take_counts(closed)?;
        self.retry(last, processes);
        for (hash, n) in counts {
            match self.stacks.get_mut(&hash) {
                Some(cached) => {
                    cached.generation = self.generation;
                    if cached.unknown {
                        self.unknown_samples += n;
                    }
                    let (thread, frames) = (cached.thread.clone(), cached.frames.clone());
                    self.count(hash, &thread, &frames, n);
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
        self.stacks.retain(|_, c| c.generation >= keep);
        self.generation += 1;
        // Processes that ended are described no more, here or in a file.
        let mut ended = Vec::new();
        self.process_info.retain(|id, info| {
            let alive = processes.get(id.pid, id.start_ticks).is_some();
            if !alive {
                ended.push(info.clone());
            }
            alive
        });
        let epoch = EpochCounts {
            start_ns: self.epoch_start.as_nanos() as u64,
            end_ns: now.as_nanos() as u64,
            counts: self.current.drain().map(|(_, c)| c).collect(),
            ended,
        };
        self.epoch_start = now;
        Ok(epoch)
    }
}

/// A stack named, kept while epochs count it.
struct CachedStack {
    thread: Rc<ThreadEntry>,
    frames: Rc<Vec<Frame>>,
    generation: u64,
    unknown: bool,
}

#[allow(clippy::too_many_arguments)]
fn print_summary(
    summary: &Summary,
    ruby_version: &str,
    unit: &str,
    stats: &Stats,
    c: &Collector,
    followed: Option<Counts>,
    tables_without_room: u64,
    written: &[String],
) {
    let mut notes = Vec::new();
    if let Some(n) = followed {
        let refused = match n.refused {
            0 => String::new(),
            r => format!(", {r} refused (their Ruby does not fit rprof's layout)"),
        };
        notes.push(format!(
            "{} processes followed, {} profiled{refused}, {} ended",
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
    if stats.verified > 0 && !ruby_version.starts_with("2.") {
        notes.push(format!("{} checked to be the thread's own EC", stats.verified));
    }
    if stats.foreign_ec > 0 {
        notes.push(if ruby_version.starts_with("2.") {
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
    let wrote = match written {
        [] => "nothing written".to_string(),
        _ => format!("wrote {}", written.join(", ")),
    };
    eprintln!(
        "rprof: {} {unit}, {} lost, {} failed in {:.1}s{notes}; {wrote}",
        summary.samples,
        summary.lost,
        summary.failed,
        summary.duration_ns as f64 / 1e9,
    );
}
