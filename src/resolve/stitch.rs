//! One stack from a sample's Ruby frames and native frames, in the order the
//! program ran them: native frames from the thread's start down to where it
//! entered the interpreter, the Ruby frames that interpreter call runs, the
//! native frames under a C method, Ruby frames again where that C code
//! called back into Ruby, and so on.
//!
//! Ruby marks the first frame each native call into the interpreter
//! (`rb_vm_exec`) runs with `VM_FRAME_FLAG_FINISH`. So, from the leaf, the
//! Ruby frames up to and including the first such frame are run by the
//! innermost `rb_vm_exec` frame of the native stack, the next batch by the
//! next one out, and so on: batches pair with interpreter entries from the
//! leaf, so a native stack cut short still stitches its leaf end right. A C
//! method sits on the native frame of its own function (`def->body.cfunc.func`,
//! matched against where each native function starts), which it stands for.
//!
//! The interpreter's own frames are folded away unless `all` is set: the
//! entries themselves, what runs between an entry and the first C method it
//! calls (the interpreter loop, the call plumbing), and the way back in from
//! C code (`rb_yield`, `rb_funcall` and what they call down to the next
//! entry). Without symbols (Debian strips libruby's local ones) that
//! plumbing is recognised by where it is: unnamed code of the VM's file
//! right after an entry or right before the next one.

use flamegraphs::Frame;

/// A Ruby frame of the sample, named.
#[derive(Debug, Clone)]
pub struct RubyFrame {
    /// None: a frame Ruby does not show (a block written in C).
    pub frame: Option<Frame>,
    /// The first frame a native call into the interpreter ran.
    pub finish: bool,
    /// A C method: where its function is, (file, vaddr), when known.
    pub cfunc: Option<Option<(u32, u64)>>,
}

/// A native frame of the sample, named and classified.
#[derive(Debug, Clone)]
pub struct NativeFrame {
    pub frame: Frame,
    pub file: u32,
    /// Where its function starts (vaddr of `file`).
    pub start: Option<u64>,
    /// A symbol names it.
    pub named: bool,
    /// The interpreter's plumbing, by name.
    pub plumbing: bool,
    /// In the VM's own ELF file (libruby or the ruby executable).
    pub in_vm: bool,
    /// An entry into the interpreter (`rb_vm_exec`).
    pub entry: bool,
}

impl NativeFrame {
    /// Interpreter code, by name or, unnamed, by being the VM's.
    fn vm_internal(&self) -> bool {
        self.plumbing || (self.in_vm && !self.named)
    }
}

