//! The only module that touches libbpf-rs: loads rprof's BPF program, gives
//! it the recipe of each target process, attaches it to events, and reads
//! back stacks (ring buffer), counts (the `counts` map) and statistics.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::mem::{size_of, MaybeUninit};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::path::Path;
use std::rc::Rc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{
    AsRawLibbpf, Iter, IterOpts, Link, MapCore, MapFlags, RingBuffer, RingBufferBuilder, TracepointCategory,
    TracepointOpts,
};

#[allow(clippy::all, clippy::pedantic, non_camel_case_types, dead_code)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/rprof.skel.rs"));
}

/// The Rust types libbpf-cargo generated from bpf/rprof.h.
pub use skel::types;
use skel::{RprofSkel, RprofSkelBuilder};

use crate::gc_time::Reading;

mod threads;
mod uprobes;
pub use threads::ThreadLister;
pub use uprobes::ProcessKey;
use uprobes::ProcessProbes;

// SAFETY: plain C structs of integers, as generated from the BPF header; any
// bit pattern is a valid value.
unsafe impl plain::Plain for types::rprof_proc {}
unsafe impl plain::Plain for types::rprof_sample_header {}
unsafe impl plain::Plain for types::rprof_frame {}
unsafe impl plain::Plain for types::rprof_stack_count {}
unsafe impl plain::Plain for types::rprof_thread_key {}
unsafe impl plain::Plain for types::rprof_process_event {}
unsafe impl plain::Plain for types::rprof_followed {}
unsafe impl plain::Plain for types::rprof_native_frame {}
unsafe impl plain::Plain for types::rprof_thread_pointer {}
unsafe impl plain::Plain for types::rprof_unwind_row {}
unsafe impl plain::Plain for types::rprof_unwind_rule {}
unsafe impl plain::Plain for types::rprof_kernel_stack {}
unsafe impl plain::Plain for types::rprof_unwind_file {}
unsafe impl plain::Plain for types::rprof_space {}
unsafe impl plain::Plain for types::rprof_wall_thread {}
unsafe impl plain::Plain for types::rprof_wall_task {}
unsafe impl plain::Plain for types::rprof_wall_seed {}

/// One stack record sent by the BPF program.
#[derive(Debug, Clone)]
pub struct Sample {
    pub header: types::rprof_sample_header,
    /// Ruby frames, leaf first.
    pub frames: Vec<types::rprof_frame>,
    /// --native: native frames, leaf first.
    pub native: Vec<types::rprof_native_frame>,
    /// --kernel: kernel addresses, leaf first.
    pub kernel: Vec<u64>,
}

impl Sample {
    pub fn has(&self, flag: types::rprof_sample_flags) -> bool {
        self.header.flags & flag.0 != 0
    }

    /// The reading of its process's GC clock BPF made with this record, if
    /// it made one (the first record at a GC time).
    pub fn clock_reading(&self) -> Option<Reading> {
        let c = &self.header.clock;
        self.has(types::rprof_sample_flags::RPROF_SAMPLE_CLOCK)
            .then(|| Reading::of_words(c.majors_before, c.count, c.flags, c.majors_after))
    }

    /// Whether BPF saw every iseq and method entry of the record old
    /// (promoted): only a major GC can free or move them, so naming them
    /// may wait (`Pace`). Not so where rprof cannot tell old objects.
    pub fn code_is_old(&self) -> bool {
        self.frames.iter().all(code_is_old)
    }
}

/// Whether BPF saw the frame's iseq and method entry (those it has) old. A
/// C block's ifunc (young, one per call) is no code to name.
pub fn code_is_old(f: &types::rprof_frame) -> bool {
    use types::rprof_frame_flags as F;
    (f.iseq == 0 || f.flags & (F::RPROF_FRAME_ISEQ_OLD.0 | F::RPROF_FRAME_IFUNC.0) != 0)
        && (f.cme == 0 || f.flags & F::RPROF_FRAME_CME_OLD.0 != 0)
}

/// (stack hash, events) of a closed epoch.
pub type Counts = Vec<(u64, u64)>;

/// A record of the ring buffer, in the order the BPF program wrote them.
#[derive(Debug, Clone)]
pub enum Record {
    Sample(Sample),
    /// A fork, exec or exit in the tree of followed processes.
    Process(types::rprof_process_event),
}

/// The BPF program's per-event counters, summed over CPUs.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub events: u64,
    pub lost: u64,
    pub read_failed: u64,
    pub truncated: u64,
    pub no_ec: u64,
    pub foreign_ec: u64,
    pub agg_full: u64,
    pub verified: u64,
    /// Events of a process that reused a target's PID, ignored.
    pub other_process: u64,
    /// Forks, execs and exits the full ring buffer refused.
    pub process_lost: u64,
    /// Events of followed processes without a recipe (not Ruby, or not yet).
    pub not_profiled: u64,
    /// wall: ns of threads off CPU since before rprof saw them (no stack).
    pub wall_unseen_ns: u64,
    /// wall: ns a full counts map could not take.
    pub wall_lost_ns: u64,
    /// wall: threads found running with no switch-in seen (their wait and
    /// run split by their CPU time).
    pub wall_missed_in: u64,
    /// cpu: ticks not counted, their thread's samples ahead of its CPU time.
    pub cpu_skipped: u64,
    /// cpu: counted beyond 1 by samples of threads behind their CPU time.
    pub cpu_added: u64,
    /// --native: events by why their native stack ended (enum rprof_native_stop).
    pub native_stops: [u64; types::rprof_native_stop::RPROF_NATIVE_STOP_MAX.0 as usize],
}

