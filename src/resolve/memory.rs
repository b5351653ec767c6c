//! Reading Ruby's objects out of the target's memory, the way Ruby itself
//! does for a backtrace. Nothing here is cached: every call reads the memory
//! as it is now, and the caller (facts.rs) decides when that reading may be
//! used for a sample.

use ruby_structs::Layout;

use std::rc::Rc;
use std::sync::Arc;

use super::lines::{self, LineTable};
use crate::address_space::{AddressSpace, PageCache};
use crate::process::Process;
use crate::target::{GlobalSymbols, RubyTarget};

/// Longest string read from the target (labels, paths).
const MAX_STRING: u64 = 4096;
/// Ivars a class's shape is followed through (Ruby 3.2; a class has a few).
const MAX_SHAPE_DEPTH: usize = 256;
/// `INVALID_SHAPE_ID`: the root shape's parent.
const NO_SHAPE: u32 = u32::MAX;
/// Largest line table read whole with its iseq (its entries, and its index
/// apart): 5,000 entries; larger ones are read a pc at a time.
const MAX_LINE_TABLE: u64 = 64 * 1024;

/// What an instruction sequence says about itself.
#[derive(Debug, Clone)]
pub struct Iseq {
    pub type_: u32,
    pub label: Arc<str>,
    pub path: Arc<str>,
    pub parent: u64,
    pub local: u64,
    pub first_lineno: u32,
    pub encoded: u64,
    pub size: u64,
    pub insns_body: u64,
    pub insns_size: u64,
    pub succ_table: u64,
    /// The line table, read with the iseq unless it is too large.
    pub lines: Option<Arc<LineTable>>,
}

impl Iseq {
    /// Whether `pc` lies in this iseq's code (it may point just past the end).
    pub fn contains(&self, pc: u64) -> bool {
        pc >= self.encoded && pc <= self.encoded + self.size * 8
    }

    /// The position of the instruction running at `pc` (Ruby's calc_pos):
    /// pc points at the next instruction once one has started.
    fn position(&self, pc: u64) -> Option<u64> {
        self.contains(pc)
            .then(|| ((pc - self.encoded) / 8).saturating_sub(1))
    }
}

/// A method entry: its owner and the method's original name.
#[derive(Debug, Clone, Copy)]
pub struct MethodEntry {
    pub owner: Option<u64>,
    pub original_id: Option<u64>,
    /// A C method's function (`def->body.cfunc.func`), where its native frames start.
    pub cfunc: Option<u64>,
    /// A Ruby method's code (`def->body.iseq.iseqptr`): what its frames run.
    pub iseq: Option<u64>,
}

/// What a class or module is, for naming methods after it.
#[derive(Debug, Clone)]
pub enum Class {
    /// A class or module, with its name and whether that name is permanent.
    Named(Option<(String, bool)>),
    /// A singleton class, and the object it belongs to.
    Singleton(Option<u64>),
    /// Anything else (an iclass, a freed slot).
    Other,
}

/// A heap object's first word, and whether the GC considers it old.
#[derive(Debug, Clone, Copy)]
pub struct Header {
    pub flags: u64,
    pub old: bool,
}

/// ID names: an ID names the same symbol for the life of the process, so a
/// name once read is kept (`known`); names read inside a bracket wait in
/// `read` until its second clock reading shows the GC stood still. A class's
/// ivars are found by their names, which would otherwise be read again for
/// every ivar of every class named.
pub struct IdNames<'a> {
    pub known: &'a foldhash::HashMap<u64, Arc<str>>,
    pub read: &'a mut Vec<(u64, Arc<str>)>,
}

impl IdNames<'_> {
    /// The name of `id`, known or read by `read_name`.
    pub fn get(&mut self, id: u64, read_name: impl FnOnce() -> Option<String>) -> Option<Arc<str>> {
        if let Some(name) = self.known.get(&id) {
            return Some(name.clone());
        }
        if let Some((_, name)) = self.read.iter().find(|(k, _)| *k == id) {
            return Some(name.clone());
        }
        let name: Arc<str> = read_name()?.into();
        self.read.push((id, name.clone()));
        Some(name)
    }
}

pub struct Memory {
    space: Rc<dyn AddressSpace>,
    /// `space`, whose reads come from whole pages inside a bracket.
    pages: Rc<PageCache>,
    layout: Layout,
    global_symbols: GlobalSymbols,
    /// Where `ruby_current_vm_ptr` is: Ruby 3.2 finds a class's name
    /// through the VM's shape list.
    vm_ptr: Option<u64>,
}

