//! The processes a recording follows, each named by its identity (PID and
//! start time): those given with `-p` or started by rprof, and with
//! `--subprocesses` every process they fork, at any depth, as BPF reports
//! forks, execs and exits in the order the kernel made them. A forked child
//! shares its parent's memory layout until it execs, so it is profiled from
//! its first instruction with its parent's recipe; after an exec the new
//! program is inspected once its Ruby VM is up. An ended process is
//! forgotten, so following many short-lived processes keeps memory flat.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::bpf::{types, Probe, ThreadLister};
use crate::error::UserError;
use crate::gc_time::GcTime;
use crate::process::Process;
use crate::proof::{self, Failure};
use crate::resolve::Resolver;
use crate::target::RubyTarget;
use crate::unwind::Unwinder;

/// How long after an exec rprof keeps looking for a Ruby VM in the new
/// program (the dynamic loader maps libruby after the exec; `bundle exec`
/// and shell wrappers take longer).
const INSPECT_FOR: Duration = Duration::from_secs(10);
/// For the first second after its exec a process is looked at every
/// INSPECT_EVERY (a Ruby's VM is up within it); after that, this often: a
/// program that is no Ruby costs little however many run (`--all` looks at
/// every exec on the host).
const INSPECT_FIRST: Duration = Duration::from_secs(1);
const INSPECT_LATER: Duration = Duration::from_millis(500);

/// A process: a PID is reused only by a process started later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProcessId {
    pub pid: u32,
    pub start_ticks: u64,
}

/// A followed process's Ruby: where its VM is, and what names its frames.
pub struct Ruby {
    pub target: RubyTarget,
    pub resolver: Resolver,
}

pub struct Followed {
    pub id: ProcessId,
    /// Process frames of its followed ancestors, root first.
    lineage: Vec<String>,
    /// Its own process frame, made at its first sample (workers rename
    /// themselves after the fork).
    label: Option<String>,
    /// None: not (yet) a Ruby rprof can read.
    pub ruby: Option<Ruby>,
    /// After an exec: when to stop looking for its Ruby VM.
    inspect_until: Option<Instant>,
    /// When it was last looked at.
    inspected_at: Option<Instant>,
    /// Found ended by the last `sweep_ended`.
    ended_at_sweep: bool,
    /// Counted as profiled (once, whatever it execs).
    profiled: bool,
    /// 2 for the second process on this PID in the recording, and so on.
    nth: u32,
    /// While its Ruby is looked for: since when, and why, its layout has
    /// not fit.
    refusal: Option<(Instant, String)>,
}

impl Followed {
    /// A followed process that is not a Ruby rprof reads; with `inspect`, it
    /// is looked at for a while in case it is one still starting.
    fn waiting(id: ProcessId, nth: u32, lineage: Vec<String>, inspect: bool) -> Self {
        Self {
            id,
            lineage,
            label: None,
            ruby: None,
            inspect_until: inspect.then(|| Instant::now() + INSPECT_FOR),
            inspected_at: None,
            ended_at_sweep: false,
            profiled: false,
            nth,
            refusal: None,
        }
    }

    /// Whether a process waiting for its Ruby is to be looked at now: at
    /// every inspection for a second after its exec, then every half second.
    fn due(&self, now: Instant) -> bool {
        let Some(until) = self.inspect_until else {
            return false;
        };
        let waited = INSPECT_FOR.saturating_sub(until.saturating_duration_since(now));
        waited < INSPECT_FIRST || self.inspected_at.is_none_or(|at| now >= at + INSPECT_LATER)
    }

    /// The process frames of this process, root first: `process PID:"command line"`.
    pub fn frames(&mut self) -> Vec<String> {
        let (pid, nth) = (self.id.pid, self.nth);
        let own = self.label.get_or_insert_with(|| label(pid, nth)).clone();
        let mut frames = self.lineage.clone();
        frames.push(own);
        frames
    }
}

/// `process PID:"command line"`; `process PID#2:...` for the second process
/// the recording meets on that PID, so that frames never merge two processes.
fn label(pid: u32, nth: u32) -> String {
    let again = if nth > 1 { format!("#{nth}") } else { String::new() };
    format!("process {pid}{again}:\"{}\"", Process { pid }.command_line())
}

