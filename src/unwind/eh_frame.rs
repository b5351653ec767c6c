//! An ELF file's `.eh_frame` (parsed by gimli) as the compact table BPF
//! unwinds with: rows `(pc, rule, back)` sorted by pc, each rule saying how
//! to find the caller's frame from this one (x86-64: the CFA from rsp, rbp or
//! an expression; rbp restored or not; the return address at CFA - 8), and
//! `back` how many rows before it its function's first row is (so BPF knows
//! where a frame's function starts, and counts stacks by function, not by
//! instruction). Consecutive rows of a function with the same rule are
//! merged, and pcs no FDE covers get an explicit "no CFI" row, so a lookup
//! never borrows a neighbour's rule.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use gimli::{
    BaseAddresses, CfaRule, CieOrFde, EhFrame, LittleEndian, Operation, Register, RegisterRule,
    UnwindContext, UnwindSection,
};
use object::{Object, ObjectSection};

use crate::bpf::types;

const RBP: Register = Register(6);
const RSP: Register = Register(7);
const RA: Register = Register(16);

/// How one frame is unwound (see `struct rprof_unwind_rule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Rule {
    pub cfa: u8,
    pub reg: u8,
    pub rbp: u8,
    pub cfa_off: i32,
    pub rbp_off: i32,
    pub deref_off: i32,
}

impl Rule {
    fn cfa(kind: types::rprof_cfa_kind) -> Self {
        Self {
            cfa: kind.0 as u8,
            ..Self::default()
        }
    }

    /// No CFI here.
    pub fn none() -> Self {
        Self::cfa(types::rprof_cfa_kind::RPROF_CFA_NONE)
    }

    pub fn to_bpf(self) -> types::rprof_unwind_rule {
        types::rprof_unwind_rule {
            cfa: self.cfa,
            reg: self.reg,
            rbp: self.rbp,
            pad: 0,
            cfa_off: self.cfa_off,
            rbp_off: self.rbp_off,
            deref_off: self.deref_off,
        }
    }
}

/// Every distinct rule of every table, numbered once (BPF's `unwind_rules`).
#[derive(Default)]
pub struct Rules {
    index: HashMap<Rule, u32>,
    pub list: Vec<Rule>,
}

impl Rules {
    pub fn id(&mut self, rule: Rule) -> u32 {
        *self.index.entry(rule).or_insert_with(|| {
            self.list.push(rule);
            (self.list.len() - 1) as u32
        })
    }
}

/// An FDE's start, end and rows.
type Fde = (u64, u64, Vec<(u64, Rule)>);

/// One file's table, its rules numbered in `Rules`.
#[derive(Debug, Default)]
pub struct Table {
    /// Row pcs are offsets from this vaddr.
    pub base: u64,
    /// (pc from `base`, rule, rows back to its function's first row)
    pub rows: Vec<(u32, u32, u16)>,
    /// For each page of code (`RPROF_UNWIND_PAGE_SHIFT`) from `base`: the
    /// row covering its first byte, so that a lookup searches one page's rows.
    pub pages: Vec<u32>,
    /// Where each FDE starts (vaddrs, sorted): the functions' first
    /// instructions, known even when the file has no symbols for them.
    pub function_starts: Vec<u64>,
    /// Most functions keep a frame pointer (rbp = CFA - 16 past their prologue).
    pub frame_pointers: bool,
    /// Rules rprof cannot follow, for the summary of a build.
    pub unsupported: usize,
}