impl Memory {
    pub fn new(space: Rc<dyn AddressSpace>, layout: Layout, global_symbols: GlobalSymbols) -> Self {
        let pages = Rc::new(PageCache::new(space));
        Self {
            space: pages.clone(),
            pages,
            layout,
            global_symbols,
            vm_ptr: None,
        }
    }

    /// The reader of a live target.
    pub fn of_target(target: &RubyTarget) -> Self {
        Self {
            vm_ptr: target.vm_ptr,
            ..Self::new(
                Rc::new(target.process),
                target.layout.clone(),
                target.global_symbols.clone(),
            )
        }
    }

    /// This reader, knowing where `ruby_current_vm_ptr` is (a core dump).
    #[cfg(test)]
    pub fn with_vm_ptr(self, vm_ptr: u64) -> Self {
        Self {
            vm_ptr: Some(vm_ptr),
            ..self
        }
    }

    pub fn space(&self) -> &Rc<dyn AddressSpace> {
        &self.space
    }

    /// The same reader for another process with this one's layout (a fork).
    pub fn for_process(&self, process: Process) -> Self {
        Self {
            vm_ptr: self.vm_ptr,
            ..Self::new(Rc::new(process), self.layout.clone(), self.global_symbols.clone())
        }
    }

    /// A bracket's reads start (true) or end (false): see `PageCache`.
    pub fn reading(&self, on: bool) {
        self.pages.reading(on);
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn is_object(v: u64) -> bool {
        v >= 0x1000 && v & 7 == 0
    }

    /// The flags word (`RBasic.flags`) of a heap object; None for special
    /// constants and unreadable addresses.
    fn flags(&self, v: u64) -> Option<u64> {
        if !Self::is_object(v) {
            return None;
        }
        self.space.read_u64(v).ok()
    }

    /// An object's header, for the age the GC gives it.
    pub fn header(&self, v: u64) -> Option<Header> {
        let flags = self.flags(v)?;
        let promoted = self.layout.value.fl_promoted;
        Some(Header {
            flags,
            old: flags & promoted == promoted,
        })
    }

    fn builtin_type(&self, v: u64) -> Option<u64> {
        Some(self.flags(v)? & self.layout.value.type_mask)
    }

    fn is_imemo(&self, flags: u64, imemo_type: u64) -> bool {
        let l = &self.layout;
        flags & l.value.type_mask == l.value.t_imemo
            && (flags >> l.imemo.type_shift) & l.imemo.type_mask == imemo_type
    }

    /// The iseq at `iseq`, if that is one.
    pub fn iseq(&self, iseq: u64, h: Header) -> Option<Iseq> {
        let l = &self.layout.iseq;
        if !self.is_imemo(h.flags, self.layout.imemo.type_iseq) {
            return None;
        }
        let body = self.space.read_u64(iseq + l.body as u64).ok()?;
        if !Self::is_object(body) {
            return None;
        }
        let mut raw = [0u8; 256];
        self.space.read(body, &mut raw).ok()?;
        let u64_at = |off: u32| u64_in(&raw, off as usize).unwrap_or(0);
        let u32_at = |off: u32| u32_in(&raw, off as usize).map_or(0, u64::from);
        let first_lineno = if l.first_lineno_is_fixnum != 0 {
            u64_at(l.first_lineno) >> 1
        } else {
            u32_at(l.first_lineno)
        } as u32;
        let mut iseq = Iseq {
            first_lineno,
            type_: u32_at(l.type_) as u32,
            label: self.rstring(u64_at(l.label))?.into(),
            path: self.path_of(u64_at(l.pathobj))?.into(),
            parent: u64_at(l.parent_iseq),
            local: u64_at(l.local_iseq),
            encoded: u64_at(l.iseq_encoded),
            size: u32_at(l.iseq_size),
            insns_body: u64_at(l.insns_info_body),
            insns_size: u32_at(l.insns_info_size),
            succ_table: u64_at(l.succ_index_table),
            lines: None,
        };
        iseq.lines = self.line_table(&iseq).map(Arc::new);
        Some(iseq)
    }

    /// The method entry at `cme`, if that is one (a frame outside any method
    /// has a cref there instead).
    pub fn method_entry(&self, cme: u64, h: Header) -> Option<MethodEntry> {
        let l = &self.layout.method_entry;
        if !self.is_imemo(h.flags, self.layout.imemo.type_ment) {
            return None;
        }
        let owner = self
            .space
            .read_u64(cme + l.owner as u64)
            .ok()
            .filter(|&o| Self::is_object(o));
        let def = self.space.read_u64(cme + l.def as u64).ok()?;
        let (original_id, cfunc, iseq) = if def == 0 {
            (None, None, None)
        } else {
            // The method type is the low bits of the definition's first word;
            // a C function and an iseq are both the body's first word.
            let kind = self.space.read_u32(def).ok().map(|w| w & 0xf);
            let body = || self.space.read_u64(def + l.def_body as u64).ok();
            (
                self.space.read_u64(def + l.def_original_id as u64).ok(),
                (kind == Some(l.type_cfunc)).then(body).flatten(),
                (kind == Some(l.type_iseq)).then(body).flatten(),
            )
        };
        Some(MethodEntry {
            owner,
            original_id,
            cfunc,
            iseq,
        })
    }

    /// A class, module or singleton class, as rb_gen_method_name needs it.
    pub fn class(&self, klass: u64, h: Header, ids: &mut IdNames) -> Class {
        let v = &self.layout.value;
        let t = h.flags & v.type_mask;
        if t != v.t_class && t != v.t_module {
            return Class::Other;
        }
        if t == v.t_class && h.flags & v.fl_singleton != 0 {
            return Class::Singleton(self.attached_object(klass, h.flags, ids));
        }
        Class::Named(self.class_name(klass, h.flags, ids))
    }

    /// A class's name, as Ruby's classname(): (path, permanent).
    fn class_name(&self, klass: u64, flags: u64, ids: &mut IdNames) -> Option<(String, bool)> {
        let c = &self.layout.class;
        if let (Some(ext), Some(path_off)) = (c.ext_embedded, c.ext_classpath) {
            let ext = klass + ext as u64;
            let path = self.space.read_u64(ext + path_off as u64).ok()?;
            let permanent = match (c.ext_permanent_classpath_byte, c.ext_permanent_classpath_mask) {
                (Some(byte), Some(mask)) => {
                    let mut b = [0u8; 1];
                    self.space.read(ext + byte as u64, &mut b).ok()?;
                    b[0] & mask != 0
                }
                _ => true,
            };
            return Some((self.rstring(path)?, permanent));
        }
        let ivars = self.class_ivars(klass, flags, ids)?;
        if let Some((_, v)) = ivars.iter().find(|(k, _)| &**k == "__classpath__") {
            return Some((self.rstring(*v)?, true));
        }
        let (_, v) = ivars.iter().find(|(k, _)| &**k == "__tmp_classpath__")?;
        Some((self.rstring(*v)?, false))
    }

    /// The object a singleton class belongs to.
    fn attached_object(&self, klass: u64, flags: u64, ids: &mut IdNames) -> Option<u64> {
        let c = &self.layout.class;
        if let (Some(ext), Some(off)) = (c.ext_embedded, c.ext_attached_object) {
            return self.space.read_u64(klass + ext as u64 + off as u64).ok();
        }
        let ivars = self.class_ivars(klass, flags, ids)?;
        ivars
            .into_iter()
            .find(|(k, _)| &**k == "__attached__")
            .map(|(_, v)| v)
    }

    /// (name, value) of a class's ivars: through its shape (3.2), or in its
    /// classext's st_table (before 3.2).
    fn class_ivars(&self, klass: u64, flags: u64, ids: &mut IdNames) -> Option<Vec<(Arc<str>, u64)>> {
        if self.layout.shapes.is_some() {
            return self.shaped_ivars(klass, flags, ids);
        }
        let c = &self.layout.class;
        let st = &self.layout.st_table;
        let ext = self.space.read_u64(klass + c.ext_ptr? as u64).ok()?;
        let tbl = self.space.read_u64(ext + c.ext_iv_tbl? as u64).ok()?;
        if tbl == 0 {
            return None;
        }
        let start = self.space.read_u64(tbl + st.entries_start as u64).ok()?;
        let bound = self.space.read_u64(tbl + st.entries_bound as u64).ok()?;
        let entries = self.space.read_u64(tbl + st.entries as u64).ok()?;
        if bound < start || bound - start > 4096 {
            return None;
        }
        let size = st.entry_size as u64;
        let mut raw = vec![0u8; ((bound - start) * size) as usize];
        self.space.read(entries + start * size, &mut raw).ok()?;
        let word = |at: usize| u64_in(&raw, at).unwrap_or(0);
        let mut out = Vec::new();
        for i in 0..(bound - start) as usize {
            let base = i * size as usize;
            // A deleted entry has the reserved hash value (all ones).
            if word(base + st.entry_hash as usize) == u64::MAX {
                continue;
            }
            let key = word(base + st.entry_key as usize);
            if let Some(name) = ids.get(key, || self.id_name(key)) {
                out.push((name, word(base + st.entry_record as usize)));
            }
        }
        Some(out)
    }

    /// Ruby 3.2's rb_ivar_lookup for a class: from the shape its flags name
    /// up to the root, each ivar shape names one ivar and its index in the
    /// classext's ivar array.
    fn shaped_ivars(&self, klass: u64, flags: u64, ids: &mut IdNames) -> Option<Vec<(Arc<str>, u64)>> {
        let sh = self.layout.shapes.as_ref()?;
        let c = &self.layout.class;
        let vm = self.space.read_u64(self.vm_ptr?).ok()?;
        let list = self.space.read_u64(vm + u64::from(sh.vm_shape_list)).ok()?;
        let ivs = self
            .space
            .read_u64(klass + u64::from(c.ext_embedded?) + u64::from(c.ext_iv_ptr?))
            .ok()?;
        let mut id = (flags >> sh.id_shift) as u32;
        let mut out = Vec::new();
        let mut raw = vec![0u8; sh.size as usize];
        for _ in 0..MAX_SHAPE_DEPTH {
            if id == NO_SHAPE {
                return Some(out);
            }
            self.space
                .read(list + u64::from(id) * u64::from(sh.size), &mut raw)
                .ok()?;
            let kind = *raw.get(sh.type_ as usize)?;
            let index = u32_in(&raw, sh.next_iv_index as usize)?;
            if kind == sh.type_ivar && index > 0 {
                let edge = u64_in(&raw, sh.edge_name as usize)?;
                let value = self.space.read_u64(ivs + 8 * u64::from(index - 1)).ok()?;
                out.push((ids.get(edge, || self.id_name(edge))?, value));
            }
            id = u32_in(&raw, sh.parent_id as usize)?;
        }
        None
    }

    /// A pathobj is a String, or an Array [path, realpath]: prefer the absolute one.
    fn path_of(&self, pathobj: u64) -> Option<String> {
        let v = &self.layout.value;
        match self.builtin_type(pathobj)? {
            t if t == v.t_string => self.rstring(pathobj),
            t if t == v.t_array => {
                let real = self.rarray_entry(pathobj, 1).and_then(|r| self.rstring(r));
                real.or_else(|| self.rarray_entry(pathobj, 0).and_then(|p| self.rstring(p)))
            }
            _ => None,
        }
    }

    fn rstring(&self, s: u64) -> Option<String> {
        let l = &self.layout.string;
        let flags = self.flags(s)?;
        if flags & self.layout.value.type_mask != self.layout.value.t_string {
            return None;
        }
        let (ptr, len) = if flags & l.noembed_flag != 0 {
            (
                self.space.read_u64(s + l.heap_ptr as u64).ok()?,
                self.space.read_u64(s + l.len as u64).ok()?,
            )
        } else {
            let len = match (l.embed_len_mask, l.embed_len_shift) {
                (Some(mask), Some(shift)) => (flags & mask) >> shift,
                _ => self.space.read_u64(s + l.len as u64).ok()?,
            };
            (s + l.embed_ary as u64, len)
        };
        let mut buf = vec![0u8; len.min(MAX_STRING) as usize];
        self.space.read(ptr, &mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf).into_owned())
    }

