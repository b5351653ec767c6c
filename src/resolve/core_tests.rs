//! The resolver on real memory of Rubies this machine cannot run: crates.io's
//! `rbspy-testdata` ships core dumps of running Rubies (x86-64 3.1.0,
//! 3.3.0, 3.4.5, 4.0.0; ARM 3.2.0). Each core's main thread is walked as BPF
//! walks a live one (`walk.rs`, which mirrors `walk_frame`, `frame_method_entry`
//! and `prepare_frame` in bpf/rprof.bpf.c), and the resolver names the frames
//! with the layout rprof picks for that Ruby. The stacks asserted are what
//! Ruby 3.4's backtraces print for those programs: labels as Ruby 3.4 makes
//! them, lines as the programs' sources (in rbspy's repository) have them.
//! (rbspy's own tests of these cores expect lines one past each call.)

use std::mem::offset_of;
use std::rc::Rc;

use flamegraphs::{Frame, FrameKind};
use rbspy_ruby_structs as rs;
use remoteprocess::ProcessMemory;
use ruby_structs::{layout_for, Layout, RubyVersion};

use super::memory::Memory;
use super::{Resolver, Unknown};
use crate::address_space::AddressSpace;
use crate::bpf::types;
use crate::gc_time::{Reading, SampleTime};
use crate::target::GlobalSymbols;

const PAGE: u64 = 4096;

/// A core dump: memory that never changes.
struct Core(rbspy_testdata::CoreDump);

impl AddressSpace for Core {
    /// Page by page: the core holds each mapping as a section of its own,
    /// and `CoreDump` reads within one.
    fn read(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            let at = addr + done as u64;
            let n = ((PAGE - at % PAGE) as usize).min(buf.len() - done);
            ProcessMemory::read(&self.0, at as usize, &mut buf[done..done + n])
                .map_err(|e| std::io::Error::other(e.to_string()))?;
            done += n;
        }
        Ok(())
    }

    fn is_still(&self) -> bool {
        true
    }
}

/// One core: the Ruby it holds, where `ruby_current_vm_ptr` and
/// `ruby_global_symbols` are (from rbspy's tests), and the offset of
/// `vm->ractor.main_thread` in that Ruby's `rb_vm_t`.
struct Dump {
    core: fn() -> rbspy_testdata::CoreDump,
    version: &'static str,
    vm_ptr: u64,
    global_symbols: u64,
    main_thread: usize,
    /// What differs from x86-64 in a core of another machine.
    arch: fn(&mut Layout),
}

/// An x86-64 core: rprof's layout as it is.
fn x86_64(_: &mut Layout) {}

/// The memory of `dump` read with rprof's layout for its Ruby, and its main
/// thread's frames as BPF sends them.
fn open(dump: &Dump) -> (Memory, Vec<types::rprof_frame>) {
    let mut layout = layout_for(RubyVersion::parse(dump.version).expect("a version")).expect("a layout");
    (dump.arch)(&mut layout);
    let space: Rc<dyn AddressSpace> = Rc::new(Core((dump.core)()));
    let word = |at: u64| space.read_u64(at).expect("the core holds it");
    let vm = word(dump.vm_ptr);
    let th = word(vm + dump.main_thread as u64);
    let ec = word(th + u64::from(layout.thread.ec));
    let frames = super::walk::frames(&*space, &layout, ec).expect("the core holds the frames");
    let memory = Memory::new(space, layout, GlobalSymbols::at(dump.global_symbols)).with_vm_ptr(dump.vm_ptr);
    (memory, frames)
}

/// The iseq of the block frame `block_in_main` (leaf first) has the root
/// frame's iseq (`<main>`) as its parent and its local iseq.
fn assert_block_of_main(dump: &Dump, block_in_main: usize) {
    let (memory, frames) = open(dump);
    let block = frames[block_in_main].iseq;
    let header = memory.header(block).expect("an object");
    let iseq = memory.iseq(block, header).expect("an iseq");
    let main = frames.last().expect("frames").iseq;
    assert_eq!(&*iseq.label, "block in <main>");
    assert_eq!((iseq.parent, iseq.local), (main, main), "{iseq:?}");
}

