//! `alloc`'s probes, per followed process: attached in that process only,
//! and closed away from the recording loop.
//!
//! Closing a uprobe makes the kernel wait for a grace period (0.11-0.15 s
//! here), and perf-event uprobes close one at a time, six to a Ruby: the
//! loop that waited for them left the next fork unprobed for 0.7 s at
//! every exit. Where the kernel has uprobe.multi links, a process's probes
//! are one link per file, closed with one grace period; wherever they are
//! closed, it is on a thread of their own (`Closer`), and a process whose
//! probes are still closing gets no new ones until they are gone (an
//! exec'd Ruby mapping the same file would be counted by both).

use std::collections::{HashMap, HashSet};
use std::ffi::c_ulong;
use std::mem::size_of;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result};
use libbpf_rs::{Link, ProgramMut, UprobeMultiOpts, UprobeOpts};

/// A process as the probes know it: PID and start time (an exec keeps both,
/// a reused PID does not).
pub type ProcessKey = (u32, u64);

/// Whether this kernel has uprobe.multi links that filter by process, as
/// libbpf's own feature probe decides: a link on `/` (no ELF file) fails
/// with EBADF where links exist (Linux 6.6); one with PID -1 fails with
/// EINVAL where the PID filter is the process's, not the thread's (6.10, and
/// the stable kernels it went back to). A thread filter would miss every
/// allocation but the main thread's.
pub fn multi_links() -> bool {
    let Some(prog) = load_empty_multi_program() else {
        return false;
    };
    let bad_path = c"/";
    create_link(&prog, bad_path, None) == -libc::EBADF
        && create_link(&prog, bad_path, Some(u32::MAX)) == -libc::EINVAL
}

