//! speedscope's file format (https://www.speedscope.app/file-format-schema.json):
//! one sampled profile per thread, its samples in the order of the epochs
//! they were counted in, weighted by CPU time or by event count.

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;

use crate::samples::{Samples, Unit};

#[derive(Serialize)]
struct File<'a> {
    #[serde(rename = "$schema")]
    schema: &'static str,
    shared: Shared<'a>,
    profiles: Vec<SampledProfile>,
    name: &'a str,
    #[serde(rename = "activeProfileIndex")]
    active_profile_index: usize,
    exporter: &'a str,
}

#[derive(Serialize)]
struct Shared<'a> {
    frames: Vec<FrameInfo<'a>>,
}

#[derive(Serialize)]
struct FrameInfo<'a> {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    line: Option<u32>,
}

#[derive(Serialize)]
struct SampledProfile {
    #[serde(rename = "type")]
    kind: &'static str,
    name: String,
    unit: &'static str,
    #[serde(rename = "startValue")]
    start_value: u64,
    #[serde(rename = "endValue")]
    end_value: u64,
    samples: Vec<Vec<u32>>,
    weights: Vec<u64>,
}

/// Writes `samples` as a speedscope file named `name`, made by `exporter`.
/// CPU samples weigh their period in nanoseconds, and a thread's profile
/// spans its first to its last epoch; events weigh one each.
pub fn write<W: Write>(samples: &Samples, name: &str, exporter: &str, w: W) -> serde_json::Result<()> {
    let frames = samples
        .frames()
        .iter()
        .map(|f| FrameInfo {
            name: f.to_string_without_location(),
            file: f.file.as_deref(),
            line: f.line,
        })
        .collect();
    // Threads in the order of their process and id, so the first profile is
    // the main thread of the first process.
    let mut by_thread: BTreeMap<(u32, u32, u32), SampledProfile> = BTreeMap::new();
    let (unit, weight) = match samples.unit {
        Unit::CpuSamples { period_ns } => ("nanoseconds", period_ns),
        Unit::Events { .. } => ("none", 1),
        Unit::Wall => ("nanoseconds", 1),
    };
    for e in samples.epochs() {
        for c in &e.counts {
            let t = &samples.threads()[c.thread as usize];
            let p = &samples.processes()[t.process as usize];
            let profile = by_thread
                .entry((t.process, t.tid, c.thread))
                .or_insert_with(|| SampledProfile {
                    kind: "sampled",
                    name: format!("{} {}", p.label, t.label),
                    unit,
                    start_value: if weight > 1 { e.start_ns } else { 0 },
                    end_value: 0,
                    samples: Vec::new(),
                    weights: Vec::new(),
                });
            profile.samples.push(samples.stacks()[c.stack as usize].clone());
            profile.weights.push(c.count.saturating_mul(weight));
            // Until its total is known: where its last epoch ended.
            profile.end_value = e.end_ns;
        }
    }
    for p in by_thread.values_mut() {
        let total = p.weights.iter().fold(0u64, |sum, w| sum.saturating_add(*w));
        p.end_value = if weight > 1 {
            p.end_value.max(p.start_value.saturating_add(total))
        } else {
            total
        };
    }
    let file = File {
        schema: "https://www.speedscope.app/file-format-schema.json",
        shared: Shared { frames },
        profiles: by_thread.into_values().collect(),
        name,
        active_profile_index: 0,
        exporter,
    };
    serde_json::to_writer(w, &file)
}
