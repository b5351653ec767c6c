//! The agent's sink: each closed epoch's counts added to its process's
//! profile of the interval; at the interval's end, each process's profile
//! rendered as pprof, labelled and queued for the push. A line a minute
//! says what was done.

use std::collections::HashMap;
use std::io::Read;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Result;
use flamegraphs::{Frame, ProcessInfo, Samples};

use super::labels;
use super::push::{Profile, Sender};
use crate::record::{EpochSink, Progress};
use crate::recording::{self, Counted, EpochCounts, Summary, ThreadEntry};

/// Pyroscope's limits on one profile: samples, and uncompressed bytes.
const MAX_SAMPLES: usize = 16_000;
const MAX_BYTES: usize = 4 << 20;
/// How often the agent says what it did.
const LOG_EVERY: Duration = Duration::from_secs(60);
/// How long the end waits for queued profiles to go.
const LAST_PUSH_WAIT: Duration = Duration::from_secs(10);

/// A process's counts in the interval, by (thread, stack).
struct Part {
    process: Rc<ProcessInfo>,
    labels: Vec<(String, String)>,
    counts: HashMap<(Rc<ThreadEntry>, Rc<Vec<Frame>>), u64>,
    ended: bool,
}

pub struct Pusher {
    interval_ns: u64,
    /// `__name__`: the profile type (`process_cpu`, `wall`).
    name: &'static str,
    /// The user's labels and the host's.
    labels: Vec<(String, String)>,
    sender: Sender,
    /// By (PID, start time).
    parts: HashMap<(u32, u64), Part>,
    /// The interval under way: since when (recording time).
    part_start_ns: u64,
    /// The recording's start, Unix time: recording time counts from it.
    started_unix_ns: u64,
    /// Of the recording so far, for the minute line.
    pushed_profiles: u64,
    /// Ruby processes profiled at the last epoch.
    rubies: usize,
    trimmed: u64,
    last_log: Instant,
    /// What the counts are (samples, nanoseconds).
    unit: flamegraphs::Unit,
}

impl Pusher {
    pub fn new(
        interval: Duration,
        name: &'static str,
        unit: flamegraphs::Unit,
        mut user: Vec<(String, String)>,
        sender: Sender,
    ) -> Self {
        user.push(("hostname".to_string(), labels::hostname()));
        Self {
            interval_ns: interval.as_nanos() as u64,
            name,
            labels: user,
            sender,
            parts: HashMap::new(),
            part_start_ns: 0,
            started_unix_ns: 0,
            pushed_profiles: 0,
            rubies: 0,
            trimmed: 0,
            last_log: Instant::now(),
            unit,
        }
    }

    /// The interval's start in Unix time: dated by the recording's clock,
    /// as its counts are, not by when the last interval was flushed (later
    /// by however long its epoch took to close).
    fn part_start_unix_ns(&self) -> u64 {
        self.started_unix_ns + self.part_start_ns
    }

    fn add(&mut self, (thread, stack, n): &Counted) {
        let p = &thread.process;
        let part = self.parts.entry((p.pid, p.started)).or_insert_with(|| Part {
            process: Rc::clone(p),
            labels: labels::of_process(p.pid, &p.command),
            counts: HashMap::new(),
            ended: false,
        });
        *part
            .counts
            .entry((Rc::clone(thread), Rc::clone(stack)))
            .or_default() += n;
    }

    /// Every process's profile of the interval ending at `end_ns` into the
    /// queue; the next interval starts.
    fn flush(&mut self, end_ns: u64) {
        let duration_ns = end_ns.saturating_sub(self.part_start_ns);
        let unit = self.unit.clone();
        let mut parts = std::mem::take(&mut self.parts);
        for part in parts.values_mut() {
            if part.counts.is_empty() {
                continue;
            }
            if let Some(pprof) = self.render(part, &unit, duration_ns) {
                let mut labels = self.labels.clone();
                labels.extend(part.labels.iter().cloned());
                labels.push(("__name__".to_string(), self.name.to_string()));
                self.sender.push(Profile {
                    labels,
                    pprof,
                    start_ns: self.part_start_unix_ns(),
                });
                self.pushed_profiles += 1;
            }
            part.counts.clear();
        }
        // Processes that ended are not pushed again.
        parts.retain(|_, p| !p.ended);
        self.parts = parts;
        self.part_start_ns = end_ns;
    }

