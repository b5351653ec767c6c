//! The only symbolizer: turns frame identities from BPF (iseq + pc, method
//! entry) into labels, paths and lines by reading the target's memory, the
//! way Ruby itself computes a backtrace.
//!
//! Addresses are not identities: the GC frees objects and hands their slots
//! to new ones, and compaction moves them. So what is read is kept as facts
//! stamped with the GC's time (facts.rs), a sample carries the GC time it was
//! taken at, and a fact names a frame only if the GC cannot have replaced the
//! object in between (src/gc_time.rs). Anything else is read again, inside a
//! bracket of two GC clock readings, or the frame is `[unknown]` with the
//! reason counted. `memory.rs` does the reading.

#[cfg(test)]
mod core_tests;
mod facts;
mod labels;
mod lines;
pub mod memory;
mod native;
mod stitch;
pub mod walk;

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::cell::Cell;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flamegraphs::Frame;

use crate::bpf::types;
use crate::gc_time::{bracket, GcClock, GcTime, MajorLog, Reading, SampleTime};
use crate::process::Process;
use crate::target::RubyTarget;
use crate::unwind::Unwinder;
use facts::{Facts, Stamp};
use labels::Labels;
use memory::{Class, Header, IdNames, Iseq, Memory, MethodEntry};
pub use native::NativeNames;
pub use stitch::RubyFrame;

/// Why a frame could not be named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unknown {
    /// Its code was freed or moved by the GC before rprof could read it
    /// (the sample was read too late).
    Collected,
    /// The GC was running every time rprof tried to read it.
    GcBusy,
    /// What is at its address is not what the frame says (not an iseq, a pc
    /// outside its code), or the memory could not be read (the target exited).
    Unreadable,
    /// Not known yet: needs a read of the target's memory.
    NotYet,
    /// Not a frame Ruby shows (a block written in C): left out.
    NotAFrame,
}

impl fmt::Display for Unknown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Unknown::Collected => "collected before they could be read",
            Unknown::GcBusy => "GC running while reading",
            Unknown::Unreadable | Unknown::NotYet => "unreadable",
            Unknown::NotAFrame => "not a frame",
        })
    }
}

/// How long naming a stack waits for a busy GC before leaving it for later.
const BUSY_WAIT: Duration = Duration::from_millis(2);

type Lookup<T> = Result<(T, u64, bool), Unknown>;

/// The key in `Resolver::lines` of an iseq's one line (no pc is 0).
const WHOLE_ISEQ: u64 = 0;

/// What a Ruby frame's pc says about its line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum PcTrust {
    /// The interpreter keeps the pc just past the instruction running (at
    /// the iseq's start before the first one runs), as Ruby's own
    /// backtraces read it.
    Interpreter,
    /// A frame YJIT pushed or entered that has called the next frame: YJIT
    /// wrote its pc at that call (never at the iseq's start).
    JitCaller,
    /// The running frame of a JIT (YJIT's `jit_return`, or any leaf while
    /// MJIT runs): its pc is whatever was last written, maybe by another
    /// frame that used the slot.
    Stale,
}

impl PcTrust {
    fn of(f: &types::rprof_frame, leaf: bool, mjit: bool) -> Self {
        let jit = f.flags & types::rprof_frame_flags::RPROF_FRAME_JIT.0 != 0;
        match (jit || mjit, leaf) {
            (true, true) => PcTrust::Stale,
            (true, false) if jit => PcTrust::JitCaller,
            _ => PcTrust::Interpreter,
        }
    }

    /// Whether the line of `pc` in `iseq` is the frame's line.
    fn line_from(self, pc: u64, iseq: &Iseq) -> bool {
        match self {
            PcTrust::Interpreter => iseq.contains(pc),
            PcTrust::JitCaller => iseq.contains(pc) && pc != iseq.encoded,
            PcTrust::Stale => false,
        }
    }
}

pub struct Resolver {
    memory: Memory,
    clock: Option<GcClock>,
    log: MajorLog,
    iseqs: Facts<Rc<Iseq>>,
    /// None: the address holds no method entry (a frame outside any method
    /// has a cref there).
    methods: Facts<Option<MethodEntry>>,
    classes: Facts<Rc<Class>>,
    /// Lines by (serial of the iseq reading, pc or `WHOLE_ISEQ`), committed
    /// and pending.
    lines: HashMap<(u64, u64), Option<u32>>,
    pending_lines: Vec<((u64, u64), Option<u32>)>,
    /// Where `mjit_opts.on` is (Ruby 2.7 to 3.1), and whether it was seen on.
    mjit: Option<u64>,
    mjit_on: bool,
    /// The objects of the sample being named that were old when it was taken.
    old_at_sample: HashSet<u64>,
    /// ID names: an ID names the same symbol for the life of the process.
    names: HashMap<u64, Arc<str>>,
    pending_names: Vec<(u64, Arc<str>)>,
    labels: Labels,
    /// Frames named, by identity (iseq, pc, method entry, flags, leaf, trust).
    named_frames: HashMap<FrameKey, NamedFrame>,
    pending_frames: Vec<(FrameKey, NamedFrame)>,
    serial: u64,
    /// While reading the target's memory: the GC time the reads happen at.
    now: Option<GcTime>,
    /// The GC time of the last tick, and when it was.
    ticked_at: GcTime,
    ticked: Instant,
    /// When facts were last carried forward and pruned.
    pruned: Instant,
    /// The last pair of times `same_old_objects` found the same: a stack's
    /// frames named together ask about the same pair (more readings never
    /// make a proof false).
    proven: Cell<Option<(SampleTime, SampleTime)>>,
    /// Naming a sample taken while compaction moved objects (`moving_stack`).
    moving: bool,
    /// A sample was named since the last tick.
    named: bool,
    /// Stacks whose naming had to read the target's memory (what was known
    /// did not name them).
    reads: u64,
}

