//! The line rprof ends a recording with: what was counted, lost and
//! failed, and why.

use super::collector::Collector;
use crate::bpf::Stats;
use crate::processes::{Counts, Processes};
use crate::recording::Summary;
use crate::resolve;

#[allow(clippy::too_many_arguments)]
pub fn print_summary(
    summary: &Summary,
    ruby_version: &str,
    unit: &str,
    wall: bool,
    stats: &Stats,
    c: &Collector,
    followed: Option<Counts>,
    tables_without_room: u64,
    written: &[String],
) {
    let mut notes = Vec::new();
    if let Some(n) = followed {
        let refused = match n.refused {
            0 => String::new(),
            r => format!(", {r} refused (their Ruby does not fit rprof's layout)"),
        };
        notes.push(format!(
            "{} processes followed, {} profiled{refused}, {} ended",
            n.followed, n.profiled, n.ended
        ));
    }
    if stats.not_profiled > 0 {
        notes.push(format!(
            "{} in followed processes not profiled (not Ruby, or before their Ruby was up)",
            stats.not_profiled
        ));
    }
    if stats.other_process > 0 {
        notes.push(format!(
            "{} of processes that reused a target's PID, ignored",
            stats.other_process
        ));
    }
    if stats.process_lost + c.unfollowed > 0 {
        notes.push(format!(
            "{} process reports lost to a full ring buffer, {} samples of processes not followed",
            stats.process_lost, c.unfollowed
        ));
    }
    if stats.truncated > 0 {
        notes.push(format!("{} truncated at the root", stats.truncated));
    }
    if !c.unknown_frames.is_empty() {
        let mut why: Vec<_> = c.unknown_frames.iter().collect();
        why.sort();
        let why: Vec<String> = why.iter().map(|(u, n)| format!("{n} {u}")).collect();
        notes.push(format!(
            "{} with [unknown] frames: {}",
            crate::recording::unknown_amount(c.unknown_samples, wall),
            why.join(", ")
        ));
    }
    if stats.wall_unseen_ns > 0 {
        notes.push(format!(
            "{:.1} ms of threads off CPU since before rprof saw them, not shown",
            stats.wall_unseen_ns as f64 / 1e6
        ));
    }
    if stats.wall_missed_in > 0 {
        notes.push(format!(
            "{} switches to a thread the kernel did not report (split by the thread's CPU time)",
            stats.wall_missed_in
        ));
    }
    if stats.cpu_skipped + stats.cpu_added > 0 {
        notes.push(format!(
            "samples kept to each thread's CPU time: {} ticks not counted, {} counted more",
            stats.cpu_skipped, stats.cpu_added
        ));
    }
    if stats.wall_lost_ns > 0 {
        notes.push(format!(
            "{:.1} ms lost: the counts map and the ring buffer were full",
            stats.wall_lost_ns as f64 / 1e6
        ));
    }
    if c.undelivered_ns() > 0 {
        notes.push(format!(
            "{:.1} ms lost: counted to stacks that never reached rprof",
            c.undelivered_ns() as f64 / 1e6
        ));
    }
    if stats.no_ec > 0 {
        notes.push(format!("{} in threads running no Ruby", stats.no_ec));
    }
    let stopped: u64 = stats.native_stops.iter().skip(1).sum();
    if stopped > 0 {
        let why: Vec<String> = stats
            .native_stops
            .iter()
            .enumerate()
            .skip(1)
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| format!("{n} {}", resolve::native_stop_name(i)))
            .collect();
        notes.push(format!(
            "native stacks: {} whole, {stopped} stopped early ({})",
            stats.native_stops[0],
            why.join(", ")
        ));
    }
    if tables_without_room > 0 {
        notes.push(format!(
            "{tables_without_room} files without room for their unwind table (raise RPROF_UNWIND_ROWS)"
        ));
    }
    if stats.agg_full > 0 {
        notes.push(format!(
            "{} sent one by one: the in-kernel counts table was full",
            stats.agg_full
        ));
    }
    if stats.verified > 0 && !ruby_version.starts_with("2.") {
        notes.push(format!("{} checked to be the thread's own EC", stats.verified));
    }
    if stats.foreign_ec > 0 {
        notes.push(if ruby_version.starts_with("2.") {
            format!("{} without the GVL", stats.foreign_ec)
        } else {
            format!(
                "{} skipped: the EC read belonged to another thread",
                stats.foreign_ec
            )
        });
    }
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join(", "))
    };
    let wrote = match written {
        [] => "nothing written".to_string(),
        _ => format!("wrote {}", written.join(", ")),
    };
    eprintln!(
        "rprof: {} {unit}, {} lost, {} failed in {:.1}s{notes}; {wrote}",
        summary.samples,
        summary.lost,
        summary.failed,
        summary.duration_ns as f64 / 1e9,
    );
}

/// The processes not profiled, by name, because their Ruby did not fit.
pub fn print_refused(processes: &Processes) {
    for why in &processes.refused {
        eprintln!("rprof: not profiled: {why}");
    }
    let unnamed = processes
        .counts
        .refused
        .saturating_sub(processes.refused.len() as u64);
    if unnamed > 0 {
        eprintln!("rprof: not profiled: {unnamed} more processes whose Ruby the layout does not fit");
    }
}
