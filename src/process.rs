//! A target process as /proc shows it: its memory mappings, its threads, and
//! reads of its memory. Reads never stop or change the process.

use std::fs;
use std::io;
use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::error::UserError;

/// One line of /proc/PID/maps.
#[derive(Debug, Clone)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub offset: u64,
    pub perms: String,
    pub path: String,
    /// The mapped file's device and inode (0 for anonymous memory).
    pub dev: String,
    pub inode: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct Process {
    pub pid: u32,
}

impl Process {
    /// The process, if it exists.
    pub fn open(pid: u32) -> Result<Self, UserError> {
        if pid == 0 || !PathBuf::from(format!("/proc/{pid}")).exists() {
            return Err(UserError::NoSuchProcess { pid });
        }
        Ok(Self { pid })
    }

    /// Whether this PID is still the process that started at `start_ticks`
    /// (see `start_ticks`) and still runs: a zombie keeps its /proc entry
    /// but has no memory left to read. One read of /proc/PID/stat.
    pub fn is_alive_since(&self, start_ticks: u64) -> bool {
        self.stat().is_some_and(|rest| {
            !rest.trim_start().starts_with(['Z', 'X']) && parse_start_ticks(&rest) == Some(start_ticks)
        })
    }

    /// /proc/PID/stat after the command's ")" (the command may hold any
    /// character): its fields from the state (field 3) on.
    fn stat(&self) -> Option<String> {
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid)).ok()?;
        Some(stat.rsplit_once(')')?.1.to_string())
    }

    pub fn maps(&self) -> Result<Vec<Mapping>> {
        let text = fs::read_to_string(format!("/proc/{}/maps", self.pid))
            .with_context(|| format!("reading /proc/{}/maps", self.pid))?;
        Ok(text.lines().filter_map(parse_maps_line).collect())
    }

    /// Where to open the file behind a mapping from here. The maps path is
    /// relative to a root that may not be ours (a container, a chroot), so
    /// prefer /proc/PID/map_files, which is the mapped file itself, then
    /// /proc/PID/root/PATH, then PATH.
    pub fn mapped_file_candidates(&self, m: &Mapping) -> Vec<PathBuf> {
        let path = m.path.trim_end_matches(" (deleted)");
        vec![
            PathBuf::from(format!("/proc/{}/map_files/{:x}-{:x}", self.pid, m.start, m.end)),
            PathBuf::from(format!("/proc/{}/root{}", self.pid, path)),
            PathBuf::from(path),
        ]
    }

    /// When the process started, as /proc/PID/stat says (boot time in clock
    /// ticks): with the PID, its identity, as a PID is only reused later.
    pub fn start_ticks(&self) -> Option<u64> {
        parse_start_ticks(&self.stat()?)
    }

    /// Its parent's PID.
    pub fn parent(&self) -> Option<u32> {
        parse_ppid(&self.stat()?)
    }

    /// The processes it started that still run, from its threads'
    /// /proc/PID/task/TID/children (none on a kernel without
    /// CONFIG_PROC_CHILDREN): its own, where `descendants` reads every
    /// process's stat.
    pub fn children(&self) -> Vec<u32> {
        let Ok(tasks) = fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return Vec::new();
        };
        tasks
            .flatten()
            .flat_map(|task| {
                let text = fs::read_to_string(task.path().join("children")).unwrap_or_default();
                text.split_whitespace()
                    .filter_map(|c| c.parse().ok())
                    .collect::<Vec<u32>>()
            })
            .collect()
    }

    /// The CPU time all its threads have used (user and system), in ns, as
    /// /proc/PID/stat counts it: in clock ticks, rounded down.
    pub fn cpu_ns(&self) -> Option<u64> {
        let stat = self.stat()?;
        // From the state (field 3): utime is field 14, stime 15.
        let mut fields = stat.split_whitespace().skip(11);
        let utime: u64 = fields.next()?.parse().ok()?;
        let stime: u64 = fields.next()?.parse().ok()?;
        Some((utime + stime).saturating_mul(1_000_000_000 / clock_ticks_per_second()))
    }

    /// `cpu_ns` of this process and of the ancestors it was forked from
    /// that run the same program (a Puma master; a worker that forks
    /// others), and how many processes that is: a fork's memory, the GC's
    /// clock in it, holds time its parent paid for, which the fork's own
    /// CPU time does not count.
    pub fn lineage_cpu_ns(&self) -> Option<(u64, u64)> {
        let exe = |pid: u32| fs::read_link(format!("/proc/{pid}/exe")).ok();
        let program = exe(self.pid);
        let (mut ns, mut n) = (self.cpu_ns()?, 1);
        let mut up = self.parent();
        while let Some(pid) = up.filter(|&p| p > 1 && n < 64) {
            if program.is_none() || exe(pid) != program {
                break;
            }
            let parent = Process { pid };
            ns = ns.saturating_add(parent.cpu_ns().unwrap_or(0));
            n += 1;
            up = parent.parent();
        }
        Some((ns, n))
    }

    /// The command line, arguments joined by spaces (empty for a zombie).
    pub fn command_line(&self) -> String {
        let raw = fs::read(format!("/proc/{}/cmdline", self.pid)).unwrap_or_default();
        let args: Vec<String> = raw
            .split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        args.join(" ")
    }

    pub fn exe_name(&self) -> String {
        fs::read_to_string(format!("/proc/{}/comm", self.pid))
            .map(|s| s.trim_end().to_string())
            .unwrap_or_else(|_| "?".to_string())
    }

    /// Reads `buf.len()` bytes at `addr` of the target's memory.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: both iovecs describe valid ranges: `local` is our own buffer,
        // and the kernel checks `remote` against the target's address space.
        let n = unsafe { libc::process_vm_readv(self.pid as libc::pid_t, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "short read of target memory",
            ));
        }
        Ok(())
    }

    /// Reads several ranges of the target's memory in one system call, in
    /// order (the kernel copies them one after the other).
    pub fn read_many(&self, ranges: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let total: usize = ranges.iter().map(|(_, b)| b.len()).sum();
        let local: Vec<libc::iovec> = ranges
            .iter_mut()
            .map(|(_, b)| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        let remote: Vec<libc::iovec> = ranges
            .iter()
            .map(|(addr, b)| libc::iovec {
                iov_base: *addr as *mut libc::c_void,
                iov_len: b.len(),
            })
            .collect();
        // SAFETY: every local iovec is one of our buffers, borrowed mutably
        // for the call; the kernel checks the remote ones.
        let n = unsafe {
            libc::process_vm_readv(
                self.pid as libc::pid_t,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != total {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "short read of target memory",
            ));
        }
        Ok(())
    }

    /// A NUL-terminated string of at most `max` bytes.
    pub fn read_cstr(&self, addr: u64, max: usize) -> io::Result<String> {
        let mut buf = vec![0u8; max];
        // The string may end near the end of a mapping: shrink until it reads.
        let mut len = max;
        loop {
            match self.read(addr, &mut buf[..len]) {
                Ok(()) => break,
                Err(_) if len > 16 => len /= 2,
                Err(e) => return Err(e),
            }
        }
        let end = buf[..len].iter().position(|&b| b == 0).unwrap_or(len);
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }
}