/// How often the GC clock of a process with no samples is followed: a
/// reading costs a system call, and `--all` and the agent follow every Ruby
/// on the host, most of them idle. Readings further apart only make the
/// record of which collections were major coarser: facts are then read
/// again, never trusted longer.
const IDLE_TICK: Duration = Duration::from_millis(100);

/// How often the clock of a process whose samples are being named is
/// followed: BPF sends a reading with the first record of each GC time,
/// which is what tells minor GCs from major ones while samples come, so a
/// reading of rprof's own at each pass of the loop (hundreds a second)
/// would only cost system calls.
const BUSY_TICK: Duration = Duration::from_millis(10);

/// How often what is known is carried forward and pruned: a busy Rails
/// worker collects tens of times a second, and each pruning walks every
/// fact. Facts not carried forward still answer through the major log;
/// they are kept a little longer.
const PRUNE_EVERY: Duration = Duration::from_millis(500);

impl Resolver {
    pub fn new(target: &RubyTarget) -> Self {
        Self::with_memory(Memory::of_target(target), target.gc, target.mjit_on)
    }

    fn with_memory(memory: Memory, clock: Option<GcClock>, mjit: Option<u64>) -> Self {
        let mut resolver = Self {
            memory,
            clock,
            log: MajorLog::default(),
            iseqs: Facts::default(),
            methods: Facts::default(),
            classes: Facts::default(),
            lines: HashMap::new(),
            pending_lines: Vec::new(),
            mjit,
            mjit_on: false,
            old_at_sample: HashSet::new(),
            names: HashMap::new(),
            pending_names: Vec::new(),
            labels: Labels::default(),
            named_frames: HashMap::new(),
            pending_frames: Vec::new(),
            serial: 0,
            now: None,
            ticked_at: GcTime(0),
            ticked: Instant::now(),
            pruned: Instant::now()
                .checked_sub(PRUNE_EVERY)
                .unwrap_or_else(Instant::now),
            proven: Cell::new(None),
            moving: false,
            named: true,
            reads: 0,
        };
        // A first reading of the GC's clock, before any sample.
        resolver.tick();
        resolver
    }

    /// The resolver of `child`, forked from this process at GC time `at`:
    /// the child's memory is a copy of this one's then, so what held then
    /// holds for the child, and this process's GC history up to then is
    /// the child's. Its first samples may come before rprof hears of it.
    pub fn forked(&self, child: Process, at: GcTime) -> Self {
        let memory = self.memory.for_process(child);
        let mut resolver = Self {
            memory,
            clock: self.clock,
            log: self.log.forked(at.count()),
            iseqs: self.iseqs.forked(at),
            methods: self.methods.forked(at),
            classes: self.classes.forked(at),
            lines: HashMap::new(),
            pending_lines: Vec::new(),
            mjit: self.mjit,
            mjit_on: self.mjit_on,
            old_at_sample: HashSet::new(),
            names: self.names.clone(),
            pending_names: Vec::new(),
            labels: Labels::default(),
            named_frames: HashMap::new(),
            pending_frames: Vec::new(),
            serial: self.serial,
            now: None,
            ticked_at: GcTime(0),
            ticked: Instant::now(),
            pruned: Instant::now()
                .checked_sub(PRUNE_EVERY)
                .unwrap_or_else(Instant::now),
            proven: Cell::new(None),
            moving: false,
            named: true,
            reads: 0,
        };
        let live: HashSet<u64> = resolver.iseqs.serials().collect();
        resolver.lines = self
            .lines
            .iter()
            .filter(|((serial, _), _)| live.contains(serial))
            .map(|(&k, &v)| (k, v))
            .collect();
        resolver.tick();
        resolver
    }

    fn read_clock(&mut self) -> Option<Reading> {
        self.memory.reading(false);
        let space = self.memory.space();
        let r = match self.clock {
            Some(clock) => clock.read(&**space)?,
            None if space.is_still() => Reading::STILL,
            None => return None,
        };
        self.log.note(&r);
        Some(r)
    }