/// What the BPF program is loaded to do beyond Ruby stacks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Unwind native stacks (--native), with room for this many table rows.
    pub native_rows: Option<u32>,
    /// Kernel stacks too (--kernel).
    pub kernel: bool,
    /// `wall`: samples weigh time, and switches count time off CPU.
    pub wall: bool,
    /// Events are tracepoints (system calls), not CPU samples.
    pub traced: bool,
    /// --all: every process that execs is followed (and looked at).
    pub follow_every_exec: bool,
    /// `alloc`: allocations, 1 in this many walked (and weighing as many).
    pub alloc_every: Option<u32>,
}

pub struct Probe {
    skel: &'static RprofSkel<'static>,
    threads: ThreadLister,
    ring: RingBuffer<'static>,
    queue: Rc<RefCell<VecDeque<Vec<u8>>>>,
    /// How many of the queue's records (from the front) `unseen_waiting`
    /// has handed out already.
    seen: Cell<usize>,
    links: Vec<Link>,
    /// `alloc`: the probes in each process, dropped with it.
    process_probes: ProcessProbes,
    epoch: u64,
    /// Detached: nothing counts waits at their end any more, so a sweep
    /// counts every wait still open (`wall_final` in BPF).
    detached: bool,
    /// When the recording stopped (`stop_ns` in BPF; 0: it records).
    stop_ns: u64,
    /// `wall` is attached: processes added from now on are accounted from
    /// when they are added.
    wall_started: bool,
    /// The ticks' period (`cpu_period_ns` in BPF; 0: not attached).
    cpu_period_ns: u64,
    /// What a stack holds beyond Ruby's frames (--native, --kernel).
    native: bool,
    kernel: bool,
}

/// Ring buffer size: room for a few hundred deep stacks between two polls.
const RING_BYTES: u32 = 32 << 20;

/// Records read from the ring buffer at a time. When rprof falls behind (its
/// targets can keep every CPU busy), the backlog is worked off a slice at a
/// time rather than copied whole into rprof's heap, where the allocator would
/// keep that high-water mark for good.
pub const BATCH: usize = 1024;
/// How long after `switch_epoch` a BPF program may still count into the old
/// epoch (one that read the epoch just before it changed finishes within
/// microseconds).
pub const EPOCH_SETTLE: Duration = Duration::from_millis(2);

