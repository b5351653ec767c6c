//! Every layout file, and the patch-level file a version picks, against the
//! offsets of Ruby's real headers for every patch release that crates.io's
//! `rbspy-ruby-structs` (bindgen of each release's headers) knows. A patch
//! release that moves a field rprof reads fails here until a patch-level
//! file covers it; updating that crate shows at once what a new release
//! needs. (What the crate does not declare is not checked here: the symbol
//! table, `st_table`'s entries, `RClass` before 3.3, and constants; the
//! layout proof checks those on live processes.)

use std::mem::{offset_of, size_of, MaybeUninit};

use rbspy_ruby_structs as rs;
use ruby_structs::{layout_for, Layout, RubyVersion};

fn layout(version: &str) -> Layout {
    layout_for(RubyVersion::parse(version).expect("a version")).expect("a layout")
}

/// (byte, mask) of the one bitfield `set` sets in an all-zero `T`.
fn bit<T>(set: impl FnOnce(&mut T)) -> (u32, u8) {
    // SAFETY: bindgen's structs are plain data; all zeroes is a value.
    let mut v: T = unsafe { MaybeUninit::zeroed().assume_init() };
    set(&mut v);
    // SAFETY: reads the bytes of a value we own.
    let bytes = unsafe { std::slice::from_raw_parts((&v as *const T).cast::<u8>(), size_of::<T>()) };
    let at = bytes.iter().position(|&b| b != 0).expect("the bit is set");
    (at as u32, bytes[at])
}

/// Compares `(name, from the headers, from the layout)` for one release.
fn compare(version: &str, fields: &[(&str, usize, u32)]) -> Vec<String> {
    fields
        .iter()
        .filter(|(_, real, ours)| *real as u64 != u64::from(*ours))
        .map(|(name, real, ours)| format!("Ruby {version}: {name} is {real}, the layout says {ours}"))
        .collect()
}

/// Why a thread waits (wall): its status bits, the fields Ruby parks it
/// with, its GVL queue node, and where the GVL's holder is.
macro_rules! waits {
    ($r:ident, $l:ident, base: $base:ident, holder: $hs:ident . $($holder:ident).+, node: $($node:ident).+) => {{
        let w = &$l.waits;
        let (status_byte, status_mask) = bit(|t: &mut $r::rb_thread_struct| t.set_status(3));
        [
            ("waits.status_byte", status_byte as usize, w.status_byte),
            ("waits.status_mask", usize::from(status_mask), u32::from(w.status_mask << w.status_shift)),
            ("waits.blocking_region_buffer", offset_of!($r::rb_thread_struct, blocking_region_buffer), w.blocking_region_buffer),
            ("waits.unblock_func", offset_of!($r::rb_thread_struct, unblock.func), w.unblock_func),
            ("waits.locking_mutex", offset_of!($r::rb_thread_struct, locking_mutex), w.locking_mutex),
            ("waits.gvl_node", offset_of!($r::rb_thread_struct, $($node).+), w.gvl_node),
            ("waits.gvl_base", offset_of!($r::rb_thread_struct, $base), w.gvl_base),
            ("waits.gvl_holder", offset_of!($r::$hs, $($holder).+), w.gvl_holder),
        ]
    }};
}