    fn rarray_entry(&self, ary: u64, index: u64) -> Option<u64> {
        let l = &self.layout.array;
        let flags = self.flags(ary)?;
        if flags & self.layout.value.type_mask != self.layout.value.t_array {
            return None;
        }
        let (ptr, len) = if flags & l.embed_flag != 0 {
            (
                ary + l.embed_ary as u64,
                (flags & l.embed_len_mask) >> l.embed_len_shift,
            )
        } else {
            (
                self.space.read_u64(ary + l.heap_ptr as u64).ok()?,
                self.space.read_u64(ary + l.len as u64).ok()?,
            )
        };
        if index >= len {
            return None;
        }
        self.space.read_u64(ptr + index * 8).ok()
    }

    /// The line of `pc` in `info`, as Ruby's calc_pos/get_insn_info compute
    /// it: from the table read with the iseq, else from the target's memory.
    pub fn line_of(&self, info: &Iseq, pc: u64) -> Option<u32> {
        let pos = info.position(pc)?;
        if let Some(table) = &info.lines {
            return table.at(pos);
        }
        let index = match info.insns_size {
            0 => return None,
            1 => 0,
            _ if info.succ_table == 0 => return None,
            size => {
                let read = |at: u64, buf: &mut [u8]| self.space.read(info.succ_table + at, buf).ok();
                let rank = lines::rank(read, pos)?;
                if rank == 0 || rank > size {
                    return None;
                }
                rank - 1
            }
        };
        let l = &self.layout.iseq;
        let entry = info.insns_body + index * l.insn_info_entry_size as u64 + l.insn_info_line_no as u64;
        let line = self.space.read_u32(entry).ok()?;
        Some(entry_line(info, line))
    }

