//! Turns BPF's records and in-kernel counts into a profile: names each
//! record's stack (or keeps it until the GC stands still), and adds each
//! closed epoch's counts to the stacks they belong to.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::Result;
use flamegraphs::{Frame, FrameKind, ProcessInfo, ThreadInfo};

use crate::bpf::{self, types, Probe, Record, Sample, Stats};
use crate::gc_time::{GcTime, SampleTime};
use crate::process::Process;
use crate::processes::{Followed, ProcessId, Processes};
use crate::recording::{self, Counted, EpochCounts, Summary, ThreadEntry};
use crate::resolve::{self, NativeNames, RubyFrame, Unknown};
use crate::system;
use crate::unwind::Unwinder;

use super::peer;
use super::wall::{self, WallKind};

/// Turns BPF's records and counts into a profile.
pub struct Collector {
    events: Vec<String>,
    /// Resolved stacks by hash, with their thread, the generation they were
    /// last used in and whether a frame in them is unknown.
    stacks: HashMap<u64, CachedStack>,
    generation: u64,
    /// The counts of the epoch open, by stack hash.
    current: HashMap<u64, Counted>,
    /// When the epoch open started, since the recording did.
    epoch_start: Duration,
    /// Each process as the recording describes it, made at its first sample
    /// (workers rename themselves after the fork).
    process_info: HashMap<ProcessId, Rc<ProcessInfo>>,
    /// Counted events whose stack never reached userspace (ring buffer full);
    /// in `wall`, whose counts are time, nanoseconds.
    undelivered: u64,
    /// `wall`: counts are nanoseconds, not events.
    pub counts_time: bool,
    /// Frames shown as `[unknown]`, counted once per stack that has them, by reason.
    pub unknown_frames: HashMap<Unknown, u64>,
    /// Samples (events) with an `[unknown]` frame.
    pub unknown_samples: u64,
    /// Records waiting for the GC to stand still.
    deferred: Vec<Sample>,
    /// Records of processes rprof could not follow (a fork report lost).
    pub unfollowed: u64,
    /// Counts of closed epochs whose record still waits (see `close_epoch`).
    waiting_counts: HashMap<u64, u64>,
    /// Tests: say on stderr when a thread's first stack of Ruby frames is
    /// named whole (`RPROF_SAY_NAMED=1`), so that they can starve or stop
    /// rprof once it has read that code: the threads said so far.
    say_named: Option<HashSet<u32>>,
    /// --native/--kernel: what names native frames, and whether to keep the
    /// interpreter's own (--native-all).
    pub native: Option<(NativeNames, bool)>,
    /// Ruby frames named whole, by what they are (see `name_ruby`); kept
    /// while used.
    named_ruby: HashMap<u64, NamedRuby>,
    /// `wall`: time of waits not walked, by kind, to share out as the epoch
    /// closes, with the epochs it has waited for a walked stack of its kind.
    wall_pending: Vec<(WallKind, u64, u32)>,
    /// `wall`: what the sockets and files waited on are called.
    names: peer::Names,
    /// A record came since `take_urgent` that must be read soon: one with
    /// young code rprof had to read (a minor GC may free it, and more
    /// records of it may come), or a process's change.
    urgent: bool,
}

impl Collector {
    pub fn new(events: Vec<String>) -> Self {
        Self {
            events,
            stacks: HashMap::new(),
            generation: 0,
            current: HashMap::new(),
            epoch_start: Duration::ZERO,
            process_info: HashMap::new(),
            undelivered: 0,
            counts_time: false,
            unknown_frames: HashMap::new(),
            unknown_samples: 0,
            deferred: Vec::new(),
            unfollowed: 0,
            waiting_counts: HashMap::new(),
            say_named: std::env::var_os("RPROF_SAY_NAMED").map(|_| HashSet::new()),
            native: None,
            named_ruby: HashMap::new(),
            wall_pending: Vec::new(),
            names: peer::Names::default(),
            urgent: false,
        }
    }

    /// Whether a record that must be read soon came since the last call.
    pub fn take_urgent(&mut self) -> bool {
        std::mem::take(&mut self.urgent)
    }

    /// Loads the native symbols of new files before their samples need them.
    pub fn warm(&mut self, processes: &Processes, kernel: bool) {
        if let (Some((names, _)), Some(unwinder)) = (&mut self.native, &processes.native) {
            names.warm(unwinder, kernel);
        }
    }

