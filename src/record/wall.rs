//! `wall`: where every followed thread's time goes, on CPU or not. BPF
//! counts each thread's intervals exactly (`on_switch`); its running time
//! is shared among the stacks its CPU samples found, by their count. A thread that
//! switches too often to walk every wait walks a random sample of them; the
//! time of the others is counted per thread and kind (state and system
//! call), and the collector shares it among the walked stacks of that kind
//! (whatever their calls wait on), in proportion to their time
//! (`Collector::pend`). Once an epoch userspace
//! runs `wall_sweep`, which counts open waits up to now, takes that time,
//! and lists the threads. A wait with no stack yet (a thread BPF has never
//! seen switch, blocked since before rprof looked, or a wait not walked) has
//! its stack read here, from userspace, which is safe because a blocked
//! thread's stack cannot change until it runs; it is given to BPF only if
//! the wait is still the one the sweep saw.

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use anyhow::Result;

use crate::address_space::AddressSpace;
use crate::bpf::{types, Probe, Record, Sample};
use crate::gc_time;
use crate::processes::Processes;
use crate::resolve::walk;
use crate::target::{EcAccess, RubyTarget};

use super::collector::Collector;
use super::peer;

use types::rprof_wall_state as S;

/// Attempts at reading a thread's stack between two equal GC clock readings.
const GC_TRIES: usize = 5;

/// Once an epoch and at the end: counts every wait with a stack up to now,
/// keeps the stacks BPF counts to named, and reads the stacks of waits that
/// have none; then sweeps again, so that those count up to now too.
pub fn sweep(probe: &mut Probe, processes: &mut Processes, collector: &mut Collector) -> Result<()> {
    for pass in 0..2 {
        let mut seeded = false;
        let mut reads = Reads::default();
        for t in probe.wall_sweep()? {
            keep_named(&t, collector);
            for slot in t.slots.iter().filter(|s| s.pending != 0) {
                collector.pend(WallKind::of_slot(&t, slot.key), slot.pending);
            }
            if t.needs_stack == 0 {
                continue;
            }
            let beyond = Beyond::of(probe, t.tid);
            let Some(sample) = processes
                .get(t.pid, t.start_ticks)
                .and_then(|f| f.ruby.as_ref())
                .and_then(|ruby| blocked_stack(&ruby.target, &t, &mut reads, beyond))
            else {
                continue;
            };
            let hash = sample.header.hash;
            if probe.seed_wall(t.tid, t.seed_mark, hash) {
                collector.on_record(Record::Sample(sample), processes, probe)?;
                // Read because it was long: not one of the sample of waits.
                collector.not_sampled(hash);
                seeded = true;
            }
        }
        if !seeded || pass == 1 {
            break;
        }
    }
    Ok(())
}

/// As the recording stops: each followed Ruby's GC clock, as BPF reads it
/// (`GC.stat(:time)` in ns, plus 1), for the last sweep, which runs in rprof
/// and so cannot read it, to split the GVL waits still open by.
pub fn note_stop_clocks(probe: &mut Probe, processes: &mut Processes) {
    for f in processes.all() {
        let Some(ruby) = f.ruby.as_ref() else {
            continue;
        };
        let target = &ruby.target;
        if let Some(ns) = target.gc.and_then(|clock| clock.time(&target.process)) {
            // Without it, the GVL waits still open count whole as waits for
            // the GVL, none of them as waits for another thread's GC.
            if let Err(e) = probe.set_stop_clock(f.id.pid, ns.saturating_add(1)) {
                eprintln!(
                    "rprof: process {}: its last GVL waits are not split by its GC: {e:#}",
                    f.id.pid
                );
            }
        }
    }
}

/// The stacks BPF counts to in epochs to come: the open wait's, those of
/// GVL waits that ended and are counted later (a CPU-bound thread's can be
/// held until the recording stops), and the slots'.
fn keep_named(t: &types::rprof_wall_thread, collector: &mut Collector) {
    if t.seen == 0 {
        return;
    }
    for hash in [t.hash, t.held_hash, t.owed_hash].into_iter().filter(|&h| h != 0) {
        collector.keep(hash);
        // A GVL wait's GC twin (gc_twin), counted when the wait is.
        collector.keep(gc_twin_hash(hash));
    }
    for slot in t.slots.iter().filter(|s| s.hash != 0) {
        collector.keep(slot.hash);
    }
}

