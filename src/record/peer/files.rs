//! Which file a blocked call waits on (`flock` on a lock file, `read` of a
//! file the page cache does not hold, `fsync` of a log): BPF, or the sweep
//! for a stack it reads, gives the file's inode, its file system's device
//! and the descriptor; its path is that descriptor's link in /proc/PID/fd,
//! taken only while the descriptor still names the same file. A pipe has
//! no path: it is named by the one other process that holds it, among the
//! process's parent and the processes it started (`IO.popen`, Open3), those
//! that started another holder aside (a shell running `a | b` holds the
//! pipe that `b` writes).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;

use crate::bpf::types;
use crate::process::Process;
use crate::processes::ProcessId;

use super::Known;

/// Paths a process's files were found at, by (device, inode); what its
/// pipes were found to be, by inode.
#[derive(Default)]
pub struct Files {
    paths: HashMap<(ProcessId, u32, u64), String>,
    pipes: HashMap<(ProcessId, u64), Known>,
}

/// Processes searched for a pipe's other end at most.
const MAX_KIN: usize = 256;

/// Files remembered at most, for all processes: a server that sends many
/// files starts again rather than grow.
const MAX_FILES: usize = 4096;

impl Files {
    /// The path of the file a wait of process `id`, `h`, is on.
    pub fn look_up(&mut self, id: ProcessId, h: &types::rprof_sample_header) -> Known {
        let (inode, dev, fd) = identity(h);
        if inode == 0 {
            return Known::Nothing;
        }
        if let Some(path) = self.paths.get(&(id, dev, inode)) {
            return Known::File(path.clone());
        }
        let link = format!("/proc/{}/fd/{fd}", id.pid);
        let same = std::fs::metadata(&link).is_ok_and(|m| m.ino() == inode && kernel_dev(m.dev()) == dev);
        let Some(path) = std::fs::read_link(&link).ok().filter(|_| same) else {
            return Known::Nothing;
        };
        let path = path.to_string_lossy().into_owned();
        if self.paths.len() >= MAX_FILES {
            self.paths.clear();
        }
        self.paths.insert((id, dev, inode), path.clone());
        Known::File(path)
    }

    /// The one other process that holds the pipe a wait of process `id`,
    /// `h`, is on: its name and PID.
    pub fn pipe(&mut self, id: ProcessId, h: &types::rprof_sample_header) -> Known {
        let (inode, _, _) = identity(h);
        if inode == 0 {
            return Known::Nothing;
        }
        if let Some(known) = self.pipes.get(&(id, inode)) {
            return known.clone();
        }
        let link = format!("pipe:[{inode}]");
        let known = match at_the_other_end(&kin(id.pid), |p| holds(p, &link)).as_slice() {
            [p] => {
                let name = Process::open(*p).map_or_else(|_| "?".to_string(), |p| p.exe_name());
                Known::PipeWith(format!("{name} [{p}]"))
            }
            _ => Known::Nothing,
        };
        if self.pipes.len() >= MAX_FILES {
            self.pipes.clear();
        }
        self.pipes.insert((id, inode), known.clone());
        known
    }

    /// Forgets a process that ended.
    pub fn forget(&mut self, id: &ProcessId) {
        self.paths.retain(|(p, _, _), _| p != id);
        self.pipes.retain(|(p, _), _| p != id);
    }
}

/// A process of `pid`'s kin (`kin`) and the process it is the kin through:
/// its parent, or for `pid`'s parent, none.
type Kin = (u32, Option<u32>);

/// Process `pid`'s parent and the processes it started, theirs and so on
/// (at most `MAX_KIN`), each with its parent among them. Read down its own
/// tree (`Process::children`), not from every process's stat
/// (`process::descendants`): a new pipe, an `IO.popen` per request, asks
/// again.
fn kin(pid: u32) -> Vec<Kin> {
    let mut found: Vec<Kin> = Process { pid }.parent().map(|p| (p, None)).into_iter().collect();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for child in (Process { pid: p }).children() {
            if found.len() >= MAX_KIN {
                return found;
            }
            found.push((child, Some(p)));
            next.push(child);
        }
    }
    found
}

