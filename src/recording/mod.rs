//! Recordings: what a recording holds ([`Recording`]), the streamed file it
//! is written to as it goes ([`file`]), its rendering into every output
//! format through the `flamegraphs` crate, and `rprof report` ([`report`]).

pub mod continuous;
pub mod diff;
pub mod file;
pub mod report;

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;

use anyhow::{Context, Result};
use flamegraphs::summary::SummaryOptions;
use flamegraphs::{Count, Epoch, Frame, ProcessInfo, Samples, Split, ThreadInfo, Unit};
use serde::{Deserialize, Serialize};

use crate::cli::Format;

/// A stack of a thread running no Ruby, when stacks are not split by thread.
pub const NO_RUBY_FRAMES: &str = "[no Ruby frames]";

/// What was recorded, said once at the start of the file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub rprof_version: String,
    pub event: Event,
    /// Start, in nanoseconds since the Unix epoch.
    pub started_ns: u64,
    /// The targets as the first line of `record` names them.
    pub target: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    Cpu {
        frequency: u64,
    },
    /// Syscall tracepoints (`sys_enter_getpid`).
    Syscalls(Vec<String>),
    /// Every thread's time, on CPU (sampled at `frequency`) or not.
    Wall {
        frequency: u64,
    },
    /// Object allocations, 1 in `every` traced (counts scaled by it).
    Alloc {
        every: u64,
    },
}

impl Event {
    /// What BPF's events are called in the live and last lines.
    pub fn events_name(&self) -> &'static str {
        match self {
            Event::Cpu { .. } => "samples",
            Event::Syscalls(_) => "events",
            Event::Wall { .. } => "samples and switches",
            Event::Alloc { .. } => "allocations",
        }
    }

    pub fn unit(&self) -> Unit {
        match self {
            Event::Cpu { frequency } => Unit::CpuSamples {
                period_ns: 1_000_000_000 / (*frequency).max(1),
            },
            Event::Syscalls(_) => Unit::Events {
                name: "syscalls".to_string(),
            },
            Event::Wall { .. } => Unit::Wall,
            Event::Alloc { .. } => Unit::Events {
                name: "alloc_objects".to_string(),
            },
        }
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Cpu { frequency } => write!(f, "cpu at {frequency} Hz"),
            Event::Wall { frequency } => write!(f, "wall, on CPU at {frequency} Hz"),
            Event::Alloc { every: 1 } => write!(f, "alloc"),
            Event::Alloc { every } => write!(f, "alloc, 1 in {every}"),
            Event::Syscalls(names) => {
                let names: Vec<&str> = names
                    .iter()
                    .map(|n| n.strip_prefix("sys_").unwrap_or(n))
                    .collect();
                write!(f, "{}", names.join(", "))
            }
        }
    }
}

/// The counts said at the end of a recording (or of one of its rotated parts).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Events the kernel counted.
    pub samples: u64,
    /// Lost to a full buffer or table.
    pub lost: u64,
    /// Whose Ruby stack could not be read.
    pub failed: u64,
    /// With an `[unknown]` frame.
    pub unknown: u64,
    pub duration_ns: u64,
}

/// A recording, whole or as far as it was written.
pub struct Recording {
    pub header: Header,
    pub samples: Samples,
    /// None if the recording was cut short before its end.
    pub summary: Option<Summary>,
}

impl Recording {
    pub fn new(header: Header) -> Self {
        let samples = Samples::new(header.event.unit());
        Self {
            header,
            samples,
            summary: None,
        }
    }
}

/// A thread as the recorder knows it: with its process, not an index.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ThreadEntry {
    pub process: Rc<ProcessInfo>,
    /// Its `process` field unused.
    pub thread: ThreadInfo,
}

/// `n` events of a thread with a stack (root first).
pub type Counted = (Rc<ThreadEntry>, Rc<Vec<Frame>>, u64);

/// An epoch's counts as the recorder collects them, before a file or a
/// window numbers their threads and stacks.
#[derive(Debug, Clone, Default)]
pub struct EpochCounts {
    /// Nanoseconds since the recording started.
    pub start_ns: u64,
    pub end_ns: u64,
    pub counts: Vec<Counted>,
    /// Processes that ended: no later epoch counts them.
    pub ended: Vec<Rc<ProcessInfo>>,
}

/// Numbers processes, threads and stacks, adding what is new: a recording's
/// tables ([`Samples`]) or a file's (what it has written).
pub trait Numbering {
    fn process(&mut self, p: &ProcessInfo) -> u32;
    /// `t.process` is an index of this numbering.
    fn thread(&mut self, t: &ThreadInfo) -> u32;
    /// `frames` root first.
    fn stack(&mut self, frames: &[Frame]) -> u32;
}