    /// Called between batches of samples: follows the GC's clock (to know
    /// which collections were major) and forgets what no sample can use.
    pub fn tick(&mut self) {
        let every = if self.named { BUSY_TICK } else { IDLE_TICK };
        if self.ticked.elapsed() < every {
            return;
        }
        self.named = false;
        self.ticked = Instant::now();
        self.note_mjit();
        let Some(r) = self.read_clock() else { return };
        if r.unsettled || r.time == self.ticked_at || self.pruned.elapsed() < PRUNE_EVERY {
            return;
        }
        self.ticked_at = r.time;
        self.pruned = Instant::now();
        self.iseqs.tick(r.time, &self.log);
        self.methods.tick(r.time, &self.log);
        self.classes.tick(r.time, &self.log);
        let log = &self.log;
        self.named_frames.retain(|_, n| {
            (n.old && n.time.holds(|t| log.describes(t, r.time, true, true)))
                || n.time.latest.count() + 2 >= r.time.count()
        });
        let live: HashSet<u64> = self.iseqs.serials().collect();
        self.lines.retain(|(serial, _), _| live.contains(serial));
        self.labels.forget_unused();
    }

    /// Whether MJIT runs this process's code: set at boot, before any of
    /// the program's code runs, and never cleared; looked at every tick,
    /// not for every stack (each look is a system call).
    fn note_mjit(&mut self) {
        if !self.mjit_on {
            let mut on = [0u8];
            self.mjit_on = self
                .mjit
                .is_some_and(|at| self.memory.space().read(at, &mut on).is_ok() && on[0] != 0);
        }
    }

