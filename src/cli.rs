//! Command-line interface.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "rprof",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("RPROF_COMMIT"), ")"),
    about = "A Ruby-aware sampling profiler for Linux: true per-thread stacks, exact lines, from eBPF"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Record a profile of a running Ruby process, or of a command rprof starts.
    #[command(after_help = "EXAMPLES:\n  \
        rprof record -p 1234                         CPU profile until Ctrl-C, icicle SVG\n  \
        rprof record -p 1234 -d 10 --format folded   10 seconds, folded stacks\n  \
        rprof record -p 1234 syscall enter_getpid    which Ruby code calls getpid\n  \
        rprof record -p 1234 --subprocesses          a Puma/Unicorn master and all its workers\n  \
        rprof record --all --processes -d 30         every Ruby on this host, split by process\n  \
        rprof record -p 1234 --native --kernel       Ruby, C and kernel frames in one stack\n  \
        rprof record -- ruby app.rb                  start app.rb and profile it; exit with its status")]
    Record(RecordArgs),
    /// Render a recording (.rprof) again, in another format.
    Report(ReportArgs),
    /// A live view of what runs now: functions by share, refreshed every
    /// second (q quits; with -o, writes what was recorded).
    #[command(after_help = "EXAMPLES:\n  \
        rprof top -p 1234                     the hottest functions, live\n  \
        rprof top -p 1234 --subprocesses      a whole Puma cluster, by process\n  \
        rprof top -p 1234 wall                where every thread's time goes, live\n  \
        rprof top -p 1234 -d 10 | cat         plain text every second, not a screen\n\n\
        KEYS: s/t sort by self/total share, a the same since start, h by thread or merged, q quit")]
    Top(RecordArgs),
    /// Compare two recordings (.rprof): what grew and what shrank.
    #[command(after_help = "EXAMPLES:\n  \
        rprof diff before.rprof after.rprof -o diff.svg        red grew, blue shrank\n  \
        rprof diff before.rprof after.rprof --format summary   functions by change in share\n  \
        rprof diff before.rprof after.rprof --absolute -o d.svg  counts as recorded, not shares")]
    Diff(DiffArgs),
    /// Profile every Ruby process on this host without end, and push one
    /// profile per process per interval to Grafana Pyroscope.
    #[command(after_help = "EXAMPLES:\n  \
        rprof agent --push http://pyroscope:4040                    CPU, every 15 s\n  \
        rprof agent --push https://profiles.example --tenant team-a --label env=prod\n  \
        rprof agent --push URL --basic-auth-user 123 --basic-auth-password-file /etc/rprof/token")]
    Agent(AgentArgs),
    /// Write rprof's man pages into a directory, or a shell's completions to
    /// standard output (for packages).
    #[command(hide = true)]
    Generate {
        #[command(subcommand)]
        what: Generate,
    },
}

#[derive(Debug, Subcommand)]
pub enum Generate {
    /// rprof.1 and a page per command (rprof-record.1...) into DIR.
    Man { dir: PathBuf },
    /// Completions for SHELL.
    Completions { shell: clap_complete::Shell },
}

#[derive(Debug, Args)]
pub struct RecordArgs {
    /// PID of a Ruby process to profile; repeat for several in one profile.
    #[arg(short, long, global = true)]
    pub pid: Vec<u32>,

    /// Also follow every process the targets fork, at any depth, from its
    /// first instruction, and the programs they exec (a Puma or Unicorn cluster).
    #[arg(long, global = true)]
    pub subprocesses: bool,

    /// Every Ruby process on this host: those running now and those
    /// started while recording (and their forks), not -p's.
    #[arg(long, global = true, conflicts_with = "pid")]
    pub all: bool,

    /// Split the profile by thread: a frame per thread (`name [tid]`, or the
    /// Ruby thread of an M:N thread), under its process's.
    #[arg(long, global = true)]
    pub threads: bool,

    /// Split the profile by process: a root frame per process
    /// (`process PID:"command line"`), each under its parent's.
    #[arg(long, global = true)]
    pub processes: bool,

    /// Seconds to record (default: until Ctrl-C or the target exits).
    #[arg(short, long, global = true)]
    pub duration: Option<f64>,

    /// Samples per second per CPU (cpu event).
    #[arg(short = 'F', long, default_value_t = 99, global = true)]
    pub frequency: u64,

