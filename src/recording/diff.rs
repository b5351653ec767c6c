//! `rprof diff BEFORE AFTER` (and `rprof report -i AFTER --diff BEFORE`):
//! two recordings compared through `flamegraphs::diff`, once it is sure
//! they count the same thing. Stacks are merged across processes and
//! threads, so that two runs of a program (other PIDs) compare.

use std::path::Path;

use anyhow::Result;
use flamegraphs::diff::{DiffOptions, TableOptions};
use flamegraphs::{Split, SvgOptions, Unit};

use super::{write_with, Event, Output, Recording};
use crate::cli::Format;
use crate::error::UserError;

/// How two recordings are compared.
#[derive(Debug, Clone, Default)]
pub struct Compare {
    /// Counts as recorded, not shares of each recording's total.
    pub absolute: bool,
    /// summary: by source line rather than by function.
    pub by_line: bool,
}

/// A recording and the file it came from.
pub struct Named<'a> {
    pub path: &'a Path,
    pub recording: &'a Recording,
}

/// Refuses a format the comparison has no rendering in.
pub fn check_format(format: Format) -> Result<(), UserError> {
    match format {
        Format::Svg | Format::Flame | Format::Folded | Format::Summary => Ok(()),
        other => Err(UserError::DiffFormat {
            given: other.extension().to_string(),
        }),
    }
}

/// Refuses two recordings whose counts do not compare: of other events, or
/// with `absolute`, sampled at other frequencies.
fn check(before: &Named, after: &Named, absolute: bool) -> Result<(), UserError> {
    let (b, a) = (&before.recording.header.event, &after.recording.header.event);
    let names = || {
        (
            before.path.display().to_string(),
            after.path.display().to_string(),
            b.to_string(),
            a.to_string(),
        )
    };
    let same_kind = match (b, a) {
        (Event::Cpu { .. }, Event::Cpu { .. })
        | (Event::Wall { .. }, Event::Wall { .. })
        | (Event::Alloc { .. }, Event::Alloc { .. }) => true,
        (Event::Syscalls(x), Event::Syscalls(y)) => x == y,
        _ => false,
    };
    if !same_kind {
        let (before, after, what_before, what_after) = names();
        return Err(UserError::DiffEvents {
            before,
            after,
            what_before,
            what_after,
        });
    }
    if absolute && b.unit() != a.unit() {
        let (before, after, what_before, what_after) = names();
        return Err(UserError::DiffFrequencies {
            before,
            after,
            what_before,
            what_after,
        });
    }
    Ok(())
}

/// Writes the comparison of `before` and `after` as `format` into `output`.
pub fn write(
    before: &Named,
    after: &Named,
    output: &Output,
    format: Format,
    compare: &Compare,
) -> Result<()> {
    check_format(format)?;
    check(before, after, compare.absolute)?;
    let (b, a) = (
        before.recording.samples.profile(&Split::default()),
        after.recording.samples.profile(&Split::default()),
    );
    let options = DiffOptions {
        absolute: compare.absolute,
    };
    let unit = &after.recording.samples.unit;
    let count_name = unit.count_name().to_string();
    let title = format!(
        "rprof diff: {} -> {} ({})",
        before.path.display(),
        after.path.display(),
        after.recording.header.event
    );
    let amount = |n: u64| match unit {
        Unit::Wall => format!("{:.2} s of thread time", n as f64 / 1e6),
        _ => format!("{n} {count_name}"),
    };
    let how = if compare.absolute {
        "counts as recorded"
    } else {
        "shares: before scaled to after's total"
    };
    let subtitle = format!(
        "widths: after ({}); red grew, blue shrank since before ({}); {how}",
        amount(a.total()),
        amount(b.total())
    );
    write_with(output, |w| {
        match format {
            Format::Folded => flamegraphs::diff::write_folded(&b, &a, &options, w)?,
            Format::Summary => {
                let table = TableOptions {
                    by_line: compare.by_line,
                    limit: 40,
                    title: title.clone(),
                    count_name: count_name.clone(),
                };
                flamegraphs::diff::write_table(&b, &a, &options, &table, w)?;
            }
            _ => {
                let svg = SvgOptions {
                    title: title.clone(),
                    subtitle: Some(subtitle.clone()),
                    count_name: count_name.clone(),
                    icicle: format == Format::Svg,
                };
                flamegraphs::diff::write_svg(&b, &a, &options, &svg, w)?;
            }
        }
        Ok(())
    })
}
