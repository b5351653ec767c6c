//! `rprof top`: a sink that shows, every second, the functions that take
//! the most samples (or time, or events) in the last second and since the
//! start: a full-screen table on a terminal (ratatui), refreshed in place
//! and sorted by the key pressed; periodic plain text when stdout is not a
//! terminal (a pipe, a log).

use std::collections::{HashMap, VecDeque};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use flamegraphs::{Frame, FrameKind, Profile, Samples, Split};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row, Table};
use ratatui::DefaultTerminal;

use crate::recording::{EpochCounts, Header, Summary};

/// How often the view is redrawn, and the "last" window it shows.
const REFRESH: Duration = Duration::from_secs(1);
/// Rows printed per refresh when stdout is not a terminal.
const PLAIN_ROWS: usize = 10;

/// What the rows are sorted by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SortBy {
    SelfNow,
    TotalNow,
    SelfAll,
    TotalAll,
}

/// A function's counts: self and total, in the last window and since the
/// start.
#[derive(Debug, Default, Clone, Copy)]
struct Counts {
    self_now: u64,
    total_now: u64,
    self_all: u64,
    total_all: u64,
}

/// Where the view goes.
enum Screen {
    /// Not drawn yet: the terminal is taken at the first draw, after the
    /// first line rprof prints.
    Pending,
    Terminal(DefaultTerminal),
    Plain,
}

pub struct Top {
    screen: Screen,
    title: String,
    /// What the totals count ("samples", "events").
    count_name: &'static str,
    unit: flamegraphs::Unit,
    /// The last window's epochs, split by process and thread.
    window: VecDeque<Profile>,
    /// Everything since the start, merged by function key at each epoch.
    all: HashMap<String, (u64, u64)>,
    all_total: u64,
    /// By thread (`h`), else merged (by process when there are several).
    by_thread: bool,
    sort: SortBy,
    started: Instant,
    drawn: Option<Instant>,
    totals: Summary,
    quit: bool,
}

impl Top {
    pub fn new(header: &Header) -> Self {
        // Keys are read from stdin: a screen needs both ends on the terminal.
        let terminal = std::io::stdout().is_terminal() && std::io::stdin().is_terminal();
        Self {
            screen: if terminal { Screen::Pending } else { Screen::Plain },
            title: format!("rprof top: {}, {}", header.target, header.event),
            count_name: header.event.events_name(),
            unit: header.event.unit(),
            window: VecDeque::new(),
            all: HashMap::new(),
            all_total: 0,
            by_thread: false,
            sort: SortBy::SelfNow,
            started: Instant::now(),
            drawn: None,
            totals: Summary::default(),
            quit: false,
        }
    }

    /// Whether `q` (or Ctrl-C on the screen) was pressed.
    pub fn quit(&self) -> bool {
        self.quit
    }

    /// An epoch's counts into the window and the totals; redraws once a
    /// second.
    pub fn epoch(&mut self, counts: &EpochCounts, totals: &Summary) -> Result<()> {
        let mut samples = Samples::new(self.unit.clone());
        let epoch = counts.add_to(&mut samples, 0);
        samples
            .push_epoch(epoch)
            .context("adding an epoch to the live view")?;
        let profile = samples.profile(&Split {
            processes: true,
            threads: true,
            said_by_thread: None,
        });
        for (key, (own, total)) in rows(&profile, self.by_thread) {
            let e = self.all.entry(key).or_default();
            e.0 += own;
            e.1 += total;
        }
        self.all_total += profile.total();
        self.window.push_back(profile);
        let epochs = (REFRESH.as_millis() / super::EPOCH.as_millis()).max(1) as usize;
        while self.window.len() > epochs {
            self.window.pop_front();
        }
        self.totals = totals.clone();
        if self.drawn.is_none_or(|d| d.elapsed() >= REFRESH) {
            self.draw()?;
            self.drawn = Some(Instant::now());
        }
        Ok(())
    }

    /// Reads the keys pressed since the last call (never waits). A terminal
    /// gone (the SSH session closed, tmux killed) quits.
    pub fn keys(&mut self) -> Result<()> {
        if !matches!(self.screen, Screen::Terminal(_)) {
            return Ok(());
        }
        let Some(typed) = typed() else {
            self.quit = true;
            return Ok(());
        };
        let mut changed = false;
        for (i, &key) in typed.iter().enumerate() {
            match key {
                // Esc alone, not the start of an escape sequence (an arrow key).
                0x1b if i + 1 == typed.len() => self.quit = true,
                b'q' | 0x03 => self.quit = true,
                b's' => self.sort = SortBy::SelfNow,
                b't' => self.sort = SortBy::TotalNow,
                b'a' => {
                    self.sort = match self.sort {
                        SortBy::SelfNow | SortBy::SelfAll => SortBy::SelfAll,
                        SortBy::TotalNow | SortBy::TotalAll => SortBy::TotalAll,
                    }
                }
                b'h' => {
                    // Since-start counts were merged by the old key: start them again.
                    self.by_thread = !self.by_thread;
                    self.all.clear();
                    self.all_total = 0;
                }
                _ => continue,
            }
            changed = true;
        }
        if changed && !self.quit {
            self.draw()?;
        }
        Ok(())
    }