/// Builds the table of an ELF file's bytes; an empty table when it has no
/// `.eh_frame`.
pub fn build(data: &[u8], rules: &mut Rules) -> Result<Table> {
    let file = object::File::parse(data).context("parsing the ELF file")?;
    let Some(section) = file.section_by_name(".eh_frame") else {
        return Ok(Table::default());
    };
    let bytes = section.data().context("reading .eh_frame")?;
    let mut bases = BaseAddresses::default().set_eh_frame(section.address());
    if let Some(text) = file.section_by_name(".text") {
        bases = bases.set_text(text.address());
    }
    if let Some(got) = file.section_by_name(".got") {
        bases = bases.set_got(got.address());
    }
    let eh = EhFrame::new(bytes, LittleEndian);
    let mut ctx = Box::new(UnwindContext::new());
    let mut fdes: Vec<Fde> = Vec::new();
    let mut unsupported = 0;
    let (mut with_fp, mut sized) = (0usize, 0usize);
    let mut entries = eh.entries(&bases);
    while let Some(entry) = entries.next().context("reading an .eh_frame entry")? {
        let CieOrFde::Fde(partial) = entry else { continue };
        let Ok(fde) = partial.parse(EhFrame::cie_from_offset) else {
            continue;
        };
        if fde.len() == 0 {
            continue;
        }
        let signal = fde.is_signal_trampoline();
        let mut rows = Vec::new();
        let mut keeps_fp = false;
        let Ok(mut table) = fde.rows(&eh, &bases, &mut ctx) else {
            continue;
        };
        while let Ok(Some(row)) = table.next_row() {
            let rule = if signal {
                Rule::cfa(types::rprof_cfa_kind::RPROF_CFA_SIGNAL)
            } else {
                convert(&eh, row.cfa(), row.register(RBP), row.register(RA))
            };
            if rule.cfa == types::rprof_cfa_kind::RPROF_CFA_UNSUPPORTED.0 as u8 {
                unsupported += 1;
            }
            if rule.cfa == types::rprof_cfa_kind::RPROF_CFA_RBP.0 as u8
                && rule.cfa_off == 16
                && rule.rbp == types::rprof_rbp_kind::RPROF_RBP_AT_CFA.0 as u8
                && rule.rbp_off == -16
            {
                keeps_fp = true;
            }
            rows.push((row.start_address(), rule));
        }
        // Functions too small for a frame do not count either way.
        if fde.len() >= 32 {
            sized += 1;
            with_fp += usize::from(keeps_fp);
        }
        fdes.push((fde.initial_address(), fde.end_address(), rows));
    }
    if fdes.is_empty() {
        return Ok(Table::default());
    }
    fdes.sort_by_key(|f| f.0);
    let base = fdes[0].0;
    let last_end = fdes.iter().map(|f| f.1).max().unwrap_or(base);
    if last_end - base > u32::MAX as u64 {
        bail!("code spans more than 4 GiB");
    }

    let none = rules.id(Rule::none());
    let mut rows = Rows::default();
    let mut covered_to = base;
    for (i, (start, end, fde_rows)) in fdes.iter().enumerate() {
        if *start < covered_to {
            continue; // overlaps the FDE before it: the first one wins
        }
        if *start > covered_to && i > 0 {
            rows.push((covered_to - base) as u32, none, true);
        }
        let stop = fdes
            .get(i + 1)
            .map_or(*end, |next| (*end).min(next.0.max(*start)));
        let mut first = true;
        for (pc, rule) in fde_rows {
            if *pc >= *start && *pc < stop {
                // Rule ids are 16 bits in BPF; past that, no CFI.
                let id = Some(rules.id(*rule))
                    .filter(|&id| id <= u16::MAX as u32)
                    .unwrap_or(none);
                rows.push((*pc - base) as u32, id, first);
                first = false;
            }
        }
        covered_to = *end;
    }
    rows.push((covered_to.max(last_end) - base) as u32, none, true);
    let rows = rows.rows;
    let mut function_starts: Vec<u64> = fdes.iter().map(|f| f.0).collect();
    function_starts.dedup();
    let pages = page_index(&rows);
    Ok(Table {
        base,
        rows,
        pages,
        function_starts,
        frame_pointers: sized > 0 && with_fp * 2 >= sized,
        unsupported,
    })
}

/// Rows as they are built: (pc, rule, rows back to the function's first).
#[derive(Default)]
struct Rows {
    rows: Vec<(u32, u32, u16)>,
    /// The current function's first row.
    first: usize,
}