    /// The part as gzipped pprof within Pyroscope's limits: its largest
    /// (thread, stack) counts, as many as fit; what is left out is counted.
    fn render(&mut self, part: &Part, unit: &flamegraphs::Unit, duration_ns: u64) -> Option<Vec<u8>> {
        let mut counts: Vec<Counted> = part
            .counts
            .iter()
            .map(|((t, s), n)| (Rc::clone(t), Rc::clone(s), *n))
            .collect();
        counts.sort_by_key(|c| std::cmp::Reverse(c.2));
        let mut keep = counts.len().min(MAX_SAMPLES);
        while keep > 0 {
            let pprof = pprof_of(
                &counts[..keep],
                unit,
                self.part_start_unix_ns(),
                duration_ns,
                &part.process,
            )?;
            if unpacked_len(&pprof) <= MAX_BYTES {
                self.trimmed += counts[keep..].iter().map(|c| c.2).sum::<u64>();
                return Some(pprof);
            }
            keep /= 2;
        }
        None
    }

    /// The minute line: what the agent follows and what it pushed.
    fn log(&mut self, totals: &Summary, progress: &Progress) {
        let s = &self.sender.stats;
        let mut line = format!(
            "rprof: agent: {} Ruby processes followed, {} samples, {} profiles made; pushes {} ok, {} failed, {} retried, {} dropped, {} bytes sent",
            self.rubies,
            totals.samples,
            self.pushed_profiles,
            s.ok.load(Ordering::Relaxed),
            s.failed.load(Ordering::Relaxed),
            s.retried.load(Ordering::Relaxed),
            s.dropped.load(Ordering::Relaxed),
            s.bytes.load(Ordering::Relaxed),
        );
        if self.trimmed > 0 {
            line.push_str(&format!(
                ", {} samples trimmed to fit 16,000 per profile",
                self.trimmed
            ));
        }
        if let Some(why) = s.last_error.lock().ok().and_then(|mut e| e.take()) {
            line.push_str(&format!("; last failure: {why}"));
        }
        progress.say(&line);
        self.last_log = Instant::now();
    }
}

impl EpochSink for Pusher {
    fn epoch(
        &mut self,
        counts: &EpochCounts,
        totals: &Summary,
        progress: &Progress,
        rubies: usize,
    ) -> Result<()> {
        self.rubies = rubies;
        for c in &counts.counts {
            self.add(c);
        }
        for p in &counts.ended {
            if let Some(part) = self.parts.get_mut(&(p.pid, p.started)) {
                part.ended = true;
            }
        }
        if counts.end_ns.saturating_sub(self.part_start_ns) >= self.interval_ns {
            self.flush(counts.end_ns);
        }
        if self.last_log.elapsed() >= LOG_EVERY {
            self.log(totals, progress);
        }
        Ok(())
    }

    fn begin(&mut self, header: &recording::Header) {
        self.started_unix_ns = header.started_ns;
    }

    fn finish(&mut self, totals: &Summary) {
        self.flush(totals.duration_ns);
        // RPROF_LAST_PUSH_WAIT_MS: a shorter wait (the tests of a server
        // that refuses every push).
        let wait = std::env::var("RPROF_LAST_PUSH_WAIT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(LAST_PUSH_WAIT, Duration::from_millis);
        self.sender.close(wait);
        self.log(totals, &Progress::new(true));
    }
}

/// One process's counts as a gzipped pprof profile of its interval.
fn pprof_of(
    counts: &[Counted],
    unit: &flamegraphs::Unit,
    start_unix_ns: u64,
    duration_ns: u64,
    process: &ProcessInfo,
) -> Option<Vec<u8>> {
    let epoch = EpochCounts {
        start_ns: 0,
        end_ns: duration_ns,
        counts: counts.to_vec(),
        ended: Vec::new(),
    };
    let mut samples = Samples::new(unit.clone());
    let e = epoch.add_to(&mut samples, 0);
    samples.push_epoch(e).ok()?;
    let opts = flamegraphs::pprof::PprofOptions {
        time_nanos: start_unix_ns as i64,
        duration_nanos: duration_ns as i64,
        comments: vec![format!(
            "rprof agent: process {} ({})",
            process.pid, process.command
        )],
    };
    let mut out = Vec::new();
    flamegraphs::pprof::write(&samples, &opts, &mut out).ok()?;
    Some(out)
}

/// The size of a gzipped profile unpacked (what Pyroscope's limit is on).
fn unpacked_len(gz: &[u8]) -> usize {
    let mut d = flate2::read::GzDecoder::new(gz);
    let mut buf = [0u8; 64 << 10];
    let mut n = 0;
    while let Ok(k) = d.read(&mut buf) {
        if k == 0 {
            break;
        }
        n += k;
    }
    n
}
