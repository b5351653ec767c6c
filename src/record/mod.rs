//! The recording loop: attach to a Ruby process, collect stacks until the
//! duration ends, Ctrl-C, or the target exits, and always write what was
//! collected, with counts of what was lost or failed.

mod collector;
mod event;
mod progress;
mod roots;
mod sinks;
mod summary;

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::bpf::{self, Probe};
use crate::cli::Format;
use crate::launch::StopSignals;
use crate::pace::{Every, Pace};
use crate::processes::Processes;
use crate::recording::{self, Header, RenderOptions};
use crate::resolve::NativeNames;
use crate::system;
use crate::unwind::{self, Unwinder};
use collector::Collector;
pub use event::EventSpec;
use progress::Progress;
use sinks::{finish_sinks, open_sinks, output_format, output_path};
use summary::print_summary;

/// How often the in-kernel counts are collected.
const EPOCH: Duration = Duration::from_millis(500);

pub enum Target {
    Pids(Vec<u32>),
    Command(Vec<String>),
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

/// Records until the duration ends, a stop signal, or the target exits.
/// Returns the exit status of the command rprof started, once it has ended.
pub fn record(cfg: RecordConfig) -> Result<Option<ExitStatus>> {
    system::check_privileges()?;
    system::check_btf()?;
    cfg.event.check()?;
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
    let mut collector = Collector::new(cfg.event.names());
    if cfg.native || cfg.kernel {
        collector.native = Some((NativeNames::default(), cfg.native_all));
    }
    let (mut child, roots) = roots::start(&cfg, &mut probe, &mut processes, &signals)?;
    let first_pid = match (&cfg.target, &child) {
        (_, Some(c)) => c.id(),
        (Target::Pids(pids), None) => pids[0],
        (Target::Command(_), None) => 0,
    };
    collector.warm(&processes, cfg.kernel);
    let header = Header {
        rprof_version: env!("CARGO_PKG_VERSION").to_string(),
        event: cfg.event.recorded(),
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
    cfg.event.attach(&mut probe)?;

    announce(&cfg, &roots);

    let progress = Progress::new(cfg.quiet);
    let unit = header.event.unit().count_name();
    let started = Instant::now();
    let mut epoch_started = Instant::now();
    let totals =
        |probe: &Probe, c: &Collector| c.totals(&probe.stats().unwrap_or_default(), started.elapsed());
    // An error while recording still writes what was collected before it.
    let mut recording_error = None;
    system::favour_recording_thread();
    let mut pace = Pace::new(cfg.event.period());
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
    summary::print_refused(&processes);
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
    roots::command_exit(child, &signals, &cfg.target, first_pid)
}

/// The first line: what is recorded, how, and until when.
fn announce(cfg: &RecordConfig, roots: &[String]) {
    let what = cfg.event.describe();
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
}