impl Rows {
    /// A row from `pc` on; `starts` a function (or a gap), which is never
    /// merged into the row before.
    fn push(&mut self, pc: u32, rule: u32, starts: bool) {
        let rows = &mut self.rows;
        match rows.last_mut() {
            // A later row at the same pc wins (the next FDE's first row).
            Some(last) if last.0 == pc => {
                last.1 = rule;
                if starts {
                    last.2 = 0;
                    self.first = rows.len() - 1;
                }
            }
            // Within a function, the same rule goes on.
            Some(last) if last.1 == rule && !starts => {}
            _ => {
                if starts {
                    self.first = rows.len();
                }
                // A function of more than 65535 rows: its start is unknown.
                let back = u16::try_from(rows.len() - self.first).unwrap_or(u16::MAX);
                rows.push((pc, rule, back));
            }
        }
        // The row before may now carry the same rule, within the function.
        let n = rows.len();
        if n >= 2 && rows[n - 1].2 != 0 && rows[n - 2].1 == rows[n - 1].1 {
            rows.pop();
        }
    }
}

/// For each page from the first row's: the last row at or below its start.
fn page_index(rows: &[(u32, u32, u16)]) -> Vec<u32> {
    let shift = types::rprof_unwind_page::RPROF_UNWIND_PAGE_SHIFT.0;
    let Some(&(last, _, _)) = rows.last() else {
        return Vec::new();
    };
    (0..=(last >> shift))
        .map(|page| {
            let start = page << shift;
            rows.partition_point(|&(pc, _, _)| pc <= start).saturating_sub(1) as u32
        })
        .collect()
}

/// One CFI row as a rule BPF can follow.
fn convert<R: gimli::Reader<Offset = usize>>(
    eh: &EhFrame<R>,
    cfa: &CfaRule<usize>,
    rbp: Option<RegisterRule<usize>>,
    ra: Option<RegisterRule<usize>>,
) -> Rule {
    use types::rprof_cfa_kind as K;
    use types::rprof_rbp_kind as B;
    let unsupported = Rule::cfa(K::RPROF_CFA_UNSUPPORTED);
    match ra {
        Some(RegisterRule::Offset(-8)) => {}
        // The outermost frame (_start, a thread's clone) says so.
        None | Some(RegisterRule::Undefined) => return Rule::cfa(K::RPROF_CFA_END),
        Some(_) => return unsupported,
    }
    let mut rule = match cfa {
        CfaRule::RegisterAndOffset { register, offset } => {
            let Ok(offset) = i32::try_from(*offset) else {
                return unsupported;
            };
            let kind = match *register {
                RSP => K::RPROF_CFA_RSP,
                RBP => K::RPROF_CFA_RBP,
                Register(r) if r < 16 => K::RPROF_CFA_REG,
                _ => return unsupported,
            };
            Rule {
                cfa: kind.0 as u8,
                reg: register.0 as u8,
                cfa_off: offset,
                ..Rule::default()
            }
        }
        CfaRule::Expression(expr) => match expr.get(eh).ok().and_then(|e| expression(&e)) {
            Some(rule) => rule,
            None => return unsupported,
        },
    };
    match rbp {
        None | Some(RegisterRule::SameValue | RegisterRule::Undefined) => {
            rule.rbp = B::RPROF_RBP_SAME.0 as u8;
        }
        Some(RegisterRule::Offset(off)) => match i32::try_from(off) {
            Ok(off) => {
                rule.rbp = B::RPROF_RBP_AT_CFA.0 as u8;
                rule.rbp_off = off;
            }
            Err(_) => rule.rbp = B::RPROF_RBP_UNKNOWN.0 as u8,
        },
        Some(_) => rule.rbp = B::RPROF_RBP_UNKNOWN.0 as u8,
    }
    rule
}