/// The stack, root first. `complete`: the native stack reached the
/// thread's first frame; otherwise `stopped` marks where it ended.
///
/// Batches and entries pair from the root when the native stack is whole
/// (the only mismatches are at the leaf, where the interpreter is between
/// pushing a frame and entering it, or leaving it), from the leaf when it
/// was cut; a neighbouring pairing wins only if it places more C methods on
/// their own functions.
pub fn stitch(
    ruby: &[RubyFrame],
    native: &[NativeFrame],
    complete: bool,
    stopped: Option<Frame>,
    all: bool,
) -> Vec<Frame> {
    let mut out = Vec::with_capacity(ruby.len() + native.len() + 1);
    if native.is_empty() {
        out.extend(ruby.iter().rev().filter_map(|r| r.frame.clone()));
        out.extend(stopped);
        return out;
    }
    // Batches root first, each leaf first and ending with its FINISH frame.
    let mut batches: Vec<Vec<&RubyFrame>> = Vec::new();
    let mut batch = Vec::new();
    for r in ruby {
        batch.push(r);
        if r.finish {
            batches.push(std::mem::take(&mut batch));
        }
    }
    if !batch.is_empty() {
        batches.push(batch);
    }
    batches.reverse();
    // Entries root first; segs[j] (leaf first) is what entries[j] called;
    // `root` (leaf first) ran before the first entry.
    let mut segs: Vec<Vec<&NativeFrame>> = Vec::new();
    let mut entries: Vec<&NativeFrame> = Vec::new();
    let mut seg = Vec::new();
    for n in native {
        if n.entry {
            segs.push(std::mem::take(&mut seg));
            entries.push(n);
        } else {
            seg.push(n);
        }
    }
    let root = seg;
    segs.reverse();
    entries.reverse();
    let (k, m) = (entries.len() as isize, batches.len() as isize);
    if k == 0 {
        out.extend(stopped.filter(|_| !complete));
        let all_ruby: Vec<&RubyFrame> = ruby.iter().collect();
        emit(&mut out, &all_ruby, &root, true, all);
        return out;
    }
    // batch a runs in entry a + e.
    let natural = if complete { 0 } else { k - m };
    let score = |e: isize| -> usize {
        (0..m)
            .filter(|a| (0..k).contains(&(a + e)))
            .map(|a| placed(&batches[a as usize], &segs[(a + e) as usize]))
            .sum()
    };
    let mut e = natural;
    let mut best = score(natural);
    for d in [-1, 1, -2, 2] {
        let s = score(natural + d);
        if s > best {
            (e, best) = (natural + d, s);
        }
    }
    if !complete {
        out.extend(stopped);
    }
    // Batches above the first entry, then what ran before it.
    for a in 0..m.min(-e).max(0) {
        out.extend(batches[a as usize].iter().rev().filter_map(|r| r.frame.clone()));
    }
    let root_first: Vec<&NativeFrame> = root.iter().rev().copied().collect();
    push_gap(&mut out, &root_first, true, all);
    let end = k.max(m + e);
    for v in 0..end {
        let b: &[&RubyFrame] = if (0..m).contains(&(v - e)) {
            &batches[(v - e) as usize]
        } else {
            &[]
        };
        let s: &[&NativeFrame] = if v < k { &segs[v as usize] } else { &[] };
        if all && v < k {
            out.push(entries[v as usize].frame.clone());
        }
        emit(&mut out, b, s, v >= k - 1, all);
    }
    out
}

/// How many C methods of `batch` sit on a function of `seg`.
fn placed(batch: &[&RubyFrame], seg: &[&NativeFrame]) -> usize {
    batch
        .iter()
        .filter_map(|r| r.cfunc.flatten())
        .filter(|&(file, start)| seg.iter().any(|n| n.file == file && n.start == Some(start)))
        .count()
}

/// One interpreter call: its Ruby frames (leaf first) and the native
/// frames it called (leaf first); `leaf`: no further entry follows.
fn emit(out: &mut Vec<Frame>, batch: &[&RubyFrame], seg: &[&NativeFrame], leaf: bool, all: bool) {
    let seg: Vec<&NativeFrame> = seg.iter().rev().copied().collect();
    let mut pos = 0;
    let mut first_cfunc = true;
    for r in batch.iter().rev() {
        let Some(cfunc) = r.cfunc else {
            out.extend(r.frame.clone());
            continue;
        };
        let found = cfunc.and_then(|(file, start)| {
            seg[pos..]
                .iter()
                .position(|n| n.file == file && n.start == Some(start))
                .map(|j| pos + j)
        });
        match found {
            Some(j) => {
                // The interpreter calling its first C method is all plumbing;
                // a later one was called back from the C code before it.
                if !first_cfunc || all {
                    push_gap(out, &seg[pos..j], true, all);
                }
                out.extend(r.frame.clone());
                if all {
                    out.push(seg[j].frame.clone());
                }
                pos = j + 1;
            }
            None => {
                if first_cfunc && !all {
                    while pos < seg.len() && seg[pos].vm_internal() {
                        pos += 1;
                    }
                }
                out.extend(r.frame.clone());
            }
        }
        first_cfunc = false;
    }
    // No C method: the first frame the entry called is the interpreter loop.
    if first_cfunc && !all && seg.get(pos).is_some_and(|n| n.in_vm && n.vm_internal()) {
        pos += 1;
    }
    push_gap(out, &seg[pos.min(seg.len())..], !leaf, all);
}

/// Native frames (root first) that ran between two Ruby frames; `reentry`:
/// the last of them called back into the interpreter, so their tail of
/// interpreter code is plumbing.
fn push_gap(out: &mut Vec<Frame>, frames: &[&NativeFrame], reentry: bool, all: bool) {
    if all {
        out.extend(frames.iter().map(|n| n.frame.clone()));
        return;
    }
    let mut end = frames.len();
    if reentry {
        while end > 0 && frames[end - 1].vm_internal() {
            end -= 1;
        }
    }
    out.extend(
        frames[..end]
            .iter()
            .filter(|n| !n.plumbing)
            .map(|n| n.frame.clone()),
    );
}

