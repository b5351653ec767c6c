//! --native and --kernel: native frames unwound in BPF and stitched with the
//! Ruby frames, on every Ruby of the per-Ruby suite (Debian's, without frame
//! pointers; source builds with full symbol tables; one with frame pointers
//! everywhere; YJIT), on a C extension built by each Ruby's own mkmf at
//! `-O2 -fomit-frame-pointer` (tests/ruby/native_ext) and on Ruby's own C
//! code: Array#sort, the GC, File.exist? with the GVL released.

use crate::common;

use common::{attach, label, record, signal, Folded, Ruby, Run};

/// `ruby native.rb PHASE EXT_DIR`, recorded at 499 Hz with --native and
/// `extra` until it has used 3 s of CPU (a fixed 3 s gave 347 samples,
/// against the 500 some tests need, beside the other lane and two CPU-bound
/// programs).
fn record_native(r: &Ruby, phase: &str, extra: &[&str]) -> Run {
    record_native_with_env(r, phase, extra, &[])
}

fn record_native_with_env(r: &Ruby, phase: &str, extra: &[&str], env: &[(&str, &str)]) -> Run {
    let dir = r.build_native_ext();
    let target = r.spawn("native.rb", &[phase, &dir]);
    let mut args = vec!["-F", "499", "--native"];
    args.extend_from_slice(extra);
    let run = common::record_cpu(&format!("Ruby {}", r.name), target.pid, (&args, env), 3.0);
    assert_eq!(run.summary("failed"), 0, "Ruby {}: {}", r.name, run.stderr);
    run
}

/// A stack's frames as labels (Ruby frames without their location).
fn labels(stack: &[String]) -> Vec<&str> {
    stack.iter().map(|f| label(f)).collect()
}

/// Whether `seq` appears in `stack`, frame after frame.
fn has_run(stack: &[&str], seq: &[&str]) -> bool {
    stack.windows(seq.len()).any(|w| w == seq)
}

/// (samples whose stack has a frame labelled `frame`, those of them `ok` holds for).
fn share(folded: &Folded, frame: &str, ok: impl Fn(&[&str]) -> bool) -> (u64, u64) {
    let mut total = 0;
    let mut good = 0;
    for (stack, n) in &folded.stacks {
        let l = labels(stack);
        if l.contains(&frame) {
            total += n;
            if ok(&l) {
                good += n;
            }
        }
    }
    (total, good)
}

fn assert_share(r: &Ruby, run: &Run, what: &str, (total, good): (u64, u64), min_total: u64, min: f64) {
    let worst: Vec<String> = run
        .folded
        .stacks
        .iter()
        .filter(|(_, n)| *n > 2)
        .take(8)
        .map(|(s, n)| format!("{n} {}", s.join(";")))
        .collect();
    assert!(
        total >= min_total && good as f64 >= min * total as f64,
        "Ruby {}: {what}: {good} of {total} samples: {}\n{}",
        r.name,
        run.stderr,
        worst.join("\n")
    );
}

/// Whether the native stacks of Ruby `r` are whole: YJIT's code keeps no
/// frame pointer (without --yjit-perf), so they stop there.
fn whole(r: &Ruby) -> bool {
    !r.name.contains("yjit") || r.name.contains("perf")
}

/// The native part begins at the thread's start: the main thread's
/// `_start`, down to `ruby_run_node`, before its first Ruby frame.
fn starts_at_main(stack: &[&str]) -> bool {
    let first_ruby = stack.iter().position(|f| f.starts_with("<main>")).unwrap_or(0);
    stack.get(1) == Some(&"_start_[n]") && stack[..first_ruby].contains(&"ruby_run_node_[n]")
}

const BURN: [&str; 5] = [
    "Object#burner",
    "RprofNative.burn",
    "rprof_a_[n]",
    "rprof_b_[n]",
    "rprof_c_[n]",
];
const YIELD: [&str; 4] = [
    "Object#yielder",
    "RprofNative.yield_each",
    "rprof_yielder_[n]",
    "block in Object#yielder",
];

