//! `rprof report`: a recording read back and rendered again, cut to a time
//! window, processes or threads.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

use super::diff::{self, Compare, Named};
use super::{write_output, Output, Recording, RenderOptions};
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
    /// Compared with this recording, from before (`rprof diff`).
    pub diff: Option<PathBuf>,
    /// With `diff`: counts as recorded, not shares.
    pub absolute: bool,
    /// Open the output in a browser (html unless a format is asked for).
    pub open: bool,
}

/// Reads the recording, keeps what was asked for and writes it (compared
/// with the one before, for `--diff`).
pub fn report(config: ReportConfig) -> Result<()> {
    let r = load(&config.input, &config)?;
    let format = match (config.open, config.format, &config.output) {
        (true, None, None) => Format::Html,
        _ => Format::for_output(config.format, config.output.as_deref())?,
    };
    let before = config.diff.as_ref().map(|path| load(path, &config)).transpose()?;
    if before.is_some() {
        diff::check_format(format)?;
    }
    let output = match (&config.output, format) {
        (Some(p), _) => Output::from_path(p),
        (None, Format::Summary) => Output::Stdout,
        (None, _) if before.is_some() => Output::File(
            config
                .input
                .with_extension(format!("diff.{}", format.extension())),
        ),
        (None, _) => Output::File(config.input.with_extension(format.extension())),
    };
    for input in std::iter::once(&config.input).chain(&config.diff) {
        if output == Output::File(input.clone()) {
            anyhow::bail!("refusing to overwrite {} with the report", input.display());
        }
    }
    match (&before, &config.diff) {
        (Some(before), Some(path)) => {
            let compare = Compare {
                absolute: config.absolute,
                by_line: config.render.by_line,
            };
            let (b, a) = (
                Named {
                    path,
                    recording: before,
                },
                Named {
                    path: &config.input,
                    recording: &r,
                },
            );
            diff::write(&b, &a, &output, format, &compare)?;
        }
        _ => write_output(&r, &output, format, &config.render)?,
    }
    let Output::File(written) = &output else {
        return Ok(());
    };
    match &config.diff {
        Some(path) => eprintln!(
            "rprof: wrote {output}: {} against {}",
            config.input.display(),
            path.display()
        ),
        None => eprintln!("rprof: wrote {output}: {}", r.describe()),
    }
    if config.open {
        open_in_browser(written);
    }
    Ok(())
}

/// Opens `path` in $BROWSER, or with xdg-open where there is a display; or
/// says where it is (a server over SSH has no browser).
fn open_in_browser(path: &std::path::Path) {
    let display = ["DISPLAY", "WAYLAND_DISPLAY"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|d| !d.is_empty()));
    let browser = std::env::var("BROWSER")
        .ok()
        .filter(|b| !b.is_empty())
        .or_else(|| display.then(|| "xdg-open".to_string()));
    let Some(browser) = browser else {
        eprintln!(
            "rprof: no browser here (no $BROWSER, no display): copy {} to a machine with one",
            path.display()
        );
        return;
    };
    // Not waited for: a browser may run for as long as it is open.
    match std::process::Command::new(&browser)
        .arg(path)
        .stdin(std::process::Stdio::null())
        .spawn()
    {
        Ok(_) => eprintln!("rprof: opened {} with {browser}", path.display()),
        Err(e) => eprintln!(
            "rprof: could not start {browser} ({e}): open {} yourself",
            path.display()
        ),
    }
}

/// A recording read back, cut to the window, processes and threads asked
/// for.
fn load(path: &std::path::Path, config: &ReportConfig) -> Result<Recording> {
    let read = super::file::read(path)?;
    let mut r = read.recording;
    if let Some((offset, why)) = read.cut_short {
        eprintln!(
            "rprof: warning: {} was cut short at byte {offset} ({why}); its first {:.1}s are reported",
            path.display(),
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
                "rprof: warning: nothing recorded matches --from/--to/--pid/--thread in {} ({before} in all)",
                path.display()
            );
        }
    }
    Ok(r)
}