/// Whether a native function is the interpreter's plumbing between Ruby
/// frames: entering the VM, calling methods and blocks, and C code's ways
/// back in (`rb_yield`, `rb_funcall`...). Compiler suffixes are ignored.
pub fn is_plumbing(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "vm_exec",
        "vm_call",
        "vm_sendish",
        "vm_invoke",
        "vm_yield",
        "vm_callee_setup",
        "invoke_block",
        "invoke_iseq_block",
        "invoke_bmethod",
        "rb_vm_exec",
        "rb_vm_invoke",
        "rb_vm_call",
        "rb_call0",
        "rb_funcall",
        "rb_yield",
        "rb_block_call",
        "rb_iterate",
        "rb_proc_call",
        "rb_iseq_eval",
        "rb_ensure",
        "rb_protect",
        "rb_rescue",
        "rb_vrescue",
        "rb_catch",
        "rb_check_funcall",
        "rb_method_call",
        "ractor_safe_call_cfunc",
        "call_cfunc_",
        "iterate_method",
        "jit_exec",
    ];
    let base = name.split('.').next().unwrap_or(name);
    base == "rb_call" || PREFIXES.iter().any(|p| base.starts_with(p))
}

/// Whether a kernel function is the tracing machinery that took the sample
/// (cut from the leaf end of kernel stacks).
pub fn is_kernel_tracing(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "bpf_",
        "__bpf",
        "perf_",
        "__perf",
        "trace_call_bpf",
        "__traceiter",
        "__do_trace",
        "trace_event",
        "__trace_",
        "__x64_sys_trace",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ruby(name: &str, finish: bool) -> RubyFrame {
        RubyFrame {
            frame: Some(Frame::code(name, "a.rb", 1)),
            finish,
            cfunc: None,
        }
    }
    fn cmethod(name: &str, at: u64) -> RubyFrame {
        RubyFrame {
            frame: Some(Frame::cmethod(name)),
            finish: false,
            cfunc: Some(Some((2, at))),
        }
    }
    fn native(name: Option<&str>, file: u32, start: u64) -> NativeFrame {
        let label = name.map_or(format!("lib+{start:#x}"), str::to_string);
        NativeFrame {
            frame: Frame::native_code(label),
            file,
            start: Some(start),
            named: name.is_some(),
            plumbing: name.is_some_and(is_plumbing),
            in_vm: file == 1,
            entry: name == Some("rb_vm_exec"),
        }
    }
    fn names(frames: &[Frame]) -> Vec<&str> {
        frames.iter().map(|f| &*f.name).collect()
    }

    /// An extension method calling a -> b -> c, Ruby -> C -> Ruby through a
    /// block, on a stripped libruby (file 1), leaf first.
    #[test]
    fn stripped_vm_ext_method_and_yield() {
        let ruby = [
            ruby("block in caller", true),
            cmethod("Ext.each", 0x10),
            ruby("caller", false),
            ruby("<main>", true),
        ];
        let native = [
            native(None, 1, 0x900), // interpreter loop running the block
            native(Some("rb_vm_exec"), 1, 0x800),
            native(None, 1, 0x700), // invoke_block_from_c, stripped
            native(Some("rb_yield"), 1, 0x600),
            native(Some("helper"), 2, 0x20),
            native(Some("ext_each"), 2, 0x10),
            native(None, 1, 0x500), // vm_call_cfunc_with_frame, stripped
            native(None, 1, 0x900), // interpreter loop
            native(Some("rb_vm_exec"), 1, 0x800),
            native(None, 1, 0x400), // rb_ec_exec_node, stripped
            native(Some("ruby_run_node"), 1, 0x300),
            native(Some("main"), 3, 0x100),
        ];
        let out = stitch(&ruby, &native, true, None, false);
        assert_eq!(
            names(&out),
            [
                "main",
                "ruby_run_node",
                "<main>",
                "caller",
                "Ext.each",
                "helper",
                "block in caller"
            ]
        );
        let all = stitch(&ruby, &native, true, None, true);
        assert_eq!(
            all.len(),
            native.len() + ruby.len(),
            "every frame, the C method beside its function"
        );
    }

    /// A sample inside a C method's callees, the native stack cut by a JIT frame.
    #[test]
    fn cut_native_stack_keeps_its_leaf_end() {
        let ruby = [
            cmethod("Ext.burn", 0x10),
            ruby("caller", false),
            ruby("<main>", true),
        ];
        let native = [
            native(Some("c"), 2, 0x40),
            native(Some("b"), 2, 0x30),
            native(Some("a"), 2, 0x20),
            native(Some("ext_burn"), 2, 0x10),
            NativeFrame {
                frame: Frame::native_code("[JIT code]"),
                file: 0,
                start: None,
                named: false,
                plumbing: false,
                in_vm: false,
                entry: false,
            },
        ];
        let out = stitch(&ruby, &native, false, Some(Frame::marker("[stopped]")), false);
        assert_eq!(
            names(&out),
            ["[stopped]", "<main>", "caller", "Ext.burn", "a", "b", "c"]
        );
    }

    /// A leaf in the GC, called from an allocation in a Ruby method.
    #[test]
    fn native_work_under_a_ruby_leaf() {
        let ruby = [ruby("alloc", false), ruby("<main>", true)];
        let native = [
            native(None, 1, 0xa00), // gc_marks, stripped
            native(Some("rb_gc_mark"), 1, 0xb00),
            native(None, 1, 0x900), // interpreter loop
            native(Some("rb_vm_exec"), 1, 0x800),
            native(Some("main"), 3, 0x100),
        ];
        let out = stitch(&ruby, &native, true, None, false);
        assert_eq!(
            names(&out),
            ["main", "<main>", "alloc", "rb_gc_mark", "lib+0xa00"]
        );
    }

    /// A sample just after a block's frame was popped, before its
    /// interpreter call returned: one entry more than batches, at the leaf.
    #[test]
    fn leaf_entry_without_its_frame() {
        let ruby = [
            cmethod("Integer#times", 0x30),
            ruby("block in yielder", true),
            cmethod("Ext.each", 0x10),
            ruby("yielder", false),
            ruby("<main>", true),
        ];
        let native = [
            native(None, 1, 0x900), // the interpreter, leaving the block
            native(Some("rb_vm_exec"), 1, 0x800),
            native(None, 1, 0x700),
            native(None, 1, 0x30), // int_dotimes
            native(None, 1, 0x500),
            native(None, 1, 0x900),
            native(Some("rb_vm_exec"), 1, 0x800),
            native(Some("rb_yield"), 1, 0x600),
            native(Some("ext_each"), 2, 0x10),
            native(None, 1, 0x500),
            native(None, 1, 0x900),
            native(Some("rb_vm_exec"), 1, 0x800),
            native(Some("main"), 3, 0x100),
        ];
        let mut times = cmethod("Integer#times", 0x30);
        times.cfunc = Some(Some((1, 0x30)));
        let ruby = [
            times,
            ruby[1].clone(),
            ruby[2].clone(),
            ruby[3].clone(),
            ruby[4].clone(),
        ];
        let want = [
            "main",
            "<main>",
            "yielder",
            "Ext.each",
            "block in yielder",
            "Integer#times",
        ];
        assert_eq!(names(&stitch(&ruby, &native, true, None, false)), want);
        // Cut below main: paired from the leaf, the C methods still decide.
        let cut = &native[..native.len() - 1];
        let out = stitch(&ruby, cut, false, Some(Frame::marker("[stopped]")), false);
        assert_eq!(names(&out)[1..], want[1..]);
    }

    #[test]
    fn plumbing_names() {
        assert!(is_plumbing("vm_call_cfunc_with_frame.isra.0"));
        assert!(is_plumbing("rb_yield_values2"));
        assert!(is_plumbing("rb_call"));
        assert!(!is_plumbing("rb_call_super"));
        assert!(!is_plumbing("rb_ary_sort_bang"));
        assert!(!is_plumbing("gc_marks"));
    }
}