    /// Gives the terminal back.
    pub fn finish(&mut self) {
        if matches!(self.screen, Screen::Terminal(_)) {
            ratatui::restore();
            self.screen = Screen::Plain;
        }
    }

    /// Each function's counts, sorted.
    fn table(&self) -> (Vec<(String, Counts)>, u64) {
        let mut now: HashMap<String, (u64, u64)> = HashMap::new();
        let mut now_total = 0;
        for p in &self.window {
            now_total += p.total();
            for (key, (own, total)) in rows(p, self.by_thread) {
                let e = now.entry(key).or_default();
                e.0 += own;
                e.1 += total;
            }
        }
        let mut keys: Vec<&String> = now.keys().chain(self.all.keys()).collect();
        keys.sort();
        keys.dedup();
        let mut out: Vec<(String, Counts)> = keys
            .into_iter()
            .map(|k| {
                let (self_now, total_now) = now.get(k).copied().unwrap_or_default();
                let (self_all, total_all) = self.all.get(k).copied().unwrap_or_default();
                let c = Counts {
                    self_now,
                    total_now,
                    self_all,
                    total_all,
                };
                (k.clone(), c)
            })
            .collect();
        let sort = self.sort;
        let key = move |c: &Counts| match sort {
            SortBy::SelfNow => (c.self_now, c.total_now, c.self_all),
            SortBy::TotalNow => (c.total_now, c.self_now, c.total_all),
            SortBy::SelfAll => (c.self_all, c.total_all, c.self_now),
            SortBy::TotalAll => (c.total_all, c.self_all, c.total_now),
        };
        out.sort_by(|a, b| key(&b.1).cmp(&key(&a.1)).then_with(|| a.0.cmp(&b.0)));
        (out, now_total)
    }

    fn draw(&mut self) -> Result<()> {
        if matches!(self.screen, Screen::Pending) {
            let mut terminal = ratatui::try_init().context("taking the terminal")?;
            terminal.clear().context("clearing the terminal")?;
            self.screen = Screen::Terminal(terminal);
        }
        let (rows, now_total) = self.table();
        let status = format!(
            "{:.0}s; {} {}, {} lost, {} failed",
            self.started.elapsed().as_secs_f64(),
            self.totals.samples,
            self.count_name,
            self.totals.lost,
            self.totals.failed
        );
        let share = |n: u64, of: u64| 100.0 * n as f64 / of.max(1) as f64;
        let all_total = self.all_total;
        match &mut self.screen {
            Screen::Terminal(terminal) => {
                let sort = self.sort;
                let by_thread = self.by_thread;
                let title = &self.title;
                terminal
                    .draw(|frame| {
                        let [head, state, keys, groups, body] = Layout::vertical([
                            Constraint::Length(1),
                            Constraint::Length(1),
                            Constraint::Length(1),
                            Constraint::Length(1),
                            Constraint::Min(1),
                        ])
                        .areas(frame.area());
                        let dim = Style::new().add_modifier(Modifier::DIM);
                        let sorted = match sort {
                            SortBy::SelfNow => "self, last 1s",
                            SortBy::TotalNow => "total, last 1s",
                            SortBy::SelfAll => "self since start",
                            SortBy::TotalAll => "total since start",
                        };
                        frame.render_widget(Paragraph::new(title.as_str()), head);
                        frame.render_widget(Paragraph::new(format!("{status}; sorted by {sorted}")), state);
                        let help = format!(
                            "s/t sort by self/total, a since start, h {}, q quit",
                            if by_thread { "merged" } else { "by thread" }
                        );
                        frame.render_widget(Paragraph::new(Line::styled(help, dim)), keys);
                        frame.render_widget(
                            Paragraph::new(Line::styled("   last 1s    since start", dim)),
                            groups,
                        );
                        let header = Row::new(["self%", "total%", "self%", "total%", "function"])
                            .style(Style::new().add_modifier(Modifier::BOLD));
                        let lines = rows
                            .iter()
                            .take(body.height.saturating_sub(1) as usize)
                            .map(|(k, c)| {
                                Row::new([
                                    Cell::from(format!("{:5.1}", share(c.self_now, now_total))),
                                    Cell::from(format!("{:6.1}", share(c.total_now, now_total))),
                                    Cell::from(format!("{:5.1}", share(c.self_all, all_total))),
                                    Cell::from(format!("{:6.1}", share(c.total_all, all_total))),
                                    Cell::from(k.as_str()),
                                ])
                            });
                        let widths = [
                            Constraint::Length(5),
                            Constraint::Length(6),
                            Constraint::Length(5),
                            Constraint::Length(6),
                            Constraint::Fill(1),
                        ];
                        frame.render_widget(Table::new(lines, widths).header(header), body);
                    })
                    .context("drawing the live view")?;
            }
            Screen::Plain => {
                let text = plain(&self.title, &status, &rows, now_total);
                let mut out = std::io::stdout().lock();
                match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
                    // Whoever read it is gone (`| head`): as if q.
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => self.quit = true,
                    written => written.context("writing the live view")?,
                }
            }
            Screen::Pending => {}
        }
        Ok(())
    }
}