/// `mov r0, 0; exit`, as a uprobe.multi program.
fn load_empty_multi_program() -> Option<OwnedFd> {
    let insns = [
        libbpf_sys::bpf_insn {
            code: (libbpf_sys::BPF_ALU64 | libbpf_sys::BPF_MOV | libbpf_sys::BPF_K) as u8,
            ..Default::default()
        },
        libbpf_sys::bpf_insn {
            code: (libbpf_sys::BPF_JMP | libbpf_sys::BPF_EXIT) as u8,
            ..Default::default()
        },
    ];
    let mut opts = libbpf_sys::bpf_prog_load_opts {
        sz: size_of::<libbpf_sys::bpf_prog_load_opts>() as _,
        expected_attach_type: libbpf_sys::BPF_TRACE_UPROBE_MULTI,
        ..Default::default()
    };
    // SAFETY: the instructions and options outlive the call; the name may be null.
    let fd = unsafe {
        libbpf_sys::bpf_prog_load(
            libbpf_sys::BPF_PROG_TYPE_KPROBE,
            std::ptr::null(),
            c"GPL".as_ptr(),
            insns.as_ptr(),
            insns.len() as _,
            &mut opts,
        )
    };
    // SAFETY: a non-negative return is a new descriptor, ours alone.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A uprobe.multi link of `prog` at offset 0 of `path`: its negative errno,
/// or 0 if one was made (and closed).
fn create_link(prog: &OwnedFd, path: &std::ffi::CStr, pid: Option<u32>) -> i32 {
    use std::os::fd::AsRawFd;
    let offset: c_ulong = 0;
    let mut opts = libbpf_sys::bpf_link_create_opts {
        sz: size_of::<libbpf_sys::bpf_link_create_opts>() as _,
        ..Default::default()
    };
    opts.__bindgen_anon_1.uprobe_multi = libbpf_sys::bpf_link_create_opts__bindgen_ty_1__bindgen_ty_3 {
        path: path.as_ptr(),
        offsets: &offset,
        cnt: 1,
        pid: pid.unwrap_or(0),
        ..Default::default()
    };
    // SAFETY: the options and what they point to outlive the call.
    let fd = unsafe {
        libbpf_sys::bpf_link_create(prog.as_raw_fd(), -1, libbpf_sys::BPF_TRACE_UPROBE_MULTI, &opts)
    };
    if fd >= 0 {
        // SAFETY: a new descriptor, ours alone.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        return 0;
    }
    fd
}

/// Each followed process's probes.
pub struct ProcessProbes {
    /// One link per file (uprobe.multi) rather than one per function.
    multi: bool,
    live: HashMap<u32, (u64, Vec<Link>)>,
    /// Processes whose probes the closer has not closed yet.
    closing: Arc<Mutex<HashSet<ProcessKey>>>,
    /// Held by an attach of perf-event uprobes, and by each of their closes.
    gate: Arc<Gate>,
    closer: Option<Closer>,
    /// The closer's queue was full once (`MAX_QUEUED`), and rprof said so.
    said_slow: bool,
}

/// Processes whose perf-event uprobes may wait for the closer: the end of a
/// recording waits 0.7 s for each.
const MAX_QUEUED: usize = 8;

/// The thread that closes the links of processes that ended or exec'd.
struct Closer {
    batches: Sender<(ProcessKey, Vec<Link>)>,
    thread: JoinHandle<()>,
}

impl ProcessProbes {
    pub fn new(multi: bool) -> Self {
        Self {
            multi,
            live: HashMap::new(),
            closing: Arc::default(),
            gate: Arc::default(),
            closer: None,
            said_slow: false,
        }
    }

    pub fn multi(&self) -> bool {
        self.multi
    }

    /// Probes `sites` (file offsets, BPF cookies) of `file` in `process`
    /// only, with `prog` (the uprobe.multi program where `multi`).
    pub fn attach(
        &mut self,
        prog: &ProgramMut<'_>,
        process: ProcessKey,
        file: &Path,
        sites: &[(u64, u64)],
    ) -> Result<()> {
        let (pid, start) = process;
        // Links left of an earlier process on this PID (its exit unseen).
        if self.live.get(&pid).is_some_and(|(was, _)| *was != start) {
            self.drop_process(pid);
        }
        let links = if self.multi {
            let opts = UprobeMultiOpts {
                offsets: sites.iter().map(|&(offset, _)| offset as usize).collect(),
                cookies: sites.iter().map(|&(_, cookie)| cookie).collect(),
                ..Default::default()
            };
            let link = prog
                .attach_uprobe_multi_with_opts(pid as i32, file, "", opts)
                .with_context(|| format!("probing {} in process {pid}", file.display()))?;
            vec![link]
        } else {
            let _held = self.gate.attach();
            sites
                .iter()
                .map(|&(offset, cookie)| {
                    let opts = UprobeOpts {
                        cookie,
                        ..Default::default()
                    };
                    prog.attach_uprobe_with_opts(pid as i32, file, offset as usize, opts)
                        .with_context(|| {
                            format!("probing {} at {offset:#x} in process {pid}", file.display())
                        })
                })
                .collect::<Result<Vec<_>>>()?
        };
        let entry = self.live.entry(pid).or_insert_with(|| (start, Vec::new()));
        entry.1.extend(links);
        Ok(())
    }

    /// Whether `process` has probes, was refused them (`refuse`), or has
    /// some still closing: in each case it gets none now.
    pub fn has(&self, process: ProcessKey) -> bool {
        self.live
            .get(&process.0)
            .is_some_and(|(start, _)| *start == process.1)
            || self.closing().contains(&process)
    }

    /// `process` cannot be probed: not tried again.
    pub fn refuse(&mut self, process: ProcessKey) {
        self.live.insert(process.0, (process.1, Vec::new()));
    }

    /// The probes of process `pid`, which ended or exec'd: closed by the
    /// closer thread.
    pub fn drop_process(&mut self, pid: u32) {
        let Some((start, links)) = self.live.remove(&pid) else {
            return;
        };
        if links.is_empty() {
            return;
        }
        let key = (pid, start);
        if self.closer.is_none() {
            self.closer = Closer::start(Arc::clone(&self.closing), self.multi, Arc::clone(&self.gate));
        }
        let Some(closer) = &self.closer else {
            // No thread could be made: closed here, as before.
            drop(links);
            return;
        };
        // Perf-event uprobes of processes that end faster than the kernel
        // removes them (0.7 s each): the queue would grow without end, and
        // the recording's end wait for all of it. Past a few, they are
        // removed here, holding the loop as before (said once).
        if !self.multi && self.closing().len() >= MAX_QUEUED {
            if !self.said_slow {
                self.said_slow = true;
                eprintln!(
                    "rprof: processes end faster than this kernel removes their allocation probes \
                     (no uprobe.multi links before Linux 6.6): forks may be probed late, their first \
                     allocations not seen"
                );
            }
            let _held = self.gate.close();
            drop(links);
            return;
        }
        self.closing().insert(key);
        if let Err(mpsc::SendError((_, links))) = closer.batches.send((key, links)) {
            // The thread is gone (it cannot panic: it only drops links).
            drop(links);
            self.closing().remove(&key);
        }
    }

    /// Every probe closed, the closer's batches too: the recording's end.
    pub fn close_all(&mut self) {
        let live = self.live.drain().flat_map(|(_, (_, links))| links).collect();
        close(live, self.multi, &self.gate);
        if let Some(closer) = self.closer.take() {
            let waiting = self.closing().len();
            // Perf-event uprobes: 0.7 s a process that ended, one after
            // another (a fork every 0.15 s, each ending 0.5 s later: 5.8 s
            // at the end of 10 of them).
            if waiting > 0 && !self.multi {
                eprintln!(
                    "rprof: removing the allocation probes of {waiting} processes that ended \
                     (this kernel has no uprobe.multi links: about 0.7 s each)"
                );
            }
            drop(closer.batches);
            let _ = closer.thread.join();
        }
    }

    fn closing(&self) -> MutexGuard<'_, HashSet<ProcessKey>> {
        lock(&self.closing)
    }
}