/// The extension's a -> b -> c under its method under its Ruby caller, and
/// Ruby -> C -> native -> Ruby through a block, each exactly in that order;
/// the native part from the process's start.
fn check_ext(r: &Ruby) {
    if r.name.contains("yjit") {
        return check_ext_yjit(r);
    }
    let run = record_native(r, "ext", &[]);
    let burn = share(&run.folded, "rprof_c_[n]", |s| s.ends_with(&BURN));
    assert_share(r, &run, "burner -> burn -> a -> b -> c", burn, 50, 0.95);
    let yields = share(&run.folded, "block in Object#yielder", |s| has_run(s, &YIELD));
    assert_share(
        r,
        &run,
        "yielder -> yield_each -> rprof_yielder -> block",
        yields,
        50,
        0.95,
    );
    let rooted = run
        .folded
        .stacks
        .iter()
        .filter(|(s, _)| starts_at_main(&labels(s)))
        .map(|(_, n)| n)
        .sum();
    let total = run.folded.total();
    assert_share(
        r,
        &run,
        "native root _start .. ruby_run_node",
        (total, rooted),
        500,
        0.95,
    );
    assert!(
        !run.stderr.contains("stopped early"),
        "Ruby {}: every native stack whole: {}",
        r.name,
        run.stderr
    );
}