/// The main thread's stack in `dump`, named, root first, as "label path:line".
fn named_stack(dump: &Dump) -> Vec<String> {
    let (memory, frames) = open(dump);
    let mut resolver = Resolver::with_memory(memory, None, None);
    resolver
        .stack(&frames, SampleTime::at(Reading::STILL.time))
        .into_iter()
        .rev()
        .filter(|f| *f != Err(Unknown::NotAFrame))
        .map(|f| match f {
            Ok(Frame {
                kind: FrameKind::Code,
                name,
                file,
                line,
            }) => format!("{name} {}:{}", file.unwrap_or_default(), line.unwrap_or(0)),
            Ok(frame) => frame.name.to_string(),
            Err(e) => format!("[unknown: {e}]"),
        })
        .collect()
}

/// Every frame of `dump`'s stack named as the leaf (the frames above it
/// cut off) as in the whole stack: a frame Ruby has entered is never taken
/// for one it is still pushing (`Resolver::entered`), whatever its kind.
/// And a leaf method frame whose method-entry slot holds what it can hold
/// while Ruby pushes it (a Fixnum the stack held there, another method's
/// entry) is left out. Returns the frames checked that way.
fn assert_leaves(dump: &Dump) -> usize {
    let (memory, frames) = open(dump);
    let layout = memory.layout().clone();
    let mut resolver = Resolver::with_memory(memory, None, None);
    let still = SampleTime::at(Reading::STILL.time);
    let whole = resolver.stack(&frames, still);
    for k in 0..frames.len() {
        let cut = resolver.stack(&frames[k..], still);
        assert_eq!(cut[0], whole[k], "frame {k} as the leaf");
    }
    // Named frames of Ruby methods, leaf first.
    let methods: Vec<usize> = (0..frames.len())
        .filter(|&k| frames[k].iseq != 0 && whole[k].is_ok())
        .filter(|&k| {
            let header = resolver.memory.header(frames[k].iseq);
            header
                .and_then(|h| resolver.memory.iseq(frames[k].iseq, h))
                .is_some_and(|i| i.type_ == layout.iseq.type_method)
        })
        .collect();
    let mut checked = 0;
    for (i, &k) in methods.iter().enumerate() {
        // Another method's entry: one that runs other code.
        let Some(&other) = methods[i..].iter().find(|&&o| frames[o].iseq != frames[k].iseq) else {
            continue;
        };
        let mut pushed = frames[k..].to_vec();
        for slot in [0x1771, frames[other].cme] {
            pushed[0].cme = slot;
            let cut = resolver.stack(&pushed, still);
            assert_eq!(
                cut[0],
                Err(Unknown::NotAFrame),
                "frame {k} with {slot:#x} for its method entry"
            );
            assert_eq!(cut[1..], whole[k + 1..], "the frames under {k}");
            checked += 1;
        }
    }
    checked
}

/// `"label path:line"` of a Ruby frame.
fn at(label: &str, path: &str, line: u32) -> String {
    format!("{label} {path}:{line}")
}

/// What a core cannot name: `<main>`'s label is a literal in the Ruby
/// binary's read-only data, which a core leaves out (a live process has
/// it), and a block's label needs its method's.
const NOT_IN_CORE: &str = "[unknown: unreadable]";

/// rbspy's `infinite.rb` (3.1.0): Ruby prints infinite.rb:2:in 'Object#aaa'.
/// (rbspy's own test expects lines 3, 7, 11: one past the call.)
#[test]
fn ruby_3_1_0_core() {
    let dump = Dump {
        core: rbspy_testdata::coredump_3_1_0,
        version: "3.1.0",
        vm_ptr: 0x7f0dc0c83c58,
        global_symbols: 0x7f0dc0c75e80,
        main_thread: offset_of!(rs::ruby_3_1_0::rb_vm_struct, ractor.main_thread),
        arch: x86_64,
    };
    let path = "/home/acj/workspace/rbspy/ci/ruby-programs/infinite.rb";
    let expected = [
        NOT_IN_CORE.to_string(),
        "Kernel#loop".to_string(),
        NOT_IN_CORE.to_string(),
        at("Object#ccc", path, 10),
        at("Object#bbb", path, 6),
        at("Object#aaa", path, 2),
        "Kernel#sleep".to_string(),
    ];
    assert_eq!(named_stack(&dump), expected);
    assert!(assert_leaves(&dump) >= 4);
    assert_block_of_main(&dump, 4);
}