    /// Names the Ruby frames of the records waiting as soon as they are
    /// read: the GC may free or move their code before they are counted
    /// (src/pace.rs, `Hold`). Counting finds them named.
    pub fn read_ahead(&mut self, probe: &Probe, processes: &mut Processes) {
        for r in probe.unseen_waiting() {
            let Record::Sample(s) = r else { continue };
            // Code rprof has not mapped yet: named when counted, after it
            // reads the mappings again (`on_record`), or a C method's
            // function would not be known as its own.
            if s.header.native_stop == types::rprof_native_stop::RPROF_NATIVE_NO_MAPPING.0 {
                continue;
            }
            let Some((f, unwinder)) = processes.get_with_native(s.header.pid, s.header.start_ticks) else {
                continue;
            };
            let Some(ruby) = f.ruby.as_mut() else { continue };
            if let Some(r) = s.clock_reading() {
                ruby.resolver.note_reading(&r);
            }
            self.name_ruby(&s, &mut ruby.resolver, unwinder);
        }
    }

    /// A record from BPF: a stack, or a change in the followed processes.
    pub fn on_record(&mut self, r: Record, processes: &mut Processes, probe: &mut Probe) -> Result<()> {
        // A change in the processes; samples are urgent as they are named.
        self.urgent |= matches!(&r, Record::Process(_));
        match r {
            Record::Sample(s) if s.has(types::rprof_sample_flags::RPROF_SAMPLE_BY_HASH) => {
                self.add_count(s.header.hash, s.header.weight);
            }
            Record::Sample(s) => {
                // Code loaded after rprof read the process's mappings.
                if s.header.native_stop == types::rprof_native_stop::RPROF_NATIVE_NO_MAPPING.0 {
                    processes.rescan_native(probe, s.header.pid);
                }
                match processes.get_with_native(s.header.pid, s.header.start_ticks) {
                    Some((f, unwinder)) => {
                        if let Some(ruby) = f.ruby.as_mut() {
                            if let Some(r) = s.clock_reading() {
                                ruby.resolver.note_reading(&r);
                            }
                        }
                        let clock = f.ruby.as_ref().and_then(|r| r.target.gc);
                        let twin = wall::gc_twin(&s, clock.is_some_and(|c| c.time_ns[0] != 0));
                        self.add_sample(s, f, unwinder, false);
                        if let Some(twin) = twin {
                            self.add_sample(twin, f, unwinder, false);
                        }
                    }
                    None => self.unfollowed += 1,
                }
            }
            // An ending process's waiting records are named now, with what is known.
            Record::Process(e) => processes.on_event(probe, &e, |f, u| self.flush(f, u))?,
        }
        Ok(())
    }

    /// Tries again the records that met a busy GC, once their GC stands
    /// still (or for good, `now`).
    pub fn retry(&mut self, now: bool, processes: &mut Processes) {
        for s in std::mem::take(&mut self.deferred) {
            match processes.get_with_native(s.header.pid, s.header.start_ticks) {
                Some((f, unwinder)) => {
                    let settled = f.ruby.as_mut().is_some_and(|r| r.resolver.settled());
                    if now || settled {
                        self.add_sample(s, f, unwinder, true);
                    } else {
                        self.deferred.push(s);
                    }
                }
                None => self.unfollowed += 1,
            }
        }
    }

    /// Names for good the waiting records of `f`, which is ending.
    pub fn flush(&mut self, f: &mut Followed, unwinder: Option<&Unwinder>) {
        let (mine, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.deferred)
            .into_iter()
            .partition(|s| s.header.pid == f.id.pid && s.header.start_ticks == f.id.start_ticks);
        self.deferred = rest;
        for s in mine {
            self.add_sample(s, f, unwinder, true);
        }
    }