impl Drop for Top {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The bytes typed on the terminal (raw mode: a key is a byte) since the
/// last call, without waiting; None once it is gone (hung up, or at its
/// end). Read here rather than through crossterm's event reader, which
/// spins on a terminal that hung up.
fn typed() -> Option<Vec<u8>> {
    let mut fds = libc::pollfd {
        fd: 0,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polls one descriptor, with a struct it owns, without waiting.
    let ready = unsafe { libc::poll(&mut fds, 1, 0) };
    if ready <= 0 {
        return Some(Vec::new()); // nothing typed (or interrupted: later)
    }
    if fds.revents & libc::POLLIN == 0 {
        return None; // hung up or closed, nothing left to read
    }
    let mut buf = [0u8; 64];
    // SAFETY: reads at most its length into a buffer it owns.
    let got = unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
    (got > 0).then(|| buf[..got as usize].to_vec())
}

/// A refresh as plain text: the title, the counts, and the top rows of
/// the last window.
fn plain(title: &str, status: &str, rows: &[(String, Counts)], now_total: u64) -> String {
    let share = |n: u64| 100.0 * n as f64 / now_total.max(1) as f64;
    let mut text = format!("{title}; {status}\n  self%  total%  (last 1s)  function\n");
    for (k, c) in rows.iter().filter(|(_, c)| c.total_now > 0).take(PLAIN_ROWS) {
        text += &format!(
            "  {:5.1}  {:6.1}             {k}\n",
            share(c.self_now),
            share(c.total_now)
        );
    }
    text + "\n"
}

/// Each function's (self, total) in `p`: merged (prefixed by its process
/// when there are several), or by thread.
fn rows(p: &Profile, by_thread: bool) -> HashMap<String, (u64, u64)> {
    let stacks = p.stacks();
    let several = {
        let mut processes: Vec<&str> = stacks
            .iter()
            .filter_map(|(s, _)| s.iter().find(|f| f.kind == FrameKind::Process).map(|f| &*f.name))
            .collect();
        processes.sort();
        processes.dedup();
        processes.len() > 1
    };
    let mut groups: HashMap<String, Profile> = HashMap::new();
    for (frames, n) in &stacks {
        let pid = frames
            .iter()
            .rfind(|f| f.kind == FrameKind::Process)
            .map(|f| short_process(&f.name));
        let thread = frames
            .iter()
            .find(|f| f.kind == FrameKind::Thread)
            .map(|f| &*f.name);
        let prefix = match (by_thread, several, pid, thread) {
            (true, true, Some(p), Some(t)) => format!("{p} {t}: "),
            (true, _, _, Some(t)) => format!("{t}: "),
            (false, true, Some(p), _) => format!("{p}: "),
            _ => String::new(),
        };
        let code: Vec<Frame> = frames
            .iter()
            .filter(|f| !matches!(f.kind, FrameKind::Process | FrameKind::Thread))
            .map(|f| (*f).clone())
            .collect();
        groups.entry(prefix).or_default().add(&code, *n);
    }
    let mut out = HashMap::new();
    for (prefix, g) in groups {
        for r in flamegraphs::summary::rows(&g, false) {
            out.insert(format!("{prefix}{}", r.name), (r.self_count, r.total_count));
        }
    }
    out
}

/// `process 42:"puma: cluster worker 0"` -> `42`.
fn short_process(name: &str) -> String {
    let rest = name.strip_prefix("process ").unwrap_or(name);
    rest.split(':').next().unwrap_or(rest).to_string()
}
