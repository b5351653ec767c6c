//! Recording for as long as it takes, in bounded memory: `--rotate` writes
//! one complete profile per interval and keeps the last few; the flight
//! recorder keeps the last minutes and writes them when asked.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use flamegraphs::Samples;

use super::{write_output, EpochCounts, Header, Output, Recording, RenderOptions, Summary};
use crate::cli::Format;

/// Where and how the parts are written.
pub struct PartOutput {
    pub dir: PathBuf,
    /// What the file names say the parts are of: the first target's PID
    /// (`all` with --all).
    pub named: String,
    pub format: Format,
    pub options: RenderOptions,
}

impl PartOutput {
    /// `DIR/rprof-PID-YYYYmmdd-HHMMSS.EXT` (`rprof-all-...`) for a part that started at
    /// `started_ns` (Unix time); `-2`, `-3`... if that name is taken.
    fn path(&self, started_ns: u64) -> PathBuf {
        let stamp = super::timestamp(started_ns);
        let ext = self.format.extension();
        let mut path = self.dir.join(format!("rprof-{}-{stamp}.{ext}", self.named));
        let mut n = 2;
        while path.exists() {
            path = self.dir.join(format!("rprof-{}-{stamp}-{n}.{ext}", self.named));
            n += 1;
        }
        path
    }

    /// Writes a recording as a part (atomically), and says where.
    fn write(&self, r: &Recording) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        let path = self.path(r.header.started_ns);
        write_output(r, &Output::File(path.clone()), self.format, &self.options)?;
        Ok(path)
    }
}

/// The counts of a stretch of the recording: the totals at its end less
/// those at its start.
fn between(start: &Summary, end: &Summary) -> Summary {
    Summary {
        samples: end.samples.saturating_sub(start.samples),
        lost: end.lost.saturating_sub(start.lost),
        failed: end.failed.saturating_sub(start.failed),
        unknown: end.unknown.saturating_sub(start.unknown),
        duration_ns: end.duration_ns.saturating_sub(start.duration_ns),
    }
}

/// `--rotate`: one complete recording per interval, each written on its own.
pub struct Rotation {
    out: PartOutput,
    every_ns: u64,
    keep: Option<usize>,
    header: Header,
    part: Samples,
    /// Totals when the part started.
    part_start: Summary,
    written: VecDeque<PathBuf>,
}

impl Rotation {
    pub fn new(out: PartOutput, every: Duration, keep: Option<usize>, header: Header) -> Self {
        Self {
            out,
            every_ns: every.as_nanos() as u64,
            keep,
            part: Samples::new(header.event.unit()),
            header,
            part_start: Summary::default(),
            written: VecDeque::new(),
        }
    }

    /// Adds an epoch; once the interval is full, writes the part and starts
    /// the next. `totals` are the recording's counts so far.
    pub fn epoch(&mut self, counts: &EpochCounts, totals: &Summary) -> Result<Option<PathBuf>> {
        let epoch = counts.add_to(&mut self.part, self.part_start.duration_ns);
        self.part
            .push_epoch(epoch)
            .context("adding an epoch to the part")?;
        if counts.end_ns.saturating_sub(self.part_start.duration_ns) >= self.every_ns {
            return self.write_part(totals).map(Some);
        }
        Ok(None)
    }

    /// Writes what the part holds (at the end: if anything), and starts the next.
    pub fn finish(&mut self, totals: &Summary) -> Result<Option<PathBuf>> {
        if self.part.epochs().is_empty() {
            return Ok(None);
        }
        self.write_part(totals).map(Some)
    }

    fn write_part(&mut self, totals: &Summary) -> Result<PathBuf> {
        let samples = std::mem::replace(&mut self.part, Samples::new(self.header.event.unit()));
        let r = Recording {
            header: Header {
                started_ns: self.header.started_ns + self.part_start.duration_ns,
                ..self.header.clone()
            },
            samples,
            summary: Some(between(&self.part_start, totals)),
        };
        self.part_start = totals.clone();
        let path = self.out.write(&r)?;
        self.written.push_back(path.clone());
        while self.keep.is_some_and(|k| self.written.len() > k) {
            if let Some(old) = self.written.pop_front() {
                std::fs::remove_file(&old).with_context(|| format!("removing {}", old.display()))?;
            }
        }
        Ok(path)
    }
}

/// `--flight-recorder`: the last `window` of the recording, in memory.
pub struct FlightRecorder {
    out: PartOutput,
    window_ns: u64,
    header: Header,
    samples: Samples,
    /// The totals at the end of each epoch held, oldest first.
    totals: VecDeque<Summary>,
}

impl FlightRecorder {
    pub fn new(out: PartOutput, window: Duration, header: Header) -> Self {
        Self {
            out,
            window_ns: window.as_nanos() as u64,
            samples: Samples::new(header.event.unit()),
            header,
            totals: VecDeque::new(),
        }
    }

    pub fn epoch(&mut self, counts: &EpochCounts, totals: &Summary) -> Result<()> {
        let epoch = counts.add_to(&mut self.samples, 0);
        self.samples
            .push_epoch(epoch)
            .context("adding an epoch to the window")?;
        self.totals.push_back(totals.clone());
        let since = counts.end_ns.saturating_sub(self.window_ns);
        self.samples.forget_before(since);
        // The totals before the oldest epoch held, to subtract.
        while self.totals.len() > self.samples.epochs().len() + 1 {
            self.totals.pop_front();
        }
        Ok(())
    }

    /// Writes the window as a part, the recording going on.
    pub fn write(&self, totals: &Summary) -> Result<Option<PathBuf>> {
        let Some(first) = self.samples.epochs().first() else {
            return Ok(None);
        };
        let before = match self.totals.len() > self.samples.epochs().len() {
            true => self.totals.front().cloned().unwrap_or_default(),
            false => Summary::default(),
        };
        // Rebased on the window's start, as a recording of its own.
        let rebased = self.samples.rebased(first.start_ns);
        let r = Recording {
            header: Header {
                started_ns: self.header.started_ns + first.start_ns,
                ..self.header.clone()
            },
            samples: rebased,
            summary: Some(between(&before, totals)),
        };
        self.out.write(&r).map(Some)
    }
}