/// Ruby 3.2's class names, found through object shapes (`Object#aaa`,
/// `Kernel#loop`), on the only 3.2 memory there is: rbspy's 3.2.0 core is of
/// an ARM (aarch64) Ruby. Every struct rprof reads has the same layout there
/// (both are LP64 and align alike) except `rb_vm_t`, where two pthread
/// mutexes (48 bytes on aarch64, 40 on x86-64: glibc's sysdeps) come before
/// `shape_list`. Otherwise as on 3.1.0's core (the same program).
#[test]
fn ruby_3_2_0_core_of_an_arm_ruby() {
    fn aarch64(l: &mut Layout) {
        let shapes = l.shapes.as_mut().expect("3.2 has shapes");
        shapes.vm_shape_list += 2 * (48 - 40);
    }
    let dump = Dump {
        core: rbspy_testdata::coredump_3_2_0,
        version: "3.2.0",
        vm_ptr: 0xffffb8034578,
        global_symbols: 0xffffb8025340,
        main_thread: offset_of!(rs::ruby_3_2_0::rb_vm_struct, ractor.main_thread),
        arch: aarch64,
    };
    let path = "/home/parallels/rbspy/ci/ruby-programs/infinite.rb";
    let expected = [
        at("<main>", path, 13),
        "Kernel#loop".to_string(),
        at("block in <main>", path, 14),
        at("Object#ccc", path, 10),
        at("Object#bbb", path, 6),
        at("Object#aaa", path, 2),
        "Kernel#sleep".to_string(),
    ];
    assert_eq!(named_stack(&dump), expected);
    assert!(assert_leaves(&dump) >= 4);
}

/// rbspy's `infinite_on_cpu.rb`, as on every Ruby from 3.3: Kernel#loop is
/// written in Ruby (`<internal:kernel>`; Ruby 3.3.8 prints line 187 too).
fn infinite_on_cpu(main: &str, block: &str, kernel_loop: u32) -> Vec<String> {
    let path = "/home/runner/work/rbspy/rbspy/ci/ruby-programs/infinite_on_cpu.rb";
    vec![
        main.replace("PATH", path),
        at("Kernel#loop", "<internal:kernel>", kernel_loop),
        block.replace("PATH", path),
        at("Object#ccc", path, 16),
        at("Object#bbb", path, 12),
        at("Object#aaa", path, 8),
        "Kernel#sleep".to_string(),
    ]
}

#[test]
fn ruby_3_3_0_core() {
    let dump = Dump {
        core: rbspy_testdata::coredump_3_3_0,
        version: "3.3.0",
        vm_ptr: 0x7f43435f4988,
        global_symbols: 0x7f43435e3c60,
        main_thread: offset_of!(rs::ruby_3_3_0::rb_vm_struct, ractor.main_thread),
        arch: x86_64,
    };
    let expected = infinite_on_cpu("<main> PATH:19", "block in <main> PATH:20", 187);
    assert_eq!(named_stack(&dump), expected);
    assert!(assert_leaves(&dump) >= 4);
}

/// Class paths: nested (`B::Ab`, `C::Cb`) and a block in a method.
#[test]
fn ruby_3_3_0_core_with_classes() {
    let dump = Dump {
        core: rbspy_testdata::coredump_with_classes_3_3_0,
        version: "3.3.0",
        vm_ptr: 0x7f58cb7f4988,
        global_symbols: 0x7f58cb7e3c60,
        main_thread: offset_of!(rs::ruby_3_3_0::rb_vm_struct, ractor.main_thread),
        arch: x86_64,
    };
    let path = "/home/runner/work/rbspy/rbspy/ci/ruby-programs/infinite_on_cpu_with_classes.rb";
    let expected = [
        NOT_IN_CORE.to_string(),
        at("Object#looper", path, 30),
        at("Kernel#loop", "<internal:kernel>", 187),
        at("block in Object#looper", path, 31),
        at("C::Cb#ccc", path, 24),
        at("B::Ab#bbb", path, 16),
        at("A#aaa", path, 9),
        "Kernel#sleep".to_string(),
    ];
    assert_eq!(named_stack(&dump), expected);
    assert!(assert_leaves(&dump) >= 4);
}