/// A thread's time of one kind: its state, and the system call it waits in.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct WallKind {
    pub pid: u32,
    pub start_ticks: u64,
    pub tid: u32,
    pub state: u32,
    pub syscall: i32,
}

impl WallKind {
    /// The kind of a `wall` record's time (None for other records).
    pub fn of(h: &types::rprof_sample_header) -> Option<Self> {
        (h.wall_state != 0).then_some(Self {
            pid: h.pid,
            start_ticks: h.start_ticks,
            tid: h.tid,
            state: h.wall_state,
            syscall: h.wall_syscall,
        })
    }

    /// The kind of a slot of thread `t` (key: RPROF_WALL_KEY).
    fn of_slot(t: &types::rprof_wall_thread, key: u32) -> Self {
        Self {
            pid: t.pid,
            start_ticks: t.start_ticks,
            tid: t.tid,
            state: key >> 16,
            syscall: (key & 0xffff) as i32 - 1,
        }
    }
}

/// `wall`: the twin of a GVL wait's record, the same stack waiting while the
/// GVL's holder collects garbage: BPF counts that part of the wait to the
/// wait's hash xor `RPROF_WALL_GC_SALT` (`gc_waited` in BPF), and sends no
/// record of its own.
/// Only for a Ruby with a GC clock (`has_clock`): BPF splits no other's waits.
/// Not for `unsampled` time, which has no stack BPF counts to. The twin of a
/// record that carries its own time (RPROF_SAMPLE_DIRECT: the counts map
/// full) carries none: it would count that time again (a thread's unsampled
/// GVL wait of 0.2 s made its total 3.2 s of a 3 s recording). It is still
/// named, for the time BPF sends it by hash.
pub fn gc_twin(s: &Sample, has_clock: bool) -> Option<Sample> {
    let unsampled = s.has(types::rprof_sample_flags::RPROF_SAMPLE_UNSAMPLED);
    (has_clock && s.header.wall_state == S::RPROF_WALL_GVL.0 && !unsampled).then(|| {
        let mut twin = s.clone();
        twin.header.hash = gc_twin_hash(s.header.hash);
        twin.header.wall_state = S::RPROF_WALL_GC.0;
        twin.header.weight = 0;
        twin
    })
}

/// The hash BPF counts a GVL wait's GC part to (`charge_gvl_wait`).
fn gc_twin_hash(hash: u64) -> u64 {
    hash ^ u64::from(types::rprof_wall_gc::RPROF_WALL_GC_SALT.0)
}

/// A record of `ns` of `kind` whose stack no walk sampled (the thread
/// walked none of that kind while its time was shared out).
pub fn unsampled(kind: WallKind, ns: u64) -> Sample {
    let mut header = header_of(kind.pid, kind.start_ticks, kind.tid);
    header.wall_state = kind.state;
    header.wall_syscall = kind.syscall;
    header.flags = types::rprof_sample_flags::RPROF_SAMPLE_DIRECT.0
        | types::rprof_sample_flags::RPROF_SAMPLE_UNSAMPLED.0;
    header.weight = ns;
    finish(header, Vec::new(), &[])
}

/// A record's header for thread `tid` of a process, with the thread's name.
fn header_of(pid: u32, start_ticks: u64, tid: u32) -> types::rprof_sample_header {
    let mut header = types::rprof_sample_header {
        kind: types::rprof_record_kind::RPROF_RECORD_SAMPLE.0,
        pid,
        start_ticks,
        tid,
        wall_syscall: -1,
        weight: 0,
        ..Default::default()
    };
    let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap_or_default();
    for (i, b) in comm.trim_end().bytes().take(15).enumerate() {
        header.comm[i] = b as _;
    }
    header
}

/// What a blocked thread's record holds beyond its Ruby frames: the kernel
/// stack the sweep took (--kernel), and with --native, why it has no native
/// frames (userspace cannot unwind them: that takes the thread's registers
/// and the unwind tables BPF has).
struct Beyond {
    kernel: Vec<u64>,
    native_stop: u32,
}