/// What every Ruby from 2.7 has in the same place.
macro_rules! common {
    ($r:ident, $l:ident) => {
        vec![
            (
                "execution_context.vm_stack",
                offset_of!($r::rb_execution_context_struct, vm_stack),
                $l.execution_context.vm_stack,
            ),
            (
                "execution_context.vm_stack_size",
                offset_of!($r::rb_execution_context_struct, vm_stack_size),
                $l.execution_context.vm_stack_size,
            ),
            (
                "execution_context.cfp",
                offset_of!($r::rb_execution_context_struct, cfp),
                $l.execution_context.cfp,
            ),
            (
                "execution_context.thread_ptr",
                offset_of!($r::rb_execution_context_struct, thread_ptr),
                $l.execution_context.thread_ptr,
            ),
            ("thread.ec", offset_of!($r::rb_thread_struct, ec), $l.thread.ec),
            (
                "control_frame.size",
                size_of::<$r::rb_control_frame_struct>(),
                $l.control_frame.size,
            ),
            (
                "control_frame.pc",
                offset_of!($r::rb_control_frame_struct, pc),
                $l.control_frame.pc,
            ),
            (
                "control_frame.sp",
                offset_of!($r::rb_control_frame_struct, sp),
                $l.control_frame.sp,
            ),
            (
                "control_frame.iseq",
                offset_of!($r::rb_control_frame_struct, iseq),
                $l.control_frame.iseq,
            ),
            (
                "control_frame.self",
                offset_of!($r::rb_control_frame_struct, self_),
                $l.control_frame.self_,
            ),
            (
                "control_frame.ep",
                offset_of!($r::rb_control_frame_struct, ep),
                $l.control_frame.ep,
            ),
            ("iseq.body", offset_of!($r::rb_iseq_struct, body), $l.iseq.body),
            (
                "iseq.type",
                offset_of!($r::rb_iseq_constant_body, type_),
                $l.iseq.type_,
            ),
            (
                "iseq.iseq_size",
                offset_of!($r::rb_iseq_constant_body, iseq_size),
                $l.iseq.iseq_size,
            ),
            (
                "iseq.iseq_encoded",
                offset_of!($r::rb_iseq_constant_body, iseq_encoded),
                $l.iseq.iseq_encoded,
            ),
            (
                "iseq.pathobj",
                offset_of!($r::rb_iseq_constant_body, location.pathobj),
                $l.iseq.pathobj,
            ),
            (
                "iseq.base_label",
                offset_of!($r::rb_iseq_constant_body, location.base_label),
                $l.iseq.base_label,
            ),
            (
                "iseq.label",
                offset_of!($r::rb_iseq_constant_body, location.label),
                $l.iseq.label,
            ),
            (
                "iseq.first_lineno",
                offset_of!($r::rb_iseq_constant_body, location.first_lineno),
                $l.iseq.first_lineno,
            ),
            (
                "iseq.insns_info_body",
                offset_of!($r::rb_iseq_constant_body, insns_info.body),
                $l.iseq.insns_info_body,
            ),
            (
                "iseq.insns_info_size",
                offset_of!($r::rb_iseq_constant_body, insns_info.size),
                $l.iseq.insns_info_size,
            ),
            (
                "iseq.succ_index_table",
                offset_of!($r::rb_iseq_constant_body, insns_info.succ_index_table),
                $l.iseq.succ_index_table,
            ),
            (
                "iseq.parent_iseq",
                offset_of!($r::rb_iseq_constant_body, parent_iseq),
                $l.iseq.parent_iseq,
            ),
            (
                "iseq.local_iseq",
                offset_of!($r::rb_iseq_constant_body, local_iseq),
                $l.iseq.local_iseq,
            ),
            (
                "iseq.insn_info_entry_size",
                size_of::<$r::iseq_insn_info_entry>(),
                $l.iseq.insn_info_entry_size,
            ),
            (
                "iseq.insn_info_line_no",
                offset_of!($r::iseq_insn_info_entry, line_no),
                $l.iseq.insn_info_line_no,
            ),
            (
                "method_entry.flags",
                offset_of!($r::rb_method_entry_struct, flags),
                $l.method_entry.flags,
            ),
            (
                "method_entry.defined_class",
                offset_of!($r::rb_method_entry_struct, defined_class),
                $l.method_entry.defined_class,
            ),
            (
                "method_entry.def",
                offset_of!($r::rb_method_entry_struct, def),
                $l.method_entry.def,
            ),
            (
                "method_entry.called_id",
                offset_of!($r::rb_method_entry_struct, called_id),
                $l.method_entry.called_id,
            ),
            (
                "method_entry.owner",
                offset_of!($r::rb_method_entry_struct, owner),
                $l.method_entry.owner,
            ),
            (
                "method_entry.def_original_id",
                offset_of!($r::rb_method_definition_struct, original_id),
                $l.method_entry.def_original_id,
            ),
            (
                "method_entry.def_body",
                offset_of!($r::rb_method_definition_struct, body),
                $l.method_entry.def_body,
            ),
            (
                "imemo.svar_cref_or_me",
                offset_of!($r::vm_svar, cref_or_me),
                $l.imemo.svar_cref_or_me,
            ),
            ("array.len", offset_of!($r::RArray, as_.heap.len), $l.array.len),
            (
                "array.heap_ptr",
                offset_of!($r::RArray, as_.heap.ptr),
                $l.array.heap_ptr,
            ),
            (
                "array.embed_ary",
                offset_of!($r::RArray, as_.ary),
                $l.array.embed_ary,
            ),
            (
                "st_table.entries_start",
                offset_of!($r::st_table, entries_start),
                $l.st_table.entries_start,
            ),
            (
                "st_table.entries_bound",
                offset_of!($r::st_table, entries_bound),
                $l.st_table.entries_bound,
            ),
            (
                "st_table.entries",
                offset_of!($r::st_table, entries),
                $l.st_table.entries,
            ),
            (
                "iseq.first_lineno_is_fixnum",
                usize::from(size_of_field(|b: &$r::rb_iseq_constant_body| &b.location.first_lineno) == 8),
                $l.iseq.first_lineno_is_fixnum,
            ),
        ]
    };
}