/// What happened to the followed processes, for the summary.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    /// Processes with a readable Ruby.
    pub profiled: u64,
    /// Processes followed (forks included).
    pub followed: u64,
    /// Followed processes that ended.
    pub ended: u64,
    /// Processes whose Ruby rprof's layout does not fit: not profiled.
    pub refused: u64,
}

pub struct Processes {
    live: HashMap<u32, Followed>,
    force_version: Option<String>,
    pub counts: Counts,
    /// The Ruby versions of every process profiled, ended ones included.
    pub ruby_versions: std::collections::BTreeSet<String>,
    /// When processes waiting for their Ruby were last looked at.
    inspected: Instant,
    pids: PidUses,
    /// --native: the unwind tables and address spaces of the processes.
    pub native: Option<Unwinder>,
    /// The processes refused (`PID (ruby_description): why`), first ones.
    pub refused: Vec<String>,
    /// --all: a process BPF reports exec'ing is looked at even if it was
    /// not followed, and let go if it is no Ruby.
    pub every_exec: bool,
    /// --all: which Rubies found are profiled (`rprof agent --only`,
    /// `--exclude`), by PID; None: all.
    pub admit: Option<Admit>,
    /// Roots whose layout `prove_root` proved before the BPF programs were
    /// loaded: `add_root` takes them as they are.
    proven: Vec<ProcessId>,
}

/// Whether the Ruby in process PID is to be profiled.
pub type Admit = Box<dyn Fn(u32) -> bool>;

/// Refused processes named in the summary; the rest are counted.
const REFUSED_NAMED: usize = 5;

/// How many processes the recording met on each PID. A byte per PID up to the
/// highest met (so at most the system's `pid_max` bytes, 4 MB with systemd's
/// default), and a map for the PIDs met 255 times or more: a storm of
/// millions of processes keeps it flat.
#[derive(Debug, Default)]
struct PidUses {
    counts: Vec<u8>,
    many: HashMap<u32, u32>,
}

impl PidUses {
    /// Counts a new process on `pid`: 1 for the first.
    fn next(&mut self, pid: u32) -> u32 {
        let i = pid as usize;
        if self.counts.len() <= i {
            self.counts.resize(i + 1, 0);
        }
        let count = &mut self.counts[i];
        if *count < u8::MAX {
            *count += 1;
            return u32::from(*count);
        }
        let many = self.many.entry(pid).or_insert(u32::from(u8::MAX));
        *many += 1;
        *many
    }
}

/// Refuses `target`, a root, if its layout is not proven within `within`.
/// One that ended meanwhile (a short command rprof started) is not refused:
/// nothing of it will be read.
fn check(threads: &ThreadLister, target: &RubyTarget, within: Duration) -> Result<()> {
    match prove(threads, target, within) {
        Err(f) if target.process.is_alive_since(target.start_ticks) => Err(refusal(target, f).into()),
        _ => Ok(()),
    }
}

