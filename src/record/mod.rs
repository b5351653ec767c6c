//! The recording loop: attach to a Ruby process, collect stacks until the
//! duration ends, Ctrl-C, or the target exits, and always write what was
//! collected, with counts of what was lost or failed.

mod alloc;
mod collector;
mod event;
mod peer;
mod progress;
mod roots;
mod sinks;
mod summary;
mod top;
mod wall;

use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::bpf::{self, Probe, ThreadLister};
use crate::cli::Format;
use crate::launch::StopSignals;
use crate::pace::{Every, Hold, Pace};
use crate::processes::Processes;
use crate::recording::{self, Header, RenderOptions, Summary};
use crate::resolve::NativeNames;
use crate::system;
use crate::unwind::{self, Unwinder};
use collector::Collector;
pub use event::EventSpec;
pub use progress::Progress;
pub use sinks::EpochSink;
use sinks::{finish_sinks, open_sinks, output_format, output_path, Sinks};
use summary::print_summary;

/// How often the in-kernel counts are collected.
const EPOCH: Duration = Duration::from_millis(500);

pub enum Target {
    Pids(Vec<u32>),
    Command(Vec<String>),
    /// Every Ruby process on the host, now and as they start (--all).
    All,
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
    /// `rprof top`: a live view instead of a progress line; an output only
    /// if one is named.
    pub top: bool,
    /// Where epochs go instead of an output (`rprof agent`).
    pub sink: Option<Box<dyn EpochSink>>,
    /// --all: which Rubies are profiled (`rprof agent --only/--exclude`).
    pub admit: Option<crate::processes::Admit>,
}

/// Records until the duration ends, a stop signal, or the target exits.
/// Returns the exit status of the command rprof started, once it has ended.
pub fn record(mut cfg: RecordConfig) -> Result<Option<ExitStatus>> {
    let external = cfg.sink.take();
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
    let unwinder = native_rows.map(Unwinder::new);
    let mut processes = Processes::new(cfg.force_version.clone(), unwinder);
    processes.every_exec = matches!(cfg.target, Target::All);
    processes.admit = cfg.admit.take();
    let threads = ThreadLister::load()?;
    let given = roots::inspect_given(&cfg, &threads, &mut processes)?;
    let mut probe = Probe::load(
        bpf::Options {
            native_rows,
            kernel: cfg.kernel,
            wall: cfg.event.is_wall(),
            traced: cfg.event.is_traced(),
            follow_every_exec: matches!(cfg.target, Target::All),
            alloc_every: cfg.event.alloc_every(),
        },
        threads,
    )?;
    let signals = StopSignals::install()?;
    if cfg.subprocesses {
        probe.attach_process_tracking()?;
    }
    let mut collector = Collector::new(cfg.event.names());
    collector.counts_time = cfg.event.is_wall();
    if cfg.native || cfg.kernel {
        collector.native = Some((NativeNames::default(), cfg.native_all));
    }
    let (child, roots) = roots::start(&cfg, given, &mut probe, &mut processes, &signals)?;
    let first_pid = match (&cfg.target, &child) {
        (_, Some(c)) => c.id(),
        (Target::Pids(pids), None) => pids[0],
        (Target::Command(_) | Target::All, None) => 0,
    };
    collector.warm(&processes, cfg.kernel);
    // The recording's time starts as the counting is about to (only the
    // sinks are opened between), not once set up: seeding `wall` with 1,000
    // blocked threads took 150 ms on a busy machine, which every thread's
    // total had and the duration did not. Its Unix time is the header's,
    // which sinks date their parts from (the agent's pushes were dated 2-3 s
    // early after a slow set-up).
    let started = Instant::now();
    let header = Header {
        rprof_version: env!("CARGO_PKG_VERSION").to_string(),
        event: cfg.event.recorded(),
        started_ns: recording::unix_now_ns(),
        target: match cfg.target {
            Target::All => "every Ruby process on the host".to_string(),
            _ => format!(
                "{}{}",
                named(&roots),
                if cfg.subprocesses {
                    " and its subprocesses"
                } else {
                    ""
                }
            ),
        },
    };
    // What default file names say they are of: the first target's PID.
    let file_stem = match cfg.target {
        Target::All => "all".to_string(),
        _ => first_pid.to_string(),
    };
    let output = output_path(&cfg, format, &file_stem, header.started_ns);
    let sinks = open_sinks(&cfg, &header, format, &output, &file_stem, external)?;
    cfg.event.attach(&mut probe)?;
    // Those given by PID must be probed (alloc); others are said and left out.
    let strict: Vec<u32> = match &cfg.target {
        Target::Pids(pids) => pids.clone(),
        _ => child.iter().map(|c| c.id()).collect(),
    };
    cfg.event.attach_processes(&mut probe, &mut processes, &strict)?;
    // `wall`: the threads blocked since before now, seeded at once.
    cfg.event.epoch_ends(&mut probe, &mut processes, &mut collector)?;

    announce(&cfg, &roots);

    system::favour_recording_thread();
    let mut session = Session {
        cfg: &cfg,
        progress: Progress::new(cfg.quiet || cfg.top),
        unit: header.event.events_name(),
        probe,
        processes,
        collector,
        sinks,
        signals,
        child,
        started,
        epoch_started: Instant::now(),
    };
    // An error while recording still writes what was collected before it.
    let error = session.run().err();
    let (child, signals) = session.finish(error, &output, format)?;
    roots::command_exit(child, &signals, &cfg.target, first_pid)
}