    /// A record of process `f`. If the GC was busy while its frames were
    /// read, it waits (unless `last_try`) for the GC to stand still.
    fn add_sample(&mut self, s: Sample, f: &mut Followed, unwinder: Option<&Unwinder>, last_try: bool) {
        let (thread, stack, unknown) = self.build_stack(&s, f, unwinder);
        if !last_try && unknown.contains(&Unknown::GcBusy) {
            self.deferred.push(s);
            return;
        }
        let hash = s.header.hash;
        if s.has(types::rprof_sample_flags::RPROF_SAMPLE_DIRECT) {
            self.count_unknown(&unknown);
            // One event: what a CPU sample counts (BPF's `cpu_sample_weight`),
            // a syscall (1), or `wall` time (ns: 0 for a wait that has just
            // begun), with time sent for it while it waited.
            let n = s.header.weight + self.waiting_counts.remove(&hash).unwrap_or(0);
            let stack = Rc::new(stack);
            if n > 0 {
                if !unknown.is_empty() {
                    self.unknown_samples += n;
                }
                self.count(hash, &thread, &stack, n);
            }
            // `wall`: its wait's time may come later by its hash alone
            // (RPROF_SAMPLE_BY_HASH).
            let generation = self.generation;
            self.stacks
                .entry(hash)
                .or_insert_with(|| CachedStack {
                    thread,
                    frames: stack,
                    generation,
                    unknown: !unknown.is_empty(),
                    kind: WallKind::of(&s.header),
                })
                .generation = generation;
            return;
        }
        // The same hash means the same frames at the same GC time, so the same
        // objects: if an earlier reading named them all, it stands.
        if !unknown.is_empty() {
            if let Some(cached) = self.stacks.get_mut(&hash).filter(|c| !c.unknown) {
                cached.generation = self.generation;
                return;
            }
        }
        self.count_unknown(&unknown);
        let stack = Rc::new(stack);
        // Counted in an epoch that closed while this record waited.
        if let Some(n) = self.waiting_counts.remove(&hash) {
            self.count(hash, &thread, &stack, n);
            if !unknown.is_empty() {
                self.unknown_samples += n;
            }
        }
        if let Some(said) = self.say_named.as_mut() {
            if unknown.is_empty() && !s.frames.is_empty() && said.insert(s.header.tid) {
                eprintln!("rprof: named a whole stack of thread {}", s.header.tid);
            }
        }
        self.stacks.insert(
            hash,
            CachedStack {
                thread,
                frames: stack,
                generation: self.generation,
                unknown: !unknown.is_empty(),
                kind: WallKind::of(&s.header),
            },
        );
    }

    /// `wall`: the stack of an interval still open, counted in epochs to
    /// come without its record being sent again: kept named.
    pub fn keep(&mut self, hash: u64) {
        if let Some(cached) = self.stacks.get_mut(&hash) {
            cached.generation = self.generation;
        }
    }

    /// `wall`: `ns` of `kind` whose waits were not walked, to share among
    /// the walked stacks of that kind as the epoch closes.
    pub fn pend(&mut self, kind: WallKind, ns: u64) {
        self.wall_pending.push((kind, ns, 0));
    }

    /// `wall`: a stack read because its wait was long, which the sample of
    /// walked waits that pending time is shared by must not include.
    pub fn not_sampled(&mut self, hash: u64) {
        if let Some(cached) = self.stacks.get_mut(&hash) {
            cached.kind = None;
        }
    }

    /// `wall`: shares the pending time of each kind among the stacks of
    /// that kind counted this epoch, in proportion to their time: the walked
    /// waits are a sample taken by chance, whatever their stack, so their
    /// split is the split of all. Running time is all pending, and its
    /// stacks count their CPU samples (1 each), so it splits as the samples
    /// do. Time of a kind with no walked stack this
    /// epoch waits up to `PENDING_EPOCHS` epochs (and not past the last),
    /// then counts with no stack.
    fn share_pending(&mut self, last: bool, processes: &mut Processes, probe: &mut Probe) -> Result<()> {
        const PENDING_EPOCHS: u32 = 4;
        if self.wall_pending.is_empty() {
            return Ok(());
        }
        let mut walked: HashMap<WallKind, Vec<(u64, u64)>> = HashMap::new();
        for (hash, counted) in &self.current {
            if let Some(kind) = self.stacks.get(hash).and_then(|c| c.kind) {
                walked.entry(kind).or_default().push((*hash, counted.2));
            }
        }
        let mut merged: HashMap<WallKind, (u64, u32)> = HashMap::new();
        for (kind, ns, age) in std::mem::take(&mut self.wall_pending) {
            let m = merged.entry(kind).or_default();
            m.0 += ns;
            m.1 = m.1.max(age);
        }
        for (kind, (ns, age)) in merged {
            let stacks = walked.get(&kind).map(Vec::as_slice).unwrap_or_default();
            let total: u64 = stacks.iter().map(|(_, n)| n).sum();
            if total == 0 {
                if !last && age < PENDING_EPOCHS {
                    self.wall_pending.push((kind, ns, age + 1));
                } else {
                    self.on_record(Record::Sample(wall::unsampled(kind, ns)), processes, probe)?;
                }
                continue;
            }
            let mut shares: Vec<(u64, u64)> = stacks
                .iter()
                .map(|(hash, n)| {
                    (
                        *hash,
                        (u128::from(ns) * u128::from(*n) / u128::from(total)) as u64,
                    )
                })
                .collect();
            // What rounding left, to the first.
            let given: u64 = shares.iter().map(|(_, share)| share).sum();
            if let Some(first) = shares.first_mut() {
                first.1 += ns - given;
            }
            for (hash, share) in shares {
                if let Some(c) = self.current.get_mut(&hash) {
                    c.2 += share;
                }
                if self.stacks.get(&hash).is_some_and(|c| c.unknown) {
                    self.unknown_samples += share;
                }
            }
        }
        Ok(())
    }