    /// The line every instruction of `info` sits on, if they all sit on one
    /// (a one-line block or method): then any pc of it, even a stale one, is
    /// on that line.
    pub fn single_line(&self, info: &Iseq) -> Option<u32> {
        info.lines.as_ref()?.single()
    }

    /// `info`'s line table, read whole if it is not too large.
    fn line_table(&self, info: &Iseq) -> Option<LineTable> {
        let l = &self.layout.iseq;
        let entry = u64::from(l.insn_info_entry_size);
        let index_len = if info.insns_size > 1 {
            lines::index_len(info.size)
        } else {
            0
        };
        let entries_len = info.insns_size * entry;
        if entries_len > MAX_LINE_TABLE
            || index_len > MAX_LINE_TABLE
            || (index_len > 0 && info.succ_table == 0)
        {
            return None;
        }
        let mut raw = vec![0u8; entries_len as usize];
        self.space.read(info.insns_body, &mut raw).ok()?;
        let at = l.insn_info_line_no as usize;
        let lines: Vec<u32> = raw
            .chunks_exact(entry as usize)
            .map(|e| entry_line(info, u32_in(e, at).unwrap_or(0)))
            .collect();
        let mut index = vec![0u8; index_len as usize];
        if index_len > 0 {
            self.space.read(info.succ_table, &mut index).ok()?;
        }
        LineTable::decode(info.size, &index, &lines)
    }