/// Field 22 of /proc/PID/stat, from what follows the command name's closing
/// parenthesis (field 3 on).
/// The unit of /proc's times (USER_HZ).
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64
}

/// Field 4, the parent, follows the state after the command name.
fn parse_ppid(after_comm: &str) -> Option<u32> {
    after_comm.split_whitespace().nth(1)?.parse().ok()
}

fn parse_start_ticks(after_comm: &str) -> Option<u64> {
    after_comm.split_whitespace().nth(19)?.parse().ok()
}

/// Every process running now, by PID (what /proc lists).
pub fn all_pids() -> Vec<u32> {
    let mut pids: Vec<u32> = fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
        .collect();
    pids.sort_unstable();
    pids
}

/// The processes running under `root` now (children, grandchildren...),
/// parents before their children, each with its parent: from the parent PID
/// in every /proc/PID/stat.
pub fn descendants(root: u32) -> Vec<(u32, u32)> {
    let mut children: std::collections::HashMap<u32, Vec<u32>> = std::collections::HashMap::new();
    for pid in all_pids() {
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| parse_ppid(rest));
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut out = Vec::new();
    let mut queue = std::collections::VecDeque::from([root]);
    while let Some(parent) = queue.pop_front() {
        for &child in children.get(&parent).into_iter().flatten() {
            out.push((child, parent));
            queue.push_back(child);
        }
    }
    out
}

fn parse_maps_line(line: &str) -> Option<Mapping> {
    let mut it = line.splitn(6, ' ');
    let range = it.next()?;
    let perms = it.next()?.to_string();
    let offset = u64::from_str_radix(it.next()?, 16).ok()?;
    let dev = it.next()?.to_string();
    let inode = it.next()?.parse().ok()?;
    let path = it.next().unwrap_or("").trim_start().to_string();
    let (start, end) = range.split_once('-')?;
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        offset,
        perms,
        path,
        dev,
        inode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_maps_lines_with_and_without_paths() {
        let m = parse_maps_line(
            "7f1c2a400000-7f1c2a433000 r--p 00033000 fe:01 1234   /usr/lib/x86_64-linux-gnu/libruby-3.1.so.3.1",
        )
        .expect("parses");
        assert_eq!(m.start, 0x7f1c2a400000);
        assert_eq!(m.offset, 0x33000);
        assert_eq!(m.path, "/usr/lib/x86_64-linux-gnu/libruby-3.1.so.3.1");
        let anon = parse_maps_line("7ffd1000-7ffd2000 rw-p 00000000 00:00 0 ").expect("parses");
        assert_eq!(anon.path, "");
    }

    #[test]
    fn reads_our_own_memory() {
        use crate::address_space::AddressSpace;
        let me = Process::open(std::process::id()).expect("we exist");
        let value: u64 = 0x1234_5678_9abc_def0;
        let got = me.read_u64(&value as *const u64 as u64).expect("readable");
        assert_eq!(got, value);
        let other: u32 = 7;
        let (mut a, mut b) = ([0u8; 8], [0u8; 4]);
        me.read_many(&mut [
            (&value as *const u64 as u64, &mut a[..]),
            (&other as *const u32 as u64, &mut b[..]),
        ])
        .expect("readable");
        assert_eq!((u64::from_le_bytes(a), u32::from_le_bytes(b)), (value, other));
        let ticks = me.start_ticks().expect("our own start");
        assert!(ticks > 0 && me.is_alive_since(ticks));
        assert!(!me.is_alive_since(ticks + 1));
        assert!(!me.command_line().is_empty());
        assert!(matches!(Process::open(0), Err(UserError::NoSuchProcess { .. })));
    }
}
