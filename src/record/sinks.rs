//! Where a recording's epochs go as they close (its streamed files,
//! rotation, the flight recorder, the heap log), and the output written
//! from them at the end.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use super::progress::Progress;
use super::top::Top;
use super::{Continuous, RecordConfig};
use crate::cli::Format;
use crate::heap_log::HeapLog;
use crate::recording::continuous::{FlightRecorder, PartOutput, Rotation};
use crate::recording::{self, file, write_output, EpochCounts, Header, Output, RenderOptions, Summary};

/// Where closed epochs go beyond files: given by whoever runs the recording
/// (`rprof agent`'s push), which then writes no output of its own.
pub trait EpochSink {
    /// A closed epoch; `totals` are the recording's counts so far, `rubies`
    /// the Ruby processes profiled now.
    fn epoch(
        &mut self,
        counts: &EpochCounts,
        totals: &Summary,
        progress: &Progress,
        rubies: usize,
    ) -> Result<()>;
    /// The recording begins: its header says when (Unix time), which the
    /// epochs' times count from.
    fn begin(&mut self, header: &Header);
    /// The recording ended: what is still held goes now.
    fn finish(&mut self, totals: &Summary);
}

/// Where the epochs of a recording go as they close.
pub struct Sinks {
    /// The recording's file(s): --raw, `--format rprof`, or a temporary file
    /// the output is rendered from at the end.
    streams: Vec<file::Writer>,
    /// --raw, said among what was written; `streams[0]` when given.
    raw: Option<PathBuf>,
    rotation: Option<Rotation>,
    pub flight: Option<FlightRecorder>,
    /// RPROF_HEAP_LOG: rprof's own heap, epoch by epoch.
    heap: Option<HeapLog>,
    /// The stream the output is rendered from, if not written by then.
    render_from: Option<usize>,
    /// `rprof top`'s live view.
    top: Option<Top>,
    /// No output (`rprof top` without -o, an external sink).
    discard: bool,
    external: Option<Box<dyn EpochSink>>,
}

impl Sinks {
    /// Whether the live view was quit.
    pub fn quit(&self) -> bool {
        self.top.as_ref().is_some_and(Top::quit)
    }

    /// The keys pressed on the live view.
    pub fn keys(&mut self) -> Result<()> {
        self.top.as_mut().map_or(Ok(()), Top::keys)
    }

    pub fn epoch(
        &mut self,
        counts: &EpochCounts,
        totals: &Summary,
        progress: &Progress,
        rubies: usize,
    ) -> Result<()> {
        if let Some(t) = &mut self.top {
            t.epoch(counts, totals)?;
        }
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
        if let Some(x) = &mut self.external {
            x.epoch(counts, totals, progress, rubies)?;
        }
        Ok(())
    }
}

/// The format asked for, or the output's extension's, or svg.
pub fn output_format(cfg: &RecordConfig) -> Result<Format> {
    // With --rotate or --flight-recorder, -o names a directory.
    let file = cfg.output.as_deref().filter(|_| cfg.continuous.is_none());
    Ok(Format::for_output(cfg.format, file)?)
}

/// The output file; or with --rotate and --flight-recorder, the directory.
pub fn output_path(cfg: &RecordConfig, format: Format, named: &str, started_ns: u64) -> Output {
    match (&cfg.output, cfg.continuous, format) {
        (Some(p), None, _) => Output::from_path(p),
        (Some(p), Some(_), _) => Output::File(p.clone()),
        (None, Some(_), _) => Output::File(PathBuf::from(".")),
        (None, None, Format::Summary) => Output::Stdout,
        (None, None, _) => Output::File(PathBuf::from(format!(
            "rprof-{named}-{}.{}",
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
pub fn open_sinks(
    cfg: &RecordConfig,
    header: &Header,
    format: Format,
    output: &Output,
    named: &str,
    mut external: Option<Box<dyn EpochSink>>,
) -> Result<Sinks> {
    if let Some(x) = &mut external {
        x.begin(header);
    }
    let discard = (cfg.top && cfg.output.is_none()) || external.is_some();
    let mut sinks = Sinks {
        streams: Vec::new(),
        raw: cfg.raw.clone(),
        rotation: None,
        flight: None,
        heap: HeapLog::from_env()?,
        render_from: None,
        top: cfg.top.then(|| Top::new(header)),
        discard,
        external,
    };
    if sinks.discard {
        return Ok(sinks);
    }
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
                named: named.to_string(),
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
pub fn finish_sinks(
    sinks: &mut Sinks,
    summary: &Summary,
    output: &Output,
    format: Format,
    render: &RenderOptions,
) -> (Vec<String>, Option<anyhow::Error>) {
    if let Some(t) = &mut sinks.top {
        t.finish();
    }
    if let Some(x) = &mut sinks.external {
        x.finish(summary);
    }
    let mut written: Vec<String> = sinks.raw.iter().map(|p| p.display().to_string()).collect();
    if sinks.discard {
        return (written, None);
    }
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
