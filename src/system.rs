//! What rprof needs of the machine, checked up front so a missing piece is a
//! clear error rather than a failure deep inside libbpf: privileges, kernel
//! BTF, tracefs and its syscall tracepoints.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::UserError;

const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

/// Effective capabilities of this process, from /proc/self/status.
fn effective_caps() -> u64 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .unwrap_or(0)
}

/// Loading BPF and opening system-wide perf events needs CAP_BPF and
/// CAP_PERFMON (or CAP_SYS_ADMIN on its own).
pub fn check_privileges() -> Result<(), UserError> {
    let caps = effective_caps();
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    if has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON)) {
        return Ok(());
    }
    let missing: Vec<&str> = [(CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")]
        .iter()
        .filter(|(c, _)| !has(*c))
        .map(|(_, n)| *n)
        .collect();
    Err(UserError::MissingPrivileges {
        missing: missing.join(" and "),
    })
}

pub fn check_btf() -> Result<(), UserError> {
    if Path::new("/sys/kernel/btf/vmlinux").exists() {
        Ok(())
    } else {
        Err(UserError::BtfMissing)
    }
}

/// The mounted tracefs (holding `events/`), if any. Without root it is
/// often there but closed (mode 0700): that is said apart.
pub fn tracefs() -> Result<PathBuf, UserError> {
    let candidates = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"].map(PathBuf::from);
    if let Some(found) = candidates.iter().find(|p| p.join("events").is_dir()) {
        return Ok(found.clone());
    }
    let closed = candidates
        .iter()
        .find(|p| fs::read_dir(p).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied));
    match closed {
        Some(p) => Err(UserError::TracefsClosed {
            path: p.display().to_string(),
        }),
        None => Err(UserError::TracefsMissing),
    }
}

/// Every syscall tracepoint, without its `sys_` prefix: `enter_getpid`, ...
pub fn syscall_tracepoints() -> Result<Vec<String>, UserError> {
    let dir = tracefs()?.join("events/syscalls");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .map_err(|_| UserError::TracefsMissing)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("sys_"))
                .map(str::to_string)
        })
        .collect();
    names.sort();
    Ok(names)
}

/// Checks a user's syscall tracepoint name (`enter_getpid`, also accepted
/// with a `sys_` prefix) and returns the tracepoint's name in tracefs.
pub fn syscall_tracepoint(name: &str, known: &[String]) -> Result<String, UserError> {
    let bare = name.strip_prefix("sys_").unwrap_or(name);
    if known.iter().any(|k| k == bare) {
        return Ok(format!("sys_{bare}"));
    }
    let mut close: Vec<(usize, &String)> = known
        .iter()
        .map(|k| (edit_distance(bare, k), k))
        .filter(|(d, k)| *d <= 3 || k.ends_with(&format!("_{bare}")))
        .collect();
    close.sort();
    let hint = if close.is_empty() {
        String::new()
    } else {
        let names: Vec<&str> = close.iter().take(4).map(|(_, k)| k.as_str()).collect();
        format!(" (did you mean {}?)", names.join(", "))
    };
    Err(UserError::UnknownSyscall {
        name: name.to_string(),
        hint,
    })
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// When a process started, in seconds since the Unix epoch, from its start
/// in clock ticks after boot (/proc/PID/stat) and the boot time (/proc/stat).
pub fn start_time(start_ticks: u64) -> u64 {
    let boot: u64 = fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
        })
        .unwrap_or(0);
    boot + start_ticks / crate::process::clock_ticks_per_second()
}

/// The nice value of rprof's recording thread: ahead of the programs it
/// profiles (0), see [`favour_recording_thread`].
const RECORDING_NICE: i32 = -5;

/// Lets the calling thread (the recording loop) run soon after it wakes on
/// a machine whose every CPU is busy. It names a sample's frames by reading
/// the target's memory, which must happen before the target's GC frees the
/// code they ran (per-request code, such as Rails's inline templates); a
/// Rails worker under load collects about 30 times a second. Measured with
/// tests/servers.rs's Rails test (2026-11-25, both CPUs busy, rprof then
/// woken by each record rather than reading at random moments): at nice 0
/// records waited up to 75 ms (p99 51–54 ms) and 0.36–1.0% of samples lost
/// a name (9 runs); at -5, p99 14–21 ms and 0.06–0.30% (11 runs). rprof
/// does the same work (about a tenth of a CPU there), only sooner. Linux's
/// nice is per thread, and this runs after any command rprof launched has
/// started, so nothing profiled inherits it. Without CAP_SYS_NICE, nothing
/// changes.
pub fn favour_recording_thread() {
    // SAFETY: plain system calls on this thread's own id.
    unsafe {
        let tid = libc::gettid();
        let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, RECORDING_NICE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syscall_names_and_suggestions() {
        let known: Vec<String> = ["enter_getpid", "exit_getpid", "enter_getppid", "enter_read"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(
            syscall_tracepoint("enter_getpid", &known).expect("known"),
            "sys_enter_getpid"
        );
        assert_eq!(
            syscall_tracepoint("sys_enter_read", &known).expect("known"),
            "sys_enter_read"
        );
        let err = syscall_tracepoint("enter_getpd", &known)
            .expect_err("unknown")
            .to_string();
        assert!(err.contains("did you mean enter_getpid"), "{err}");
        let err = syscall_tracepoint("getpid", &known)
            .expect_err("unknown")
            .to_string();
        assert!(
            err.contains("enter_getpid"),
            "a bare syscall name suggests its tracepoints: {err}"
        );
    }
}