/// Proves `target`'s layout from its main thread's own thread pointer.
fn prove(threads: &ThreadLister, target: &RubyTarget, within: Duration) -> Result<(), Failure> {
    let started = Instant::now();
    proof::prove(target, || threads.list(target.process.pid), within)?;
    // RPROF_SAY_PROVEN: what the proof costs (BENCHMARKS.md).
    if std::env::var_os("RPROF_SAY_PROVEN").is_some() {
        eprintln!(
            "rprof: layout proven for process {} in {:.2} ms",
            target.process.pid,
            started.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(())
}

/// What the user is told about a process whose layout did not fit.
fn refusal(target: &RubyTarget, Failure(check): Failure) -> UserError {
    UserError::LayoutRefused {
        pid: target.process.pid,
        description: target.description.clone(),
        layout: target.layout.version.clone(),
        check,
    }
}

/// How long a Ruby whose VM is up may fail the layout proof (while it
/// boots) before it is refused.
pub const BOOT_PROOF: Duration = Duration::from_secs(2);

/// How often processes waiting for their Ruby VM are looked at.
const INSPECT_EVERY: Duration = Duration::from_millis(20);

impl Processes {
    /// Processes that had the same PID are told apart (`process PID#2`).
    pub fn new(force_version: Option<String>, native: Option<Unwinder>) -> Self {
        Self {
            native,
            pids: PidUses::default(),
            live: HashMap::new(),
            force_version,
            counts: Counts::default(),
            ruby_versions: Default::default(),
            inspected: Instant::now(),
            refused: Vec::new(),
            every_exec: false,
            admit: None,
            proven: Vec::new(),
        }
    }

    /// Proves the layout of `target`, a root given with -p, before rprof's
    /// BPF programs are loaded: one that does not fit is refused in a tenth
    /// of a second, not after the kernel has verified them (a quarter of a
    /// second to a second).
    pub fn prove_root(
        &mut self,
        threads: &ThreadLister,
        target: &RubyTarget,
        within: Duration,
    ) -> Result<()> {
        check(threads, target, within)?;
        self.proven.push(ProcessId {
            pid: target.process.pid,
            start_ticks: target.start_ticks,
        });
        Ok(())
    }

    /// How many processes are profiled now (their Ruby read).
    pub fn live_rubies(&self) -> usize {
        self.live.values().filter(|f| f.ruby.is_some()).count()
    }

    /// Whether the Ruby in process `pid`, found by --all, is profiled.
    pub fn admits(&self, pid: u32) -> bool {
        self.admit.as_ref().is_none_or(|admit| admit(pid))
    }

    /// Profiles `target` (given with -p or started by rprof); with `follow`,
    /// its forks too. Its layout must be proven within `within` (longer for
    /// a process rprof started, whose VM is still booting).
    pub fn add_root(
        &mut self,
        probe: &mut Probe,
        target: RubyTarget,
        follow: bool,
        within: Duration,
    ) -> Result<()> {
        let id = ProcessId {
            pid: target.process.pid,
            start_ticks: target.start_ticks,
        };
        if !self.proven.contains(&id) {
            check(probe.threads(), &target, within)?;
        }
        if follow {
            probe.follow(id.pid, id.start_ticks)?;
        }
        self.counts.followed += 1;
        // Created before its first sample: its first reading of the GC clock
        // lets it prove that no GC came between the first samples and their naming.
        let resolver = Resolver::new(&target);
        self.start_profiling(probe, id, Vec::new(), Ruby { target, resolver }, None)
    }

    /// Follows the processes already running under `root` (a cluster's
    /// workers when rprof attaches to its master). Called after `root` is
    /// followed: a process forked meanwhile is also reported by BPF, and
    /// counted once.
    pub fn adopt_descendants(&mut self, probe: &mut Probe, root: u32) -> Result<()> {
        for (pid, parent) in crate::process::descendants(root) {
            let process = Process { pid };
            let Some(start_ticks) = process.start_ticks() else {
                continue;
            };
            let id = ProcessId { pid, start_ticks };
            if self.live.get(&pid).is_some_and(|f| f.id == id) {
                continue;
            }
            let lineage = match self.live.get_mut(&parent) {
                Some(p) => p.frames(),
                None => continue, // its parent ended meanwhile: so did it, or it was re-parented
            };
            probe.follow(pid, start_ticks)?;
            self.counts.followed += 1;
            match RubyTarget::inspect(pid, self.force_version.as_deref()) {
                Ok(target)
                    if target.ready()
                        && target.start_ticks == start_ticks
                        && prove(probe.threads(), &target, proof::ATTEMPTS_FOR).is_ok() =>
                {
                    let resolver = Resolver::new(&target);
                    self.start_profiling(probe, id, lineage, Ruby { target, resolver }, None)?;
                }
                // Not a Ruby, one still starting, or one whose layout did not
                // fit (yet): looked at again for a while, and refused then.
                _ => {
                    let nth = self.nth(id);
                    self.live.insert(pid, Followed::waiting(id, nth, lineage, true));
                }
            }
        }
        Ok(())
    }

    /// Follows `id` (not a readable Ruby, or not yet): its forks are followed,
    /// and its samples wait for an exec into a Ruby.
    pub fn add_followed_root(&mut self, probe: &mut Probe, id: ProcessId) -> Result<()> {
        probe.follow(id.pid, id.start_ticks)?;
        self.counts.followed += 1;
        let nth = self.nth(id);
        self.live
            .insert(id.pid, Followed::waiting(id, nth, Vec::new(), true));
        Ok(())
    }

    pub fn note_refused(&mut self, why: String) {
        self.counts.refused += 1;
        if self.refused.len() < REFUSED_NAMED {
            self.refused.push(why);
        }
    }

    /// Which process on its PID `id` is: 1 for the first the recording meets.
    fn nth(&mut self, id: ProcessId) -> u32 {
        match self.live.get(&id.pid).filter(|f| f.id == id) {
            Some(f) => f.nth,
            None => self.pids.next(id.pid),
        }
    }

    /// Profiles `id`; `inherited_from`: a forked child BPF gave the recipe of
    /// this parent at the fork.
    fn start_profiling(
        &mut self,
        probe: &mut Probe,
        id: ProcessId,
        lineage: Vec<String>,
        ruby: Ruby,
        inherited_from: Option<u32>,
    ) -> Result<()> {
        let target = &ruby.target;
        probe.set_threads(id.pid, &target.ruby_threads().unwrap_or_default())?;
        match (inherited_from, &mut self.native) {
            // A forked child got its recipe from BPF at the fork; adding it
            // here again would bring it back if the child has ended meanwhile.
            (Some(parent), Some(native)) => native.inherit(id.pid, id.start_ticks, parent),
            (Some(_), None) => {}
            (None, native) => {
                let mut recipe = target.recipe();
                if let Some(native) = native {
                    // Without its mappings, its native stacks say so (and are counted).
                    match native.attach(probe, target.process, id.start_ticks, Some(target.vm.clone())) {
                        Ok(space) => recipe.native_space = space,
                        Err(e) => eprintln!("rprof: warning: no native stacks for process {}: {e:#}", id.pid),
                    }
                }
                probe.add_process(id.pid, &recipe)?;
            }
        }
        self.ruby_versions.insert(target.version.to_string());
        let known = self.live.get(&id.pid).filter(|f| f.id == id);
        if !known.is_some_and(|f| f.profiled) {
            self.counts.profiled += 1;
        }
        let label = known.and_then(|f| f.label.clone());
        let nth = match known {
            Some(f) => f.nth,
            None => self.nth(id),
        };
        self.live.insert(
            id.pid,
            Followed {
                id,
                lineage,
                label,
                ruby: Some(ruby),
                inspect_until: None,
                inspected_at: None,
                ended_at_sweep: false,
                profiled: true,
                nth,
                refusal: None,
            },
        );
        Ok(())
    }

    /// The followed process a sample of (`pid`, `start_ticks`) came from.
    pub fn get(&mut self, pid: u32, start_ticks: u64) -> Option<&mut Followed> {
        self.live
            .get_mut(&pid)
            .filter(|f| f.id.start_ticks == start_ticks)
    }

    /// `get`, with the unwinder (--native) that knows its native code.
    pub fn get_with_native(
        &mut self,
        pid: u32,
        start_ticks: u64,
    ) -> Option<(&mut Followed, Option<&Unwinder>)> {
        let f = self
            .live
            .get_mut(&pid)
            .filter(|f| f.id.start_ticks == start_ticks)?;
        Some((f, self.native.as_ref()))
    }

    /// A native stack of `pid` left the mappings rprof knows: look again.
    pub fn rescan_native(&mut self, probe: &mut Probe, pid: u32) {
        if let Some(native) = &mut self.native {
            if let Err(e) = native.rescan(probe, pid) {
                eprintln!("rprof: warning: reading the mappings of process {pid} again: {e:#}");
            }
        }
    }

    pub fn all(&mut self) -> impl Iterator<Item = &mut Followed> {
        self.live.values_mut()
    }

    /// A fork, exec or exit reported by BPF. `on_exit` gets an ending
    /// process before it is forgotten.
    pub fn on_event(
        &mut self,
        probe: &mut Probe,
        e: &types::rprof_process_event,
        on_exit: impl FnMut(&mut Followed, Option<&Unwinder>),
    ) -> Result<()> {
        let id = ProcessId {
            pid: e.pid,
            start_ticks: e.start_ticks,
        };
        let change = types::rprof_process_change(e.change as _);
        if change == types::rprof_process_change::RPROF_PROCESS_FORK {
            if self.get(id.pid, id.start_ticks).is_some() {
                return Ok(()); // found running when the recording started
            }
            self.counts.followed += 1;
            // A child of a process rprof started itself is a root.
            let parent = self.get(e.parent, e.parent_start_ticks);
            let lineage = parent.map(|p| p.frames()).unwrap_or_default();
            let parent = self.get(e.parent, e.parent_start_ticks);
            // A child forked by a program that exec'd and is still starting
            // (Puma's master after USR2) may be its Ruby, once that is up.
            let parent_starting = parent
                .as_ref()
                .is_some_and(|p| p.ruby.is_none() && p.inspect_until.is_some());
            match parent.and_then(|p| p.ruby.as_ref()) {
                Some(parent) => {
                    // BPF gave it the parent's recipe already; what rprof
                    // knew of the parent's memory at the fork holds for it.
                    let child = Process { pid: id.pid };
                    let target = parent.target.forked(child, id.start_ticks);
                    let resolver = if e.gc_time != 0 {
                        parent.resolver.forked(child, GcTime(e.gc_time))
                    } else {
                        Resolver::new(&target)
                    };
                    // Unless the parent's own recipe reached BPF after the fork.
                    let inherited = (e.inherited != 0).then_some(e.parent);
                    self.start_profiling(probe, id, lineage, Ruby { target, resolver }, inherited)?;
                }
                None => {
                    let nth = self.nth(id);
                    let waiting = Followed::waiting(id, nth, lineage, parent_starting);
                    self.live.insert(id.pid, waiting);
                }
            }
        } else if change == types::rprof_process_change::RPROF_PROCESS_EXEC {
            if self.every_exec && self.get(id.pid, id.start_ticks).is_none() {
                // --all: any program may be a Ruby; looked at as it starts.
                self.counts.followed += 1;
                let nth = self.nth(id);
                self.live
                    .insert(id.pid, Followed::waiting(id, nth, Vec::new(), true));
            } else if let Some(f) = self.get(id.pid, id.start_ticks) {
                // BPF dropped its recipe; the new program may be a Ruby.
                f.ruby = None;
                f.label = None;
                f.inspect_until = Some(Instant::now() + INSPECT_FOR);
                f.inspected_at = None;
                probe.drop_process_probes(id.pid);
                if let Some(native) = &mut self.native {
                    native.forget(probe, id.pid);
                }
            }
        } else if change == types::rprof_process_change::RPROF_PROCESS_EXIT
            && self.get(id.pid, id.start_ticks).is_some()
        {
            self.forget(probe, id.pid, on_exit);
        }
        Ok(())
    }

    fn forget(
        &mut self,
        probe: &mut Probe,
        pid: u32,
        on_exit: impl FnOnce(&mut Followed, Option<&Unwinder>),
    ) {
        if let Some(mut f) = self.live.remove(&pid) {
            on_exit(&mut f, self.native.as_ref());
            self.counts.ended += 1;
            // Its threads' entries come only from userspace: none of a newer
            // process on this PID can exist before its fork is read, later.
            let _ = probe.set_threads(pid, &[]);
            // Its recipe, if added after BPF dropped it at the exit (a Ruby
            // inspected just before it ended).
            probe.remove_process_of(pid, f.id.start_ticks);
            probe.drop_process_probes(pid);
            if let Some(native) = &mut self.native {
                native.forget(probe, pid);
            }
        }
    }

    /// Forgets processes that ended without their exit reaching rprof (its
    /// record was lost to a full ring buffer; BPF forgot them already). Run
    /// once an epoch: a process found ended at two sweeps in a row has had
    /// every record it sent read.
    pub fn sweep_ended(
        &mut self,
        probe: &mut Probe,
        mut on_exit: impl FnMut(&mut Followed, Option<&Unwinder>),
    ) {
        let mut gone = Vec::new();
        for f in self.live.values_mut() {
            let ended = !Process { pid: f.id.pid }.is_alive_since(f.id.start_ticks);
            if ended && f.ended_at_sweep {
                gone.push(f.id.pid);
            }
            f.ended_at_sweep = ended;
        }
        for pid in gone {
            self.forget(probe, pid, &mut on_exit);
        }
    }

    /// Looks for the Ruby VM of processes that exec'd, until it is up or
    /// their time runs out.
    pub fn inspect_pending(&mut self, probe: &mut Probe) -> Result<()> {
        let now = Instant::now();
        if now < self.inspected + INSPECT_EVERY {
            return Ok(());
        }
        self.inspected = now;
        let mut refused = Vec::new();
        let mut let_go = Vec::new();
        let every_exec = self.every_exec;
        let pending: Vec<(ProcessId, Vec<String>)> = self
            .live
            .values_mut()
            .filter(|f| f.inspect_until.is_some())
            .filter_map(|f| {
                let refused_for = f.refusal.as_ref().map(|(since, _)| now - *since);
                if f.inspect_until.is_some_and(|t| now > t) || refused_for.is_some_and(|d| d > BOOT_PROOF) {
                    f.inspect_until = None; // not a Ruby rprof can read
                    let alive = Process { pid: f.id.pid }.is_alive_since(f.id.start_ticks);
                    refused.extend(f.refusal.take().filter(|_| alive).map(|(_, why)| why));
                    if every_exec {
                        let_go.push(f.id);
                    }
                    return None;
                }
                if !f.due(now) {
                    return None;
                }
                f.inspected_at = Some(now);
                Some((f.id, f.lineage.clone()))
            })
            .collect();
        for why in refused {
            self.note_refused(why);
        }
        // --all: no Ruby in it; its next exec is seen all the same.
        for id in let_go {
            probe.unfollow(id.pid);
            if self.live.remove(&id.pid).is_some() {
                self.counts.followed -= 1;
            }
        }
        for (id, lineage) in pending {
            let Ok(target) = RubyTarget::inspect(id.pid, self.force_version.as_deref()) else {
                continue;
            };
            // --all: a Ruby left out is let go like a program that is none.
            if every_exec && lineage.is_empty() && !self.admits(id.pid) {
                probe.unfollow(id.pid);
                if self.live.remove(&id.pid).is_some() {
                    self.counts.followed -= 1;
                }
                continue;
            }
            if target.start_ticks == id.start_ticks && target.ready() {
                // A Ruby still booting fails some checks: it is looked at
                // again until its time runs out, and refused then.
                if let Err(f) = prove(probe.threads(), &target, Duration::ZERO) {
                    if let Some(followed) = self.get(id.pid, id.start_ticks) {
                        let since = followed.refusal.as_ref().map_or(now, |(since, _)| *since);
                        followed.refusal = Some((since, refusal(&target, f).to_string()));
                    }
                    continue;
                }
                let resolver = Resolver::new(&target);
                self.start_profiling(probe, id, lineage, Ruby { target, resolver }, None)?;
            }
        }
        Ok(())
    }

    /// Refreshes the thread lists BPF needs for Rubies without a thread-local EC.
    pub fn refresh_threads(&mut self, probe: &mut Probe) -> Result<()> {
        for f in self.live.values() {
            if let Some(ruby) = &f.ruby {
                // Threads come and go; a dead process's list is simply not read.
                if let Ok(threads) = ruby.target.ruby_threads() {
                    probe.set_threads(f.id.pid, &threads)?;
                }
            }
        }
        Ok(())
    }

    /// Whether any followed process still runs. (Ended ones stay until
    /// BPF reports their exit, or the recording ends: their last records
    /// are named with what is known of them.)
    pub fn any_alive(&self) -> bool {
        // Its PID alone may be another process's by now.
        self.live
            .values()
            .any(|f| Process { pid: f.id.pid }.is_alive_since(f.id.start_ticks))
    }
}

#[cfg(test)]
mod tests {
    use super::PidUses;

    #[test]
    fn each_pid_counts_its_own_processes_past_a_byte() {
        let mut uses = PidUses::default();
        let counts: Vec<u32> = (0..300).map(|_| uses.next(4_194_303)).collect();
        assert_eq!(counts, (1..=300).collect::<Vec<u32>>());
        assert_eq!((uses.next(7), uses.next(7), uses.next(4_194_303)), (1, 2, 301));
        assert_eq!(uses.counts.len(), 4_194_304);
        assert_eq!(uses.many.len(), 1);
    }
}