impl Probe {
    /// Loads the BPF program (not yet attached to anything).
    pub fn load(options: Options, threads: ThreadLister) -> Result<Self> {
        let stats = set_libbpf_print();
        // The skeleton lives as long as rprof does; leaking it gives the ring
        // buffer and links the 'static borrows libbpf-rs asks for.
        let open_object = Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = RprofSkelBuilder::default()
            .open(open_object)
            .context("opening the BPF object")?;
        let cpus = libbpf_rs::num_possible_cpus().context("counting CPUs")? as u32;
        open.maps
            .scratch
            .set_max_entries(cpus * 2)
            .context("sizing the scratch map")?;
        // RPROF_RING_BYTES (a power of two, at least a page) shrinks the ring
        // buffer: the tests use it to make records overflow.
        let ring_bytes = std::env::var("RPROF_RING_BYTES")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|b| b.is_power_of_two() && *b >= 4096)
            .unwrap_or(RING_BYTES);
        open.maps
            .samples
            .set_max_entries(ring_bytes)
            .context("sizing the ring buffer")?;
        // RPROF_COUNTS_ENTRIES shrinks the in-kernel counts tables: the tests
        // use it to fill them, so that events are sent one by one.
        if let Some(entries) = std::env::var("RPROF_COUNTS_ENTRIES")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|n| *n > 0)
        {
            for map in [&mut open.maps.counts0, &mut open.maps.counts1] {
                map.set_max_entries(entries).context("sizing the counts tables")?;
            }
        }
        if let Some(rows) = options.native_rows {
            open.maps
                .unwind_rows
                .set_max_entries(rows.max(1))
                .context("sizing the unwind tables")?;
            open.maps
                .unwind_pages
                .set_max_entries(crate::unwind::pages_for(rows.max(1)))
                .context("sizing the unwind page index")?;
            open.maps
                .unwind_rules
                .set_max_entries(crate::unwind::MAX_RULES)
                .context("sizing the unwind rules")?;
            open.maps
                .unwind_files
                .set_max_entries(crate::unwind::MAX_FILES)
                .context("sizing the unwind files")?;
            open.maps
                .spaces
                .set_max_entries(crate::unwind::MAX_SPACES)
                .context("sizing the address spaces")?;
        }
        {
            let rodata = open
                .maps
                .rodata_data
                .as_deref_mut()
                .context("the BPF object has no read-only data")?;
            rodata.native_stacks = options.native_rows.is_some();
            rodata.kernel_stacks = options.kernel;
            rodata.wall_mode = options.wall;
            rodata.follow_every_exec = options.follow_every_exec;
            rodata.alloc_every = options.alloc_every.unwrap_or(1).max(1);
        }
        if stats {
            for mut prog in open.open_object_mut().progs_mut() {
                prog.set_log_level(4);
            }
        }
        // The sampling programs or the tracepoint ones, not both: each walks
        // a stack, and each takes the kernel a quarter of a second to verify
        // (RPROF_DEBUG=stats), most of rprof's start-up.
        if options.traced || options.alloc_every.is_some() {
            open.progs.on_cpu_sample.set_autoload(false);
            open.progs.on_cpu_sample_native.set_autoload(false);
        }
        if !options.traced {
            open.progs.on_tracepoint.set_autoload(false);
            open.progs.on_tracepoint_native.set_autoload(false);
        }
        // alloc: one link per process and file where the kernel can
        // (RPROF_UPROBE_MULTI=0: a uprobe per function, as before Linux 6.6;
        // the tests run both).
        let multi = options.alloc_every.is_some()
            && std::env::var("RPROF_UPROBE_MULTI").map_or(true, |v| v != "0")
            && uprobes::multi_links();
        if options.alloc_every.is_none() || multi {
            open.progs.on_alloc.set_autoload(false);
        }
        if !multi {
            open.progs.on_alloc_multi.set_autoload(false);
        }
        // The wall programs only for `wall`: verifying the switch program
        // (it walks a stack) takes the kernel about a second and a half.
        if !options.wall {
            open.progs.on_switch.set_autoload(false);
            open.progs.on_waking.set_autoload(false);
            open.progs.on_thread_exit.set_autoload(false);
            open.progs.wall_sweep.set_autoload(false);
        }
        let skel: &'static RprofSkel<'static> = Box::leak(Box::new(
            open.load()
                .context("loading the BPF program into the kernel (RPROF_DEBUG=1 shows libbpf's log)")?,
        ));
        // The program the loaded one continues in with --native/--kernel.
        let tail = if options.traced {
            Some((&skel.maps.tail_tracepoint, &skel.progs.on_tracepoint_native))
        } else if options.alloc_every.is_none() {
            Some((&skel.maps.tail_perf_event, &skel.progs.on_cpu_sample_native))
        } else {
            None
        };
        if let Some((tail, next)) = tail {
            tail.update(
                &0u32.to_ne_bytes(),
                &next.as_fd().as_raw_fd().to_ne_bytes(),
                MapFlags::ANY,
            )
            .context("filling the native stacks' program array")?;
        }
        let queue = Rc::new(RefCell::new(VecDeque::new()));
        let sink = Rc::clone(&queue);
        let mut builder = RingBufferBuilder::new();
        builder
            .add(&skel.maps.samples, move |data: &[u8]| {
                sink.borrow_mut().push_back(data.to_vec());
                0
            })
            .context("setting up the ring buffer")?;
        let ring = builder.build().context("setting up the ring buffer")?;
        Ok(Self {
            skel,
            threads,
            ring,
            queue,
            seen: Cell::new(0),
            links: Vec::new(),
            process_probes: ProcessProbes::new(multi),
            epoch: 0,
            detached: false,
            stop_ns: 0,
            cpu_period_ns: 0,
            wall_started: false,
            native: options.native_rows.is_some(),
            kernel: options.kernel,
        })
    }

    /// Starts tracing the threads of process `pid` with this recipe.
    pub fn add_process(&mut self, pid: u32, recipe: &types::rprof_proc) -> Result<()> {
        let mut recipe = *recipe;
        if self.wall_started {
            recipe.wall_since = monotonic_ns();
        }
        self.mark_pid(pid)?;
        write_plain(&self.skel.maps.procs, &pid.to_ne_bytes(), &recipe, MapFlags::ANY)
            .with_context(|| format!("registering process {pid} with the BPF program"))
    }

    /// Sets `pid`'s bit in userspace's maybe-followed bitmap (`pids_user`,
    /// BPF's `may_follow`), before the process goes into `procs` or
    /// `followed`: BPF looks no further for a PID whose bit is clear. This is
    /// the map's only writer, so rewriting a word loses no bit.
    fn mark_pid(&mut self, pid: u32) -> Result<()> {
        let map = &self.skel.maps.pids_user;
        let key = ((pid >> 6) & (map.max_entries() - 1)).to_ne_bytes();
        let word = map
            .lookup(&key, MapFlags::ANY)
            .context("reading the followed PIDs' bitmap")?
            .and_then(|bytes| bytes.try_into().ok())
            .map_or(0, u64::from_ne_bytes);
        map.update(&key, &(word | 1 << (pid & 63)).to_ne_bytes(), MapFlags::ANY)
            .context("marking a followed PID for BPF")
    }

    /// Forgets the recipe of the process `pid` that started at `start_ticks`,
    /// if BPF still holds it (its exit dropped it; userspace may have added
    /// it again since, and the PID may be a newer process's by now, which
    /// keeps its own).
    pub fn remove_process_of(&mut self, pid: u32, start_ticks: u64) {
        let key = pid.to_ne_bytes();
        let Ok(Some(bytes)) = self.skel.maps.procs.lookup(&key, MapFlags::ANY) else {
            return;
        };
        let mut recipe = types::rprof_proc::default();
        if plain::copy_from_bytes(&mut recipe, &bytes).is_ok() && recipe.start_ticks == start_ticks {
            let _ = self.skel.maps.procs.delete(&key);
        }
    }

    /// The proof's thread lister, loaded before this probe.
    pub fn threads(&self) -> &ThreadLister {
        &self.threads
    }

    /// Replaces the native thread -> rb_thread_t entries of process `pid`.
    pub fn set_threads(&mut self, pid: u32, threads: &[(u64, u64)]) -> Result<()> {
        let map = &self.skel.maps.threads;
        let wanted: Vec<Vec<u8>> = threads
            .iter()
            .map(|&(tp, _)| {
                let key = types::rprof_thread_key { pid, pad: 0, tp };
                // SAFETY: rprof_thread_key is Plain.
                unsafe { plain::as_bytes(&key) }.to_vec()
            })
            .collect();
        for key in map.keys() {
            let mut k = types::rprof_thread_key::default();
            if plain::copy_from_bytes(&mut k, &key).is_ok() && k.pid == pid && !wanted.contains(&key) {
                let _ = map.delete(&key);
            }
        }
        for (key, &(_, th)) in wanted.iter().zip(threads) {
            map.update(key, &th.to_ne_bytes(), MapFlags::ANY)
                .context("registering a Ruby thread with the BPF program")?;
        }
        Ok(())
    }

    /// Follows the forks of process `pid` (started at `start_ticks`), and
    /// theirs: children inherit its recipe and are followed in turn.
    pub fn follow(&mut self, pid: u32, start_ticks: u64) -> Result<()> {
        self.mark_pid(pid)?;
        let value = types::rprof_followed { start_ticks };
        write_plain(
            &self.skel.maps.followed,
            &pid.to_ne_bytes(),
            &value,
            MapFlags::ANY,
        )
        .with_context(|| format!("following the children of process {pid}"))
    }

    /// Stops following the forks of `pid`.
    pub fn unfollow(&mut self, pid: u32) {
        let _ = self.skel.maps.followed.delete(&pid.to_ne_bytes());
    }

    /// Starts reporting forks, execs and exits of followed processes.
    pub fn attach_process_tracking(&mut self) -> Result<()> {
        let progs = &self.skel.progs;
        self.attach_all(&[
            ("sched_process_fork", &progs.on_fork),
            ("sched_process_exec", &progs.on_exec),
            ("sched_process_exit", &progs.on_exit),
        ])
    }

    /// Attaches BTF tracepoint programs, each named for its tracepoint.
    fn attach_all(&mut self, progs: &[(&str, &libbpf_rs::ProgramMut<'static>)]) -> Result<()> {
        for (name, prog) in progs {
            let link = prog
                .attach()
                .with_context(|| format!("attaching to the {name} tracepoint"))?;
            self.links.push(link);
        }
        Ok(())
    }

    /// Gives process `pid` (started at `start_ticks`) the address space
    /// `space`, keeping what BPF has learned in its recipe.
    pub fn set_native_space(&mut self, pid: u32, start_ticks: u64, space: u32) {
        let key = pid.to_ne_bytes();
        let Ok(Some(bytes)) = self.skel.maps.procs.lookup(&key, MapFlags::ANY) else {
            return;
        };
        let mut recipe = types::rprof_proc::default();
        if plain::copy_from_bytes(&mut recipe, &bytes).is_ok() && recipe.start_ticks == start_ticks {
            recipe.native_space = space;
            let _ = write_plain(&self.skel.maps.procs, &key, &recipe, MapFlags::EXIST);
        }
    }

    /// Unwind rules `first..` (they are only ever added).
    pub fn set_unwind_rules(&mut self, first: u32, rules: &[types::rprof_unwind_rule]) -> Result<()> {
        write_array(&self.skel.maps.unwind_rules, first, rules).context("loading unwind rules into BPF")
    }

    /// A file's table rows, at `first` in `unwind_rows`.
    pub fn set_unwind_rows(&mut self, first: u32, rows: &[(u32, u32, u16)]) -> Result<()> {
        let rows: Vec<types::rprof_unwind_row> = rows
            .iter()
            .map(|&(pc, rule, back)| types::rprof_unwind_row {
                pc,
                rule: rule as u16,
                back,
            })
            .collect();
        write_array(&self.skel.maps.unwind_rows, first, &rows).context("loading an unwind table into BPF")
    }

    /// A file's page index, at `first` in `unwind_pages`.
    pub fn set_unwind_pages(&mut self, first: u32, pages: &[u32]) -> Result<()> {
        write_array(&self.skel.maps.unwind_pages, first, pages)
            .context("loading an unwind page index into BPF")
    }

    pub fn set_unwind_file(&mut self, id: u32, file: &types::rprof_unwind_file) -> Result<()> {
        write_plain(
            &self.skel.maps.unwind_files,
            &id.to_ne_bytes(),
            file,
            MapFlags::ANY,
        )
        .context("registering an unwind table with BPF")
    }

    pub fn set_space(&mut self, id: u32, space: &types::rprof_space) -> Result<()> {
        write_plain(&self.skel.maps.spaces, &id.to_ne_bytes(), space, MapFlags::ANY)
            .context("registering a process's mappings with BPF")
    }

    pub fn remove_space(&mut self, id: u32) {
        let _ = self.skel.maps.spaces.delete(&id.to_ne_bytes());
    }

    pub fn remove_process(&mut self, pid: u32) {
        let _ = self.set_threads(pid, &[]);
        let _ = self.skel.maps.procs.delete(&pid.to_ne_bytes());
        self.drop_process_probes(pid);
    }

    /// `alloc`: probes the functions at `sites` in `file` (file offsets,
    /// each with the cookie its events carry: RPROF_ALLOC_*) in `process`
    /// only.
    pub fn attach_alloc(&mut self, process: ProcessKey, file: &Path, sites: &[(u64, u64)]) -> Result<()> {
        let progs = &self.skel.progs;
        let prog = if self.process_probes.multi() {
            &progs.on_alloc_multi
        } else {
            &progs.on_alloc
        };
        self.process_probes.attach(prog, process, file, sites)
    }

    /// Whether `process` has had its `alloc` probes attached (or refused:
    /// see `no_alloc_probes`), or has its last ones still closing.
    pub fn has_alloc_probes(&self, process: ProcessKey) -> bool {
        self.process_probes.has(process)
    }

    /// `process` cannot be probed: not tried again, its probes dropped.
    pub fn no_alloc_probes(&mut self, process: ProcessKey) {
        self.process_probes.refuse(process);
    }

    /// The probes of process `pid`, which ended or exec'd (closed on a
    /// thread of their own: the kernel takes a grace period).
    pub fn drop_process_probes(&mut self, pid: u32) {
        self.process_probes.drop_process(pid);
    }

    /// Samples every online CPU `frequency` times a second (cpu-clock).
    pub fn attach_cpu_clock(&mut self, frequency: u64) -> Result<()> {
        let period_ns = (1_000_000_000 / frequency.max(1)).max(1);
        self.cpu_period_ns = period_ns;
        self.write_bss().context("setting the ticks' period")?;
        for cpu in online_cpus()? {
            // SAFETY: perf_event_attr is a plain C struct; all-zero is its default.
            let mut attr: libbpf_sys::perf_event_attr = unsafe { std::mem::zeroed() };
            attr.type_ = libbpf_sys::PERF_TYPE_SOFTWARE;
            attr.size = size_of::<libbpf_sys::perf_event_attr>() as u32;
            attr.config = libbpf_sys::PERF_COUNT_SW_CPU_CLOCK as u64;
            // A fixed period, not a frequency: the kernel's perf_event_max_sample_rate
            // caps frequencies, and a period is exactly what the user asked for.
            attr.__bindgen_anon_1.sample_period = period_ns;
            // An idle CPU's ticks run no program: its idle task is no Ruby.
            attr.set_exclude_idle(1);
            // SAFETY: attr is initialised and outlives the call.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_perf_event_open,
                    &attr as *const libbpf_sys::perf_event_attr,
                    -1 as libc::pid_t,
                    cpu as libc::c_int,
                    -1 as libc::c_int,
                    libbpf_sys::PERF_FLAG_FD_CLOEXEC as libc::c_ulong,
                )
            };
            if fd < 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::ENODEV) {
                    continue; // CPU went offline meanwhile
                }
                return Err(anyhow!(err))
                    .with_context(|| format!("opening a cpu-clock perf event on CPU {cpu}"));
            }
            // SAFETY: perf_event_open returned a new descriptor that we own.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            let link = self
                .skel
                .progs
                .on_cpu_sample
                .attach_perf_event(fd.as_raw_fd())
                .with_context(|| format!("attaching to the perf event of CPU {cpu}"))?;
            // The link owns the perf event now and closes it when dropped.
            let _ = fd.into_raw_fd();
            self.links.push(link);
        }
        if self.links.is_empty() {
            return Err(anyhow!("no online CPU accepted a perf event"));
        }
        Ok(())
    }

    /// `wall`: from now on, each followed thread's time is accounted:
    /// the processes followed so far from this moment, later ones from when
    /// they are added. Then every context switch of their threads counts.
    pub fn attach_wall(&mut self) -> Result<()> {
        let now = monotonic_ns();
        self.wall_started = true;
        let procs = &self.skel.maps.procs;
        for key in procs.keys() {
            let Ok(Some(bytes)) = procs.lookup(&key, MapFlags::ANY) else {
                continue;
            };
            let mut recipe = types::rprof_proc::default();
            if plain::copy_from_bytes(&mut recipe, &bytes).is_ok() && recipe.wall_since == 0 {
                recipe.wall_since = now;
                let _ = write_plain(procs, &key, &recipe, MapFlags::EXIST);
            }
        }
        let progs = &self.skel.progs;
        self.attach_all(&[
            ("sched_switch", &progs.on_switch),
            ("sched_waking", &progs.on_waking),
            ("sched_process_exit", &progs.on_thread_exit),
        ])
    }

    /// `wall`: counts each followed thread's open wait up to now, and lists
    /// the threads (`wall_sweep`).
    pub fn wall_sweep(&self) -> Result<Vec<types::rprof_wall_thread>> {
        run_iter(&self.skel.progs.wall_sweep, "sweeping the followed threads")
    }

    /// Whether stacks hold native frames (--native) and kernel frames
    /// (--kernel).
    pub fn stacks_beyond_ruby(&self) -> (bool, bool) {
        (self.native, self.kernel)
    }

    /// `wall --kernel`: the kernel stack (leaf first) the last sweep took of
    /// blocked thread `tid`, whose stack it asked userspace for; taken out.
    pub fn seed_kernel_stack(&mut self, tid: u32) -> Vec<u64> {
        let key = tid.to_ne_bytes();
        let map = &self.skel.maps.wall_seed_kstacks;
        let Ok(Some(bytes)) = map.lookup_and_delete(&key) else {
            return Vec::new();
        };
        let mut k = types::rprof_kernel_stack::default();
        if plain::copy_from_bytes(&mut k, &bytes).is_err() {
            return Vec::new();
        }
        k.ips[..(k.n as usize).min(k.ips.len())].to_vec()
    }

    /// `wall`: the stack `hash` of thread `tid`'s wait that began at
    /// `mark`, if the wait is still that one (the thread has not run since,
    /// so the stack read is the one it waits in): whether it was given.
    pub fn seed_wall(&mut self, tid: u32, mark: u64, hash: u64) -> bool {
        let key = tid.to_ne_bytes();
        let open = self.skel.maps.wall_tasks.lookup(&key, MapFlags::ANY);
        let mut task = types::rprof_wall_task::default();
        let unchanged = matches!(open, Ok(Some(bytes)) if plain::copy_from_bytes(&mut task, &bytes).is_ok() && task.mark == mark);
        let seed = types::rprof_wall_seed { mark, hash };
        unchanged && write_plain(&self.skel.maps.wall_seeds, &key, &seed, MapFlags::ANY).is_ok()
    }

    /// `wall`: process `pid`'s GC clock when the recording stopped, for the
    /// last sweep.
    pub fn set_stop_clock(&mut self, pid: u32, clock: u64) -> Result<()> {
        self.skel
            .maps
            .wall_stop_clocks
            .update(&pid.to_ne_bytes(), &clock.to_ne_bytes(), MapFlags::ANY)
            .context("noting a GC clock at the stop")
    }

    /// Traces tracepoint `category:name`; its events carry `cookie` (1-based).
    pub fn attach_tracepoint(&mut self, category: &str, name: &str, cookie: u32) -> Result<()> {
        let opts = TracepointOpts {
            cookie: cookie as u64,
            ..Default::default()
        };
        let link = self
            .skel
            .progs
            .on_tracepoint
            .attach_tracepoint_with_opts(TracepointCategory::Custom(category.to_string()), name, opts)
            .with_context(|| format!("attaching to tracepoint {category}:{name}"))?;
        self.links.push(link);
        Ok(())
    }

    /// Waits up to `timeout` for records, then hands up to [`BATCH`] of
    /// them to `f`; returns how many were read.
    pub fn poll(&mut self, timeout: Duration, mut f: impl FnMut(Record)) -> Result<usize> {
        let mut n = self.consume_batch()?;
        if n == 0 {
            self.wait(timeout)?;
            // Read what is there even if no wakeup came (a signal, a timeout).
            n = self.consume_batch()?;
        }
        self.drain_queue(&mut f);
        Ok(n)
    }

    /// The next record: those read before first, then the ring buffer's (a
    /// batch at a time); `None` when neither holds one. Never waits: the
    /// recording loop reads at moments of its own choosing (see
    /// `wakeup_flags` in bpf/rprof.bpf.c).
    pub fn next_record(&mut self) -> Result<Option<Record>> {
        loop {
            if let Some(record) = self.queued() {
                return Ok(Some(record));
            }
            if self.consume_batch()? == 0 {
                return Ok(None);
            }
        }
    }

    /// Reads a batch of records from the ring buffer unless a batch waits
    /// already; how many records wait (read and not yet handed out).
    pub fn take_in(&mut self) -> Result<usize> {
        if self.queue.borrow().len() < BATCH {
            self.consume_batch()?;
        }
        Ok(self.queue.borrow().len())
    }

    /// The records waiting that this has not shown before, parsed; they
    /// stay waiting (to be handed out by `next_record`).
    pub fn unseen_waiting(&self) -> Vec<Record> {
        let queue = self.queue.borrow();
        let unseen = queue
            .iter()
            .skip(self.seen.get())
            .filter_map(|data| parse_record(data))
            .collect();
        self.seen.set(queue.len());
        unseen
    }

    /// The next record read from the ring buffer and not yet handed out
    /// (ones that do not parse are skipped).
    fn queued(&self) -> Option<Record> {
        loop {
            let data = self.queue.borrow_mut().pop_front()?;
            self.seen.set(self.seen.get().saturating_sub(1));
            if let Some(record) = parse_record(&data) {
                return Some(record);
            }
        }
    }

    /// Moves up to [`BATCH`] records from the ring buffer to the queue.
    fn consume_batch(&self) -> Result<usize> {
        let n = self.ring.consume_raw_n(BATCH);
        if n < 0 {
            return Err(std::io::Error::from_raw_os_error(-n)).context("reading the ring buffer");
        }
        Ok(n as usize)
    }

    /// Sleeps until the ring buffer has records, a signal comes or `timeout`
    /// passes. libbpf's own poll would also read every record there.
    fn wait(&self, timeout: Duration) -> Result<()> {
        let mut event = libc::epoll_event { events: 0, u64: 0 };
        // Rounded up: a wait of less than a millisecond must not be none.
        let ms = i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX);
        // SAFETY: room for the one event asked for; the fd is libbpf's epoll
        // instance, open as long as the ring buffer is.
        let ready = unsafe { libc::epoll_wait(self.ring.epoll_fd(), &mut event, 1, ms) };
        if ready < 0 {
            let e = std::io::Error::last_os_error();
            // A signal (Ctrl-C) interrupts the wait; the caller decides what next.
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e).context("waiting on the ring buffer");
            }
        }
        Ok(())
    }

    fn drain_queue(&mut self, f: &mut impl FnMut(Record)) {
        while let Some(record) = self.queued() {
            f(record);
        }
    }

    /// How far BPF has written the ring buffer (bytes since it was made):
    /// a mark for [`Probe::unread_before`].
    pub fn written(&self) -> Result<u64> {
        Ok(self.ring_positions()?.1)
    }

    /// Whether some record written before `mark` is still unread. Closing an
    /// epoch reads up to the mark taken once it settled, not until the ring
    /// buffer is empty: targets can fill it faster than a starved rprof
    /// empties it, and the epoch would never close.
    pub fn unread_before(&self, mark: u64) -> Result<bool> {
        Ok(self.ring_positions()?.0 < mark)
    }

    /// The ring buffer's (consumer, producer) positions.
    fn ring_positions(&self) -> Result<(u64, u64)> {
        let rb = self.ring.as_libbpf_object().as_ptr();
        // SAFETY: `rb` is the live ring buffer this probe owns; index 0 is
        // its one ring.
        let ring = unsafe { libbpf_sys::ring_buffer__ring(rb, 0) };
        if ring.is_null() {
            return Err(anyhow!("the ring buffer has no ring"));
        }
        // SAFETY: `ring` belongs to `rb`, which outlives this call.
        unsafe {
            Ok((
                libbpf_sys::ring__consumer_pos(ring) as u64,
                libbpf_sys::ring__producer_pos(ring) as u64,
            ))
        }
    }

    /// Closes the current counting epoch: the BPF program moves on to a new
    /// one. Returns the closed epoch, whose records the caller reads with
    /// `poll` until [`EPOCH_SETTLE`] has passed and then up to the
    /// [`Probe::written`] mark, before taking its counts with `take_counts`.
    pub fn switch_epoch(&mut self) -> Result<u64> {
        let closed = self.epoch;
        self.epoch += 1;
        self.write_bss().context("advancing the counts epoch")?;
        Ok(closed)
    }

    /// Every (hash, count) of the `closed` epoch, removed from the kernel.
    pub fn take_counts(&mut self, closed: u64) -> Result<Counts> {
        let map = if closed & 1 == 0 {
            &self.skel.maps.counts0
        } else {
            &self.skel.maps.counts1
        };
        // Nothing writes the closed map any more: empty it in a few batches.
        // An iteration ends at the first batch shorter than asked for, and
        // the kernel ends a batch short where the next bucket would not fit,
        // with more to come: so until a pass finds nothing (each pass the
        // map has fewer). Counts left there were never read.
        const PASSES: usize = 64;
        let mut counts = Vec::new();
        for _ in 0..PASSES {
            let before = counts.len();
            let drained = map
                .lookup_and_delete_batch(4096, MapFlags::ANY, MapFlags::ANY)
                .context("draining the stack counts")?;
            for (key, value) in drained {
                let mut count = types::rprof_stack_count::default();
                if let (Ok(hash), Ok(())) = (
                    key.as_slice().try_into().map(u64::from_ne_bytes),
                    plain::copy_from_bytes(&mut count, &value),
                ) {
                    counts.push((hash, count.count));
                }
            }
            if counts.len() == before {
                break;
            }
        }
        Ok(counts)
    }

    /// Writes BPF's globals that userspace sets (the whole .bss: they are
    /// all of it).
    fn write_bss(&self) -> Result<()> {
        let mut bss: types::bss = unsafe { std::mem::zeroed() };
        bss.epoch = self.epoch;
        bss.wall_final = self.detached;
        bss.stop_ns = self.stop_ns;
        bss.cpu_period_ns = self.cpu_period_ns;
        // SAFETY: `bss` is a plain C struct generated from the BPF object.
        let bytes = unsafe {
            std::slice::from_raw_parts((&bss as *const types::bss).cast::<u8>(), size_of::<types::bss>())
        };
        // The Rust struct may carry tail padding the section does not have.
        let len = (self.skel.maps.bss.value_size() as usize).min(bytes.len());
        self.skel
            .maps
            .bss
            .update(&0u32.to_ne_bytes(), &bytes[..len], MapFlags::ANY)
            .context("writing BPF's globals")
    }

    pub fn stats(&self) -> Result<Stats> {
        let read = |stat: types::rprof_stat| -> Result<u64> {
            let per_cpu = self
                .skel
                .maps
                .stats
                .lookup_percpu(&stat.0.to_ne_bytes(), MapFlags::ANY)
                .context("reading BPF statistics")?
                .unwrap_or_default();
            Ok(per_cpu
                .iter()
                .filter_map(|v| {
                    v.get(..8)
                        .map(|b| u64::from_ne_bytes(b.try_into().unwrap_or([0; 8])))
                })
                .sum())
        };
        Ok(Stats {
            events: read(types::rprof_stat::RPROF_STAT_EVENTS)?,
            lost: read(types::rprof_stat::RPROF_STAT_LOST)?,
            read_failed: read(types::rprof_stat::RPROF_STAT_READ_FAILED)?,
            truncated: read(types::rprof_stat::RPROF_STAT_TRUNCATED)?,
            no_ec: read(types::rprof_stat::RPROF_STAT_NO_EC)?,
            foreign_ec: read(types::rprof_stat::RPROF_STAT_FOREIGN_EC)?,
            agg_full: read(types::rprof_stat::RPROF_STAT_AGG_FULL)?,
            verified: read(types::rprof_stat::RPROF_STAT_VERIFIED)?,
            other_process: read(types::rprof_stat::RPROF_STAT_OTHER_PROCESS)?,
            process_lost: read(types::rprof_stat::RPROF_STAT_PROCESS_LOST)?,
            not_profiled: read(types::rprof_stat::RPROF_STAT_NOT_PROFILED)?,
            wall_unseen_ns: read(types::rprof_stat::RPROF_STAT_WALL_UNSEEN)?,
            wall_lost_ns: read(types::rprof_stat::RPROF_STAT_WALL_LOST)?,
            wall_missed_in: read(types::rprof_stat::RPROF_STAT_WALL_MISSED_IN)?,
            cpu_skipped: read(types::rprof_stat::RPROF_STAT_CPU_SKIPPED)?,
            cpu_added: read(types::rprof_stat::RPROF_STAT_CPU_ADDED)?,
            native_stops: {
                let mut stops = [0; types::rprof_native_stop::RPROF_NATIVE_STOP_MAX.0 as usize];
                for (i, n) in stops.iter_mut().enumerate() {
                    *n = read(types::rprof_stat(
                        types::rprof_stat::RPROF_STAT_NATIVE_STOP.0 + i as u32,
                    ))?;
                }
                stops
            },
        })
    }

    /// Ends the recording now: BPF counts nothing from here on, though its
    /// programs stay attached until `detach` (which can take seconds on a
    /// busy machine), and the last sweep counts open waits up to this
    /// moment.
    pub fn stop(&mut self) {
        self.stop_ns = monotonic_ns();
        if let Err(e) = self.write_bss() {
            eprintln!("rprof: {e:#}");
        }
    }

    /// Detaches from every event; what was collected can still be read.
    pub fn detach(&mut self) {
        self.links.clear();
        self.process_probes.close_all();
        self.detached = true;
        if let Err(e) = self.write_bss() {
            eprintln!("rprof: {e:#}");
        }
    }
}

