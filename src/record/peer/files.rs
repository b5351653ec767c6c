//! Which file a blocked call waits on (`flock` on a lock file, `read` of a
//! file the page cache does not hold, `fsync` of a log): BPF, or the sweep
//! for a stack it reads, gives the file's inode, its file system's device
//! and the descriptor; its path is that descriptor's link in /proc/PID/fd,
//! taken only while the descriptor still names the same file.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;

use crate::bpf::types;
use crate::processes::ProcessId;

use super::Known;

/// Paths a process's files were found at, by (device, inode).
#[derive(Default)]
pub struct Files(HashMap<(ProcessId, u32, u64), String>);

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
        if let Some(path) = self.0.get(&(id, dev, inode)) {
            return Known::File(path.clone());
        }
        let link = format!("/proc/{}/fd/{fd}", id.pid);
        let same = std::fs::metadata(&link).is_ok_and(|m| m.ino() == inode && kernel_dev(m.dev()) == dev);
        let Some(path) = std::fs::read_link(&link).ok().filter(|_| same) else {
            return Known::Nothing;
        };
        let path = path.to_string_lossy().into_owned();
        if self.0.len() >= MAX_FILES {
            self.0.clear();
        }
        self.0.insert((id, dev, inode), path.clone());
        Known::File(path)
    }

    /// Forgets a process that ended.
    pub fn forget(&mut self, id: &ProcessId) {
        self.0.retain(|(p, _, _), _| p != id);
    }
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