    /// Names the frames of one sample taken at GC time `sample`: first from
    /// what is known, then by reading the target's memory while the GC stands
    /// still.
    pub fn stack(
        &mut self,
        frames: &[types::rprof_frame],
        sample: SampleTime,
    ) -> Vec<Result<Frame, Unknown>> {
        self.now = None;
        self.named = true;
        self.old_at_sample = old_objects(frames);
        let mjit = self.mjit_on;
        let trust: Vec<PcTrust> = (0..frames.len())
            .map(|i| PcTrust::of(&frames[i], i == 0, mjit))
            .collect();
        let mut out: Vec<_> = frames
            .iter()
            .zip(&trust)
            .enumerate()
            .map(|(i, (f, &t))| self.frame(f, t, sample, i == 0))
            .collect();
        // A GC's unsettled moments (between counting itself and marking, at
        // its very end) last microseconds: wait them out here, as later the
        // objects may be gone. Compaction takes longer: the caller retries.
        let deadline = Instant::now() + BUSY_WAIT;
        if out.contains(&Err(Unknown::NotYet)) {
            self.reads += 1;
        }
        while out.contains(&Err(Unknown::NotYet)) {
            let Some(before) = self.read_clock() else { break };
            if !before.unsettled {
                self.now = Some(before.time);
                self.memory.reading(true);
                let fresh: Vec<_> = (0..frames.len())
                    .filter(|&i| out[i] == Err(Unknown::NotYet))
                    .map(|i| (i, self.frame(&frames[i], trust[i], sample, i == 0)))
                    .collect();
                self.now = None;
                let after = self.read_clock();
                if after.and_then(|a| bracket(before, a)) == Some(before.time) {
                    self.commit();
                    for (i, f) in fresh {
                        out[i] = f;
                    }
                    continue;
                }
                self.roll_back();
                if after.is_none() {
                    break;
                }
            }
            if Instant::now() >= deadline {
                for f in out.iter_mut().filter(|f| **f == Err(Unknown::NotYet)) {
                    *f = Err(Unknown::GcBusy);
                }
                return out;
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        // The clock could not be read: the target is gone.
        for f in out.iter_mut().filter(|f| **f == Err(Unknown::NotYet)) {
            *f = Err(Unknown::Unreadable);
        }
        out
    }

    /// Whether what named the objects of a sample at `named` names those of
    /// a sample at `sample`, each with whether BPF saw them all old: at the
    /// same GC time, or when old at both, with no major GC between (only a
    /// major GC frees or moves an old object).
    pub fn still_names(
        &self,
        (named, old_then): (SampleTime, bool),
        (sample, old_now): (SampleTime, bool),
    ) -> bool {
        let same_time = named.earliest == sample.earliest && named.latest == sample.latest;
        same_time || (old_then && old_now && self.same_old_objects(named, sample))
    }

    /// `MajorLog::describes` for objects old at both samples.
    fn same_old_objects(&self, named: SampleTime, sample: SampleTime) -> bool {
        if self.proven.get() == Some((named, sample)) {
            return true;
        }
        let same = named.holds(|a| sample.holds(|b| self.log.describes(a, b, true, true)));
        if same {
            self.proven.set(Some((named, sample)));
        }
        same
    }

    /// How many stacks needed reads of the target's memory to be named: one
    /// that did not was named from what earlier readings hold, which no GC
    /// takes away while a sample of theirs may still come.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// Names the frames of a sample taken while a compacting GC moved
    /// objects (at `sample`, the time after its marking). Each frame's iseq
    /// address is then either where its object was before compaction or
    /// where it is after, and the frame's object was alive both before and
    /// after. Two live iseqs never share code, so a reading in either world
    /// whose code holds the frame's pc is that frame's iseq: the world after
    /// (read now) is tried first, then the one before (what was known when
    /// the GC was marking). Method entries on the VM stack are pinned.
    pub fn moving_stack(
        &mut self,
        frames: &[types::rprof_frame],
        sample: SampleTime,
    ) -> Vec<Result<Frame, Unknown>> {
        self.moving = true;
        let out = self.moving_frames(frames, sample);
        self.moving = false;
        out
    }

    fn moving_frames(
        &mut self,
        frames: &[types::rprof_frame],
        sample: SampleTime,
    ) -> Vec<Result<Frame, Unknown>> {
        let mut out = self.stack(frames, sample);
        let before = SampleTime::at(GcTime(sample.latest.0.saturating_sub(1)));
        for (i, f) in frames.iter().enumerate() {
            if f.iseq == 0 {
                continue;
            }
            // Only a reading whose code holds the pc proves the frame's iseq.
            if matches!(&out[i], Ok(frame) if frame.line.is_none()) {
                out[i] = Err(Unknown::Unreadable);
            }
            if matches!(out[i], Err(Unknown::Unreadable | Unknown::Collected)) {
                self.now = None;
                let trust = PcTrust::of(f, i == 0, self.mjit_on);
                out[i] = match self.frame(f, trust, before, i == 0) {
                    Ok(frame) if frame.line.is_some() => Ok(frame),
                    _ => Err(Unknown::Unreadable),
                };
            }
        }
        out
    }

    /// The name of the class at `klass` as a sample of time `sample` saw it
    /// (an allocation's class): from what is known, else read while the GC
    /// stands still.
    pub fn class_name(&mut self, klass: u64, sample: SampleTime) -> Result<String, Unknown> {
        self.now = None;
        self.named = true;
        match self.class_label(klass, sample) {
            Err(Unknown::NotYet) => {}
            known => return known,
        }
        let deadline = Instant::now() + BUSY_WAIT;
        loop {
            let before = self.read_clock().ok_or(Unknown::Unreadable)?;
            if !before.unsettled {
                self.now = Some(before.time);
                self.memory.reading(true);
                let named = self.class_label(klass, sample);
                self.now = None;
                let after = self.read_clock();
                if after.and_then(|a| bracket(before, a)) == Some(before.time) {
                    self.commit();
                    return named;
                }
                self.roll_back();
                after.ok_or(Unknown::Unreadable)?;
            }
            if Instant::now() >= deadline {
                return Err(Unknown::GcBusy);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// What Ruby's `Class#name` (or `#inspect`, for an anonymous class) says.
    fn class_label(&mut self, klass: u64, sample: SampleTime) -> Result<String, Unknown> {
        let (class, _, _) = self.class(klass, sample)?;
        match &*class {
            Class::Named(Some((path, _))) => Ok(path.clone()),
            Class::Named(None) => Ok(format!("#<Class:{klass:#018x}>")),
            // A singleton class's object: a class's metaclass, made as
            // Ruby creates singleton classes (`#<Class:Foo>`).
            Class::Singleton(Some(attached)) => {
                let attached = *attached;
                let (of, _, _) = self.class(attached, sample)?;
                Ok(match &*of {
                    Class::Named(Some((path, _))) => format!("#<Class:{path}>"),
                    _ => "#<Class:(singleton class)>".to_string(),
                })
            }
            Class::Singleton(None) | Class::Other => Err(Unknown::Unreadable),
        }
    }

    /// The thread frame of an M:N Ruby thread (one sharing native threads):
    /// its Thread#name, read while the GC stands still, and the address of
    /// its `rb_thread_t`, which stays the same for the thread's life.
    pub fn ruby_thread(&mut self, th: u64) -> String {
        let name = self.read_clock().filter(|r| !r.unsettled).and_then(|before| {
            self.memory.reading(true);
            let name = self.memory.thread_name(th);
            self.memory.reading(false);
            let name = name?;
            let after = self.read_clock()?;
            bracket(before, after).map(|_| name)
        });
        match name {
            Some(name) => format!("{name} (Ruby thread {th:#x})"),
            None => format!("Ruby thread {th:#x}"),
        }
    }

    /// The function of the C method whose method entry is at `cme`, from
    /// what naming its frame read (no new read).
    pub fn cfunc(&mut self, cme: u64, sample: SampleTime) -> Option<u64> {
        self.now = None;
        self.method(cme, sample).ok()?.0?.cfunc
    }

    /// A reading of the clock BPF made as it took a sample
    /// (`RPROF_SAMPLE_CLOCK`): what it says of major GCs counts as rprof's
    /// own readings do, however late it is read.
    pub fn note_reading(&mut self, r: &Reading) {
        self.log.note(r);
    }

    /// Whether the GC stands still now (reads can be made).
    pub fn settled(&mut self) -> bool {
        self.read_clock().is_some_and(|r| !r.unsettled)
    }

    fn commit(&mut self) {
        self.iseqs.commit();
        self.methods.commit();
        self.classes.commit();
        self.lines.extend(self.pending_lines.drain(..));
        self.names.extend(self.pending_names.drain(..));
        self.named_frames.extend(self.pending_frames.drain(..));
    }

    fn roll_back(&mut self) {
        self.iseqs.roll_back();
        self.methods.roll_back();
        self.classes.roll_back();
        self.pending_lines.clear();
        self.pending_names.clear();
        self.pending_frames.clear();
    }

    /// A frame as named before for the same identity, when that naming
    /// holds at `sample` (see `NamedFrame`), else named now.
    fn frame(
        &mut self,
        f: &types::rprof_frame,
        trust: PcTrust,
        sample: SampleTime,
        leaf: bool,
    ) -> Result<Frame, Unknown> {
        let key = (f.iseq, f.pc, f.cme, f.flags, leaf, trust);
        let old = crate::bpf::code_is_old(f);
        // A sample of objects in motion is named by its own rule alone.
        if self.moving {
            return self.name_frame(f, trust, sample, leaf);
        }
        if let Some(n) = self.named_frames.get(&key) {
            if self.still_names((n.time, n.old), (sample, old)) {
                return Ok(n.frame.clone());
            }
        }
        let named = self.name_frame(f, trust, sample, leaf);
        if let Ok(frame) = &named {
            let n = NamedFrame {
                frame: frame.clone(),
                time: sample,
                old,
            };
            // What a bracket's reads named waits for its commit.
            if self.now.is_some() {
                self.pending_frames.push((key, n));
            } else {
                self.named_frames.insert(key, n);
            }
        }
        named
    }

    fn name_frame(
        &mut self,
        f: &types::rprof_frame,
        trust: PcTrust,
        sample: SampleTime,
        leaf: bool,
    ) -> Result<Frame, Unknown> {
        if f.flags & types::rprof_frame_flags::RPROF_FRAME_IFUNC.0 != 0 {
            // A block written in C: Ruby's backtraces leave it out.
            return Err(Unknown::NotAFrame);
        }
        if f.iseq != 0 {
            self.ruby_frame(f, trust, sample, leaf)
        } else {
            self.cfunc_label(f.cme, sample, leaf).map(Frame::cmethod)
        }
    }

    fn ruby_frame(
        &mut self,
        f: &types::rprof_frame,
        trust: PcTrust,
        sample: SampleTime,
        leaf: bool,
    ) -> Result<Frame, Unknown> {
        let (addr, pc) = (f.iseq, f.pc);
        let (iseq, serial, current) = match self.iseq(addr, sample) {
            Ok(found) => found,
            // No iseq and no pc: a block written in C (an ifunc), which
            // Ruby's backtraces leave out, and so does rprof.
            Err(Unknown::Unreadable) if pc == 0 => return Err(Unknown::NotAFrame),
            Err(e) => return Err(e),
        };
        let from_pc = trust.line_from(pc, &iseq);
        let read = |m: &Memory| {
            if from_pc {
                m.line_of(&iseq, pc).map(Some).ok_or(Unknown::Unreadable)
            } else {
                // The pc says nothing (a JIT's running frame, a frame YJIT
                // entered without writing one): a line only if the iseq has
                // just one, never a guessed one.
                Ok(m.single_line(&iseq))
            }
        };
        let line = if iseq.lines.is_some() {
            // Its line table was read with it: any pc the reading describes
            // has its line, even once the GC has freed the table.
            read(&self.memory)?
        } else {
            self.line(serial, if from_pc { pc } else { WHOLE_ISEQ }, current, read)?
        };
        let entry = self.frame_method(f.cme, sample)?;
        if leaf && !self.entered(addr, &iseq, entry.as_ref().map(|e| &e.0), sample) {
            return Err(Unknown::NotAFrame);
        }
        let owner = entry.and_then(|(m, pinned)| m.owner.map(|at| Owner { at, pinned }));
        let label = self.iseq_label(owner, addr, sample, 0)?;
        Ok(Frame {
            line,
            ..Frame::code(label, iseq.path.clone(), 0)
        })
    }

    /// The method entry at `cme`, if that is one (a frame outside any
    /// method has a cref there), and whether it is the object it was at the
    /// sample; a method's label needs its owner.
    fn frame_method(&mut self, cme: u64, sample: SampleTime) -> Result<Option<(MethodEntry, bool)>, Unknown> {
        match self.method(cme, sample) {
            Ok((m, _, current)) => Ok(m.map(|m| (m, current))),
            Err(Unknown::Unreadable) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Whether the leaf frame running `iseq` (at `addr`) has been entered.
    /// Ruby points `ec->cfp` at a new frame and writes the frame's env
    /// slots in whichever order its compiler chose, so a sample can catch a
    /// frame whose method-entry slot still holds what the stack held there
    /// before: Ruby 2.7's churn showed `churn_301` without its class, the
    /// slot holding Fixnum 3000 (the argument `send` had moved down), its
    /// pc at the method's first instruction, and a class_eval's code as
    /// `block in run`. A frame of a method, or of code in one (a block, an
    /// eval, a rescue), whose entry is missing or runs other code is such a
    /// frame; the thread still runs its caller's call, so the frame is left
    /// out, as a C method's being pushed is (`cfunc_label`).
    fn entered(&mut self, addr: u64, iseq: &Iseq, entry: Option<&MethodEntry>, sample: SampleTime) -> bool {
        let method = self.memory.layout().iseq.type_method;
        let (local, code) = if iseq.type_ == method {
            (addr, iseq.encoded)
        } else if iseq.local != 0 && iseq.local != addr {
            match self.iseq(iseq.local, sample) {
                Ok((local, ..)) if local.type_ == method => (iseq.local, local.encoded),
                _ => return true,
            }
        } else {
            return true;
        };
        let Some(entry) = entry else { return false };
        let Some(runs) = entry.iseq else {
            // A block run as a method (define_method), or code in one: its
            // entry runs a proc.
            return iseq.type_ != method;
        };
        // Compaction moves iseqs but not their code, which proves sameness
        // whichever side of a move each address was read on.
        runs == local
            || self
                .iseq(runs, sample)
                .map_or(true, |(other, ..)| other.encoded == code)
    }

    /// A line of the iseq reading `serial`: the line of `pc`, or with
    /// `WHOLE_ISEQ` the one line all its instructions sit on, if they do.
    /// Cached per reading, and read only while that reading still describes
    /// the present (the line table belongs to the object read).
    fn line(
        &mut self,
        serial: u64,
        pc: u64,
        current: bool,
        read: impl FnOnce(&Memory) -> Result<Option<u32>, Unknown>,
    ) -> Result<Option<u32>, Unknown> {
        if let Some(&line) = self.lines.get(&(serial, pc)) {
            return Ok(line);
        }
        if let Some((_, line)) = self.pending_lines.iter().find(|(k, _)| *k == (serial, pc)) {
            return Ok(*line);
        }
        if self.now.is_none() {
            return Err(Unknown::NotYet);
        }
        if !current {
            return Err(Unknown::Collected);
        }
        let line = read(&self.memory)?;
        self.pending_lines.push(((serial, pc), line));
        Ok(line)
    }

    /// The label Ruby 3.4 prints for a C method: `Integer#times`, `File.exist?`.
    /// A `leaf` frame without code whose method-entry slot holds no method
    /// entry is one Ruby is still pushing: it has set `ec->cfp` but not yet
    /// written the slot, which holds whatever the stack held there before
    /// (Ruby 2.7, in Integer#^ and other short C methods: 7 of 49 samples
    /// in one). The thread still runs its caller's call instruction, so the
    /// frame is left out, as it is from Ruby's backtraces (as are dummy
    /// frames, which have no method entry either).
    fn cfunc_label(&mut self, cme: u64, sample: SampleTime, leaf: bool) -> Result<Arc<str>, Unknown> {
        // Not an object's address: a special constant (Qnil, a Fixnum...).
        if leaf && !Memory::is_object(cme) {
            return Err(Unknown::NotAFrame);
        }
        let (m, current) = match self.method(cme, sample)? {
            (Some(m), _, current) => (m, current),
            (None, ..) if leaf => return Err(Unknown::NotAFrame),
            (None, ..) => return Err(Unknown::Unreadable),
        };
        let name = self.id_name(m.original_id.ok_or(Unknown::Unreadable)?)?;
        let owner = m.owner.map(|at| Owner { at, pinned: current });
        self.method_name(owner, &name, sample)
    }

    /// Ruby 3.4's calculate_iseq_label: methods qualified by their owner,
    /// blocks named after the method they are in.
    fn iseq_label(
        &mut self,
        owner: Option<Owner>,
        addr: u64,
        sample: SampleTime,
        depth: u32,
    ) -> Result<Arc<str>, Unknown> {
        let info = self.iseq(addr, sample)?.0;
        let l = self.memory.layout().iseq.clone();
        let t = info.type_;
        if depth > 64 {
            return Err(Unknown::Unreadable);
        }
        if t == l.type_method {
            self.method_name(owner, &info.label, sample)
        } else if t == l.type_block || t == l.type_plain {
            let mut level = 0;
            let mut cur = addr;
            if info.parent != 0 {
                let mut steps = 0;
                while info.local != cur {
                    let cur_info = self.iseq(cur, sample)?.0;
                    if cur_info.type_ == l.type_block {
                        level += 1;
                    }
                    cur = cur_info.parent;
                    steps += 1;
                    if cur == 0 || steps > 256 {
                        return Err(Unknown::Unreadable);
                    }
                }
            }
            let inner = self.iseq_label(owner, cur, sample, depth + 1)?;
            Ok(if level <= 1 {
                self.labels.of(format_args!("block in {inner}"))
            } else {
                self.labels.of(format_args!("block ({level} levels) in {inner}"))
            })
        } else if t == l.type_rescue || t == l.type_ensure || t == l.type_eval {
            if info.parent == 0 {
                return Ok(info.label.clone());
            }
            self.iseq_label(owner, info.parent, sample, depth + 1)
        } else {
            Ok(info.label.clone())
        }
    }

    /// rb_gen_method_name: `Owner#name`, `Owner.name` for singleton methods,
    /// the bare name when the owner has no permanent name.
    fn method_name(
        &mut self,
        owner: Option<Owner>,
        name: &Arc<str>,
        sample: SampleTime,
    ) -> Result<Arc<str>, Unknown> {
        let Some(Owner { at: owner, pinned }) = owner else {
            return Ok(name.clone());
        };
        // A method entry that is the same object at the sample and now kept
        // its owner alive in between (it marks it), so the class read now is
        // the sample's. Classes Ruby will not promote (Ruby 2.7's Kernel,
        // written to without a barrier, stays young) are then named however
        // many GCs late rprof reads.
        let sample = match (pinned, self.now) {
            (true, Some(now)) => SampleTime::at(now),
            _ => sample,
        };
        let class = match self.class(owner, sample) {
            Ok((class, _, _)) => class,
            Err(Unknown::Unreadable) => return Ok(name.clone()),
            Err(e) => return Err(e),
        };
        // The class whose name qualifies the method: a singleton's object.
        let (named, sep) = match &*class {
            Class::Singleton(Some(attached)) => match self.class(*attached, sample) {
                Ok((c, _, _)) => (Some(c), '.'),
                // Not an object (what Ruby names with the bare name too).
                Err(Unknown::Unreadable) => (None, '.'),
                Err(e) => return Err(e),
            },
            _ => (Some(class.clone()), '#'),
        };
        let path = named.as_deref().and_then(|c| match c {
            Class::Named(Some((path, true))) => Some(path.as_str()),
            _ => None,
        });
        Ok(match path {
            Some(path) => self.labels.of(format_args!("{path}{sep}{name}")),
            None => name.clone(),
        })
    }

    fn id_name(&mut self, id: u64) -> Result<Arc<str>, Unknown> {
        let reading = self.now.is_some();
        let memory = &self.memory;
        let mut ids = IdNames {
            known: &self.names,
            read: &mut self.pending_names,
        };
        match ids.get(id, || reading.then(|| memory.id_name(id)).flatten()) {
            Some(name) => Ok(name),
            None if reading => Err(Unknown::Unreadable),
            None => Err(Unknown::NotYet),
        }
    }

    fn iseq(&mut self, addr: u64, sample: SampleTime) -> Lookup<Rc<Iseq>> {
        let sample = sample.of_object(self.old_at_sample.contains(&addr));
        lookup(
            &mut self.iseqs,
            &self.log,
            &self.memory,
            &mut self.serial,
            self.now,
            addr,
            sample,
            |m, h| m.iseq(addr, h).map(Rc::new),
        )
    }

    fn method(&mut self, addr: u64, sample: SampleTime) -> Lookup<Option<MethodEntry>> {
        let sample = sample.of_object(self.old_at_sample.contains(&addr));
        lookup(
            &mut self.methods,
            &self.log,
            &self.memory,
            &mut self.serial,
            self.now,
            addr,
            sample,
            |m, h| Some(m.method_entry(addr, h)),
        )
    }

    fn class(&mut self, addr: u64, sample: SampleTime) -> Lookup<Rc<Class>> {
        let mut ids = IdNames {
            known: &self.names,
            read: &mut self.pending_names,
        };
        lookup(
            &mut self.classes,
            &self.log,
            &self.memory,
            &mut self.serial,
            self.now,
            addr,
            sample,
            |m, h| Some(Rc::new(m.class(addr, h, &mut ids))),
        )
    }
}

/// The class a method entry belongs to; `pinned` when the entry is known to
/// be the same object at the sample and now.
#[derive(Debug, Clone, Copy)]
struct Owner {
    at: u64,
    pinned: bool,
}

type FrameKey = (u64, u64, u64, u32, bool, PcTrust);

/// A frame as named for a sample of `time`. It names a later sample's frame
/// of the same identity taken at the same GC time, or, when BPF saw its iseq
/// and method entry old at both samples, at any time with no major GC in
/// between: the same objects, so the same name and line. A program that
/// collects often sends its stacks anew after each collection, and a
/// server's stacks differ in a few leaf frames: naming every frame again
/// would be most of a busy rprof's work.
struct NamedFrame {
    frame: Frame,
    time: SampleTime,
    old: bool,
}

/// The iseqs and method entries BPF saw old when it sent the sample's record.
fn old_objects(frames: &[types::rprof_frame]) -> HashSet<u64> {
    use types::rprof_frame_flags as F;
    let mut old = HashSet::new();
    for f in frames {
        if f.flags & F::RPROF_FRAME_ISEQ_OLD.0 != 0 {
            old.insert(f.iseq);
        }
        if f.flags & F::RPROF_FRAME_CME_OLD.0 != 0 {
            old.insert(f.cme);
        }
    }
    old
}

/// The fact about `addr` for a sample of time `sample`: a known one that
/// describes it, or, while reads are allowed (`now`), a new reading, kept
/// pending and used only if the object cannot have changed since the sample.
/// Returns the value, the reading's serial, and whether it describes `now`.
#[allow(clippy::too_many_arguments)]
fn lookup<T: Clone>(
    facts: &mut Facts<T>,
    log: &MajorLog,
    memory: &Memory,
    serial: &mut u64,
    now: Option<GcTime>,
    addr: u64,
    sample: SampleTime,
    read: impl FnOnce(&Memory, Header) -> Option<T>,
) -> Lookup<T> {
    let sample = now.map_or(sample, |now| sample.no_later_than(now));
    if let Some(found) = facts.get(addr, sample, now, log) {
        return Ok((found.value.clone(), found.serial, found.current));
    }
    let Some(now) = now else {
        return Err(Unknown::NotYet);
    };
    // Not even an object old at both times would be the sample's: no read
    // can name it, and reading anyway would make a starved rprof's backlog
    // dearer the longer it grows.
    if Memory::is_object(addr) && !sample.holds(|t| Stamp::read_at(now, true).describes(log, t, true)) {
        return Err(Unknown::Collected);
    }
    // An object's address that cannot be read: the GC freed its page, so
    // it freed the object first (callers read Unreadable as "no object
    // there": a frame outside any method has no method entry).
    let header = memory.header(addr).ok_or(if Memory::is_object(addr) {
        Unknown::Collected
    } else {
        Unknown::Unreadable
    })?;
    let stamp = Stamp::read_at(now, header.old);
    // Whatever is at the address now may not be what the sample saw.
    if !sample.holds(|t| stamp.describes(log, t, sample.old)) {
        return Err(Unknown::Collected);
    }
    let value = read(memory, header).ok_or(Unknown::Unreadable)?;
    *serial += 1;
    facts.read(addr, value.clone(), stamp, *serial);
    Ok((value, *serial, true))
}

/// Why a native stack ended early, as its marker says it.
fn native_stop_reason(stop: u32) -> Option<&'static str> {
    use types::rprof_native_stop as S;
    Some(match types::rprof_native_stop(stop as _) {
        S::RPROF_NATIVE_DONE => return None,
        S::RPROF_NATIVE_NO_MAPPING => "code outside its known mappings",
        S::RPROF_NATIVE_NO_CFI => "no unwind info",
        S::RPROF_NATIVE_UNSUPPORTED => "unsupported unwind info",
        S::RPROF_NATIVE_READ_FAILED => "stack unreadable",
        S::RPROF_NATIVE_BAD_FRAME => "bad frame",
        S::RPROF_NATIVE_TRUNCATED => "too deep",
        S::RPROF_NATIVE_NO_SPACE => "mappings unknown",
        S::RPROF_NATIVE_JIT => "JIT code",
        S::RPROF_NATIVE_NOT_READ => "stack read from userspace while blocked",
        _ => "unknown reason",
    })
}

/// What the summary calls each reason a native stack ended early, by
/// `enum rprof_native_stop`.
pub fn native_stop_name(stop: usize) -> &'static str {
    native_stop_reason(stop as u32).unwrap_or("whole")
}

/// Names a sample's native frames (leaf first, as BPF sent them) and
/// stitches them with its Ruby frames (named, leaf first); then its kernel
/// frames. Root first. `all`: keep the interpreter's own frames.
#[allow(clippy::too_many_arguments)]
pub fn stitched(
    names: &mut NativeNames,
    unwinder: Option<&Unwinder>,
    pid: u32,
    ruby: &[RubyFrame],
    native: &[types::rprof_native_frame],
    stop: u32,
    kernel: &[u64],
    all: bool,
) -> Vec<Frame> {
    let vm_exec = unwinder.and_then(|u| u.vm_exec(pid));
    let frames: Vec<stitch::NativeFrame> = native
        .iter()
        .map(|n| {
            let sym = unwinder.and_then(|u| names.user(u, n.file, n.addr));
            let Some(sym) = sym else {
                // Code a JIT compiled from Ruby stands for the Ruby frames
                // (folded like the interpreter).
                let jit = n.file == 0 && unwinder.is_some_and(|u| u.is_jit(pid, n.addr));
                return stitch::NativeFrame {
                    frame: Frame::native_code(if jit { "[JIT code]" } else { "[unknown code]" }),
                    file: n.file,
                    start: None,
                    named: false,
                    plumbing: false,
                    in_vm: jit,
                    entry: false,
                };
            };
            let in_vm = vm_exec.is_some_and(|v| v.file == n.file);
            let name = sym.name.as_deref();
            stitch::NativeFrame {
                frame: Frame::native_code(sym.label.clone()),
                file: n.file,
                start: sym.start,
                named: name.is_some(),
                plumbing: name.is_some_and(stitch::is_plumbing),
                in_vm,
                entry: in_vm
                    && (vm_exec.is_some_and(|v| sym.start == Some(v.vaddr))
                        || name.is_some_and(|n| n.split('.').next() == Some("rb_vm_exec"))),
            }
        })
        .collect();
    let reason = native_stop_reason(stop);
    let marker = reason.map(|r| Frame::marker(format!("[native unwind stopped: {r}]")));
    let mut out = stitch::stitch(ruby, &frames, reason.is_none(), marker, all);
    // The kernel's frames, root first, without the tracing that took the sample.
    let kernel: Vec<Arc<str>> = kernel.iter().map(|&a| names.kernel(a)).collect();
    let skip = if all {
        0
    } else {
        kernel.iter().take_while(|n| stitch::is_kernel_tracing(n)).count()
    };
    out.extend(kernel[skip..].iter().rev().map(|n| Frame::kernel(n.clone())));
    out
}