/// `m`, whole: poisoned only if a holder panicked, and none can.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Closes `links`. uprobe.multi links (`multi`) close on up to 16 threads
/// at once, so that their grace periods overlap: ten Rubies recorded with
/// `-d 0.5` took 0.96-0.98 s in all with one thread closing their links,
/// 0.71-0.73 s with 16. Perf-event uprobes close one at a time under a lock
/// of the kernel's whatever closes them, and a new probe's attach waits for
/// it behind every close queued: six closing side by side held the next
/// fork's probing 0.7 s again (3 of 10 short-lived forks counted). So they
/// close one by one, each under `gate`, which an attach holds for all its
/// probes: it waits for one close at most.
fn close(links: Vec<Link>, multi: bool, gate: &Gate) {
    if !multi {
        for link in links {
            let _held = gate.close();
            drop(link);
        }
        return;
    }
    const CLOSERS: usize = 16;
    let mut shares: Vec<Vec<Link>> = (0..CLOSERS).map(|_| Vec::new()).collect();
    for (i, link) in links.into_iter().enumerate() {
        shares[i % CLOSERS].push(link);
    }
    std::thread::scope(|s| {
        for share in shares.into_iter().filter(|l| !l.is_empty()) {
            // A thread that cannot be made drops its closure, and with it
            // the links, here.
            let _ = std::thread::Builder::new().spawn_scoped(s, move || drop(share));
        }
    });
}

/// Attaches before closes: a mutex lets its last holder take it again at
/// once, and a closer with a queue of closes kept a fork's attach waiting
/// for all of them (7 of 10 short-lived forks missed).
#[derive(Default)]
struct Gate {
    lock: Mutex<()>,
    attaches_waiting: AtomicUsize,
}

impl Gate {
    fn attach(&self) -> MutexGuard<'_, ()> {
        self.attaches_waiting.fetch_add(1, Ordering::SeqCst);
        let held = lock(&self.lock);
        self.attaches_waiting.fetch_sub(1, Ordering::SeqCst);
        held
    }

    fn close(&self) -> MutexGuard<'_, ()> {
        while self.attaches_waiting.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        lock(&self.lock)
    }
}

impl Closer {
    /// None if the system can make no thread. It takes every batch waiting
    /// at once: a program that forks thousands of short-lived Rubies must
    /// not leave a queue of closes a grace period each for the end.
    fn start(closing: Arc<Mutex<HashSet<ProcessKey>>>, multi: bool, gate: Arc<Gate>) -> Option<Self> {
        let (batches, rx) = mpsc::channel::<(ProcessKey, Vec<Link>)>();
        let thread = std::thread::Builder::new()
            .name("rprof-uprobes".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    let waiting: Vec<_> = std::iter::once(first).chain(rx.try_iter()).collect();
                    if !multi {
                        // One process after another, each free for new
                        // probes (an exec) as soon as its own are gone.
                        for (key, links) in waiting {
                            close(links, false, &gate);
                            lock(&closing).remove(&key);
                        }
                        continue;
                    }
                    let keys: Vec<ProcessKey> = waiting.iter().map(|(key, _)| *key).collect();
                    let links = waiting.into_iter().flat_map(|(_, links)| links).collect();
                    close(links, true, &gate);
                    let mut closing = lock(&closing);
                    for key in keys {
                        closing.remove(&key);
                    }
                }
            })
            .ok()?;
        Some(Self { batches, thread })
    }
}

impl Drop for ProcessProbes {
    fn drop(&mut self) {
        self.close_all();
    }
}
