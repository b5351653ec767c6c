//! Errors the user can fix, each with what to do about it.

use ruby_structs::LayoutError;

#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error("no process with PID {pid}: check the PID (ps -e | grep ruby)")]
    NoSuchProcess { pid: u32 },

    #[error("process {pid} ({exe}) is not a Ruby process: no mapped file defines ruby_version; point -p at a ruby process, or add --subprocesses to follow the Ruby processes it starts")]
    NotRuby { pid: u32, exe: String },

    #[error("{0}")]
    UnsupportedVersion(#[from] LayoutError),

    #[error("process {pid} runs {description}, which rprof's Ruby {layout} layout does not fit ({check}): rprof will not guess; try another layout with --force-version X.Y, and please report it")]
    LayoutRefused {
        pid: u32,
        description: String,
        layout: String,
        check: String,
    },

    #[error("--force-version {given:?} is not a Ruby version: give one like 3.3")]
    BadForcedVersion { given: String },

    #[error("rprof needs {missing} to load BPF programs and open perf events: run it as root (sudo rprof ...) or grant {missing}")]
    MissingPrivileges { missing: String },

    #[error("this kernel exposes no BTF (/sys/kernel/btf/vmlinux is missing): rprof needs a kernel built with CONFIG_DEBUG_INFO_BTF=y (5.8 or newer)")]
    BtfMissing,

    #[error("tracefs is not mounted, so syscall tracepoints cannot be found: run `mount -t tracefs nodev /sys/kernel/tracing`")]
    TracefsMissing,

    #[error("{path} (tracefs) is not readable by this user: syscall tracing needs root, or CAP_DAC_READ_SEARCH besides rprof's other capabilities")]
    TracefsClosed { path: String },

    #[error("unknown system call tracepoint {name:?}{hint}; `rprof record syscall --list` lists them all")]
    UnknownSyscall { name: String, hint: String },

    #[error("-F/--frequency must be between 1 and {max} samples per second, not {given}")]
    BadFrequency { given: u64, max: u64 },

    #[error("process {pid} exited before rprof could attach to it")]
    TargetGone { pid: u32 },

    #[error("cannot read the memory of process {pid}: {why}; rprof needs CAP_SYS_PTRACE (root) to read other users' processes")]
    CannotReadMemory { pid: u32, why: String },

    #[error("{path}: {why}")]
    BadRecording {
        path: String,
        why: crate::recording::file::FileError,
    },

    #[error(
        "{given:?} is not a duration: give seconds (30, 1.5) or a number with a unit (500ms, 60s, 5m, 1h)"
    )]
    BadDuration { given: String },

    #[error("cannot tell the format of {path} from its extension: give --format (svg, flame, folded, speedscope, pprof, summary, html, rprof)")]
    UnknownExtension { path: String },

    #[error("rprof diff writes svg, flame, folded or summary, not {given}: give one of those with --format or -o's extension")]
    DiffFormat { given: String },

    #[error("{before} and {after} record different things ({what_before} and {what_after}): compare recordings of one event")]
    DiffEvents {
        before: String,
        after: String,
        what_before: String,
        what_after: String,
    },

    #[error("process {pid} runs Ruby {version}, whose allocation functions rprof does not know: `alloc` works on Ruby 2.7, 3.1, 3.3 and 3.4")]
    AllocUnknownRuby { pid: u32, version: String },

    #[error("`alloc` records Ruby stacks only: leave out --native and --kernel")]
    AllocWithNative,

    #[error("--push {given:?} is not a URL: give Pyroscope's, like http://pyroscope:4040")]
    BadPushUrl { given: String },

    #[error("{path} can be read by others (mode {mode:o}): the password file must be its owner's only (chmod 600 {path})")]
    OpenPasswordFile { path: String, mode: u32 },

    #[error("--label {given:?}: give NAME=VALUE, NAME made of letters, digits and _ (not starting with a digit or __)")]
    BadLabel { given: String },

    #[error("--every must be between 1 and {max}, not {given}")]
    BadAllocEvery { given: u64, max: u64 },

    #[error("{before} and {after} were sampled at different frequencies ({what_before} and {what_after}): their counts do not compare; leave out --absolute to compare shares")]
    DiffFrequencies {
        before: String,
        after: String,
        what_before: String,
        what_after: String,
    },
}