    /// Output file (default: rprof-<pid>-<YYYYmmdd-HHMMSS>.<format>; summary:
    /// the terminal). With --rotate or --flight-recorder: a directory (default: .).
    #[arg(short, long, global = true)]
    pub output: Option<PathBuf>,

    /// Output format (default: from the output's extension, else svg).
    #[arg(long, value_enum, global = true)]
    pub format: Option<Format>,

    /// Also keep the recording, written as it goes, for `rprof report`.
    #[arg(long, global = true, value_name = "FILE")]
    pub raw: Option<PathBuf>,

    /// Record continuously: write one complete profile per interval (60s,
    /// 5m...) into the -o directory.
    #[arg(
        long,
        global = true,
        value_name = "INTERVAL",
        conflicts_with = "flight_recorder"
    )]
    pub rotate: Option<String>,

    /// With --rotate: keep only the newest N profiles.
    #[arg(long, global = true, value_name = "N", requires = "rotate")]
    pub keep: Option<usize>,

    /// Keep the last DURATION (5m...) in memory; write it into the -o
    /// directory on SIGUSR2 (recording goes on) and at the end.
    #[arg(long, global = true, value_name = "DURATION")]
    pub flight_recorder: Option<String>,

    /// summary format: by source line rather than by function.
    #[arg(long, global = true)]
    pub by_line: bool,

    /// No progress line while recording.
    #[arg(short, long, global = true)]
    pub quiet: bool,

    /// Add native frames (C extensions, the interpreter, libc) stitched with
    /// the Ruby frames, unwound in BPF from the binaries' .eh_frame.
    #[arg(long, global = true)]
    pub native: bool,

    /// With --native: keep the interpreter's own frames between Ruby frames
    /// (rb_vm_exec, vm_call_cfunc..., rb_yield...), folded away by default.
    #[arg(long, global = true)]
    pub native_all: bool,

    /// Add kernel frames at the leaf (a syscall's path into the kernel, or
    /// where a CPU sample landed in the kernel).
    #[arg(long, global = true)]
    pub kernel: bool,

    /// Use the struct layout of this Ruby version for a version rprof does not
    /// know (only if it passes the layout proof on the process).
    #[arg(long, global = true, value_name = "VERSION")]
    pub force_version: Option<String>,

    /// Run the command as root even when rprof runs through sudo (by default
    /// it runs as the user who ran sudo).
    #[arg(long, global = true)]
    pub root: bool,

    /// What to record (default: cpu).
    #[command(subcommand)]
    pub event: Option<Event>,

    /// Command to start and profile, after `--`.
    #[arg(last = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Event {
    /// Sample what threads run on CPU (the default).
    Cpu {
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Trace system calls: every event, with the Ruby stack of the thread that made it.
    Syscall {
        /// Tracepoints of the syscalls group without `sys_`: enter_getpid,exit_read,...
        #[arg(value_delimiter = ',', required_unless_present = "list")]
        names: Vec<String>,
        /// List the syscall tracepoints this kernel has.
        #[arg(long)]
        list: bool,
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Every thread's time, on CPU or not, and why it waits: running, the
    /// GVL, a blocking system call, sleep, a Mutex, a Queue... (on CPU
    /// sampled at -F; off CPU timed whole at each context switch).
    Wall {
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
    /// Object allocations, with the Ruby stack that allocated and the class
    /// allocated (Ruby 2.7, 3.1, 3.3, 3.4). Every allocation costs the
    /// program microseconds while recording (a uprobe trap), whatever
    /// --every is: on a running program it records 10 s unless -d says.
    Alloc {
        /// Walk 1 in N allocations, chosen at random, and count each as N.
        #[arg(long, default_value_t = 1, value_name = "N")]
        every: u64,
        #[arg(last = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Pyroscope's URL (its push API is under it: URL/push.v1.PusherService/Push).
    #[arg(long, value_name = "URL")]
    pub push: String,
    /// How much each pushed profile covers (15s, 1m...).
    #[arg(long, default_value = "15s", value_name = "DURATION")]
    pub interval: String,
    /// Samples per second per CPU.
    #[arg(short = 'F', long, default_value_t = 99)]
    pub frequency: u64,
    /// What to profile: cpu, or wall (every thread's time, and why it waits).
    #[arg(long, value_enum, default_value = "cpu")]
    pub event: AgentEvent,
    /// A label on every profile (env=prod); repeat for more.
    #[arg(long = "label", value_name = "NAME=VALUE")]
    pub labels: Vec<String>,
    /// HTTP basic auth user (Grafana Cloud: the stack's user ID).
    #[arg(long, value_name = "USER", requires = "basic_auth_password_file")]
    pub basic_auth_user: Option<String>,
    /// A file holding the password (an API token), readable by its owner only.
    #[arg(long, value_name = "FILE", requires = "basic_auth_user")]
    pub basic_auth_password_file: Option<PathBuf>,
    /// The tenant (X-Scope-OrgID), for a multi-tenant Pyroscope.
    #[arg(long, value_name = "ID")]
    pub tenant: Option<String>,
    /// Profile only these Rubies: a service name, or cgroup:TEXT for those
    /// whose cgroup path holds TEXT; repeat for more.
    #[arg(long, value_name = "NAME|cgroup:TEXT")]
    pub only: Vec<String>,
    /// Leave these Rubies out (as --only says them); repeat for more.
    #[arg(long, value_name = "NAME|cgroup:TEXT")]
    pub exclude: Vec<String>,
    /// Stop after this many seconds (default: never).
    #[arg(short, long)]
    pub duration: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AgentEvent {
    Cpu,
    Wall,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// The recording before (.rprof).
    pub before: PathBuf,
    /// The recording after.
    pub after: PathBuf,
    /// Output file (default: AFTER's name with `.diff` and the format's
    /// extension; summary: the terminal).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// svg (a differential flame graph: after's shape, red grew, blue
    /// shrank), flame, folded (`stack before after`) or summary (default:
    /// from the output's extension, else svg).
    #[arg(long, value_enum)]
    pub format: Option<Format>,
    #[command(flatten)]
    pub compare: CompareArgs,
}

/// How two recordings are compared.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Compare counts as recorded, not shares of each recording's total.
    #[arg(long)]
    pub absolute: bool,
    /// summary format: by source line rather than by function.
    #[arg(long)]
    pub by_line: bool,
}

#[derive(Debug, Args)]
#[command(after_help = "EXAMPLES:\n  \
    rprof report -i rec.rprof --format summary            top functions in the terminal\n  \
    rprof report -i rec.rprof -o rec.pb.gz                pprof, for go tool pprof, Pyroscope...\n  \
    rprof report -i rec.rprof --from 10s --to 20s -o w.svg  seconds 10 to 20 only\n  \
    rprof report -i rec.rprof --pid 4242 --threads        one process, split by thread\n  \
    rprof report -i after.rprof --diff before.rprof       what changed since before.rprof\n  \
    rprof report -i rec.rprof --open                      one HTML page, opened in a browser")]
pub struct ReportArgs {
    /// A recording (written with --raw, or --format rprof).
    #[arg(short, long)]
    pub input: PathBuf,
    /// Output file (default: the input's name with the format's extension;
    /// summary: the terminal).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Output format (default: from the output's extension, else svg).
    #[arg(long, value_enum)]
    pub format: Option<Format>,
    /// Only what was recorded from this time on (since the recording
    /// started: 10, 1.5s, 2m...), to the nearest half second.
    #[arg(long, value_name = "TIME")]
    pub from: Option<String>,
    /// Only what was recorded before this time.
    #[arg(long, value_name = "TIME")]
    pub to: Option<String>,
    /// Only these processes; repeat for several.
    #[arg(long)]
    pub pid: Vec<u32>,
    /// Only these threads, by thread id or name; repeat for several.
    #[arg(long)]
    pub thread: Vec<String>,
    /// A frame per thread.
    #[arg(long)]
    pub threads: bool,
    /// A root frame per process.
    #[arg(long)]
    pub processes: bool,
    /// summary format: by source line rather than by function.
    #[arg(long)]
    pub by_line: bool,
    /// Compare with this recording, from before (as `rprof diff BEFORE
    /// INPUT`; cut to the same --from, --to, --pid and --thread).
    #[arg(long, value_name = "BEFORE")]
    pub diff: Option<PathBuf>,
    /// With --diff: compare counts as recorded, not shares.
    #[arg(long, requires = "diff")]
    pub absolute: bool,
    /// Open what is written in a browser ($BROWSER, else xdg-open when
    /// there is a display); html unless another format is asked for.
    #[arg(long)]
    pub open: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Interactive icicle graph (root at the top).
    Svg,
    /// Flame graph SVG (root at the bottom).
    Flame,
    /// Folded stacks: `root;...;leaf count` per line.
    Folded,
    /// speedscope's JSON: a profile per thread (https://www.speedscope.app).
    Speedscope,
    /// pprof's gzipped protobuf, for go tool pprof, Pyroscope, Parca, Grafana.
    Pprof,
    /// A table of the top functions by self and total share.
    Summary,
    /// One self-contained page: the flame graph, the summary, what was
    /// recorded.
    Html,
    /// rprof's own recording, for `rprof report`.
    Rprof,
}

impl Format {
    pub fn extension(self) -> &'static str {
        match self {
            Format::Svg | Format::Flame => "svg",
            Format::Folded => "folded",
            Format::Speedscope => "speedscope.json",
            Format::Pprof => "pb.gz",
            Format::Summary => "txt",
            Format::Html => "html",
            Format::Rprof => "rprof",
        }
    }

    /// The format given, or else the one `output`'s extension asks for, or
    /// else svg (no output file named).
    pub fn for_output(
        given: Option<Format>,
        output: Option<&std::path::Path>,
    ) -> Result<Format, crate::error::UserError> {
        match (given, output) {
            (Some(f), _) => Ok(f),
            (None, Some(path)) => {
                Format::of_path(path).ok_or_else(|| crate::error::UserError::UnknownExtension {
                    path: path.display().to_string(),
                })
            }
            (None, None) => Ok(Format::Svg),
        }
    }

    /// The format a file name asks for, by its extension.
    pub fn of_path(path: &std::path::Path) -> Option<Format> {
        let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
        let formats = [
            (".svg", Format::Svg),
            (".folded", Format::Folded),
            (".json", Format::Speedscope),
            (".pb.gz", Format::Pprof),
            (".pprof", Format::Pprof),
            (".pb", Format::Pprof),
            (".txt", Format::Summary),
            (".html", Format::Html),
            (".htm", Format::Html),
            (".rprof", Format::Rprof),
        ];
        formats
            .iter()
            .find(|(ext, _)| name.ends_with(ext))
            .map(|&(_, f)| f)
    }
}

/// A duration as users write one: seconds (`30`, `1.5`) or with units
/// (`500ms`, `60s`, `5m`, `1h30m`).
pub fn parse_duration(given: &str) -> Result<std::time::Duration, crate::error::UserError> {
    let bad = || crate::error::UserError::BadDuration {
        given: given.to_string(),
    };
    let text = given.trim();
    // Seconds, with or without their unit (`1.5`, `1.5s`); anything else by humantime.
    let secs = text.strip_suffix('s').unwrap_or(text).parse::<f64>();
    let d = match secs {
        Ok(secs) if secs.is_finite() && secs >= 0.0 => std::time::Duration::from_secs_f64(secs),
        Ok(_) => return Err(bad()),
        Err(_) => humantime::parse_duration(text).map_err(|_| bad())?,
    };
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn durations_as_users_write_them() {
        let ok = |s: &str| parse_duration(s).expect(s);
        assert_eq!(ok("30"), Duration::from_secs(30));
        assert_eq!(ok("1.5"), Duration::from_millis(1500));
        assert_eq!(ok("1.5s"), Duration::from_millis(1500));
        assert_eq!(ok("500ms"), Duration::from_millis(500));
        assert_eq!(ok("5m"), Duration::from_secs(300));
        assert_eq!(ok("1h30m"), Duration::from_secs(5400));
        for bad in ["soon", "-1", "NaN", "inf", ""] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formats_from_extensions() {
        let of = |p: &str| Format::of_path(std::path::Path::new(p));
        assert_eq!(of("a.svg"), Some(Format::Svg));
        assert_eq!(of("a.speedscope.json"), Some(Format::Speedscope));
        assert_eq!(of("a.pb.gz"), Some(Format::Pprof));
        assert_eq!(of("A.PPROF"), Some(Format::Pprof));
        assert_eq!(of("a.txt"), Some(Format::Summary));
        assert_eq!(of("a.rprof"), Some(Format::Rprof));
        assert_eq!(of("a.png"), None);
        for f in [
            Format::Svg,
            Format::Folded,
            Format::Speedscope,
            Format::Pprof,
            Format::Summary,
            Format::Html,
            Format::Rprof,
        ] {
            assert_eq!(
                of(&format!("x.{}", f.extension())),
                Some(f),
                "{f:?}'s own extension"
            );
        }
    }
}