/// rbspy's `cme_complex_labels.rb` over `interesting_backtrace_helper.rb`:
/// modules, singleton methods, refinements, anonymous classes (a method of
/// a class with no permanent name is its bare name, as Ruby 3.4 prints it),
/// `method_missing`, `bind_call`, `define_method`, blocks nested in blocks,
/// `eval` (its frame named after the method that called it, as Ruby 3.4
/// names it) and `instance_eval` of a string. Every line is the one in those
/// files' source; Ruby 3.4.11 prints the same lines for Kernel#loop (168)
/// and Integer#times (257).
#[test]
fn ruby_3_4_5_core() {
    let dump = Dump {
        core: rbspy_testdata::coredump_complex_3_4_5,
        version: "3.4.5",
        vm_ptr: 0x7f271feb5390,
        global_symbols: 0x7f271fea3dc0,
        main_thread: offset_of!(rs::ruby_3_4_5::rb_vm_struct, ractor.main_thread),
        arch: x86_64,
    };
    let main = "/home/runner/work/rbspy/rbspy/ci/ruby-programs/cme_complex_labels.rb";
    let h = "/home/runner/work/rbspy/rbspy/ci/ruby-programs/interesting_backtrace_helper.rb";
    let eval_at = |line: u32| format!("(eval at {h}:{line})");
    let expected = [
        at("<main>", main, 24),
        at("Kernel#loop", "<internal:kernel>", 168),
        at("block in <main>", main, 25),
        at("Object#work_main", main, 21),
        at("ModuleMethod#call_instance", main, 11),
        at("InstanceMethod#work", main, 5),
        at("Object#top_level_hello", h, 206),
        at("block (2 levels) in <top (required)>", h, 199),
        at("Integer#times", "<internal:numeric>", 257),
        at("block (3 levels) in <top (required)>", h, 200),
        at("ClassM#hello", h, 193),
        "Kernel#eval".to_string(),
        at("ClassM#hello", &eval_at(193), 1),
        at("ClassL#hello", h, 187),
        "BasicObject#instance_eval".to_string(),
        at("ClassL#hello", &eval_at(187), 1),
        at("ClassK#hello", h, 181),
        "Kernel#eval".to_string(),
        at("ClassK#hello", h, 181),
        at("ClassJ#hello", h, 171),
        at("ClassJ#hello_helper", h, 167),
        at("block in ClassJ#hello", h, 172),
        at("ClassJ#hello_helper", h, 167),
        at("block (2 levels) in ClassJ#hello", h, 173),
        at("Object#method_with_complex_parameters", h, 162),
        at("hello", h, 157),
        at("hello", h, 151),
        at("hello", h, 146),
        at("block (2 levels) in <top (required)>", h, 139),
        at("ClassF#hello", h, 131),
        at("Integer#times", "<internal:numeric>", 257),
        at("block in ClassF#hello", h, 132),
        at("ClassH#method_missing", h, 125),
        at("ModuleE.hello", h, 117),
        at("hello", h, 104),
        "UnboundMethod#bind_call".to_string(),
        at("ClassE#hello", h, 89),
        at("hello", h, 84),
        at("block in <top (required)>", h, 77),
        at("block in <top (required)>", h, 75),
        at("ModuleD#hello", h, 67),
        at("ClassWithStaticMethod.hello", h, 61),
        at("ModuleC.hello", h, 55),
        at("ModuleB::ClassB#hello", h, 48),
        at("ClassA#hello", h, 39),
        at("Kernel#loop", "<internal:kernel>", 168),
        at("block in ClassA#hello", h, 40),
        "Kernel#sleep".to_string(),
    ];
    assert_eq!(named_stack(&dump), expected);
    assert!(assert_leaves(&dump) >= 4);
}

/// Ruby 4.0: the classext at klass+24 (`Object#aaa`, `Kernel#loop`), the
/// symbol table as 4.0 lays it out (every method name is read through it),
/// and the iseq's parent and local iseq at 168/176 (the block's label, whose
/// method's is not in the core, is checked through those).
#[test]
fn ruby_4_0_0_core() {
    let dump = Dump {
        core: rbspy_testdata::coredump_4_0_0,
        version: "4.0.0",
        vm_ptr: 0x7fa56b875738,
        global_symbols: 0x7fa56b862b50,
        main_thread: offset_of!(rs::ruby_4_0_0::rb_vm_struct, ractor.main_thread),
        arch: x86_64,
    };
    let expected = infinite_on_cpu(NOT_IN_CORE, NOT_IN_CORE, 169);
    assert_eq!(named_stack(&dump), expected);
    assert!(assert_leaves(&dump) >= 4);
    assert_block_of_main(&dump, 4);
}