impl Beyond {
    fn of(probe: &mut Probe, tid: u32) -> Self {
        let (native, kernel) = probe.stacks_beyond_ruby();
        Self {
            kernel: if kernel {
                probe.seed_kernel_stack(tid)
            } else {
                Vec::new()
            },
            native_stop: if native {
                types::rprof_native_stop::RPROF_NATIVE_NOT_READ.0
            } else {
                0
            },
        }
    }
}

/// The record of `t`'s wait, blocked: its stack, read between two equal
/// readings of the GC clock, and why it waits (as BPF saw it at switch-out,
/// or read now for a wait the sweep opened).
fn blocked_stack(
    target: &RubyTarget,
    t: &types::rprof_wall_thread,
    reads: &mut Reads,
    beyond: Beyond,
) -> Option<Sample> {
    let (mut header, frames) = blocked_record(target, t, &mut reads.threads)?;
    header.wall_object = object_now(target, t, &mut reads.sockets, &mut header);
    header.native_stop = beyond.native_stop;
    header.nkernel = beyond.kernel.len() as u32;
    let mut sample = finish(header, frames, &beyond.kernel);
    sample.kernel = beyond.kernel;
    Some(sample)
}

/// `blocked_stack`'s header and frames.
fn blocked_record(
    target: &RubyTarget,
    t: &types::rprof_wall_thread,
    lists: &mut ThreadLists,
) -> Option<(types::rprof_sample_header, Vec<types::rprof_frame>)> {
    let space: &dyn AddressSpace = &target.process;
    let clock = target.gc?;
    let mut header = header_of(t.pid, t.start_ticks, t.tid);
    header.wall_syscall = if t.state != 0 {
        t.wait_syscall
    } else {
        t.syscall as i32
    };
    let Some(ec) = ec_of(target, t.pid, t.tp, lists) else {
        header.flags |= types::rprof_sample_flags::RPROF_SAMPLE_NO_EC.0;
        header.wall_state = known_or(t, S::RPROF_WALL_OFF_CPU.0);
        return Some((header, Vec::new()));
    };
    for _ in 0..GC_TRIES {
        let before = clock.read(space)?;
        let frames = walk::frames(space, &target.layout, ec);
        let th = space
            .read_u64(ec + u64::from(target.layout.execution_context.thread_ptr))
            .ok();
        let after = clock.read(space)?;
        let Some(time) = gc_time::bracket(before, after) else {
            continue;
        };
        let Some(frames) = frames else {
            header.flags |= types::rprof_sample_flags::RPROF_SAMPLE_READ_FAILED.0;
            header.wall_state = known_or(t, S::RPROF_WALL_OFF_CPU.0);
            return Some((header, Vec::new()));
        };
        header.gc_time = time.0;
        header.nframes = frames.len() as u32;
        header.wall_state = known_or(t, th.map_or(S::RPROF_WALL_OFF_CPU.0, |th| reason(target, th)));
        return Some((header, frames));
    }
    None
}

