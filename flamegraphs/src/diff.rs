//! Two profiles compared, before and after (a deploy, a parameter): a
//! differential flame graph (the after profile's shape, a frame red where it
//! grew and blue where it shrank, inferno's convention), folded stacks with
//! both counts (`stack before after`, what `inferno-flamegraph` reads), and
//! a table of functions by their change in share.
//!
//! By default before's counts are scaled to after's total, so that two
//! recordings of different lengths compare by share; `absolute` compares
//! the counts as recorded.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use crate::summary::rows;
use crate::{folded_name, Profile, RenderError, SvgOptions};

/// How two profiles are compared.
#[derive(Debug, Clone, Default)]
pub struct DiffOptions {
    /// Counts as recorded, rather than before's scaled to after's total.
    pub absolute: bool,
}

/// Each stack's folded line with before's count (scaled unless absolute)
/// and after's, sorted.
fn lines(before: &Profile, after: &Profile, options: &DiffOptions) -> Vec<(String, u64, u64)> {
    let scale = if options.absolute || before.total() == 0 {
        1.0
    } else {
        after.total() as f64 / before.total() as f64
    };
    let mut both: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let folded = |frames: Vec<&crate::Frame>| {
        frames
            .iter()
            .map(|f| folded_name(f))
            .collect::<Vec<_>>()
            .join(";")
    };
    for (frames, n) in before.stacks() {
        both.entry(folded(frames)).or_default().0 += (n as f64 * scale).round() as u64;
    }
    for (frames, n) in after.stacks() {
        both.entry(folded(frames)).or_default().1 += n;
    }
    both.into_iter().map(|(s, (b, a))| (s, b, a)).collect()
}

/// `stack before after` per line.
pub fn write_folded<W: Write>(
    before: &Profile,
    after: &Profile,
    options: &DiffOptions,
    mut w: W,
) -> io::Result<()> {
    for (stack, b, a) in lines(before, after, options) {
        writeln!(w, "{stack} {b} {a}")?;
    }
    Ok(())
}

/// The differential flame graph: widths are after's counts; a frame is red
/// by how much it grew, blue by how much it shrank, near white if unchanged.
pub fn write_svg<W: Write>(
    before: &Profile,
    after: &Profile,
    options: &DiffOptions,
    svg: &SvgOptions,
    w: W,
) -> Result<(), RenderError> {
    let lines: Vec<String> = lines(before, after, options)
        .into_iter()
        .map(|(s, b, a)| format!("{s} {b} {a}"))
        .collect();
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = svg.title.clone();
    opts.subtitle = svg.subtitle.clone();
    opts.count_name = svg.count_name.clone();
    opts.direction = if svg.icicle {
        inferno::flamegraph::Direction::Inverted
    } else {
        inferno::flamegraph::Direction::Straight
    };
    if lines.iter().all(|l| l.ends_with(" 0")) {
        opts.subtitle = Some("nothing was recorded after".to_string());
        let placeholder = ["[no samples] 0 1"];
        return inferno::flamegraph::from_lines(&mut opts, placeholder, w).map_err(RenderError::Svg);
    }
    inferno::flamegraph::from_lines(&mut opts, lines.iter().map(|s| s.as_str()), w).map_err(RenderError::Svg)
}

/// A function's share (or count) before and after.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub name: String,
    pub self_before: f64,
    pub self_after: f64,
    pub total_before: f64,
    pub total_after: f64,
}

impl Change {
    pub fn self_change(&self) -> f64 {
        self.self_after - self.self_before
    }
    pub fn total_change(&self) -> f64 {
        self.total_after - self.total_before
    }
}

/// Each function's self and total, before and after, as shares of each
/// profile's total in percent (or counts, if absolute); the largest change
/// in self first, then in total.
pub fn changes(before: &Profile, after: &Profile, by_line: bool, options: &DiffOptions) -> Vec<Change> {
    let of = |p: &Profile| {
        let total = p.total().max(1) as f64;
        let per = if options.absolute { 1.0 } else { 100.0 / total };
        rows(p, by_line)
            .into_iter()
            .map(|r| (r.name, (r.self_count as f64 * per, r.total_count as f64 * per)))
            .collect::<HashMap<String, (f64, f64)>>()
    };
    let (b, a) = (of(before), of(after));
    let mut names: Vec<&String> = b.keys().chain(a.keys()).collect();
    names.sort();
    names.dedup();
    let mut out: Vec<Change> = names
        .into_iter()
        .map(|name| {
            let (sb, tb) = b.get(name).copied().unwrap_or_default();
            let (sa, ta) = a.get(name).copied().unwrap_or_default();
            Change {
                name: name.clone(),
                self_before: sb,
                self_after: sa,
                total_before: tb,
                total_after: ta,
            }
        })
        .collect();
    out.sort_by(|x, y| {
        let key = |c: &Change| (c.self_change().abs(), c.total_change().abs());
        key(y)
            .partial_cmp(&key(x))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then_with(|| x.name.cmp(&y.name))
    });
    out
}

/// How the table is written.
#[derive(Debug, Clone)]
pub struct TableOptions {
    pub by_line: bool,
    /// Rows shown; the rest are counted in a last line.
    pub limit: usize,
    /// First line of the table.
    pub title: String,
    /// What counts are, with `absolute` (`samples`, `µs`).
    pub count_name: String,
}