/// The size of a field, to tell a VALUE from an int.
fn size_of_field<S, F>(_: impl Fn(&S) -> &F) -> usize {
    size_of::<F>()
}

/// 2.7: the VM's thread list, the pthread id in the thread, strings with
/// their bytes right after the header.
macro_rules! ruby_2_7 {
    ($($m:ident => $v:literal),* $(,)?) => {{
        let mut wrong = Vec::new();
        $({
            use rs::$m as r;
            let l = layout($v);
            let mut fields = common!(r, l);
            fields.extend([
                ("thread.native_thread_id", offset_of!(r::rb_thread_struct, thread_id), l.thread.native_thread_id),
                ("thread.vm_living_threads", offset_of!(r::rb_vm_struct, living_threads), l.thread.vm_living_threads.unwrap_or(0)),
                ("thread.living_threads_node", offset_of!(r::rb_thread_struct, vmlt_node), l.thread.living_threads_node.unwrap_or(0)),
                ("string.len", offset_of!(r::RString, as_.heap.len), l.string.len),
                ("string.heap_ptr", offset_of!(r::RString, as_.heap.ptr), l.string.heap_ptr),
                ("string.embed_ary", offset_of!(r::RString, as_.ary), l.string.embed_ary),
                ("class.ext_iv_tbl", offset_of!(r::rb_classext_struct, iv_tbl), l.class.ext_iv_tbl.unwrap_or(0)),
            ]);
            fields.extend(waits!(r, l, base: vm, holder: rb_vm_struct.gvl.owner, node: native_thread_data));
            wrong.extend(compare($v, &fields));
        })*
        wrong
    }};
}

/// 3.1: YJIT's `jit_return`; embedded strings in `as.embed`.
macro_rules! ruby_3_1 {
    ($($m:ident => $v:literal),* $(,)?) => {{
        let mut wrong = Vec::new();
        $({
            use rs::$m as r;
            let l = layout($v);
            let mut fields = common!(r, l);
            fields.extend([
                ("control_frame.jit_return", offset_of!(r::rb_control_frame_struct, jit_return), l.control_frame.jit_return.unwrap_or(0)),
                ("thread.native_thread_id", offset_of!(r::rb_thread_struct, thread_id), l.thread.native_thread_id),
                ("string.len", offset_of!(r::RString, as_.heap.len), l.string.len),
                ("string.heap_ptr", offset_of!(r::RString, as_.heap.ptr), l.string.heap_ptr),
                ("string.embed_ary", offset_of!(r::RString, as_.embed.ary), l.string.embed_ary),
            ]);
            fields.extend(waits!(r, l, base: ractor, holder: rb_ractor_struct.threads.gvl.owner, node: native_thread_data));
            wrong.extend(compare($v, &fields));
        })*
        wrong
    }};
}