/// What the system call of `t`, blocked, waits on (`object_of` in BPF, from
/// /proc): the kind of its descriptor; a socket's peer into `h`.
fn object_now(
    target: &RubyTarget,
    t: &types::rprof_wall_thread,
    sockets: &mut peer::Sockets,
    h: &mut types::rprof_sample_header,
) -> u32 {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    use types::rprof_wall_object as O;
    let waits_on_a_call = [
        S::RPROF_WALL_BLOCKED.0,
        S::RPROF_WALL_GVL_HELD.0,
        S::RPROF_WALL_OFF_CPU.0,
    ];
    if !waits_on_a_call.contains(&h.wall_state) {
        return O::RPROF_WALL_OBJECT_NONE.0;
    }
    // "NR ARG0 ARG1 ..." in hex, of the call the thread is blocked in.
    let line = std::fs::read_to_string(format!("/proc/{}/task/{}/syscall", t.pid, t.tid)).unwrap_or_default();
    let words: Vec<u64> = line
        .split_whitespace()
        .map(|w| {
            u64::from_str_radix(
                w.trim_start_matches("0x"),
                if w.starts_with("0x") { 16 } else { 10 },
            )
        })
        .map_while(Result::ok)
        .collect();
    let fd = match words.as_slice() {
        [0..=1 | 17..=20 | 42..=47 | 72..=75 | 288, fd, ..] => *fd,
        [7 | 271, fds, nfds, ..] => match polled_fd(target, t.pid, *fds, *nfds) {
            Some(fd) => fd,
            None => return O::RPROF_WALL_OBJECT_NONE.0,
        },
        [23 | 270, nfds, rset, wset, ..] => match selected_fd(target, t.pid, *nfds, [*rset, *wset]) {
            Some(fd) => fd,
            None => return O::RPROF_WALL_OBJECT_NONE.0,
        },
        _ => return O::RPROF_WALL_OBJECT_NONE.0,
    };
    let Ok(meta) = std::fs::metadata(format!("/proc/{}/fd/{fd}", t.pid)) else {
        return O::RPROF_WALL_OBJECT_NONE.0;
    };
    let kind = meta.file_type();
    if kind.is_socket() {
        sockets.describe(t.pid, meta.ino(), h)
    } else if kind.is_fifo() {
        peer::set_file_identity(h, meta.dev(), meta.ino(), fd);
        O::RPROF_WALL_OBJECT_PIPE.0
    } else if kind.is_file() {
        peer::set_file_identity(h, meta.dev(), meta.ino(), fd);
        O::RPROF_WALL_OBJECT_FILE.0
    } else if kind.is_char_device() {
        peer::set_file_identity(h, meta.dev(), meta.ino(), fd);
        O::RPROF_WALL_OBJECT_DEVICE.0
    } else {
        O::RPROF_WALL_OBJECT_NONE.0
    }
}

/// The descriptor a poll of `nfds` descriptors at `ufds` waits on
/// (`polled_fd` in BPF): Ruby waits for one descriptor, and on 2.7-3.2 the
/// thread that holds the VM's signal eventfd (one thread at a time) polls it
/// second.
fn polled_fd(target: &RubyTarget, pid: u32, ufds: u64, nfds: u64) -> Option<u64> {
    // struct pollfd: int fd; short events, revents.
    let mut fds = [0u8; 16];
    let n = usize::try_from(nfds).ok().filter(|n| (1..=2).contains(n))?;
    let space: &dyn AddressSpace = &target.process;
    space.read(ufds, &mut fds[..n * 8]).ok()?;
    let fd_at = |i: usize| i32::from_ne_bytes([fds[i * 8], fds[i * 8 + 1], fds[i * 8 + 2], fds[i * 8 + 3]]);
    if n == 2 && !is_eventfd(pid, u64::try_from(fd_at(1)).ok()?) {
        return None;
    }
    u64::try_from(fd_at(0)).ok()
}

/// Whether descriptor `fd` of `pid` is an eventfd (Ruby 2.7-3.2's signal fd).
fn is_eventfd(pid: u32, fd: u64) -> bool {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).is_ok_and(|l| l.as_os_str() == "anon_inode:[eventfd]")
}

/// The most descriptors a select is read for (`SELECT_MAX_FDS` in BPF).
const SELECT_MAX_FDS: u64 = 8192;

/// The descriptor a select of `nfds` descriptors waits on (`selected_fd` in
/// BPF): one in its read and write sets together, or one beside the signal
/// eventfd that Ruby 2.7-3.2's holder of it adds to the read set.
fn selected_fd(target: &RubyTarget, pid: u32, nfds: u64, sets: [u64; 2]) -> Option<u64> {
    if !(1..=SELECT_MAX_FDS).contains(&nfds) {
        return None;
    }
    let space: &dyn AddressSpace = &target.process;
    // The kernel reads nfds bits, rounded up to whole longs.
    let mut words = vec![0u64; nfds.div_ceil(64) as usize];
    let mut bytes = vec![0u8; words.len() * 8];
    for set in sets.into_iter().filter(|&s| s != 0) {
        space.read(set, &mut bytes).ok()?;
        for (w, b) in words.iter_mut().zip(bytes.chunks_exact(8)) {
            *w |= u64::from_ne_bytes(b.try_into().ok()?);
        }
    }
    let fds: Vec<u64> = words
        .iter()
        .enumerate()
        .flat_map(|(i, &w)| {
            (0..64)
                .filter(move |b| w >> b & 1 == 1)
                .map(move |b| i as u64 * 64 + b)
        })
        .take(3)
        .collect();
    match fds.as_slice() {
        [fd] => Some(*fd),
        [a, b] if is_eventfd(pid, *a) => Some(*b),
        [a, b] if is_eventfd(pid, *b) => Some(*a),
        _ => None,
    }
}

