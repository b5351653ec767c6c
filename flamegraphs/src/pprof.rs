//! pprof's profile.proto, gzipped: what `go tool pprof`, Pyroscope, Parca and
//! Grafana read. The messages are derived with prost from their field numbers
//! (github.com/google/pprof, proto/profile.proto); only what rprof fills is
//! declared, as protobuf readers skip nothing they are not sent.

use std::collections::HashMap;
use std::io::Write;

use flate2::write::GzEncoder;
use prost::Message;

use crate::samples::{Samples, Unit};
use crate::FrameKind;

#[derive(Clone, PartialEq, Message)]
struct Profile {
    #[prost(message, repeated, tag = "1")]
    sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    sample: Vec<Sample>,
    #[prost(message, repeated, tag = "4")]
    location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    string_table: Vec<String>,
    #[prost(int64, tag = "9")]
    time_nanos: i64,
    #[prost(int64, tag = "10")]
    duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    period: i64,
    #[prost(int64, repeated, tag = "13")]
    comment: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
struct ValueType {
    #[prost(int64, tag = "1")]
    r#type: i64,
    #[prost(int64, tag = "2")]
    unit: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Sample {
    /// Leaf first.
    #[prost(uint64, repeated, tag = "1")]
    location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    label: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
struct Label {
    #[prost(int64, tag = "1")]
    key: i64,
    #[prost(int64, tag = "2")]
    str: i64,
    #[prost(int64, tag = "3")]
    num: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Location {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(message, repeated, tag = "4")]
    line: Vec<Line>,
}

#[derive(Clone, PartialEq, Message)]
struct Line {
    #[prost(uint64, tag = "1")]
    function_id: u64,
    #[prost(int64, tag = "2")]
    line: i64,
}

#[derive(Clone, PartialEq, Message)]
struct Function {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(int64, tag = "2")]
    name: i64,
    #[prost(int64, tag = "3")]
    system_name: i64,
    #[prost(int64, tag = "4")]
    filename: i64,
}

/// Strings by index, the first one empty as the format requires.
#[derive(Default)]
struct Strings {
    table: Vec<String>,
    index: HashMap<String, i64>,
}

impl Strings {
    fn id(&mut self, s: &str) -> i64 {
        if self.table.is_empty() {
            self.table.push(String::new());
            self.index.insert(String::new(), 0);
        }
        if let Some(&i) = self.index.get(s) {
            return i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_string());
        self.index.insert(s.to_string(), i);
        i
    }
}

/// What the profile says of itself.
#[derive(Debug, Clone, Default)]
pub struct PprofOptions {
    /// Start of the recording, in nanoseconds since the Unix epoch.
    pub time_nanos: i64,
    pub duration_nanos: i64,
    /// Shown by `go tool pprof` as comments.
    pub comments: Vec<String>,
}

/// Writes `samples` as a gzipped profile: a location per frame, a function
/// per (name, file), a sample per (thread, stack) with `pid`, `thread_id` and
/// `thread_name` labels (names Pyroscope 1.x accepts: no spaces). CPU samples carry two values, their count and their
/// CPU time in nanoseconds; events, their count.
pub fn write<W: Write>(samples: &Samples, options: &PprofOptions, w: W) -> std::io::Result<()> {
    let mut strings = Strings::default();
    strings.id("");
    let (sample_type, period_type, period) = match &samples.unit {
        Unit::CpuSamples { period_ns } => {
            let cpu = ValueType {
                r#type: strings.id("cpu"),
                unit: strings.id("nanoseconds"),
            };
            let count = ValueType {
                r#type: strings.id("samples"),
                unit: strings.id("count"),
            };
            (vec![count, cpu.clone()], Some(cpu), *period_ns as i64)
        }
        Unit::Events { name } => {
            let events = ValueType {
                r#type: strings.id(name),
                unit: strings.id("count"),
            };
            (vec![events.clone()], Some(events), 1)
        }
        Unit::Wall => {
            let wall = ValueType {
                r#type: strings.id("wall"),
                unit: strings.id("nanoseconds"),
            };
            (vec![wall.clone()], Some(wall), 1)
        }
    };
    let mut functions: Vec<Function> = Vec::new();
    let mut function_index: HashMap<(String, Option<&str>), u64> = HashMap::new();
    let mut locations = Vec::with_capacity(samples.frames().len());
    for (i, f) in samples.frames().iter().enumerate() {
        let name = f.to_string_without_location();
        let key = (name, f.file.as_deref());
        let function_id = match function_index.get(&key) {
            Some(&id) => id,
            None => {
                let id = functions.len() as u64 + 1;
                let name = strings.id(&key.0);
                // No system name: pprof takes a name equal to it for a
                // mangled one and cuts `<main>` out of `block in <main>`.
                functions.push(Function {
                    id,
                    name,
                    system_name: 0,
                    filename: strings.id(f.file.as_deref().unwrap_or("")),
                });
                function_index.insert(key, id);
                id
            }
        };
        let line = match f.kind {
            FrameKind::Code => f.line.unwrap_or(0) as i64,
            _ => 0,
        };
        locations.push(Location {
            id: i as u64 + 1,
            line: vec![Line { function_id, line }],
        });
    }
    let mut sums: HashMap<(u32, u32), u64> = HashMap::new();
    for c in samples.epochs().iter().flat_map(|e| &e.counts) {
        let sum = sums.entry((c.thread, c.stack)).or_default();
        *sum = sum.saturating_add(c.count);
    }
    let mut sums: Vec<_> = sums.into_iter().collect();
    sums.sort();
    let (pid, tid, thread_name, state) = (
        strings.id("pid"),
        strings.id("thread_id"),
        strings.id("thread_name"),
        strings.id("state"),
    );
    let mut out = Vec::with_capacity(sums.len());
    for ((thread, stack), n) in sums {
        let t = &samples.threads()[thread as usize];
        let p = &samples.processes()[t.process as usize];
        let frames = &samples.stacks()[stack as usize];
        let location_id = frames.iter().rev().map(|&f| f as u64 + 1).collect();
        let value = match samples.unit {
            Unit::CpuSamples { period_ns } => vec![n as i64, n.saturating_mul(period_ns) as i64],
            Unit::Events { .. } | Unit::Wall => vec![n as i64],
        };
        // `wall`: what the thread was doing, its stack's leaf, as a label too.
        let leaf_state = frames
            .last()
            .map(|&f| &samples.frames()[f as usize])
            .filter(|f| f.kind == FrameKind::State);
        let mut label = vec![
            Label {
                key: pid,
                str: 0,
                num: p.pid as i64,
            },
            Label {
                key: tid,
                str: 0,
                num: t.tid as i64,
            },
            Label {
                key: thread_name,
                str: strings.id(&t.name),
                num: 0,
            },
        ];
        if let Some(f) = leaf_state {
            label.push(Label {
                key: state,
                str: strings.id(&f.name),
                num: 0,
            });
        }
        out.push(Sample {
            location_id,
            value,
            label,
        });
    }
    let comment = options.comments.iter().map(|c| strings.id(c)).collect();
    let profile = Profile {
        sample_type,
        sample: out,
        location: locations,
        function: functions,
        string_table: strings.table,
        time_nanos: options.time_nanos,
        duration_nanos: options.duration_nanos,
        period_type,
        period,
        comment,
    };
    let mut gz = GzEncoder::new(w, flate2::Compression::default());
    gz.write_all(&profile.encode_to_vec())?;
    gz.finish()?;
    Ok(())
}
