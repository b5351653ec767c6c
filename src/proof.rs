//! Proves that a layout fits a live Ruby before BPF reads with it. A layout
//! that does not fit gives junk, not an error (another version's offsets
//! read other fields), so before the first sample rprof walks what BPF and
//! the resolver will walk, from the main thread's own thread pointer, and
//! checks what must hold there: its EC points to a thread that points back
//! to it and runs on that native thread; control frames tile the VM stack
//! down to the dummy frame every thread starts with; each frame's env has a known
//! magic; each iseq frame's iseq is an iseq whose label and path are Strings
//! and whose line table covers its pc; method entries name methods; the
//! symbol table names `+`; `Object` is called Object and its singleton
//! class belongs to it; the GC's counts add up. Ruby keeps running: a check
//! may see memory in the middle of a change, so a fitting layout passes one
//! of a few attempts, and a wrong one fails them all.

use std::cell::RefCell;
use std::collections::HashSet;
use std::time::{Duration, Instant};

use ruby_structs::Layout;

use crate::address_space::AddressSpace;
use crate::gc_time::GcClock;
use crate::process::Process;
use crate::resolve::memory::{Class, Header, IdNames, Memory};
use crate::target::{EcAccess, RubyTarget};

/// `VM_FRAME_MAGIC_*` of every frame kind: the same in every Ruby rprof
/// reads (method, block, class, top, cfunc, ifunc, eval, rescue, dummy).
const FRAME_MAGICS: [u64; 9] = [
    0x1111_0001,
    0x2222_0001,
    0x3333_0001,
    0x4444_0001,
    0x5555_0001,
    0x6666_0001,
    0x7777_0001,
    0x7888_0001,
    0x7999_0001,
];
const MAGIC_METHOD: u64 = 0x1111_0001;
const MAGIC_BLOCK: u64 = 0x2222_0001;
/// `RBasic.klass`, after the flags word, in every Ruby.
const RBASIC_KLASS: u64 = 8;
/// glibc's `TLS_DTV_UNALLOCATED`: a thread that never touched this TLS block.
const DTV_UNALLOCATED: u64 = u64::MAX;
/// Control frames read per thread: the stack's top (where BPF starts), and
/// its bottom separately.
const MAX_FRAMES: u64 = 512;

/// A check that failed: what was read, and which layout fields it depends on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure(pub String);

fn fail<T>(what: impl Into<String>) -> Result<T, Failure> {
    Err(Failure(what.into()))
}

/// How long a process that runs already may take to pass; one that is still
/// starting is retried by its caller.
pub const ATTEMPTS_FOR: Duration = Duration::from_millis(100);