/// 3.2: the native thread struct (no M:N threads yet), strings with their
/// length in the header, class ivars found through object shapes.
macro_rules! ruby_3_2 {
    ($($m:ident => $v:literal),* $(,)?) => {{
        let mut wrong = Vec::new();
        $({
            use rs::$m as r;
            let l = layout($v);
            let mut fields = common!(r, l);
            let t = &l.thread;
            let sh = l.shapes.as_ref().expect("3.2 has shapes");
            fields.extend([
                ("control_frame.jit_return", offset_of!(r::rb_control_frame_struct, jit_return), l.control_frame.jit_return.unwrap_or(0)),
                ("thread.native_thread", offset_of!(r::rb_thread_struct, nt), t.native_thread.unwrap_or(0)),
                ("thread.native_thread_id", offset_of!(r::rb_native_thread, thread_id), t.native_thread_id),
                ("thread.name", offset_of!(r::rb_thread_struct, name), t.name.unwrap_or(0)),
                ("string.len", offset_of!(r::RString, as_.embed.len), l.string.len),
                ("string.len (heap)", offset_of!(r::RString, as_.heap.len), l.string.len),
                ("string.heap_ptr", offset_of!(r::RString, as_.heap.ptr), l.string.heap_ptr),
                ("string.embed_ary", offset_of!(r::RString, as_.embed.ary), l.string.embed_ary),
                ("shapes.vm_shape_list", offset_of!(r::rb_vm_struct, shape_list), sh.vm_shape_list),
                ("shapes.size", size_of::<r::rb_shape>(), sh.size),
                ("shapes.edge_name", offset_of!(r::rb_shape, edge_name), sh.edge_name),
                ("shapes.next_iv_index", offset_of!(r::rb_shape, next_iv_index), sh.next_iv_index),
                ("shapes.type", offset_of!(r::rb_shape, type_), sh.type_),
                ("shapes.parent_id", offset_of!(r::rb_shape, parent_id), sh.parent_id),
            ]);
            fields.extend(waits!(r, l, base: ractor, holder: rb_ractor_struct.threads.sched.running, node: sched.node.readyq));
            wrong.extend(compare($v, &fields));
        })*
        wrong
    }};
}

/// 3.3 on: the native thread struct, M:N threads, the classext embedded.
macro_rules! ruby_3_3_on {
    ($($m:ident => $v:literal),* $(,)?) => {{
        let mut wrong = Vec::new();
        $({
            use rs::$m as r;
            let l = layout($v);
            let mut fields = common!(r, l);
            let (nt_byte, nt_mask) = bit(|t: &mut r::rb_thread_struct| t.set_has_dedicated_nt(1));
            let (path_byte, path_mask) = bit(|c: &mut r::rb_classext_struct| c.set_permanent_classpath(true));
            let t = &l.thread;
            let c = &l.class;
            fields.extend([
                ("control_frame.jit_return", offset_of!(r::rb_control_frame_struct, jit_return), l.control_frame.jit_return.unwrap_or(0)),
                ("thread.native_thread", offset_of!(r::rb_thread_struct, nt), t.native_thread.unwrap_or(0)),
                ("thread.native_thread_id", offset_of!(r::rb_native_thread, thread_id), t.native_thread_id),
                ("thread.name", offset_of!(r::rb_thread_struct, name), t.name.unwrap_or(0)),
                ("thread.dedicated_nt_byte", nt_byte as usize, t.dedicated_nt_byte.unwrap_or(0)),
                ("thread.dedicated_nt_mask", usize::from(nt_mask), u32::from(t.dedicated_nt_mask.unwrap_or(0))),
                ("string.len", offset_of!(r::RString, len), l.string.len),
                ("string.heap_ptr", offset_of!(r::RString, as_.heap.ptr), l.string.heap_ptr),
                ("string.embed_ary", offset_of!(r::RString, as_.embed.ary), l.string.embed_ary),
                ("class.ext_embedded", size_of::<r::RClass>(), c.ext_embedded.unwrap_or(0)),
                ("class.ext_classpath", offset_of!(r::rb_classext_struct, classpath), c.ext_classpath.unwrap_or(0)),
                (
                    "class.ext_attached_object",
                    offset_of!(r::rb_classext_struct, as_.singleton_class.attached_object),
                    c.ext_attached_object.unwrap_or(0),
                ),
                ("class.ext_permanent_classpath_byte", path_byte as usize, c.ext_permanent_classpath_byte.unwrap_or(0)),
                ("class.ext_permanent_classpath_mask", usize::from(path_mask), u32::from(c.ext_permanent_classpath_mask.unwrap_or(0))),
            ]);
            // Where BasicObject's allocator is read (`alloc`, 3.3 only).
            if let Some(off) = l.alloc.as_ref().and_then(|a| a.ext_allocator) {
                fields.push(("alloc.ext_allocator", offset_of!(r::rb_classext_struct, as_.class.allocator), off));
            }
            fields.extend(waits!(r, l, base: ractor, holder: rb_ractor_struct.threads.sched.running, node: sched.node.readyq));
            wrong.extend(compare($v, &fields));
        })*
        wrong
    }};
}