/// The state BPF saw `t`'s wait begin in, if it saw it; else `read`.
fn known_or(t: &types::rprof_wall_thread, read: u32) -> u32 {
    if t.state != 0 {
        t.state
    } else {
        read
    }
}

/// What a sweep reads of a process once, for all its threads whose stacks
/// it reads.
#[derive(Default)]
struct Reads {
    threads: ThreadLists,
    sockets: peer::Sockets,
}

/// Ruby 2.7 (no thread-local EC): each process's Ruby threads, read from its
/// VM once a sweep, not once per thread (1,000 threads would be a million
/// reads).
#[derive(Default)]
struct ThreadLists(HashMap<u32, Vec<(u64, u64)>>);

/// The EC of thread `tp` of process `pid`, as BPF finds it; None for a
/// thread without one.
fn ec_of(target: &RubyTarget, pid: u32, tp: u64, lists: &mut ThreadLists) -> Option<u64> {
    let space: &dyn AddressSpace = &target.process;
    let at = match target.ec_access {
        // The GVL holder's: not this thread's unless it holds the GVL.
        EcAccess::Global { .. } => return None,
        EcAccess::ThreadMap { .. } => {
            let threads = lists
                .0
                .entry(pid)
                .or_insert_with(|| target.ruby_threads().unwrap_or_default());
            let th = threads.iter().find(|&&(p, _)| p == tp)?.1;
            th + u64::from(target.layout.thread.ec)
        }
        EcAccess::TlsTpOffset { offset } => tp.wrapping_add(offset as u64),
        EcAccess::TlsDtv { module, offset } => {
            let dtv = space.read_u64(tp + 8).ok()?;
            let block = space.read_u64(dtv + module * 16).ok()?;
            if block == 0 || block == u64::MAX {
                return None;
            }
            block + offset
        }
    };
    space.read_u64(at).ok().filter(|&ec| ec != 0)
}

/// Why the blocked thread `th` waits: `wall_reason` in bpf/rprof.bpf.c.
fn reason(target: &RubyTarget, th: u64) -> u32 {
    let space: &dyn AddressSpace = &target.process;
    let w = &target.layout.waits;
    let word = |at: u64| space.read_u64(at).ok();
    let field = |off: u32| word(th + u64::from(off));
    let (Some(base), Some(next), Some(ubf), Some(brb), Some(mutex)) = (
        field(w.gvl_base),
        field(w.gvl_node),
        field(w.unblock_func),
        field(w.blocking_region_buffer),
        field(w.locking_mutex),
    ) else {
        return S::RPROF_WALL_OFF_CPU.0;
    };
    let mut status = [0u8];
    if space.read(th + u64::from(w.status_byte), &mut status).is_err() {
        return S::RPROF_WALL_OFF_CPU.0;
    }
    let status = (status[0] >> w.status_shift) & w.status_mask;
    let node = th + u64::from(w.gvl_node);
    if next != 0 && next != node && !(w.gvl_node_shares_ubf && ubf != 0) {
        return S::RPROF_WALL_GVL.0;
    }
    // In a blocking region, sleeping or stopped, a thread has released the
    // GVL: only a runnable one outside them may block holding it.
    if brb != 0 {
        return S::RPROF_WALL_BLOCKED.0;
    }
    match status {
        0 if base != 0 && word(base + u64::from(w.gvl_holder)) == Some(th) => S::RPROF_WALL_GVL_HELD.0,
        0 => S::RPROF_WALL_GVL.0,
        1 => S::RPROF_WALL_SLEEP.0,
        2 if mutex != 0 => S::RPROF_WALL_MUTEX.0,
        2 => S::RPROF_WALL_WAIT.0,
        _ => S::RPROF_WALL_OFF_CPU.0,
    }
}