/// Proves `target`'s layout, retrying while Ruby changes what is read, for
/// up to `within` (at least once). `threads` lists (tid, thread pointer) of
/// its threads.
pub fn prove(
    target: &RubyTarget,
    threads: impl Fn() -> anyhow::Result<Vec<(u32, u64)>>,
    within: Duration,
) -> Result<(), Failure> {
    let deadline = Instant::now() + within;
    loop {
        let result = threads()
            .or_else(|e| fail(format!("the process's threads cannot be listed ({e:#})")))
            .and_then(|threads| check(target, &threads));
        if result.is_ok() || Instant::now() >= deadline {
            return result;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// One attempt.
fn check(target: &RubyTarget, threads: &[(u32, u64)]) -> Result<(), Failure> {
    let p = Prover {
        process: target.process,
        layout: &target.layout,
        mem: Memory::of_target(target),
        mjit_running: target.mjit_on.is_some_and(|on| {
            let mut b = [0u8];
            target.process.read(on, &mut b).is_ok_and(|()| b[0] != 0)
        }),
        seen: RefCell::default(),
    };
    p.symbols()?;
    if let Some(object) = target.object_class {
        p.object_class(object)?;
    }
    match target.gc {
        Some(clock) => p.gc(clock)?,
        None => return fail("the GC has not started"),
    }
    p.threads(target, threads)
}

struct Prover<'a> {
    process: Process,
    layout: &'a Layout,
    mem: Memory,
    /// MJIT (2.7, 3.1 with --jit) is on: it writes pcs lazily too.
    mjit_running: bool,
    /// Frames checked: (iseq, pc, method entry or cref, env flags, pc written).
    seen: RefCell<HashSet<[u64; 5]>>,
}

/// One control frame, as BPF reads it.
struct Frame {
    pc: u64,
    iseq: u64,
    ep: u64,
    jit_return: u64,
}

impl Prover<'_> {
    fn u64_at(&self, addr: u64, what: &str) -> Result<u64, Failure> {
        self.process
            .read_u64(addr)
            .or_else(|e| fail(format!("{what} at {addr:#x} cannot be read ({e})")))
    }

    /// The symbol table names the operator IDs Ruby registers at boot.
    fn symbols(&self) -> Result<(), Failure> {
        match self.mem.id_name(u64::from(b'+')) {
            Some(name) if name == "+" => Ok(()),
            other => fail(format!(
                "the symbol table names ID 43 {other:?}, not \"+\" (symbols, array, string)"
            )),
        }
    }

    /// `rb_cObject` is a class named Object, whose class is a singleton
    /// class attached to it.
    fn object_class(&self, ptr: u64) -> Result<(), Failure> {
        let object = self.u64_at(ptr, "rb_cObject")?;
        let header = |v: u64| {
            self.mem
                .header(v)
                .ok_or_else(|| Failure(format!("the object at {v:#x} cannot be read")))
        };
        let known = Default::default();
        let mut read = Vec::new();
        let mut ids = IdNames {
            known: &known,
            read: &mut read,
        };
        match self.mem.class(object, header(object)?, &mut ids) {
            Class::Named(Some((name, _))) if name == "Object" => {}
            other => {
                return fail(format!(
                    "rb_cObject reads as {other:?}, not the class Object (class, string, st_table)"
                ))
            }
        }
        let meta = self.u64_at(object + RBASIC_KLASS, "Object's class")?;
        match self.mem.class(meta, header(meta)?, &mut ids) {
            Class::Singleton(Some(attached)) if attached == object => Ok(()),
            other => fail(format!(
                "Object's singleton class reads as {other:?}, not attached to Object (class, value)"
            )),
        }
    }

    /// The GC's counts: every collection is major or minor.
    fn gc(&self, clock: GcClock) -> Result<(), Failure> {
        let gc = &self.layout.gc;
        let minor_at = clock.count.wrapping_add(gc.minor_gc_count_from_count as u64);
        let mut words = [[0u8; 8]; 3];
        let [count, major, minor] = &mut words;
        self.process
            .read_many(&mut [
                (clock.count, &mut count[..]),
                (clock.major_count, &mut major[..]),
                (minor_at, &mut minor[..]),
            ])
            .or_else(|e| fail(format!("the GC's counts cannot be read ({e})")))?;
        let [count, major, minor] = words.map(u64::from_le_bytes);
        if major.checked_add(minor) != Some(count) {
            return fail(format!(
                "the GC counts {count} collections, but {major} major and {minor} minor (gc)"
            ));
        }
        self.gc_time(clock)
    }

    /// The GC's own clock (`GC.stat(:time)`): the process's CPU time in
    /// collections, so never more than all of its CPU time, read after,
    /// with that of the processes it was forked from (`lineage_cpu_ns`: a
    /// Puma worker's clock starts at its master's, whose boot collected
    /// for longer than a young worker has run; such workers were refused).
    fn gc_time(&self, clock: GcClock) -> Result<(), Failure> {
        let mut ns = 0u64;
        for &addr in clock.time_ns.iter().filter(|&&a| a != 0) {
            let field = self.u64_at(addr, "the GC's time")?;
            ns = ns.saturating_add(field);
        }
        // For each process, utime and stime each rounded down to a clock
        // tick (10 ms), and a tick it may use between the two reads.
        match self.process.lineage_cpu_ns() {
            Some((cpu, n)) if ns > cpu.saturating_add(n * 30_000_000) => fail(format!(
                "the GC's time reads {} ms, more than the CPU time of the process and those it was forked from, {} ms (gc time_ns_from_count)",
                ns / 1_000_000,
                cpu / 1_000_000
            )),
            _ => Ok(()),
        }
    }

    /// The main thread, reached as BPF will reach it. (Other threads are
    /// read with the same offsets; the main thread always exists, has its
    /// own native thread, and holds the program's frames.)
    fn threads(&self, target: &RubyTarget, threads: &[(u32, u64)]) -> Result<(), Failure> {
        let pid = self.process.pid;
        let Some(&(_, tp)) = threads.iter().find(|(tid, _)| *tid == pid) else {
            return fail("the main thread was not found");
        };
        let ec = match target.ec_access {
            EcAccess::ThreadMap { .. } => {
                let list = target
                    .ruby_threads()
                    .or_else(|e| fail(format!("the VM's thread list cannot be read ({e:#})")))?;
                match list.iter().find(|(t, _)| *t == tp) {
                    Some(&(_, th)) => self.u64_at(th + u64::from(self.layout.thread.ec), "th->ec")?,
                    None => {
                        return fail(format!(
                            "the VM's thread list has no thread on the main thread's pthread {tp:#x} (thread)"
                        ))
                    }
                }
            }
            access => self.ec_of(access, tp)?,
        };
        if ec == 0 {
            return fail(format!(
                "the main thread has no execution context (recipe {:?}; thread)",
                target.ec_access
            ));
        }
        // The global EC (Ruby 2.7 without its VM's thread list) is the GVL
        // holder's, whichever thread that is.
        let main = !matches!(target.ec_access, EcAccess::Global { .. });
        self.thread(ec, main.then_some(tp))
            .map_err(|Failure(f)| Failure(format!("main thread: {f}")))
    }

    /// The EC the recipe leads to from thread pointer `tp`, as BPF follows it.
    fn ec_of(&self, access: EcAccess, tp: u64) -> Result<u64, Failure> {
        match access {
            EcAccess::Global { addr } => self.u64_at(addr, "the global EC"),
            EcAccess::ThreadMap { .. } => Ok(0),
            EcAccess::TlsTpOffset { offset } => {
                self.u64_at(tp.wrapping_add(offset as u64), "the EC in static TLS")
            }
            EcAccess::TlsDtv { module, offset } => {
                let dtv = self.u64_at(tp + 8, "the thread's dtv")?;
                let block = self.u64_at(dtv + module * 16, "the thread's TLS block")?;
                if block == 0 || block == DTV_UNALLOCATED {
                    return Ok(0);
                }
                self.u64_at(block + offset, "the EC in TLS")
            }
        }
    }

    /// One thread: its EC and thread point to each other, the main thread
    /// runs on its native thread (`main`: its pthread), and its control
    /// frames check out.
    fn thread(&self, ec: u64, main: Option<u64>) -> Result<(), Failure> {
        let l = self.layout;
        let e = &l.execution_context;
        let th = self.u64_at(ec + u64::from(e.thread_ptr), "ec->thread_ptr")?;
        let back = self.u64_at(th + u64::from(l.thread.ec), "th->ec")?;
        if back != ec {
            return fail(format!(
                "the EC at {ec:#x} names thread {th:#x}, whose EC is {back:#x} (execution_context, thread)"
            ));
        }
        if let Some(tp) = main {
            if !self.runs_on(th, tp)? {
                return fail(format!(
                    "thread {th:#x} does not name its native thread {tp:#x} (thread.native_thread)"
                ));
            }
            self.main_thread(th)?;
        }
        let vm_stack = self.u64_at(ec + u64::from(e.vm_stack), "ec->vm_stack")?;
        let size = self.u64_at(ec + u64::from(e.vm_stack_size), "ec->vm_stack_size")?;
        let cfp = self.u64_at(ec + u64::from(e.cfp), "ec->cfp")?;
        self.frames(vm_stack, size, cfp)
    }

    /// Whether the Ruby thread at `th` says it runs on the native thread
    /// whose pthread (thread pointer) is `tp`.
    fn runs_on(&self, th: u64, tp: u64) -> Result<bool, Failure> {
        let t = &self.layout.thread;
        let id_at = match t.native_thread {
            Some(nt) => self.u64_at(th + u64::from(nt), "th->nt")? + u64::from(t.native_thread_id),
            None => th + u64::from(t.native_thread_id),
        };
        Ok(self.u64_at(id_at, "the native thread id")? == tp)
    }

    /// The main thread has its own native thread (M:N Rubies) and a name
    /// that is nil or a String.
    fn main_thread(&self, th: u64) -> Result<(), Failure> {
        let t = &self.layout.thread;
        if let (Some(byte), Some(mask)) = (t.dedicated_nt_byte, t.dedicated_nt_mask) {
            let mut b = [0u8];
            self.process
                .read(th + u64::from(byte), &mut b)
                .or_else(|e| fail(format!("has_dedicated_nt cannot be read ({e})")))?;
            if b[0] & mask == 0 {
                return fail("the main thread does not have its own native thread (thread.dedicated_nt)");
            }
        }
        if let Some(name) = t.name {
            let v = self.u64_at(th + u64::from(name), "th->name")?;
            if v != self.layout.value.qnil && self.mem.thread_name(th).is_none() {
                return fail(format!(
                    "the main thread's name is {v:#x}, not nil or a String (thread.name)"
                ));
            }
        }
        Ok(())
    }

    /// The control frames from `cfp` to the end of the VM stack.
    fn frames(&self, vm_stack: u64, size: u64, cfp: u64) -> Result<(), Failure> {
        let c = &self.layout.control_frame;
        let cfp_size = u64::from(c.size);
        if vm_stack == 0 || vm_stack & 7 != 0 || !(1024..1 << 28).contains(&size) {
            return fail(format!(
                "the VM stack reads as {size} words at {vm_stack:#x} (execution_context)"
            ));
        }
        let end = vm_stack + size * 8;
        if cfp < vm_stack || cfp >= end || !(end - cfp).is_multiple_of(cfp_size) {
            return fail(format!(
                "the control frames at {cfp:#x} do not tile the VM stack {vm_stack:#x}..{end:#x} \
                 in {cfp_size}-byte frames (control_frame, execution_context)"
            ));
        }
        let count = (end - cfp) / cfp_size;
        let top = self.read_frames(cfp, count.min(MAX_FRAMES))?;
        let bottom = self.read_frames(end - cfp_size, 1)?;
        for (i, f) in top.iter().enumerate() {
            // A JIT's running frame may still hold an earlier frame's pc
            // (YJIT writes it before calls; MJIT marks no frame).
            let pc_written = i > 0 || (f.jit_return == 0 && !self.mjit_running);
            self.frame(f, pc_written)
                .map_err(|Failure(e)| Failure(format!("frame {i}: {e}")))?;
        }
        self.bottom_frame(&bottom[0])
    }

    fn read_frames(&self, at: u64, n: u64) -> Result<Vec<Frame>, Failure> {
        let c = &self.layout.control_frame;
        let size = c.size as usize;
        let mut raw = vec![0u8; n as usize * size];
        self.process
            .read(at, &mut raw)
            .or_else(|e| fail(format!("the control frames at {at:#x} cannot be read ({e})")))?;
        let word = |f: &[u8], off: Option<u32>| {
            off.and_then(|o| f.get(o as usize..o as usize + 8))
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
        };
        Ok(raw
            .chunks_exact(size)
            .map(|f| Frame {
                pc: word(f, Some(c.pc)),
                iseq: word(f, Some(c.iseq)),
                ep: word(f, Some(c.ep)),
                jit_return: word(f, c.jit_return),
            })
            .collect())
    }

    /// ep[-2], ep[-1], ep[0]: method entry or cref, block handler, flags.
    fn env(&self, ep: u64) -> Result<[u64; 3], Failure> {
        if ep < 16 || ep & 7 != 0 {
            return fail(format!("a frame's ep is {ep:#x} (control_frame)"));
        }
        let mut raw = [0u8; 24];
        self.process
            .read(ep - 16, &mut raw)
            .or_else(|e| fail(format!("the env at {ep:#x} cannot be read ({e})")))?;
        let w = |i: usize| u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
        Ok([w(0), w(1), w(2)])
    }

    fn magic(&self, flags: u64) -> Result<u64, Failure> {
        let magic = flags & self.layout.frame.magic_mask;
        if !FRAME_MAGICS.contains(&magic) {
            return fail(format!(
                "a frame's env flags {flags:#x} hold no frame magic (control_frame, frame)"
            ));
        }
        Ok(magic)
    }

    /// Every thread's stack starts with a dummy frame: a local env with the
    /// finish flag (where native code entered the VM), not JIT code, and no
    /// iseq, or (the main thread's) an iseq of its own holding its pc.
    fn bottom_frame(&self, f: &Frame) -> Result<(), Failure> {
        let fr = &self.layout.frame;
        let [_, _, flags] = self.env(f.ep)?;
        let magic = self.magic(flags)?;
        let iseq_fits = match f.iseq {
            0 => f.pc == 0,
            iseq => self
                .mem
                .header(iseq)
                .and_then(|h| self.mem.iseq(iseq, h))
                .is_some_and(|i| i.contains(f.pc)),
        };
        if magic != fr.magic_dummy
            || !iseq_fits
            || f.jit_return != 0
            || flags & fr.flag_finish == 0
            || flags & fr.env_flag_local == 0
        {
            return fail(format!(
                "the first frame is not the dummy frame every thread starts with \
                 (iseq {:#x}, pc {:#x}, jit_return {:#x}, flags {flags:#x}; control_frame, frame)",
                f.iseq, f.pc, f.jit_return
            ));
        }
        Ok(())
    }

    fn frame(&self, f: &Frame, pc_written: bool) -> Result<(), Failure> {
        let fr = &self.layout.frame;
        let [me_cref, _, flags] = self.env(f.ep)?;
        let magic = self.magic(flags)?;
        // A frame like one checked already (recursion, a loop's block) passes.
        if !self
            .seen
            .borrow_mut()
            .insert([f.iseq, f.pc, me_cref, flags, u64::from(pc_written)])
        {
            return Ok(());
        }
        if magic == fr.magic_cfunc {
            return self.method_entry(me_cref);
        }
        if magic == fr.magic_ifunc || magic == fr.magic_dummy {
            return Ok(());
        }
        let header = self.mem.header(f.iseq).ok_or_else(|| {
            Failure(format!(
                "an iseq frame's iseq {:#x} cannot be read (control_frame)",
                f.iseq
            ))
        })?;
        let Some(iseq) = self.mem.iseq(f.iseq, header) else {
            return fail(format!(
                "an iseq frame's iseq {:#x} (flags {:#x}) is not an iseq whose label and path are Strings \
                 (control_frame, iseq, imemo, string)",
                f.iseq, header.flags
            ));
        };
        let i = &self.layout.iseq;
        let expected = match magic {
            MAGIC_METHOD => Some(i.type_method),
            MAGIC_BLOCK => Some(i.type_block),
            _ => None,
        };
        if iseq.label.is_empty() || iseq.path.is_empty() || expected.is_some_and(|t| t != iseq.type_) {
            return fail(format!(
                "the iseq {:?} ({}, type {}) does not fit its frame (iseq)",
                iseq.label, iseq.path, iseq.type_
            ));
        }
        if pc_written && f.pc != 0 && (!iseq.contains(f.pc) || self.mem.line_of(&iseq, f.pc).is_none()) {
            return fail(format!(
                "the pc of {:?} ({}) is not in its code, or its line table does not cover it (iseq)",
                iseq.label, iseq.path
            ));
        }
        if magic == MAGIC_METHOD && flags & fr.env_flag_local != 0 {
            self.method_entry(me_cref)?;
        }
        Ok(())
    }

    /// A method frame's method entry (a `$~` holder in its place holds it)
    /// names its method.
    fn method_entry(&self, v: u64) -> Result<(), Failure> {
        let im = &self.layout.imemo;
        let header = |v: u64| self.mem.header(v).unwrap_or(Header { flags: 0, old: false });
        let mut me = v;
        let h = header(me);
        let kind = (h.flags >> im.type_shift) & im.type_mask;
        if h.flags & self.layout.value.type_mask == self.layout.value.t_imemo && kind == im.type_svar {
            me = self.u64_at(v + u64::from(im.svar_cref_or_me), "svar->cref_or_me")?;
        }
        let Some(entry) = self.mem.method_entry(me, header(me)) else {
            return fail(format!(
                "a method frame's method entry {me:#x} is not one (frame, imemo)"
            ));
        };
        match entry.original_id.and_then(|id| self.mem.id_name(id)) {
            Some(name) if !name.is_empty() => Ok(()),
            _ => fail(format!(
                "the method entry {me:#x} names no method (method_entry, symbols)"
            )),
        }
    }
}