    /// Adds `n` events (or `wall` ns) to the stack named by `hash`: counted
    /// in the kernel, or sent by hash when its table was full.
    fn add_count(&mut self, hash: u64, n: u64) {
        match self.stacks.get_mut(&hash) {
            // `wall`: a wait that has just begun (counted when it ends).
            Some(cached) if n == 0 => cached.generation = self.generation,
            None if n == 0 => {}
            Some(cached) => {
                cached.generation = self.generation;
                if cached.unknown {
                    self.unknown_samples += n;
                }
                let (thread, frames) = (cached.thread.clone(), cached.frames.clone());
                self.count(hash, &thread, &frames, n);
            }
            None if self.deferred.iter().any(|s| s.header.hash == hash) => {
                *self.waiting_counts.entry(hash).or_default() += n;
            }
            None => self.undelivered += n,
        }
    }

    /// Adds `n` events of this stack to the epoch open.
    fn count(&mut self, hash: u64, thread: &Rc<ThreadEntry>, stack: &Rc<Vec<Frame>>, n: u64) {
        self.current
            .entry(hash)
            .or_insert_with(|| (thread.clone(), stack.clone(), 0))
            .2 += n;
    }

    /// The recording's counts so far.
    pub fn totals(&self, stats: &Stats, elapsed: Duration) -> Summary {
        Summary {
            samples: stats.events,
            lost: stats.lost + if self.counts_time { 0 } else { self.undelivered },
            failed: stats.read_failed,
            unknown: self.unknown_samples,
            duration_ns: elapsed.as_nanos() as u64,
        }
    }

    /// `wall`: time counted to stacks that never reached userspace (shown
    /// apart from the events lost: it is time, not a number of events).
    pub fn undelivered_ns(&self) -> u64 {
        if self.counts_time {
            self.undelivered
        } else {
            0
        }
    }

    /// The process of a sample as the recording describes it.
    fn process_info(&mut self, f: &mut Followed) -> Rc<ProcessInfo> {
        if let Some(p) = self.process_info.get(&f.id) {
            return p.clone();
        }
        let mut frames = f.frames();
        let label = frames.pop().unwrap_or_default();
        let process = Process { pid: f.id.pid };
        let p = Rc::new(ProcessInfo {
            pid: f.id.pid,
            started: system::start_time(f.id.start_ticks),
            command: process.command_line(),
            runtime: f
                .ruby
                .as_ref()
                .map(|r| format!("Ruby {}", r.target.version))
                .unwrap_or_default(),
            label,
            parents: frames,
        });
        self.process_info.insert(f.id, p.clone());
        p
    }

    fn count_unknown(&mut self, unknown: &[Unknown]) {
        for u in unknown {
            *self.unknown_frames.entry(*u).or_default() += 1;
        }
    }

