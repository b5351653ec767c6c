//! The only symbolizer: turns frame identities from BPF (iseq + pc, method
//! entry) into labels, paths and lines by reading the target's memory, the
//! way Ruby itself computes a backtrace. Results are cached per epoch, so a
//! frame whose data GC moved is re-read rather than remembered wrong.

use std::collections::HashMap;
use std::rc::Rc;

use flamegraphs::Frame;
use ruby_structs::Layout;

use crate::bpf::types;
use crate::process::Process;
use crate::target::RubyTarget;

/// Longest string read from the target (labels, paths).
const MAX_STRING: u64 = 4096;
/// Entries of Ruby's line-table index below this position are packed in `imm_part`.
const IMMEDIATE_TABLE_SIZE: u64 = 54;
const SUCC_BLOCK_SIZE: u64 = 80;

#[derive(Debug)]
struct IseqInfo {
    label: String,
    path: String,
    first_lineno: u32,
    encoded: u64,
    size: u64,
    insns_body: u64,
    insns_size: u64,
    succ_table: u64,
}

pub struct Resolver {
    process: Process,
    layout: Layout,
    global_symbols: Option<u64>,
    iseqs: HashMap<u64, Option<Rc<IseqInfo>>>,
    lines: HashMap<(u64, u64), Option<u32>>,
    methods: HashMap<u64, Option<String>>,
    /// Frames that could not be named (shown as `[unknown]`).
    pub unknown_frames: u64,
}

impl Resolver {
    pub fn new(target: &RubyTarget) -> Self {
        Self {
            process: target.process,
            layout: target.layout.clone(),
            global_symbols: target.global_symbols,
            iseqs: HashMap::new(),
            lines: HashMap::new(),
            methods: HashMap::new(),
            unknown_frames: 0,
        }
    }

    /// Forgets what was read: objects may have moved or been freed since.
    pub fn new_epoch(&mut self) {
        self.iseqs.clear();
        self.lines.clear();
        self.methods.clear();
    }

    pub fn frame(&mut self, f: &types::rprof_frame) -> Frame {
        let resolved = if f.iseq != 0 {
            self.ruby_frame(f.iseq, f.pc)
        } else {
            self.cfunc_frame(f.cme)
        };
        resolved.unwrap_or_else(|| {
            self.unknown_frames += 1;
            Frame::marker("[unknown]")
        })
    }

    fn ruby_frame(&mut self, iseq: u64, pc: u64) -> Option<Frame> {
        let info = self.iseq(iseq)?;
        let line = match self.lines.get(&(iseq, pc)) {
            Some(line) => *line,
            None => {
                let line = self.line_of(&info, pc);
                self.lines.insert((iseq, pc), line);
                line
            }
        }?;
        Some(Frame::code(info.label.clone(), info.path.clone(), line))
    }

    fn cfunc_frame(&mut self, cme: u64) -> Option<Frame> {
        if let Some(name) = self.methods.get(&cme) {
            return name.clone().map(Frame::native);
        }
        let name = self.method_name(cme);
        self.methods.insert(cme, name.clone());
        name.map(Frame::native)
    }

    fn iseq(&mut self, iseq: u64) -> Option<Rc<IseqInfo>> {
        if let Some(info) = self.iseqs.get(&iseq) {
            return info.clone();
        }
        let info = self.read_iseq(iseq).map(Rc::new);
        self.iseqs.insert(iseq, info.clone());
        info
    }

    fn is_object(v: u64) -> bool {
        v >= 0x1000 && v & 7 == 0
    }

    fn builtin_type(&self, v: u64) -> Option<u64> {
        if !Self::is_object(v) {
            return None;
        }
        Some(self.process.read_u64(v).ok()? & self.layout.value.type_mask)
    }

    fn is_imemo(&self, v: u64, imemo_type: u64) -> bool {
        let Some(flags) = Self::is_object(v).then(|| self.process.read_u64(v).ok()).flatten() else {
            return false;
        };
        let l = &self.layout;
        flags & l.value.type_mask == l.value.t_imemo
            && (flags >> l.imemo.type_shift) & l.imemo.type_mask == imemo_type
    }

