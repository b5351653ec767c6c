//! The live line on a terminal while recording.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::processes::Counts;
use crate::recording::Summary;

/// The live line on a terminal: elapsed, samples, lost, failed, processes.
pub struct Progress(ProgressBar);

impl Progress {
    pub fn new(quiet: bool) -> Self {
        if quiet || !std::io::stderr().is_terminal() {
            return Progress(ProgressBar::hidden());
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(4));
        if let Ok(style) = ProgressStyle::with_template("{spinner} rprof: recording {elapsed_precise}: {msg}")
        {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(250));
        Progress(bar)
    }

    pub fn update(&self, totals: &Summary, unit: &str, followed: Option<Counts>) {
        let mut msg = format!(
            "{} {unit}, {} lost, {} failed",
            totals.samples, totals.lost, totals.failed
        );
        if let Some(n) = followed {
            msg.push_str(&format!(", {} processes followed", n.followed));
        }
        self.0.set_message(msg);
    }

    /// A line above the progress line.
    pub fn say(&self, line: &str) {
        self.0.suspend(|| eprintln!("{line}"));
    }

    pub fn finish(&self) {
        self.0.finish_and_clear();
    }
}
