//! Command-line interface.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "rprof",
    version,
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
        rprof record -p 1234 --native --kernel       Ruby, C and kernel frames in one stack\n  \
        rprof record -- ruby app.rb                  start app.rb and profile it; exit with its status")]
    Record(RecordArgs),
    /// Render a recording (.rprof) again, in another format.
    Report(ReportArgs),
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

    /// Output file (default: rprof-<pid>-<YYYYmmdd-HHMMSS>.<format>).
    #[arg(short, long, global = true)]
    pub output: Option<PathBuf>,

    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Svg, global = true)]
    pub format: Format,

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

    /// Use the struct layout of this Ruby version for a version rprof does not know.
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
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// A recording written with --format rprof.
    #[arg(short, long)]
    pub input: PathBuf,
    /// Output file (default: the input's name with the format's extension).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Format::Svg)]
    pub format: Format,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Interactive icicle graph (root at the top).
    Svg,
    /// Flame graph SVG (root at the bottom).
    Flame,
    /// Folded stacks: `root;...;leaf count` per line.
    Folded,
    /// rprof's own recording, for `rprof report`.
    Rprof,
}

impl Format {
    pub fn extension(self) -> &'static str {
        match self {
            Format::Svg | Format::Flame => "svg",
            Format::Folded => "folded",
            Format::Rprof => "rprof",
        }
    }
}