impl Numbering for Samples {
    fn process(&mut self, p: &ProcessInfo) -> u32 {
        Samples::process(self, p)
    }
    fn thread(&mut self, t: &ThreadInfo) -> u32 {
        Samples::thread(self, t)
    }
    fn stack(&mut self, frames: &[Frame]) -> u32 {
        Samples::stack(self, frames)
    }
}

impl EpochCounts {
    /// The epoch numbered in `to`'s tables (added to them as needed), its
    /// times `offset_ns` earlier, and its equal (thread, stack) pairs merged.
    pub fn add_to(&self, to: &mut impl Numbering, offset_ns: u64) -> Epoch {
        let mut counts: Vec<Count> = Vec::with_capacity(self.counts.len());
        let mut index: HashMap<(u32, u32), usize> = HashMap::new();
        for (entry, frames, n) in &self.counts {
            let process = to.process(&entry.process);
            let thread = to.thread(&ThreadInfo {
                process,
                ..entry.thread.clone()
            });
            let stack = to.stack(frames);
            match index.get(&(thread, stack)) {
                Some(&i) => counts[i].count = counts[i].count.saturating_add(*n),
                None => {
                    index.insert((thread, stack), counts.len());
                    counts.push(Count {
                        thread,
                        stack,
                        count: *n,
                    });
                }
            }
        }
        Epoch {
            start_ns: self.start_ns.saturating_sub(offset_ns),
            end_ns: self.end_ns.saturating_sub(offset_ns),
            counts,
        }
    }
}

impl Recording {
    /// How long it covers, from its start to the end of its last epoch.
    pub fn held_ns(&self) -> u64 {
        self.samples.epochs().last().map_or(0, |e| e.end_ns)
    }

    /// How long its epochs span, from the first one's start.
    pub fn span_ns(&self) -> u64 {
        let first = self.samples.epochs().first().map_or(0, |e| e.start_ns);
        self.held_ns().saturating_sub(first)
    }

    /// `2.5s of cpu at 99 Hz: 245 samples, 1 process, 2 threads`.
    pub fn describe(&self) -> String {
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "es" });
        format!(
            "{:.1}s of {}: {} {}, {}, {} thread{}",
            self.span_ns() as f64 / 1e9,
            self.header.event,
            self.samples.total(),
            self.samples.unit.count_name(),
            plural(self.samples.processes().len(), "process"),
            self.samples.threads().len(),
            if self.samples.threads().len() == 1 {
                ""
            } else {
                "s"
            }
        )
    }
}

/// How a recording is rendered.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// A root frame per process.
    pub processes: bool,
    /// A frame per thread.
    pub threads: bool,
    /// `summary` by line rather than by function.
    pub by_line: bool,
}

/// Where output goes: a file, or for `summary` without `-o`, the terminal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    File(PathBuf),
    Stdout,
}

impl Output {
    /// A path given with -o; `-` is standard output.
    pub fn from_path(path: &Path) -> Output {
        if path.as_os_str() == "-" {
            Output::Stdout
        } else {
            Output::File(path.to_path_buf())
        }
    }
}

impl std::fmt::Display for Output {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Output::File(p) => write!(f, "{}", p.display()),
            Output::Stdout => f.write_str("standard output"),
        }
    }
}

/// Renders `r` as `format` into `output`, a file written whole then renamed
/// into place, so that no reader ever sees half of it.
pub fn write_output(r: &Recording, output: &Output, format: Format, opts: &RenderOptions) -> Result<()> {
    write_with(output, |w| render(r, format, opts, w))
}

/// Writes what `render` writes into `output`: a file written whole then
/// renamed into place, a device or pipe in place, or standard output.
pub fn write_with(output: &Output, render: impl Fn(&mut dyn Write) -> Result<()>) -> Result<()> {
    let path = match output {
        Output::Stdout => {
            let stdout = std::io::stdout();
            let mut w = stdout.lock();
            render(&mut w)?;
            return w.flush().context("writing to standard output");
        }
        Output::File(p) => p,
    };
    // A device or a pipe (/dev/stdout, <(...)) is written in place.
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        let mut w = BufWriter::new(
            File::options()
                .write(true)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?,
        );
        render(&mut w)?;
        return w.flush().with_context(|| format!("writing {}", path.display()));
    }
    let tmp = temporary_name(path);
    let written = (|| -> Result<()> {
        let file = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = BufWriter::new(file);
        render(&mut w)?;
        w.flush()?;
        Ok(())
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("writing {}", path.display())));
    }
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// `dir/.name.tmp`: beside the file, so that renaming it is atomic.
pub fn temporary_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.tmp", std::process::id()))
}