/// YJIT's code keeps no frame pointer unless Ruby runs with --yjit-perf:
/// then the stacks are whole, as without YJIT; without it the native part
/// stops at the JIT code, marked and counted, its leaf end still exact.
fn check_ext_yjit(r: &Ruby) {
    let run = record_native(r, "ext", &[]);
    let burn = share(&run.folded, "rprof_c_[n]", |s| s.ends_with(&BURN));
    assert_share(
        r,
        &run,
        "burner -> burn -> a -> b -> c (default YJIT)",
        burn,
        50,
        0.95,
    );
    let marked = share(&run.folded, "rprof_c_[n]", |s| {
        s[1] == "[native unwind stopped: JIT code]"
    });
    assert_share(r, &run, "JIT code marked", marked, 50, 0.95);
    assert!(run.stderr.contains(" JIT code"), "counted: {}", run.stderr);

    let mut perf = r.clone();
    perf.env = vec![("RUBYOPT".into(), "--yjit --yjit-perf".into())];
    perf.name = format!("{} --yjit-perf", r.name);
    let run = record_native(&perf, "ext", &[]);
    let burn = share(&run.folded, "rprof_c_[n]", |s| {
        s.ends_with(&BURN) && starts_at_main(s)
    });
    assert_share(&perf, &run, "whole burner -> burn -> a -> b -> c", burn, 50, 0.95);
    let yields = share(&run.folded, "block in Object#yielder", |s| has_run(s, &YIELD));
    assert_share(
        &perf,
        &run,
        "yielder -> yield_each -> rprof_yielder -> block",
        yields,
        50,
        0.95,
    );
    // --yjit-perf writes /tmp/perf-PID.map for perf; leave no litter.
    for entry in std::fs::read_dir("/tmp").expect("/tmp").flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().starts_with("perf-") && name.to_string_lossy().ends_with(".map") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Array#sort's native frames under the Array#sort frame (its own function,
/// rb_ary_sort, folded into it).
fn check_sort(r: &Ruby) {
    let run = record_native(r, "sort", &[]);
    let sorted = share(&run.folded, "Array#sort", |s| {
        has_run(s, &["Object#sorter", "Array#sort", "rb_ary_sort_bang_[n]"])
            && (!whole(r) || starts_at_main(s))
    });
    assert_share(
        r,
        &run,
        "sorter -> Array#sort -> rb_ary_sort_bang",
        sorted,
        200,
        0.9,
    );
    if r.name == "3.1" {
        // Debian's libc keeps only its exported symbols; libc6-dbg's
        // separate debug file names its static functions.
        let named = share(&run.folded, "Array#sort", |s| s.contains(&"msort_with_tmp_[n]"));
        assert_share(
            r,
            &run,
            "libc's static msort_with_tmp, from libc6-dbg",
            named,
            200,
            0.5,
        );
    }
}

/// A GC function, by name where the VM has its symbols. Debian strips the
/// VM's local symbols, so there the GC is what an allocation function
/// (exported: `rb_wb_protected_newobj_of`, `rb_str_resurrect`...) calls two
/// or more frames deep: unnamed libruby code, newobj_of's slow path and the GC.
fn gc_frames(stack: &[&str]) -> Option<usize> {
    stack
        .iter()
        .position(|f| {
            ["gc_", "garbage_collect", "newobj_slowpath"]
                .iter()
                .any(|p| f.starts_with(p) && f.ends_with("_[n]"))
        })
        .or_else(|| {
            let at = stack
                .iter()
                .position(|f| f.ends_with("_[n]") && (f.contains("newobj") || f.contains("resurrect")))?;
            let deeper = stack[at + 1..].iter().take_while(|f| f.ends_with("_[n]")).count();
            (deeper >= 2).then_some(at + 1)
        })
}

/// The GC's native frames under the Ruby frames that allocated.
fn check_gc(r: &Ruby) {
    let run = record_native(r, "gc", &[]);
    let (total, in_gc) = share(&run.folded, "Object#allocator", |s| gc_frames(s).is_some());
    assert_share(r, &run, "samples in the GC", (total, in_gc), 200, 0.01);
    let under = share(&run.folded, "Object#allocator", |s| {
        gc_frames(s).is_none_or(|at| s[..at].contains(&"Object#allocator"))
    });
    assert_share(r, &run, "GC frames under Object#allocator", under, 200, 1.0);
}

/// A system call's kernel frames, then the native frames that made it,
/// under the Ruby frame, on a thread that released the GVL.
fn check_syscall(r: &Ruby) {
    // glibc before 2.33 (Debian 11) stats with stat(2), later with fstatat(2).
    let run = record_native(
        r,
        "exist",
        &["--kernel", "syscall", "enter_newfstatat,enter_newstat"],
    );
    let ordered = |s: &[&str]| {
        let at = |pred: &dyn Fn(&str) -> bool| s.iter().position(|f| pred(f));
        let (Some(exister), Some(exist), Some(stat), Some(kernel)) = (
            at(&|f| f == "Object#exister"),
            at(&|f| f == "File.exist?"),
            at(&|f| f.contains("stat") && f.ends_with("_[n]")),
            at(&|f| f.ends_with("_[k]")),
        ) else {
            return false;
        };
        let last_native = s.iter().rposition(|f| f.ends_with("_[n]")).unwrap_or(0);
        exister < exist
            && exist < stat
            && stat < kernel
            && last_native < kernel
            && s.last().is_some_and(|f| f.starts_with("enter_new"))
            && s[0].starts_with("exister ")
    };
    let events = share(&run.folded, "Object#exister", ordered);
    assert_share(
        r,
        &run,
        "exister -> File.exist? -> libc stat -> kernel",
        events,
        500,
        0.95,
    );
}

macro_rules! on_every_ruby {
    ($($version:ident => $name:literal),*) => {
        $(
            mod $version {
                use super::*;
                #[test] fn extension_frames_stitched() { check_ext(&Ruby::named($name)) }
                #[test] fn array_sort_native_frames() { check_sort(&Ruby::named($name)) }
                #[test] fn gc_frames_under_the_allocating_ruby_frame() { check_gc(&Ruby::named($name)) }
                #[test] fn syscall_kernel_and_native_frames() { check_syscall(&Ruby::named($name)) }
            }
        )*
    };
}

on_every_ruby!(
    ruby_2_7 => "2.7",
    ruby_3_1 => "3.1",
    ruby_3_1_static => "3.1-static",
    ruby_3_3 => "3.3",
    ruby_3_3_frame_pointers => "3.3-fp",
    ruby_3_3_yjit => "3.3-yjit",
    ruby_3_4 => "3.4"
);

/// The same program on Debian's Ruby 3.3 (no frame pointers, stripped) and
/// on the same source built with frame pointers (Ubuntu's and Fedora's
/// shape): rprof unwinds both from their CFI, and the stitched stacks agree.
#[test]
fn frame_pointers_or_not_the_stacks_agree() {
    // The most common path from <main> (the part both builds name alike)
    // down to the frame `to`.
    let dominant = |run: &Run, to: &str| -> Vec<String> {
        let mut by: std::collections::BTreeMap<Vec<String>, u64> = Default::default();
        for (stack, n) in &run.folded.stacks {
            let l = labels(stack);
            let Some(end) = l.iter().position(|f| *f == to) else {
                continue;
            };
            let from = l.iter().position(|f| *f == "<main>").unwrap_or(0);
            *by.entry(l[from..=end].iter().map(|f| f.to_string()).collect())
                .or_default() += n;
        }
        by.into_iter()
            .max_by_key(|(_, n)| *n)
            .map(|(s, _)| s)
            .unwrap_or_default()
    };
    let mut tables = Vec::new();
    let mut stacks = Vec::new();
    for name in ["3.3", "3.3-fp"] {
        let r = Ruby::named(name);
        let run = record_native_with_env(&r, "ext", &[], &[("RPROF_SAY_TABLES", "1")]);
        let vm = run
            .stderr
            .lines()
            .find(|l| l.contains("unwind table for libruby"))
            .unwrap_or_else(|| panic!("Ruby {name}: no table for libruby: {}", run.stderr))
            .to_string();
        tables.push(vm);
        stacks.push((
            dominant(&run, "rprof_c_[n]"),
            dominant(&run, "block in Object#yielder"),
        ));
    }
    assert!(tables[0].contains("without frame pointers"), "{}", tables[0]);
    assert!(tables[1].contains("with frame pointers"), "{}", tables[1]);
    assert!(
        stacks[0].0.ends_with(&BURN.map(String::from)),
        "{:?}",
        stacks[0].0
    );
    assert_eq!(stacks[0], stacks[1], "Debian's 3.3 and 3.3 with frame pointers");
}

/// A handler running on a signal frame: unwound through the kernel's
/// frame back to the code it interrupted.
#[test]
fn signal_frames() {
    let r = Ruby::host();
    let run = record_native(&r, "signal", &[]);
    let through = share(&run.folded, "rprof_in_handler_[n]", |s| {
        has_run(s, &["rprof_handler_[n]", "rprof_in_handler_[n]", "rprof_c_[n]"])
            && has_run(
                s,
                &["Object#signaler", "RprofNative.signal_burn", "rprof_signaler_[n]"],
            )
            && s.contains(&"__restore_rt_[n]")
            && starts_at_main(s)
    });
    assert_share(
        &r,
        &run,
        "signaler -> ... -> __restore_rt -> handler",
        through,
        500,
        0.95,
    );
}

/// Code without CFI ends the native part with a marker, counted by reason.
#[test]
fn code_without_cfi_is_marked() {
    let r = Ruby::host();
    let run = record_native(&r, "nocfi", &[]);
    let marked = share(&run.folded, "rprof_no_cfi_[n]", |s| {
        s[1] == "[native unwind stopped: no unwind info]"
            && s.ends_with(&["Object#nocfi", "RprofNative.no_cfi_burn", "rprof_no_cfi_[n]"])
    });
    assert_share(&r, &run, "marked, leaf kept", marked, 500, 0.95);
    assert!(run.stderr.contains(" no unwind info"), "counted: {}", run.stderr);
}

/// 200 native frames deep, and the stack still reaches the process's start.
#[test]
fn deep_native_stacks() {
    let r = Ruby::host();
    let run = record_native(&r, "deep", &[]);
    let deep = share(&run.folded, "rprof_c_[n]", |s| {
        s.iter().filter(|f| **f == "rprof_deep_[n]").count() == 201 && starts_at_main(s)
    });
    assert_share(&r, &run, "201 rprof_deep frames, whole", deep, 500, 0.95);
}

/// --native-all keeps the interpreter's frames between Ruby frames.
#[test]
fn native_all_keeps_the_interpreter() {
    let r = Ruby::host();
    let run = record_native(&r, "ext", &["--native-all"]);
    let kept = share(&run.folded, "block in Object#yielder", |s| {
        let from = s.iter().position(|f| *f == "rprof_yielder_[n]");
        let to = s.iter().position(|f| *f == "block in Object#yielder");
        matches!((from, to), (Some(a), Some(b)) if s[a..b].contains(&"rb_yield_[n]") && s[a..b].contains(&"rb_vm_exec_[n]"))
    });
    assert_share(&r, &run, "rb_yield .. rb_vm_exec kept", kept, 50, 0.9);
}

/// Kernel frames of CPU samples that land in the kernel, with --kernel alone.
#[test]
fn kernel_frames_without_native() {
    let r = Ruby::host();
    let target = r.spawn("native.rb", &["exist", "-"]);
    let run = record(target.pid, &["-d", "3", "-F", "499", "--kernel"]);
    assert!(run.success, "{}", run.stderr);
    let (total, kernel) = share(&run.folded, "Object#exister", |s| {
        s.last().is_some_and(|f| f.ends_with("_[k]")) && s.iter().all(|f| !f.ends_with("_[n]"))
    });
    assert!(total > 50 && kernel > 0, "{kernel} of {total}: {}", run.stderr);
}

/// A library loaded after rprof read the process's mappings (a gem
/// required late): its frames first stop the native part, rprof reads the
/// mappings again, and the stacks are whole from then on.
#[test]
fn a_library_loaded_while_recording() {
    let r = Ruby::host();
    let dir = r.build_native_ext();
    let mut target = r.spawn("native.rb", &["late", &dir]);
    let rprof = attach(target.pid, &["-d", "120", "-F", "499", "--native"]);
    signal(target.pid, libc::SIGUSR1);
    target.wait_line("loaded", std::time::Duration::from_secs(10));
    // From then on, until it has used 1.5 s of CPU (about 750 samples),
    // however busy the machine.
    let run = common::stop_when("native.rb late", rprof, 100, common::used_cpu(target.pid, 1.5));
    let burn = share(&run.folded, "rprof_c_[n]", |s| {
        s.ends_with(&BURN) && starts_at_main(s)
    });
    assert_share(&r, &run, "whole burner -> burn -> a -> b -> c", burn, 300, 0.9);
}