/// The record, with a hash of everything in it (as BPF's covers).
fn finish(mut header: types::rprof_sample_header, frames: Vec<types::rprof_frame>, kernel: &[u64]) -> Sample {
    let mut h = DefaultHasher::new();
    let hd = &header;
    (
        hd.pid,
        hd.start_ticks,
        hd.tid,
        hd.flags,
        hd.gc_time,
        hd.wall_state,
        hd.wall_syscall,
        hd.wall_object,
        hd.native_stop,
        hd.gc_state,
    )
        .hash(&mut h);
    (hd.peer_family, hd.peer_port, hd.local_port, hd.peer_addr).hash(&mut h);
    for f in &frames {
        (f.iseq, f.pc, f.cme, f.flags).hash(&mut h);
    }
    kernel.hash(&mut h);
    header.hash = h.finish();
    Sample {
        header,
        frames,
        native: Vec::new(),
        kernel: Vec::new(),
    }
}

/// The leaf frame that says what the thread of `h` was doing, its system
/// call and what that waits on; `leaf` the name of its leaf Ruby frame (the
/// C method it waits in).
pub fn state_label(h: &types::rprof_sample_header, leaf: Option<&str>, known: &peer::Known) -> String {
    let call = || format!("{}{}", syscall_name(h.wall_syscall), peer::label(h, known));
    match types::rprof_wall_state(h.wall_state) {
        S::RPROF_WALL_RUNNING => "[running]".to_string(),
        S::RPROF_WALL_RUNNABLE => "[runnable: CPU busy]".to_string(),
        S::RPROF_WALL_GVL => "[waiting for the GVL]".to_string(),
        S::RPROF_WALL_GC => "[waiting for GC]".to_string(),
        S::RPROF_WALL_BLOCKED => format!("[blocked: {}]", call()),
        S::RPROF_WALL_SLEEP => "[sleeping]".to_string(),
        S::RPROF_WALL_MUTEX => "[waiting: Mutex#lock]".to_string(),
        S::RPROF_WALL_WAIT => match leaf {
            Some(method) => format!("[waiting: {}]", method.strip_prefix("Thread::").unwrap_or(method)),
            None => "[waiting]".to_string(),
        },
        S::RPROF_WALL_GVL_HELD => format!("[blocked holding the GVL: {}]", call()),
        _ => format!("[off CPU: {}]", call()),
    }
}

/// A system call's name (x86-64 numbers), or "no system call".
fn syscall_name(nr: i32) -> String {
    if nr < 0 {
        return "no system call".to_string();
    }
    syscalls::Sysno::new(nr as usize).map_or_else(|| format!("system call {nr}"), |s| s.name().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gvl_wait() -> WallKind {
        WallKind {
            pid: 1,
            start_ticks: 1,
            tid: 1,
            state: S::RPROF_WALL_GVL.0,
            syscall: 202,
        }
    }

    /// Unsampled GVL time has no GC twin; a walked GVL wait has, and the
    /// twin of one sent on its own (the counts map full) counts nothing of
    /// the wait's time itself.
    #[test]
    fn only_hashed_gvl_waits_have_a_gc_twin() {
        let unsampled = unsampled(gvl_wait(), 200_000_000);
        assert!(gc_twin(&unsampled, true).is_none());
        let mut walked = unsampled.clone();
        walked.header.flags = 0;
        walked.header.weight = 0;
        let twin = gc_twin(&walked, true).expect("a twin");
        assert_eq!(twin.header.wall_state, S::RPROF_WALL_GC.0);
        assert_eq!(twin.header.hash, gc_twin_hash(walked.header.hash));
        assert!(gc_twin(&walked, false).is_none());
        let mut direct = walked.clone();
        direct.header.flags = types::rprof_sample_flags::RPROF_SAMPLE_DIRECT.0;
        direct.header.weight = 5_000_000;
        let twin = gc_twin(&direct, true).expect("a twin");
        assert_eq!(twin.header.weight, 0);
    }
}