    fn read_iseq(&self, iseq: u64) -> Option<IseqInfo> {
        let l = &self.layout.iseq;
        if !self.is_imemo(iseq, self.layout.imemo.type_iseq) {
            return None;
        }
        let body = self.process.read_u64(iseq + l.body as u64).ok()?;
        if !Self::is_object(body) {
            return None;
        }
        let mut raw = [0u8; 256];
        self.process.read(body, &mut raw).ok()?;
        let u64_at = |off: u32| -> u64 {
            let o = off as usize;
            raw.get(o..o + 8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                .unwrap_or(0)
        };
        let u32_at = |off: u32| -> u64 {
            let o = off as usize;
            raw.get(o..o + 4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as u64)
                .unwrap_or(0)
        };
        let first_lineno = if l.first_lineno_is_fixnum != 0 {
            u64_at(l.first_lineno) >> 1
        } else {
            u32_at(l.first_lineno)
        } as u32;
        Some(IseqInfo {
            label: self.rstring(u64_at(l.label))?,
            path: self.path_of(u64_at(l.pathobj))?,
            first_lineno,
            encoded: u64_at(l.iseq_encoded),
            size: u32_at(l.iseq_size),
            insns_body: u64_at(l.insns_info_body),
            insns_size: u32_at(l.insns_info_size),
            succ_table: u64_at(l.succ_index_table),
        })
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
        let flags = self.process.read_u64(s).ok().filter(|_| Self::is_object(s))?;
        if flags & self.layout.value.type_mask != self.layout.value.t_string {
            return None;
        }
        let (ptr, len) = if flags & l.noembed_flag != 0 {
            (
                self.process.read_u64(s + l.heap_ptr as u64).ok()?,
                self.process.read_u64(s + l.len as u64).ok()?,
            )
        } else {
            let len = match (l.embed_len_mask, l.embed_len_shift) {
                (Some(mask), Some(shift)) => (flags & mask) >> shift,
                _ => self.process.read_u64(s + l.len as u64).ok()?,
            };
            (s + l.embed_ary as u64, len)
        };
        let mut buf = vec![0u8; len.min(MAX_STRING) as usize];
        self.process.read(ptr, &mut buf).ok()?;
        Some(String::from_utf8_lossy(&buf).into_owned())
    }

    fn rarray_entry(&self, ary: u64, index: u64) -> Option<u64> {
        let l = &self.layout.array;
        let flags = self.process.read_u64(ary).ok()?;
        if flags & self.layout.value.type_mask != self.layout.value.t_array {
            return None;
        }
        let (ptr, len) = if flags & l.embed_flag != 0 {
            (ary + l.embed_ary as u64, (flags & l.embed_len_mask) >> l.embed_len_shift)
        } else {
            (
                self.process.read_u64(ary + l.heap_ptr as u64).ok()?,
                self.process.read_u64(ary + l.len as u64).ok()?,
            )
        };
        if index >= len {
            return None;
        }
        self.process.read_u64(ptr + index * 8).ok()
    }

    /// The line of `pc` in `info`, as Ruby's calc_pos/get_insn_info compute it.
    fn line_of(&self, info: &IseqInfo, pc: u64) -> Option<u32> {
        if pc < info.encoded || pc > info.encoded + info.size * 8 {
            return None;
        }
        let n = (pc - info.encoded) / 8;
        // pc points at the next instruction once one has started.
        let pos = n.saturating_sub(1);
        let index = match info.insns_size {
            0 => return None,
            1 => 0,
            size => {
                let rank = self.succ_index_lookup(info.succ_table, pos)?;
                if rank == 0 || rank > size {
                    return None;
                }
                rank - 1
            }
        };
        let l = &self.layout.iseq;
        let entry = info.insns_body + index * l.insn_info_entry_size as u64 + l.insn_info_line_no as u64;
        self.process.read_u32(entry).ok()
    }

    /// Ruby's succinct bit vector lookup (iseq.c succ_index_lookup).
    fn succ_index_lookup(&self, table: u64, pos: u64) -> Option<u64> {
        if table == 0 {
            return None;
        }
        if pos < IMMEDIATE_TABLE_SIZE {
            let word = self.process.read_u64(table + 8 * (pos / 9)).ok()?;
            return Some((word >> (7 * (pos % 9))) & 0x7f);
        }
        let x = pos - IMMEDIATE_TABLE_SIZE;
        let block = table + 8 * (IMMEDIATE_TABLE_SIZE / 9) + (x / 512) * SUCC_BLOCK_SIZE;
        let mut raw = [0u8; SUCC_BLOCK_SIZE as usize];
        self.process.read(block, &mut raw).ok()?;
        let word = |off: usize| u64::from_le_bytes(raw[off..off + 8].try_into().unwrap_or([0; 8]));
        let rank = u32::from_le_bytes(raw[0..4].try_into().unwrap_or([0; 4])) as u64;
        let small_ranks = word(8);
        let bit = x % 512;
        let j = bit / 64;
        let small = if j > 0 { (small_ranks >> ((j - 1) * 9)) & 0x1ff } else { 0 };
        let bits = word(16 + 8 * j as usize);
        let pop = (bits << (63 - bit % 64)).count_ones() as u64;
        Some(rank + small + pop)
    }

    /// The name of a C method from its callable method entry.
    fn method_name(&self, cme: u64) -> Option<String> {
        let l = &self.layout.method_entry;
        if !self.is_imemo(cme, self.layout.imemo.type_ment) {
            return None;
        }
        let def = self.process.read_u64(cme + l.def as u64).ok()?;
        if def == 0 {
            return None;
        }
        let id = self.process.read_u64(def + l.def_original_id as u64).ok()?;
        self.id_name(id)
    }

    /// rb_id2str: an ID's name from the global symbol table.
    fn id_name(&self, id: u64) -> Option<String> {
        let s = &self.layout.symbols;
        let base = self.global_symbols?;
        let serial = if id > s.last_op_id { id >> s.id_scope_shift } else { id };
        let last_id = self.process.read_u32(base + s.last_id as u64).ok()? as u64;
        if serial == 0 || serial > last_id {
            return None;
        }
        let ids = self.process.read_u64(base + s.ids as u64).ok()?;
        let chunk = self.rarray_entry(ids, serial / s.id_entry_unit)?;
        let name = self.rarray_entry(chunk, (serial % s.id_entry_unit) * 2)?;
        self.rstring(name)
    }
}
