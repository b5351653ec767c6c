//! `rprof top`: the live view, driven in tmux as a person over SSH sees it
//! (80x24), and as plain text when stdout is not a terminal.

use crate::common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{rprof, signal, Ruby, RPROF};

/// A tmux session of 80x24 running a command, killed when dropped.
struct Tmux {
    name: String,
}

impl Tmux {
    /// Runs `command` in `dir`; "EXITED <status>" follows when it ends.
    fn start(command: &str, dir: &std::path::Path) -> Tmux {
        let name = format!("rprof-top-{}", std::process::id());
        let script = format!("{command}; echo EXITED $?; sleep 60");
        let ok = Command::new("tmux")
            .args(["new-session", "-d", "-s", &name, "-x", "80", "-y", "24", "-c"])
            .arg(dir)
            .arg(script)
            .status()
            .expect("tmux (apt install tmux)");
        assert!(ok.success(), "tmux new-session");
        Tmux { name }
    }

    /// The screen's lines.
    fn screen(&self) -> Vec<String> {
        let out = Command::new("tmux")
            .args(["capture-pane", "-p", "-t", &self.name])
            .output()
            .expect("tmux capture-pane");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn keys(&self, keys: &str) {
        let ok = Command::new("tmux")
            .args(["send-keys", "-t", &self.name, keys])
            .status()
            .expect("tmux send-keys");
        assert!(ok.success());
    }

    /// Waits up to `timeout` for the screen to satisfy `ready`; the screen
    /// then, and how long it took.
    fn wait(&self, timeout: Duration, ready: impl Fn(&[String]) -> bool) -> (Vec<String>, Duration) {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if ready(&screen) {
                return (screen, start.elapsed());
            }
            assert!(
                start.elapsed() < timeout,
                "the screen never got there in {timeout:?}:\n{}",
                screen.join("\n")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Tmux {
    /// The PID of the command the pane's shell runs.
    fn command_pid(&self) -> u32 {
        let out = Command::new("tmux")
            .args(["list-panes", "-t", &self.name, "-F", "#{pane_pid}"])
            .output()
            .expect("tmux list-panes");
        let shell: u32 = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("the pane's PID");
        common::children_of(shell)
            .into_iter()
            .next()
            .expect("the pane's command")
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.name])
            .status();
    }
}

/// The function of the table's first row: a line of four shares, then it.
fn top_function(screen: &[String]) -> Option<String> {
    screen.iter().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 4 && f[..4].iter().all(|v| v.parse::<f64>().is_ok())).then(|| f[4..].join(" "))
    })
}

/// On a terminal: the hot method on top, then the new one within 3 s of
/// the change (the view covers the last second and is redrawn every
/// second: measured 1.0 to 1.1 s, idle and with both CPUs busy); 80
/// columns hold each line of the head whole; h splits by thread; q quits
/// and writes nothing.
#[test]
fn top_follows_the_hot_method_in_80_columns() {
    let target = Ruby::host().spawn("shift.rb", &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let tmux = Tmux::start(&format!("{RPROF} top -p {}", target.pid), dir.path());
    let on_top =
        |method: &'static str| move |s: &[String]| top_function(s).is_some_and(|f| f.starts_with(method));
    let (screen, _) = tmux.wait(Duration::from_secs(15), on_top("Object#first_phase"));
    let text = screen.join("\n");
    // Each line of the head whole in 80 columns (neither cut nor wrapped).
    let head = format!(
        "rprof top: process {} (ruby, Ruby 3.1.2), cpu at 99 Hz",
        target.pid
    );
    assert_eq!(screen[0], head, "{text}");
    assert!(
        screen[1].contains(" samples, 0 lost, 0 failed; sorted by self, last 1s"),
        "{text}"
    );
    assert!(screen[2].ends_with("h by thread, q quit"), "{text}");
    signal(target.pid, libc::SIGUSR1);
    let (screen, took) = tmux.wait(Duration::from_secs(10), on_top("Object#second_phase"));
    eprintln!("second_phase on top {took:?} after the change");
    assert!(
        took <= Duration::from_secs(3),
        "second_phase on top {took:?} after the change:\n{}",
        screen.join("\n")
    );
    // By thread: the main thread's id is the process's.
    tmux.keys("h");
    let main_thread = format!("[{}]: Object#second_phase", target.pid);
    tmux.wait(Duration::from_secs(5), |s| {
        top_function(s).is_some_and(|f| f.contains(&main_thread))
    });
    tmux.keys("q");
    let (screen, _) = tmux.wait(Duration::from_secs(5), |s| {
        s.iter().any(|l| l.starts_with("EXITED"))
    });
    let text = screen.join("\n");
    assert!(
        text.contains("EXITED 0") && text.contains("nothing written"),
        "{text}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
    assert!(left.is_empty(), "q wrote {left:?}");
}

/// Not a terminal: a plain block per second, the hot method first; with -o
/// the recording is written at the end.
#[test]
fn top_prints_plain_text_to_a_pipe() {
    let target = Ruby::host().spawn("shift.rb", &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("top.folded");
    let pid = target.pid.to_string();
    let run = rprof(&["top", "-p", &pid, "-d", "3.2", "-o", out.to_str().expect("utf8")]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let blocks: Vec<&str> = stdout
        .split("\n\n")
        .filter(|b| b.starts_with("rprof top:"))
        .collect();
    assert!(blocks.len() >= 2, "a block a second:\n{stdout}");
    for b in &blocks {
        let first_row = b.lines().nth(2).unwrap_or_default();
        assert!(first_row.contains(" Object#first_phase ("), "{b}");
    }
    let folded = std::fs::read_to_string(&out).expect("-o written");
    assert!(folded.contains("Object#first_phase"), "{folded}");
}

/// Following several processes, each merged row says its process.
#[test]
fn top_names_the_process_of_each_row_when_there_are_several() {
    let (a, b) = (
        Ruby::host().spawn("shift.rb", &[]),
        Ruby::host().spawn("diff_work.rb", &["1"]),
    );
    let (pa, pb) = (a.pid.to_string(), b.pid.to_string());
    let run = rprof(&["top", "-p", &pa, "-p", &pb, "-d", "1.2"]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for row in [
        format!(" {pa}: Object#first_phase ("),
        format!(" {pb}: Object#scaled ("),
    ] {
        assert!(stdout.contains(&row), "no row {row:?}:\n{stdout}");
    }
}

/// The terminal gone (an SSH session dropped, tmux killed): rprof ends, at
/// once, rather than reading a closed terminal in a loop.
#[test]
fn top_ends_when_its_terminal_goes() {
    let target = Ruby::host().spawn("shift.rb", &[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let tmux = Tmux::start(&format!("{RPROF} top -p {}", target.pid), dir.path());
    tmux.wait(Duration::from_secs(15), |s| top_function(s).is_some());
    let rprof = tmux.command_pid();
    drop(tmux);
    let gone = Instant::now();
    while std::path::Path::new(&format!("/proc/{rprof}")).exists() {
        if gone.elapsed() > Duration::from_secs(5) {
            // Not left spinning for the tests after this one.
            common::signal(rprof, libc::SIGKILL);
            panic!("rprof top (PID {rprof}) still ran 5 s after its terminal went");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
