//! A terminal table of the functions (or lines) that take the most samples,
//! by self share (where the samples landed) and total share (what ran under
//! them): what one reads over ssh before opening a flame graph.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Write};

use crate::{Frame, FrameKind, Profile};

#[derive(Debug, Clone)]
pub struct SummaryOptions {
    /// Rows by source line (`name (file:line)`) rather than by function.
    pub by_line: bool,
    /// Rows shown; the rest are counted in a last line.
    pub limit: usize,
    /// First line of the table.
    pub title: String,
    /// `samples` or `events`.
    pub count_name: String,
}

/// A row: self and total counts of one function or line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub name: String,
    pub self_count: u64,
    pub total_count: u64,
}

/// The rows of the table, largest self count first. Process and thread frames
/// are not functions, and a function is counted once per stack in its total
/// however deep it recurses.
pub fn rows(profile: &Profile, by_line: bool) -> Vec<Row> {
    let mut counts: HashMap<String, (u64, u64)> = HashMap::new();
    for (frames, n) in profile.stacks() {
        let code: Vec<&Frame> = frames
            .into_iter()
            .filter(|f| !matches!(f.kind, FrameKind::Process | FrameKind::Thread))
            .collect();
        let mut seen = HashSet::new();
        for f in &code {
            let key = row_name(f, by_line);
            if seen.insert(key.clone()) {
                let total = &mut counts.entry(key).or_default().1;
                *total = total.saturating_add(n);
            }
        }
        if let Some(leaf) = code.last() {
            let own = &mut counts.entry(row_name(leaf, by_line)).or_default().0;
            *own = own.saturating_add(n);
        }
    }
    let mut rows: Vec<Row> = counts
        .into_iter()
        .map(|(name, (self_count, total_count))| Row {
            name,
            self_count,
            total_count,
        })
        .collect();
    rows.sort_by(|a, b| (b.self_count, b.total_count, &a.name).cmp(&(a.self_count, a.total_count, &b.name)));
    rows
}

fn row_name(f: &Frame, by_line: bool) -> String {
    let name = f.to_string_without_location();
    match (&f.file, f.line) {
        (Some(file), Some(line)) if by_line => format!("{name} ({file}:{line})"),
        (Some(file), _) => format!("{name} ({file})"),
        _ => name,
    }
}

pub fn write<W: Write>(profile: &Profile, options: &SummaryOptions, mut w: W) -> io::Result<()> {
    let total = profile.total();
    let rows = rows(profile, options.by_line);
    writeln!(w, "{}", options.title)?;
    let share = |n: u64| {
        if total == 0 {
            0.0
        } else {
            100.0 * n as f64 / total as f64
        }
    };
    let width = total.to_string().len().max(5);
    writeln!(
        w,
        "{:>7} {:>width$} {:>7} {:>width$}  {}",
        "self%",
        "self",
        "total%",
        "total",
        if options.by_line { "line" } else { "function" },
    )?;
    for r in rows.iter().take(options.limit) {
        writeln!(
            w,
            "{:>6.2}% {:>width$} {:>6.2}% {:>width$}  {}",
            share(r.self_count),
            r.self_count,
            share(r.total_count),
            r.total_count,
            r.name
        )?;
    }
    if rows.len() > options.limit {
        let rest = rows[options.limit..]
            .iter()
            .fold(0u64, |sum, r| sum.saturating_add(r.self_count));
        writeln!(
            w,
            "{:>6.2}% {:>width$} {:>7} {:>width$}  ({} more rows)",
            share(rest),
            rest,
            "",
            "",
            rows.len() - options.limit
        )?;
    }
    writeln!(w, "{total} {} in all", options.count_name)?;
    write_gc(profile, options, &mut w)?;
    write_states(profile, options, &mut w)
}

/// The share of the profile in garbage collections, by what they were doing
/// (the `[GC: ...]` frames). Nothing if none.
fn write_gc<W: Write>(profile: &Profile, options: &SummaryOptions, w: &mut W) -> io::Result<()> {
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    for (frames, n) in profile.stacks() {
        if let Some(gc) = frames.iter().find(|f| f.kind == FrameKind::Gc) {
            *by_kind.entry(gc.name.to_string()).or_default() += n;
        }
    }
    if by_kind.is_empty() {
        return Ok(());
    }
    let share = |n: u64| 100.0 * n as f64 / profile.total().max(1) as f64;
    let in_gc: u64 = by_kind.values().sum();
    let kinds: Vec<String> = by_kind
        .iter()
        .map(|(k, n)| format!("{k} {n} ({:.1}%)", share(*n)))
        .collect();
    writeln!(
        w,
        "in garbage collection: {in_gc} {} ({:.1}%): {}",
        options.count_name,
        share(in_gc),
        kinds.join(", ")
    )
}

/// Stacks kept per state in the summary.
const STACKS_PER_STATE: usize = 3;
/// Frames of each such stack shown, from its leaf.
const FRAMES_PER_STACK: usize = 4;