/// The table: per function, self before and after and its change (`+12.3
/// pts`, or in counts with `absolute`), total before and after; largest
/// change first.
pub fn write_table<W: Write>(
    before: &Profile,
    after: &Profile,
    options: &DiffOptions,
    table: &TableOptions,
    mut w: W,
) -> io::Result<()> {
    let changes = changes(before, after, table.by_line, options);
    writeln!(w, "{}", table.title)?;
    let change_unit = if options.absolute {
        table.count_name.as_str()
    } else {
        "pts"
    };
    let cell = |v: f64| {
        if options.absolute {
            format!("{v:.0}")
        } else {
            format!("{v:.1}%")
        }
    };
    let change = |v: f64| {
        if options.absolute {
            format!("{v:+.0} {change_unit}")
        } else {
            format!("{v:+.1} {change_unit}")
        }
    };
    writeln!(
        w,
        "{:>12} {:>12} {:>14} {:>12} {:>12}  {}",
        "self before",
        "self after",
        "change",
        "total before",
        "total after",
        if table.by_line { "line" } else { "function" }
    )?;
    for c in changes.iter().take(table.limit) {
        writeln!(
            w,
            "{:>12} {:>12} {:>14} {:>12} {:>12}  {}",
            cell(c.self_before),
            cell(c.self_after),
            change(c.self_change()),
            cell(c.total_before),
            cell(c.total_after),
            c.name
        )?;
    }
    if changes.len() > table.limit {
        writeln!(w, "({} more rows, smaller changes)", changes.len() - table.limit)?;
    }
    writeln!(
        w,
        "{} {} before, {} after{}",
        before.total(),
        table.count_name,
        after.total(),
        if options.absolute {
            ""
        } else {
            "; shares of each one's total"
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Frame;

    fn profile(steady: u64, scaled: u64) -> Profile {
        let mut p = Profile::default();
        let main = Frame::code("<main>", "w.rb", 1);
        p.add(&[main.clone(), Frame::code("Object#steady", "w.rb", 3)], steady);
        p.add(&[main.clone(), Frame::code("Object#scaled", "w.rb", 7)], scaled);
        p.add(&[main, Frame::code("Object#other", "w.rb", 9)], 100);
        p
    }

    #[test]
    fn before_is_scaled_to_after_unless_absolute() {
        let (before, after) = (profile(50, 50), profile(100, 200));
        let mut out = Vec::new();
        write_folded(&before, &after, &DiffOptions::default(), &mut out).expect("folded");
        assert_eq!(
            String::from_utf8(out).expect("utf8"),
            "<main> (w.rb:1);Object#other (w.rb:9) 200 100\n<main> (w.rb:1);Object#scaled (w.rb:7) 100 200\n<main> (w.rb:1);Object#steady (w.rb:3) 100 100\n"
        );
        let mut out = Vec::new();
        write_folded(&before, &after, &DiffOptions { absolute: true }, &mut out).expect("folded");
        assert!(String::from_utf8(out)
            .expect("utf8")
            .contains("Object#scaled (w.rb:7) 50 200\n"));
    }

    #[test]
    fn the_grower_comes_first_and_a_profile_against_itself_changes_nothing() {
        // 25/25/50% before, 20/60/20% after.
        let c = changes(
            &profile(50, 50),
            &profile(100, 300),
            false,
            &DiffOptions::default(),
        );
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            &names[..3],
            [
                "Object#scaled (w.rb)",
                "Object#other (w.rb)",
                "Object#steady (w.rb)"
            ]
        );
        assert!((c[0].self_change() - 35.0).abs() < 1e-9, "{c:?}");
        assert!((c[1].self_change() + 30.0).abs() < 1e-9, "{c:?}");
        let same = changes(&profile(10, 30), &profile(10, 30), false, &DiffOptions::default());
        assert!(same
            .iter()
            .all(|c| c.self_change() == 0.0 && c.total_change() == 0.0));
    }

    #[test]
    fn svg_reds_what_grew_and_blues_what_shrank() {
        let mut out = Vec::new();
        write_svg(
            &profile(50, 50),
            &profile(100, 300),
            &DiffOptions::default(),
            &SvgOptions::default(),
            &mut out,
        )
        .expect("svg");
        let svg = String::from_utf8(out).expect("utf8");
        let fill_of = |name: &str| {
            let at = svg.find(&format!("<title>{name}")).expect("frame drawn");
            let rest = &svg[at..];
            let fill = rest.find("fill=\"rgb(").expect("fill") + "fill=\"rgb(".len();
            let rgb: Vec<u8> = rest[fill..rest[fill..].find(')').expect("rgb") + fill]
                .split(',')
                .map(|v| v.parse().expect("channel"))
                .collect();
            (rgb[0], rgb[1], rgb[2])
        };
        let (r, g, b) = fill_of("Object#scaled");
        assert!(r == 255 && g < 250 && b < 250, "grew: red ({r},{g},{b})");
        let (r, g, b) = fill_of("Object#steady");
        assert!(b == 255 && r < 250 && g < 250, "shrank: blue ({r},{g},{b})");
    }
}