    /// The sample's thread; its stack, root first: [truncated], Ruby frames,
    /// then the traced event; and why frames could not be named.
    fn build_stack(
        &mut self,
        s: &Sample,
        f: &mut Followed,
        unwinder: Option<&Unwinder>,
    ) -> (Rc<ThreadEntry>, Vec<Frame>, Vec<Unknown>) {
        let h = &s.header;
        let comm: Vec<u8> = h.comm.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let comm = String::from_utf8_lossy(&comm).into_owned();
        let process = self.process_info(f);
        let known = self.names.look_up(f.id, h, self.generation);
        let mut stack = Vec::with_capacity(s.frames.len() + 4);
        let native_thread = |process| ThreadEntry {
            process,
            thread: ThreadInfo {
                process: 0,
                tid: h.tid,
                label: format!("{comm} [{}]", h.tid),
                name: comm.clone(),
            },
        };
        let Some(ruby) = f.ruby.as_mut() else {
            stack.push(Frame::marker("[process not profiled]"));
            return (Rc::new(native_thread(process)), stack, Vec::new());
        };
        let resolver = &mut ruby.resolver;
        // An M:N Ruby thread moves between native threads: name it, not them.
        let thread = Rc::new(if h.ruby_thread != 0 {
            let label = resolver.ruby_thread(h.ruby_thread);
            ThreadEntry {
                process,
                thread: ThreadInfo {
                    process: 0,
                    tid: 0,
                    name: label.clone(),
                    label,
                },
            }
        } else {
            native_thread(process)
        });
        if s.has(types::rprof_sample_flags::RPROF_SAMPLE_READ_FAILED) {
            stack.push(Frame::marker("[failed to read the Ruby stack]"));
        } else if s.has(types::rprof_sample_flags::RPROF_SAMPLE_FOREIGN_EC) {
            stack.push(Frame::marker("[GVL released: Ruby stack unknown]"));
        } else if s.has(types::rprof_sample_flags::RPROF_SAMPLE_UNSAMPLED) {
            stack.push(Frame::marker(
                if h.wall_state == types::rprof_wall_state::RPROF_WALL_RUNNING.0 {
                    "[short runs: stack not sampled]"
                } else {
                    "[short waits: stack not sampled]"
                },
            ));
        }
        if s.has(types::rprof_sample_flags::RPROF_SAMPLE_TRUNCATED) {
            stack.push(Frame::marker("[truncated]"));
        }
        let (ruby, mut unknown) = self.name_ruby(s, resolver, unwinder);
        match &mut self.native {
            Some((names, all)) => stack.extend(resolve::stitched(
                names,
                unwinder,
                h.pid,
                &ruby,
                &s.native,
                h.native_stop,
                &s.kernel,
                *all,
            )),
            None => stack.extend(ruby.iter().rev().filter_map(|r| r.frame.clone())),
        }
        // A thread running no Ruby (nor native frames): said by its thread
        // frame, or this one.
        if s.frames.is_empty() && s.native.is_empty() && !stack.iter().any(|f| f.kind == FrameKind::Marker) {
            stack.push(Frame::marker(recording::NO_RUBY_FRAMES));
        }
        if let Some(gc) = gc_label(h.gc_state) {
            stack.push(Frame::gc(gc));
        }
        if h.wall_state != 0 {
            // The method it waits in: a C method, or one of Ruby's own
            // (3.3's Queue#pop is written in Ruby, `<internal:thread_sync>`).
            let leaf = ruby.first().and_then(|r| r.frame.as_ref()).filter(|f| {
                f.kind == FrameKind::CMethod || f.file.as_deref().is_some_and(|p| p.starts_with("<internal:"))
            });
            stack.push(Frame::state(wall::state_label(h, leaf.map(|f| &*f.name), &known)));
        } else if h.alloc_type != 0 {
            let (frame, why) = alloc_frame(h, resolver, sample_time(s));
            stack.push(frame);
            unknown.extend(why);
        } else if h.event > 0 {
            let name = self
                .events
                .get(h.event as usize - 1)
                .map(|n| n.strip_prefix("sys_").unwrap_or(n).to_string())
                .unwrap_or_else(|| format!("event {}", h.event));
            stack.push(Frame::event(name));
        }
        (thread, stack, unknown)
    }