/// `value` at `key` in `map`, whose values are a type shared with BPF.
fn write_plain<T: plain::Plain>(
    map: &impl MapCore,
    key: &[u8],
    value: &T,
    flags: MapFlags,
) -> libbpf_rs::Result<()> {
    // SAFETY: the types of rprof.h are Plain: their bytes are their value.
    map.update(key, unsafe { plain::as_bytes(value) }, flags)
}

/// `values` into an array map from index `first` on, in batches.
fn write_array<T: plain::Plain>(map: &impl MapCore, first: u32, values: &[T]) -> Result<()> {
    const BATCH: usize = 1 << 16;
    for (i, chunk) in values.chunks(BATCH).enumerate() {
        let from = first + (i * BATCH) as u32;
        let keys: Vec<u8> = (from..from + chunk.len() as u32)
            .flat_map(u32::to_ne_bytes)
            .collect();
        // SAFETY: T is Plain.
        let bytes: Vec<u8> = chunk
            .iter()
            .flat_map(|v| unsafe { plain::as_bytes(v) }.to_vec())
            .collect();
        map.update_batch(&keys, &bytes, chunk.len() as u32, MapFlags::ANY, MapFlags::ANY)?;
    }
    Ok(())
}

fn parse_record(data: &[u8]) -> Option<Record> {
    let kind = u32::from_ne_bytes(data.get(..4)?.try_into().ok()?);
    if kind == types::rprof_record_kind::RPROF_RECORD_PROCESS.0 {
        let mut event = types::rprof_process_event::default();
        plain::copy_from_bytes(&mut event, data).ok()?;
        return Some(Record::Process(event));
    }
    parse_sample(data).map(Record::Sample)
}