/// `wall`: each thread's time by state (its stacks' leaf frame), then the
/// stacks that take the most of each state. Nothing for other events.
fn write_states<W: Write>(profile: &Profile, options: &SummaryOptions, w: &mut W) -> io::Result<()> {
    let mut by_thread: BTreeMap<String, HashMap<String, u64>> = BTreeMap::new();
    let mut by_state: BTreeMap<String, HashMap<String, u64>> = BTreeMap::new();
    for (frames, n) in profile.stacks() {
        let Some(state) = frames.last().filter(|f| f.kind == FrameKind::State) else {
            continue;
        };
        let owner: Vec<String> = frames
            .iter()
            .filter(|f| matches!(f.kind, FrameKind::Process | FrameKind::Thread))
            .map(|f| f.to_string())
            .collect();
        let owner = if owner.is_empty() {
            "all threads".to_string()
        } else {
            owner.join(" / ")
        };
        *by_thread
            .entry(owner)
            .or_default()
            .entry(state.name.to_string())
            .or_default() += n;
        let code: Vec<String> = frames
            .iter()
            .rev()
            .skip(1)
            .filter(|f| !matches!(f.kind, FrameKind::Process | FrameKind::Thread))
            .take(FRAMES_PER_STACK)
            .map(|f| f.to_string_without_location())
            .collect();
        *by_state
            .entry(state.name.to_string())
            .or_default()
            .entry(code.join(" < "))
            .or_default() += n;
    }
    if by_thread.is_empty() {
        return Ok(());
    }
    let unit = &options.count_name;
    writeln!(w, "\nTime by thread and state ({unit}):")?;
    for (owner, states) in &by_thread {
        let all: u64 = states.values().sum();
        let mut states: Vec<(&String, &u64)> = states.iter().collect();
        states.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        let shown: Vec<String> = states
            .iter()
            .map(|(s, n)| format!("{s} {n} ({:.1}%)", 100.0 * **n as f64 / all.max(1) as f64))
            .collect();
        writeln!(w, "  {owner}: {}", shown.join(", "))?;
    }
    writeln!(w, "\nTop stacks per state ({unit}; leaf first):")?;
    for (state, stacks) in &by_state {
        let all: u64 = stacks.values().sum();
        writeln!(w, "  {state}: {all}")?;
        let mut stacks: Vec<(&String, &u64)> = stacks.iter().collect();
        stacks.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (stack, n) in stacks.into_iter().take(STACKS_PER_STATE) {
            writeln!(
                w,
                "    {n:>12}  {}",
                if stack.is_empty() { "(no frames)" } else { stack }
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_and_total_count_recursion_once() {
        let mut p = Profile::default();
        let a = Frame::code("a", "x.rb", 1);
        let a2 = Frame::code("a", "x.rb", 2);
        let b = Frame::code("b", "x.rb", 9);
        p.add(&[Frame::thread("t [1]"), a.clone(), a2.clone(), b.clone()], 3);
        p.add(std::slice::from_ref(&a), 1);
        let r = rows(&p, false);
        assert_eq!(
            r,
            vec![
                Row {
                    name: "b (x.rb)".into(),
                    self_count: 3,
                    total_count: 3
                },
                Row {
                    name: "a (x.rb)".into(),
                    self_count: 1,
                    total_count: 4
                },
            ]
        );
        let by_line = rows(&p, true);
        assert_eq!(by_line.len(), 3);
        assert!(by_line.contains(&Row {
            name: "a (x.rb:2)".into(),
            self_count: 0,
            total_count: 3
        }));
        let mut out = Vec::new();
        let opts = SummaryOptions {
            by_line: false,
            limit: 1,
            title: "t".into(),
            count_name: "samples".into(),
        };
        write(&p, &opts, &mut out).expect("write");
        let text = String::from_utf8(out).expect("utf8");
        assert!(text.contains(" 75.00%     3  75.00%     3  b (x.rb)"), "{text}");
        assert!(text.contains("(1 more rows)"), "{text}");
        assert!(text.ends_with("4 samples in all\n"), "{text}");
    }

    #[test]
    fn share_in_garbage_collection_by_kind() {
        let mut p = Profile::default();
        let alloc = Frame::code("alloc", "x.rb", 3);
        p.add(std::slice::from_ref(&alloc), 60);
        p.add(&[alloc.clone(), Frame::gc("[GC: marking (minor)]")], 30);
        p.add(&[alloc, Frame::gc("[GC: sweeping]")], 10);
        let opts = SummaryOptions {
            by_line: false,
            limit: 10,
            title: "t".into(),
            count_name: "samples".into(),
        };
        let mut out = Vec::new();
        write(&p, &opts, &mut out).expect("write");
        let text = String::from_utf8(out).expect("utf8");
        assert!(
            text.contains(
                "in garbage collection: 40 samples (40.0%): [GC: marking (minor)] 30 (30.0%), [GC: sweeping] 10 (10.0%)"
            ),
            "{text}"
        );
        let mut none = Profile::default();
        none.add(&[Frame::code("alloc", "x.rb", 3)], 1);
        let mut out = Vec::new();
        write(&none, &opts, &mut out).expect("write");
        assert!(!String::from_utf8(out).expect("utf8").contains("garbage"));
    }

    #[test]
    fn wall_time_by_thread_and_state() {
        let mut p = Profile::default();
        let main = Frame::code("main", "x.rb", 1);
        let pop = Frame::cmethod("Thread::Queue#pop");
        p.add(
            &[Frame::thread("a [1]"), main.clone(), Frame::state("[running]")],
            30,
        );
        p.add(
            &[
                Frame::thread("a [1]"),
                main.clone(),
                pop,
                Frame::state("[waiting: Queue#pop]"),
            ],
            70,
        );
        p.add(&[Frame::thread("b [2]"), main, Frame::state("[sleeping]")], 100);
        let opts = SummaryOptions {
            by_line: false,
            limit: 10,
            title: "t".into(),
            count_name: "µs".into(),
        };
        let mut out = Vec::new();
        write(&p, &opts, &mut out).expect("write");
        let text = String::from_utf8(out).expect("utf8");
        assert!(
            text.contains("a [1]: [waiting: Queue#pop] 70 (70.0%), [running] 30 (30.0%)"),
            "{text}"
        );
        assert!(text.contains("b [2]: [sleeping] 100 (100.0%)"), "{text}");
        assert!(text.contains("[waiting: Queue#pop]: 70\n"), "{text}");
        assert!(text.contains("70  Thread::Queue#pop < main"), "{text}");
    }
}