fn render(r: &Recording, format: Format, opts: &RenderOptions, w: &mut dyn Write) -> Result<()> {
    let split = Split {
        processes: opts.processes,
        threads: opts.threads,
        said_by_thread: Some(Frame::marker(NO_RUBY_FRAMES)),
    };
    let count_name = r.samples.unit.count_name().to_string();
    let title = format!("rprof: {}, {}", r.header.target, r.header.event);
    let total = match r.samples.unit {
        Unit::Wall => format!("{:.2} s of thread time", r.samples.total() as f64 / 1e9),
        _ => format!("{} {count_name}", r.samples.total()),
    };
    let counts = match &r.summary {
        Some(s) => format!(
            "{total}, {} lost, {} failed, {} with [unknown] frames",
            s.lost,
            s.failed,
            unknown_amount(s.unknown, r.samples.unit == Unit::Wall)
        ),
        None => format!("{total} (the recording was cut short)"),
    };
    let svg = |icicle: bool, w: &mut dyn Write| -> Result<()> {
        let opts = flamegraphs::SvgOptions {
            title: title.clone(),
            subtitle: Some(counts.clone()),
            count_name: count_name.clone(),
            icicle,
        };
        Ok(r.samples.profile(&split).write_svg(w, &opts)?)
    };
    let summary = |w: &mut dyn Write| -> Result<()> {
        let opts = SummaryOptions {
            by_line: opts.by_line,
            limit: 40,
            title: format!("{title}: {counts}"),
            count_name: count_name.clone(),
        };
        // `wall`: with thread frames, for its time by thread and state
        // (the function rows leave them out).
        let split = Split {
            threads: r.samples.unit == Unit::Wall,
            ..Split::default()
        };
        Ok(flamegraphs::summary::write(&r.samples.profile(&split), &opts, w)?)
    };
    match format {
        Format::Svg | Format::Flame => svg(format == Format::Svg, w)?,
        Format::Folded => r.samples.profile(&split).write_folded(w)?,
        Format::Summary => summary(w)?,
        Format::Html => {
            let (mut graph, mut table) = (Vec::new(), Vec::new());
            svg(true, &mut graph)?;
            summary(&mut table)?;
            let page = flamegraphs::html::Page {
                title: title.clone(),
                subtitle: counts.clone(),
                summary: String::from_utf8_lossy(&table).into_owned(),
                facts: facts(r),
            };
            flamegraphs::html::write(&page, &graph, w)?;
        }
        Format::Speedscope => {
            let exporter = format!("rprof {}", env!("CARGO_PKG_VERSION"));
            flamegraphs::speedscope::write(&r.samples, &title, &exporter, w)
                .context("writing the speedscope profile")?;
        }
        Format::Pprof => {
            let opts = flamegraphs::pprof::PprofOptions {
                time_nanos: r.header.started_ns as i64,
                duration_nanos: r.summary.as_ref().map_or_else(
                    || r.samples.epochs().last().map_or(0, |e| e.end_ns),
                    |s| s.duration_ns,
                ) as i64,
                comments: vec![title, counts],
            };
            flamegraphs::pprof::write(&r.samples, &opts, w)?;
        }
        Format::Rprof => file::write_whole(r, w)?,
    }
    Ok(())
}

/// What a recording's header says, as rows of the HTML page.
fn facts(r: &Recording) -> Vec<(String, String)> {
    vec![
        ("target".to_string(), r.header.target.clone()),
        ("event".to_string(), r.header.event.to_string()),
        ("started".to_string(), timestamp(r.header.started_ns)),
        ("recorded".to_string(), r.describe()),
        ("rprof".to_string(), r.header.rprof_version.clone()),
    ]
}

/// YYYYmmdd-HHMMSS in local time, of `unix_ns`.
pub fn timestamp(unix_ns: u64) -> String {
    let secs = (unix_ns / 1_000_000_000) as libc::time_t;
    // SAFETY: localtime_r with a time and a zeroed tm we own.
    unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&secs, &mut tm);
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

/// Nanoseconds since the Unix epoch, now.
pub fn unix_now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// How much of a recording has `[unknown]` frames: samples or events, or
/// in `wall` (whose counts are nanoseconds) a time.
pub fn unknown_amount(n: u64, wall: bool) -> String {
    if wall {
        format!("{:.1} ms", n as f64 / 1e6)
    } else {
        n.to_string()
    }
}