    /// The sample's Ruby frames, named, leaf first, and why any could not be.
    /// Samples that differ only in their native frames (most, with --native)
    /// have the same Ruby frames at the same GC time, so the same objects:
    /// one naming serves them all, however late the later ones are read.
    fn name_ruby(
        &mut self,
        s: &Sample,
        resolver: &mut crate::resolve::Resolver,
        unwinder: Option<&Unwinder>,
    ) -> (Rc<Vec<RubyFrame>>, Vec<Unknown>) {
        use std::hash::{Hash, Hasher};
        let h = &s.header;
        let mut key = std::collections::hash_map::DefaultHasher::new();
        let time_flags = types::rprof_sample_flags::RPROF_SAMPLE_GC_EDGE.0
            | types::rprof_sample_flags::RPROF_SAMPLE_GC_MOVING.0;
        (h.pid, h.start_ticks, h.flags & time_flags).hash(&mut key);
        for f in &s.frames {
            (f.iseq, f.pc, f.cme, f.flags).hash(&mut key);
        }
        let key = key.finish();
        let time = sample_time(s);
        let old = s.code_is_old();
        if let Some(named) = self.named_ruby.get_mut(&key) {
            if resolver.still_names((named.time, named.old), (time, old)) {
                named.used = self.generation;
                return (named.frames.clone(), Vec::new());
            }
        }
        let reads = resolver.reads();
        let frames = if s.has(types::rprof_sample_flags::RPROF_SAMPLE_GC_MOVING) {
            resolver.moving_stack(&s.frames, time)
        } else {
            resolver.stack(&s.frames, time)
        };
        // Young code that had to be read: more of it may come, which a minor
        // GC can free before rprof reads it (src/pace.rs). Young code named
        // from earlier readings (a program that does not allocate runs the
        // same young code between GCs) can wait.
        self.urgent |= resolver.reads() != reads && !old;
        let mut unknown = Vec::new();
        let mut ruby = Vec::with_capacity(frames.len());
        for (named, raw) in frames.into_iter().zip(&s.frames) {
            let frame = match named {
                Ok(frame) => Some(frame),
                Err(Unknown::NotAFrame) => None,
                Err(why) => {
                    unknown.push(why);
                    Some(Frame::marker("[unknown]"))
                }
            };
            // A C method's function, where its native frames start.
            let cfunc = (raw.iseq == 0).then(|| {
                let at = resolver.cfunc(raw.cme, time)?;
                let code = unwinder?.locate(h.pid, at)?;
                Some((code.file, code.vaddr))
            });
            ruby.push(RubyFrame {
                frame,
                finish: raw.flags & types::rprof_frame_flags::RPROF_FRAME_FINISH.0 != 0,
                cfunc,
            });
        }
        let ruby = Rc::new(ruby);
        if unknown.is_empty() {
            let named = NamedRuby {
                frames: ruby.clone(),
                time,
                old,
                used: self.generation,
            };
            self.named_ruby.insert(key, named);
        }
        (ruby, unknown)
    }

    /// Adds the closed epoch's counts to the profile. A stack still waiting
    /// for its GC to stand still keeps its count until it is named, unless
    /// this is the `last` epoch.
    pub fn close_epoch(
        &mut self,
        probe: &mut Probe,
        processes: &mut Processes,
        last: bool,
        now: Duration,
    ) -> Result<EpochCounts> {
        let closed = probe.switch_epoch()?;
        let settled = Instant::now() + bpf::EPOCH_SETTLE;
        // Its records, before its counts: a count finds its stack named.
        // New records are named while the old epoch settles, not after; then
        // what was written up to then, and no more (targets may write faster
        // than a starved rprof reads).
        let mut mark = None;
        loop {
            let mut records = Vec::new();
            let wait = settled.saturating_duration_since(Instant::now());
            probe.poll(wait.max(bpf::EPOCH_SETTLE / 2), |r| records.push(r))?;
            for r in records {
                self.on_record(r, processes, probe)?;
            }
            if mark.is_none() && Instant::now() >= settled {
                mark = Some(probe.written()?);
            }
            if let Some(mark) = mark {
                if !probe.unread_before(mark)? {
                    break;
                }
            }
        }
        let counts = probe.take_counts(closed)?;
        self.retry(last, processes);
        for (hash, n) in counts {
            self.add_count(hash, n);
        }
        if last {
            self.undelivered += self.waiting_counts.drain().map(|(_, n)| n).sum::<u64>();
        }
        self.share_pending(last, processes, probe)?;
        // Each epoch re-sends the stacks it sees: older ones can go.
        let keep = self.generation.saturating_sub(1);
        self.stacks.retain(|_, c| c.generation >= keep);
        self.named_ruby.retain(|_, n| n.used >= keep);
        self.generation += 1;
        // Processes that ended are described no more, here or in a file.
        let mut ended = Vec::new();
        let names = &mut self.names;
        self.process_info.retain(|id, info| {
            let alive = processes.get(id.pid, id.start_ticks).is_some();
            if !alive {
                ended.push(info.clone());
                names.forget(id);
            }
            alive
        });
        let epoch = EpochCounts {
            start_ns: self.epoch_start.as_nanos() as u64,
            end_ns: now.as_nanos() as u64,
            counts: self.current.drain().map(|(_, c)| c).collect(),
            ended,
        };
        self.epoch_start = now;
        Ok(epoch)
    }
}