#[test]
fn every_patch_release_of_2_7_fits_its_layout() {
    let wrong = ruby_2_7!(
        ruby_2_7_0 => "2.7.0", ruby_2_7_1 => "2.7.1", ruby_2_7_2 => "2.7.2", ruby_2_7_3 => "2.7.3",
        ruby_2_7_4 => "2.7.4", ruby_2_7_5 => "2.7.5", ruby_2_7_6 => "2.7.6", ruby_2_7_7 => "2.7.7",
        ruby_2_7_8 => "2.7.8",
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn every_patch_release_of_3_1_fits_its_layout() {
    let wrong = ruby_3_1!(
        ruby_3_1_0 => "3.1.0", ruby_3_1_1 => "3.1.1", ruby_3_1_2 => "3.1.2", ruby_3_1_3 => "3.1.3",
        ruby_3_1_4 => "3.1.4", ruby_3_1_5 => "3.1.5", ruby_3_1_6 => "3.1.6", ruby_3_1_7 => "3.1.7",
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn every_patch_release_of_3_2_fits_its_layout() {
    let wrong = ruby_3_2!(
        ruby_3_2_0 => "3.2.0", ruby_3_2_1 => "3.2.1", ruby_3_2_2 => "3.2.2", ruby_3_2_3 => "3.2.3",
        ruby_3_2_4 => "3.2.4", ruby_3_2_5 => "3.2.5", ruby_3_2_6 => "3.2.6", ruby_3_2_7 => "3.2.7",
        ruby_3_2_8 => "3.2.8", ruby_3_2_9 => "3.2.9", ruby_3_2_10 => "3.2.10", ruby_3_2_11 => "3.2.11",
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn every_patch_release_of_3_3_fits_its_layout() {
    let wrong = ruby_3_3_on!(
        ruby_3_3_0 => "3.3.0", ruby_3_3_1 => "3.3.1", ruby_3_3_2 => "3.3.2", ruby_3_3_3 => "3.3.3",
        ruby_3_3_4 => "3.3.4", ruby_3_3_5 => "3.3.5", ruby_3_3_6 => "3.3.6", ruby_3_3_7 => "3.3.7",
        ruby_3_3_8 => "3.3.8", ruby_3_3_9 => "3.3.9", ruby_3_3_10 => "3.3.10", ruby_3_3_11 => "3.3.11",
        ruby_3_3_12 => "3.3.12", ruby_3_3_13 => "3.3.13",
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn every_patch_release_of_3_4_fits_its_layout() {
    let wrong = ruby_3_3_on!(
        ruby_3_4_0 => "3.4.0", ruby_3_4_1 => "3.4.1", ruby_3_4_2 => "3.4.2", ruby_3_4_3 => "3.4.3",
        ruby_3_4_4 => "3.4.4", ruby_3_4_5 => "3.4.5", ruby_3_4_6 => "3.4.6", ruby_3_4_7 => "3.4.7",
        ruby_3_4_8 => "3.4.8", ruby_3_4_9 => "3.4.9", ruby_3_4_10 => "3.4.10", ruby_3_4_11 => "3.4.11",
        ruby_3_4_12 => "3.4.12",
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
}

/// 4.0.6 moved rb_thread_t's name and has_dedicated_nt (4.0.6.toml).
#[test]
fn every_patch_release_of_4_0_fits_its_layout() {
    let wrong = ruby_3_3_on!(
        ruby_4_0_0 => "4.0.0", ruby_4_0_1 => "4.0.1", ruby_4_0_2 => "4.0.2", ruby_4_0_3 => "4.0.3",
        ruby_4_0_4 => "4.0.4", ruby_4_0_5 => "4.0.5", ruby_4_0_6 => "4.0.6", ruby_4_0_7 => "4.0.7",
        ruby_4_0_8 => "4.0.8", ruby_4_0_9 => "4.0.9",
    );
    assert!(wrong.is_empty(), "{wrong:#?}");
}