/// The CFA expressions compilers emit on x86-64: GCC's PLT stubs
/// (`rsp + 8 + ((rip & 15) >= N) << 3`) and a CFA saved in the frame after
/// the stack was realigned (`*(rbp|rsp + off) [+ k]`). Others: None.
fn expression<R: gimli::Reader<Offset = usize>>(expr: &gimli::Expression<R>) -> Option<Rule> {
    use types::rprof_cfa_kind as K;
    let encoding = gimli::Encoding {
        format: gimli::Format::Dwarf32,
        version: 4,
        address_size: 8,
    };
    let mut ops = Vec::new();
    let mut iter = expr.clone().operations(encoding);
    while let Ok(Some(op)) = iter.next() {
        ops.push(op);
        if ops.len() > 12 {
            return None;
        }
    }
    use Operation as O;
    match ops.as_slice() {
        [O::RegisterOffset {
            register: RSP,
            offset: 8,
            ..
        }, O::RegisterOffset {
            register: RA,
            offset: 0,
            ..
        }, O::UnsignedConstant { value: 15 }, O::And, O::UnsignedConstant { value: threshold }, O::Ge, O::UnsignedConstant { value: 3 }, O::Shl, O::Plus] => {
            Some(Rule {
                cfa: K::RPROF_CFA_PLT.0 as u8,
                cfa_off: *threshold as i32,
                ..Rule::default()
            })
        }
        [O::RegisterOffset { register, offset, .. }, O::Deref { .. }, rest @ ..]
            if (*register == RSP || *register == RBP) && rest.len() <= 1 =>
        {
            let deref_off = match rest {
                [] => 0,
                [O::PlusConstant { value }] => i32::try_from(*value).ok()?,
                _ => return None,
            };
            Some(Rule {
                cfa: K::RPROF_CFA_DEREF.0 as u8,
                reg: register.0 as u8,
                cfa_off: i32::try_from(*offset).ok()?,
                deref_off,
                ..Rule::default()
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_of(path: &str) -> (Table, Rules) {
        let data = std::fs::read(path).expect("a system library");
        let mut rules = Rules::default();
        let table = build(&data, &mut rules).expect("table");
        (table, rules)
    }

    /// Debian's libc: no frame pointers, a signal trampoline, PLT stubs.
    #[test]
    fn libc_table() {
        let (t, rules) = table_of("/lib/x86_64-linux-gnu/libc.so.6");
        assert!(t.rows.len() > 5000, "{} rows", t.rows.len());
        assert!(
            t.rows.windows(2).all(|w| w[0].0 < w[1].0),
            "sorted, one row per pc"
        );
        assert!(
            t.rows.windows(2).all(|w| w[0].1 != w[1].1 || w[1].2 == 0),
            "merged within functions"
        );
        // Every row leads back to a function's first row, at an FDE start.
        for (i, row) in t.rows.iter().enumerate().take(t.rows.len() - 1) {
            let first = &t.rows[i - row.2 as usize];
            assert_eq!(first.2, 0);
            let start = t.base + first.0 as u64;
            assert!(
                t.function_starts.binary_search(&start).is_ok()
                    || rules.list[first.1 as usize] == Rule::none(),
                "row {i} leads to {start:#x}, no function start"
            );
        }
        assert!(!t.frame_pointers);
        let kinds: Vec<u8> = rules.list.iter().map(|r| r.cfa).collect();
        assert!(kinds.contains(&(types::rprof_cfa_kind::RPROF_CFA_SIGNAL.0 as u8)));
        assert!(kinds.contains(&(types::rprof_cfa_kind::RPROF_CFA_END.0 as u8)));
        assert!(kinds.contains(&(types::rprof_cfa_kind::RPROF_CFA_PLT.0 as u8)));
        // The last row closes the table.
        assert_eq!(rules.list[t.rows[t.rows.len() - 1].1 as usize], Rule::none());
        // Each page's entry is the row covering its start.
        for (page, &row) in t.pages.iter().enumerate() {
            let start = (page as u32) << types::rprof_unwind_page::RPROF_UNWIND_PAGE_SHIFT.0;
            let row = row as usize;
            assert!(t.rows[row].0 <= start && t.rows.get(row + 1).is_none_or(|r| r.0 > start));
        }
        assert!(t.unsupported < 50, "{} unsupported rows", t.unsupported);
    }
}