/// A stack named, kept while epochs count it.
struct CachedStack {
    thread: Rc<ThreadEntry>,
    frames: Rc<Vec<Frame>>,
    generation: u64,
    unknown: bool,
    /// `wall`: the thread and kind of time it counts (None: not a walked
    /// stack of the sample pending time is shared by).
    kind: Option<WallKind>,
}

/// A sample's Ruby frames as named, for later samples of the same frames:
/// those of the same GC time, and, when every object was old at both, those
/// of any time with no major GC in between (the GC time is part of a stack's
/// hash in BPF, so a program that collects often sends the same stack anew
/// after each collection, and naming it again is work a starved rprof lacks
/// the time for).
struct NamedRuby {
    frames: Rc<Vec<RubyFrame>>,
    time: SampleTime,
    /// BPF saw every iseq and method entry old at `time`.
    old: bool,
    /// The generation (epoch) it was last used in.
    used: u64,
}

/// The GC time a sample was taken at, as its frames' objects are named.
fn sample_time(s: &Sample) -> SampleTime {
    let at = GcTime(s.header.gc_time);
    if s.has(types::rprof_sample_flags::RPROF_SAMPLE_GC_EDGE) {
        SampleTime::at_edge(at)
    } else {
        SampleTime::at(at)
    }
}

/// `alloc`: the leaf saying what was allocated, `[alloc: Foo]`; a hidden
/// object (no class: Ruby's own) by its type.
fn alloc_frame(
    h: &types::rprof_sample_header,
    resolver: &mut crate::resolve::Resolver,
    time: SampleTime,
) -> (Frame, Option<Unknown>) {
    if h.alloc_class == 0 {
        let name = format!("[alloc: hidden {}]", value_type_name(h.alloc_type));
        return (Frame::event(name), None);
    }
    match resolver.class_name(h.alloc_class, time) {
        Ok(name) => (Frame::event(format!("[alloc: {name}]")), None),
        Err(why) => (Frame::event("[alloc: unknown class]"), Some(why)),
    }
}

/// `enum ruby_value_type`, the same from Ruby 2.7 to 3.4.
fn value_type_name(t: u32) -> &'static str {
    match t {
        0x01 => "object",
        0x02 => "class",
        0x03 => "module",
        0x04 => "float",
        0x05 => "string",
        0x06 => "regexp",
        0x07 => "array",
        0x08 => "hash",
        0x09 => "struct",
        0x0a => "bignum",
        0x0b => "file",
        0x0c => "data",
        0x0d => "match",
        0x0e => "complex",
        0x0f => "rational",
        0x14 => "symbol",
        0x1a => "imemo",
        0x1c => "iclass",
        _ => "object of an unknown type",
    }
}

/// The frame of a collection the sampled thread was running, under the
/// stack that triggered it (`enum rprof_gc_state`).
fn gc_label(state: u32) -> Option<&'static str> {
    use types::rprof_gc_state as G;
    Some(match G(state) {
        G::RPROF_GC_NONE => return None,
        G::RPROF_GC_MARKING_MINOR => "[GC: marking (minor)]",
        G::RPROF_GC_MARKING_MAJOR => "[GC: marking (major)]",
        G::RPROF_GC_SWEEPING => "[GC: sweeping]",
        G::RPROF_GC_COMPACTING => "[GC: compacting]",
        // Its first instructions, before Ruby says which kind it is.
        G::RPROF_GC_MARKING => "[GC: marking]",
        _ => "[GC]",
    })
}