/// A recording under way: where records come from, what names them, where
/// what is collected goes.
struct Session<'a> {
    cfg: &'a RecordConfig,
    probe: Probe,
    processes: Processes,
    collector: Collector,
    sinks: Sinks,
    progress: Progress,
    signals: StopSignals,
    /// The command rprof started, if it did.
    child: Option<Child>,
    /// What the counts count ("samples").
    unit: &'static str,
    started: Instant,
    epoch_started: Instant,
}

impl Session<'_> {
    /// Reads, names and counts until the duration ends, a stop signal, or
    /// the targets end.
    fn run(&mut self) -> Result<()> {
        let mut pace = Pace::new(self.cfg.event.period());
        let mut hold = Hold::new(self.cfg.event.tick_period());
        // Exits come as records; this is for a target that ends otherwise (a
        // PID rprof follows without its exit, an exec). Each look is a read
        // of /proc, rare enough here to stay off a busy rprof's budget.
        let mut liveness = Every::new(Duration::from_millis(100));
        loop {
            pace.sleep(hold.until());
            let waiting = self.probe.take_in()?;
            let spread = hold.holds() && pace.fast();
            if spread {
                self.collector.read_ahead(&self.probe, &mut self.processes);
            }
            let read = self.read_batch(hold.due(waiting, spread))?;
            pace.read(read == bpf::BATCH, self.collector.take_urgent());
            self.tick()?;
            if self.ended(&mut liveness) {
                return Ok(());
            }
            if self.epoch_started.elapsed() >= EPOCH {
                // It counts every record read so far, held or not.
                self.close_epoch()?;
                hold.forget();
            }
            if self.signals.take_write_request() {
                self.write_window()?;
            }
        }
    }

    fn time_is_up(&self) -> bool {
        self.signals.stopped()
            || self.sinks.quit()
            || self.cfg.duration.is_some_and(|d| self.started.elapsed() >= d)
    }

    /// A batch of records at most, and no further once time is up: a
    /// starved rprof still stops when asked (the rest is read at the end).
    fn read_batch(&mut self, most: usize) -> Result<usize> {
        let mut read = 0;
        while read < most.min(bpf::BATCH) && !self.time_is_up() {
            let Some(r) = self.probe.next_record()? else { break };
            self.collector
                .on_record(r, &mut self.processes, &mut self.probe)?;
            read += 1;
        }
        Ok(read)
    }

    /// New processes inspected, the GC clocks followed, waiting records
    /// tried again.
    fn tick(&mut self) -> Result<()> {
        self.sinks.keys()?;
        self.processes.inspect_pending(&mut self.probe)?;
        self.cfg
            .event
            .attach_processes(&mut self.probe, &mut self.processes, &[])?;
        self.collector.warm(&self.processes, self.cfg.kernel);
        for f in self.processes.all() {
            if let Some(ruby) = &mut f.ruby {
                ruby.resolver.tick();
            }
        }
        self.collector.retry(false, &mut self.processes);
        Ok(())
    }

    /// Whether the recording is over: time is up, or what it records ended.
    fn ended(&mut self, liveness: &mut Every) -> bool {
        let command_ended = self
            .child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
        // --all waits for Rubies to come.
        let waits = matches!(self.cfg.target, Target::All);
        self.time_is_up()
            || command_ended
            || (self.child.is_none() && !waits && liveness.due() && !self.processes.any_alive())
    }

    fn totals(&self) -> Summary {
        let stats = self.probe.stats().unwrap_or_default();
        self.collector.totals(&stats, self.started.elapsed())
    }

    /// Closes the epoch open: its counts go to the sinks.
    fn close_epoch(&mut self) -> Result<()> {
        self.cfg
            .event
            .epoch_ends(&mut self.probe, &mut self.processes, &mut self.collector)?;
        let now = self.started.elapsed();
        let counts = self
            .collector
            .close_epoch(&mut self.probe, &mut self.processes, false, now)?;
        let totals = self.totals();
        let rubies = self.processes.live_rubies();
        self.sinks.epoch(&counts, &totals, &self.progress, rubies)?;
        let followed = self.cfg.subprocesses.then_some(self.processes.counts);
        self.progress.update(&totals, self.unit, followed);
        let collector = &mut self.collector;
        self.processes
            .sweep_ended(&mut self.probe, |f, u| collector.flush(f, u));
        self.processes.refresh_threads(&mut self.probe)?;
        self.epoch_started = Instant::now();
        Ok(())
    }

    /// `kill -USR2`: the flight recorder's window, written now.
    fn write_window(&self) -> Result<()> {
        if let Some(f) = &self.sinks.flight {
            if let Some(path) = f.write(&self.totals())? {
                self.progress.say(&format!("rprof: wrote {}", path.display()));
            }
        }
        Ok(())
    }

    /// The last epoch, the output and the summary line. `error` stopped the
    /// recording early; what was collected before it is written all the
    /// same. Returns the command rprof started and the stop signals, for
    /// its exit.
    fn finish(
        mut self,
        mut error: Option<anyhow::Error>,
        output: &recording::Output,
        format: Format,
    ) -> Result<(Option<Child>, StopSignals)> {
        self.probe.stop();
        self.cfg.event.stops(&mut self.probe, &mut self.processes);
        // What was recorded: a starved rprof may take a while to detach and
        // to name the rest.
        let recorded = self.started.elapsed();
        slow_detach_for_tests();
        self.probe.detach();
        let ended = self
            .cfg
            .event
            .epoch_ends(&mut self.probe, &mut self.processes, &mut self.collector);
        if let Err(e) = ended {
            error.get_or_insert(e);
        }
        let rubies = self.processes.live_rubies();
        let last = self
            .collector
            .close_epoch(&mut self.probe, &mut self.processes, true, recorded)
            .and_then(|counts| {
                let totals = self
                    .collector
                    .totals(&self.probe.stats().unwrap_or_default(), recorded);
                self.sinks.epoch(&counts, &totals, &self.progress, rubies)
            });
        if let Err(e) = last {
            error.get_or_insert(e);
        }
        self.progress.finish();
        let stats = self.probe.stats().unwrap_or_default();
        let summary = self.collector.totals(&stats, recorded);
        let ruby_version = Vec::from_iter(self.processes.ruby_versions.iter().cloned()).join(", ");
        for f in self.processes.all() {
            self.probe.remove_process(f.id.pid);
        }
        let (written, unwritten) = finish_sinks(&mut self.sinks, &summary, output, format, &self.cfg.render);
        let p = &self.processes;
        print_summary(
            &summary,
            &ruby_version,
            self.unit,
            self.cfg.event.is_wall(),
            &stats,
            &self.collector,
            self.cfg.subprocesses.then_some(p.counts),
            p.native.as_ref().map_or(0, |u| u.no_room),
            &written,
        );
        summary::print_refused(p);
        if let Some(e) = error {
            let what = if written.is_empty() {
                ""
            } else {
                " (what was collected is written)"
            };
            return Err(e.context(format!("recording stopped early{what}")));
        }
        if let Some(e) = unwritten {
            return Err(e);
        }
        Ok((self.child, self.signals))
    }
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
    let whom = match cfg.target {
        Target::All if roots.is_empty() => "every Ruby process on this host (none yet)".to_string(),
        Target::All => format!(
            "every Ruby process on this host ({} now: {})",
            roots.len(),
            roots.join(", ")
        ),
        _ if cfg.subprocesses => format!("{} and every process forked from it", named(roots)),
        _ => named(roots),
    };
    eprintln!("rprof: recording {whom}, {what}; {until}");
}

/// "process 42 (ruby, Ruby 3.1.2)", "processes 42 (...), 43 (...)".
fn named(roots: &[String]) -> String {
    let noun = if roots.len() == 1 { "process" } else { "processes" };
    format!("{noun} {}", roots.join(", "))
}

/// RPROF_DETACH_DELAY_MS: a wait between the recording's stop and its
/// detach, standing in for the seconds a busy kernel can take to detach
/// (each tracepoint link waits for an RCU grace period: 2 to 12 s measured
/// with two `wall` recordings of storms), so that a test can hold a
/// recording's times to its duration whatever the detach takes.
fn slow_detach_for_tests() {
    if let Some(ms) = std::env::var("RPROF_DETACH_DELAY_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}
