//! `rprof report`: a recording read back and rendered again, cut to a time
//! window, processes or threads.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

use super::{write_output, Output, RenderOptions};
use crate::cli::Format;

/// What `rprof report` was asked for, its arguments checked.
pub struct ReportConfig {
    pub input: PathBuf,
    /// Default: the input's name with the format's extension (summary: stdout).
    pub output: Option<PathBuf>,
    /// Default: from the output's extension.
    pub format: Option<Format>,
    /// Only epochs whose middle is in `from..to`, since the recording started.
    pub from: Option<Duration>,
    pub to: Option<Duration>,
    /// Only these processes (none: all).
    pub pids: Vec<u32>,
    /// Only these threads, by id, name or label (none: all).
    pub threads: Vec<String>,
    pub render: RenderOptions,
}

/// Reads the recording, keeps what was asked for and writes it.
pub fn report(config: ReportConfig) -> Result<()> {
    let read = super::file::read(&config.input)?;
    let mut r = read.recording;
    if let Some((offset, why)) = read.cut_short {
        eprintln!(
            "rprof: warning: {} was cut short at byte {offset} ({why}); its first {:.1}s are reported",
            config.input.display(),
            r.held_ns() as f64 / 1e9
        );
    }
    let ns = |t: Option<Duration>| t.map(|t| t.as_nanos() as u64);
    let (from, to) = (ns(config.from), ns(config.to));
    if let (Some(f), Some(t)) = (from, to) {
        if f >= t {
            anyhow::bail!("--from must come before --to");
        }
    }
    if from.is_some() || to.is_some() || !config.pids.is_empty() || !config.threads.is_empty() {
        let before = r.samples.total();
        r.samples = r.samples.filter(
            |e| {
                let middle = e.start_ns / 2 + e.end_ns / 2;
                from.is_none_or(|f| middle >= f) && to.is_none_or(|t| middle < t)
            },
            |t, p| {
                (config.pids.is_empty() || config.pids.contains(&p.pid))
                    && (config.threads.is_empty()
                        || config
                            .threads
                            .iter()
                            .any(|want| *want == t.tid.to_string() || *want == t.name || t.label == *want))
            },
        );
        if r.samples.total() == 0 && before > 0 {
            eprintln!(
                "rprof: warning: nothing recorded matches --from/--to/--pid/--thread ({before} in all)"
            );
        }
    }
    let format = Format::for_output(config.format, config.output.as_deref())?;
    let output = match (config.output, format) {
        (Some(p), _) => Output::from_path(&p),
        (None, Format::Summary) => Output::Stdout,
        (None, _) => Output::File(config.input.with_extension(format.extension())),
    };
    if output == Output::File(config.input.clone()) {
        anyhow::bail!("refusing to overwrite {} with itself", config.input.display());
    }
    write_output(&r, &output, format, &config.render)?;
    if output != Output::Stdout {
        eprintln!("rprof: wrote {output}: {}", r.describe());
    }
    Ok(())
}