/// The processes of `kin` that `holds`, less those that started another
/// of them (directly or not): the shell between a program and the command
/// it runs holds the command's pipe too, and writes nothing to it.
fn at_the_other_end(kin: &[Kin], holds: impl Fn(u32) -> bool) -> Vec<u32> {
    let holders: Vec<u32> = kin.iter().map(|&(p, _)| p).filter(|&p| holds(p)).collect();
    let parent = |p: u32| kin.iter().find(|&&(k, _)| k == p).and_then(|&(_, up)| up);
    let mut starters = Vec::new();
    for &h in &holders {
        let mut up = parent(h);
        while let Some(p) = up {
            starters.push(p);
            up = parent(p);
        }
    }
    holders.into_iter().filter(|h| !starters.contains(h)).collect()
}

/// Whether process `pid` has a descriptor whose link is `link`.
fn holds(pid: u32, link: &str) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == link))
}

/// A file's identity into `h` as BPF's `file_identity` puts it, from the
/// metadata of its descriptor `fd` (`st_dev`, `st_ino`).
pub fn set_identity(h: &mut types::rprof_sample_header, st_dev: u64, inode: u64, fd: u64) {
    h.peer_addr[..8].copy_from_slice(&inode.to_ne_bytes());
    h.peer_addr[8..12].copy_from_slice(&kernel_dev(st_dev).to_ne_bytes());
    h.peer_addr[12..].copy_from_slice(&(fd as u32).to_ne_bytes());
}

/// (inode, device, descriptor) of `h`'s file.
fn identity(h: &types::rprof_sample_header) -> (u64, u32, u32) {
    let a = &h.peer_addr;
    (
        u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u32::from_ne_bytes([a[8], a[9], a[10], a[11]]),
        u32::from_ne_bytes([a[12], a[13], a[14], a[15]]),
    )
}

/// A device number as the kernel keeps it (`MKDEV`: 12 bits of major, 20
/// of minor), from `stat`'s.
fn kernel_dev(st_dev: u64) -> u32 {
    (libc::major(st_dev) << 20) | libc::minor(st_dev)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kin of process 10: its parent 1; its shell 20 (`sh -c 'a | b'`),
    /// whose 21 and 22 it started; and its own 30.
    const KIN: [Kin; 5] = [
        (1, None),
        (20, Some(10)),
        (21, Some(20)),
        (22, Some(20)),
        (30, Some(10)),
    ];

    fn other_end(holders: &[u32]) -> Vec<u32> {
        at_the_other_end(&KIN, |p| holders.contains(&p))
    }

    #[test]
    fn a_pipe_is_named_by_the_command_not_the_shell_that_started_it() {
        assert_eq!(other_end(&[20, 22]), [22]);
        assert_eq!(other_end(&[22]), [22]);
        assert_eq!(other_end(&[20]), [20]);
        // Two commands, or the parent and a command: neither is the end.
        assert_eq!(other_end(&[21, 22]), [21, 22]);
        assert_eq!(other_end(&[20, 21, 22]), [21, 22]);
        assert_eq!(other_end(&[1, 30]), [1, 30]);
        assert_eq!(other_end(&[1, 20, 22]), [1, 22]);
    }

    /// A file of this process, as a wait on it would carry it.
    #[test]
    fn a_descriptor_names_its_file_while_it_is_that_file() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lock");
        let file = std::fs::File::create(&path).expect("a file");
        let meta = file.metadata().expect("its metadata");
        let mut h = types::rprof_sample_header::default();
        set_identity(&mut h, meta.dev(), meta.ino(), file.as_raw_fd() as u64);
        let id = ProcessId {
            pid: std::process::id(),
            start_ticks: 0,
        };
        let mut files = Files::default();
        assert_eq!(files.look_up(id, &h), Known::File(path.display().to_string()));
        // Another file at that descriptor: not named by its path.
        files.forget(&id);
        h.peer_addr[..8].copy_from_slice(&(meta.ino() + 1).to_ne_bytes());
        assert_eq!(files.look_up(id, &h), Known::Nothing);
    }
}