    /// Thread#name of the Ruby thread at `th`, if it has one.
    pub fn thread_name(&self, th: u64) -> Option<String> {
        let t = &self.layout.thread;
        let name = self.space.read_u64(th + t.name? as u64).ok()?;
        self.rstring(name)
    }

    /// rb_id2str: an ID's name from the global symbol table. An ID names
    /// the same symbol for the life of the process (IDs are never reused).
    pub fn id_name(&self, id: u64) -> Option<String> {
        let s = &self.layout.symbols;
        let base = self.global_symbols.base(&*self.space, &self.layout)?;
        let serial = if id > s.last_op_id {
            id >> s.id_scope_shift
        } else {
            id
        };
        let bound = self.space.read_u32(base + s.last_id as u64).ok()? as u64;
        let exists = if s.last_id_is_next {
            serial < bound
        } else {
            serial <= bound
        };
        if serial == 0 || !exists {
            return None;
        }
        let ids = self.space.read_u64(base + s.ids as u64).ok()?;
        let chunk = self.rarray_entry(ids, serial / s.id_entry_unit)?;
        let name = self.rarray_entry(chunk, (serial % s.id_entry_unit) * 2)?;
        self.rstring(name)
    }
}

/// An entry's line: line 0 entries are bookkeeping at the iseq's start (a
/// frame pushed but not started sits on one in some versions), so they are
/// on its first line.
fn entry_line(info: &Iseq, line: u32) -> u32 {
    match line {
        0 => info.first_lineno,
        line => line,
    }
}

/// The little-endian u64 at byte `at` of `raw`, if `raw` holds one there.
fn u64_in(raw: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(raw.get(at..at + 8)?.try_into().ok()?))
}

/// The little-endian u32 at byte `at` of `raw`, if `raw` holds one there.
fn u32_in(raw: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(raw.get(at..at + 4)?.try_into().ok()?))
}