fn parse_sample(data: &[u8]) -> Option<Sample> {
    let mut header = types::rprof_sample_header::default();
    plain::copy_from_bytes(&mut header, data).ok()?;
    let mut rest = data.get(size_of::<types::rprof_sample_header>()..)?;
    let frames = take_all(&mut rest, header.nframes)?;
    let native = take_all(&mut rest, header.nnative)?;
    let mut kernel = Vec::with_capacity(header.nkernel as usize);
    for _ in 0..header.nkernel {
        kernel.push(u64::from_ne_bytes(rest.get(..8)?.try_into().ok()?));
        rest = rest.get(8..)?;
    }
    Some(Sample {
        header,
        frames,
        native,
        kernel,
    })
}

/// `n` records of type T off the front of `rest`.
fn take_all<T: plain::Plain + Default>(rest: &mut &[u8], n: u32) -> Option<Vec<T>> {
    let mut out = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let mut item = T::default();
        plain::copy_from_bytes(&mut item, rest).ok()?;
        out.push(item);
        *rest = rest.get(size_of::<T>()..)?;
    }
    Some(out)
}

/// The online CPUs, from /sys/devices/system/cpu/online ("0-3,5").
fn online_cpus() -> Result<Vec<u32>> {
    let text =
        std::fs::read_to_string("/sys/devices/system/cpu/online").context("reading the online CPUs")?;
    parse_cpu_list(&text).ok_or_else(|| anyhow!("unreadable CPU list {text:?}"))
}

fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// RPROF_DEBUG=stats: of libbpf's debug messages, the lines of each
/// program's verifier log that give its cost.
fn print_verifier_stats(_level: libbpf_rs::PrintLevel, msg: String) {
    for line in msg.lines() {
        if line.contains("BEGIN PROG LOAD LOG")
            || line.contains("verification time")
            || line.contains("processed ")
        {
            eprintln!("{line}");
        }
    }
}

/// libbpf's own messages (the verifier log) only with RPROF_DEBUG=1;
/// RPROF_DEBUG=stats: the verifier's statistics of each program
/// (instructions processed, time: rprof's start-up is mostly this), which
/// it returns.
fn set_libbpf_print() -> bool {
    let stats = std::env::var("RPROF_DEBUG").is_ok_and(|v| v == "stats");
    if stats {
        libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, print_verifier_stats)));
    } else if std::env::var_os("RPROF_DEBUG").is_none() {
        libbpf_rs::set_print(None);
    }
    stats
}

/// Runs a task iterator: the records it writes, each a `T`.
fn run_iter<T: plain::Plain + Default>(prog: &libbpf_rs::ProgramMut<'_>, what: &str) -> Result<Vec<T>> {
    let link = prog
        .attach_iter_with_opts(IterOpts::None)
        .with_context(|| format!("{what}: attaching the task iterator"))?;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(
        &mut Iter::new(&link).with_context(|| format!("{what}: opening the task iterator"))?,
        &mut bytes,
    )
    .with_context(|| what.to_string())?;
    Ok(bytes
        .chunks_exact(size_of::<T>())
        .filter_map(|chunk| {
            let mut t = T::default();
            plain::copy_from_bytes(&mut t, chunk).ok()?;
            Some(t)
        })
        .collect())
}

/// CLOCK_MONOTONIC in ns: BPF's `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,5\n"), Some(vec![0, 1, 2, 3, 5]));
        assert_eq!(parse_cpu_list("0"), Some(vec![0]));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn records_parse_header_then_frames() {
        let header = types::rprof_sample_header {
            hash: 7,
            tid: 9,
            nframes: 2,
            ..Default::default()
        };
        let mut data = unsafe { plain::as_bytes(&header) }.to_vec();
        for i in 1..=2u64 {
            let f = types::rprof_frame {
                iseq: i,
                pc: i * 8,
                ..Default::default()
            };
            data.extend_from_slice(unsafe { plain::as_bytes(&f) });
        }
        let s = parse_sample(&data).expect("parses");
        assert_eq!(s.header.tid, 9);
        assert_eq!(s.frames.len(), 2);
        assert_eq!(s.frames[1].pc, 16);
        assert!(
            parse_sample(&data[..data.len() - 1]).is_none(),
            "a cut record is refused"
        );
    }
}
