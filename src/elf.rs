//! The few things rprof reads from an ELF file: symbols (exported or in the
//! full symbol table), the TLS segment, the GOT slots of TLS relocations, and
//! the bytes of a function for disassembly.

use std::fs::File;
use std::path::Path;

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use object::elf;
use object::read::elf::{ElfFile64, ProgramHeader};
use object::{
    Endianness, Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationFlags, RelocationTarget,
};

use crate::process::Mapping;

pub struct ElfImage {
    data: Mmap,
}

#[derive(Debug, Clone, Copy)]
pub struct Symbol {
    /// st_value: an address for code and data, an offset in the TLS block for TLS.
    pub value: u64,
    pub tls: bool,
}

/// The PT_TLS program header.
#[derive(Debug, Clone, Copy)]
pub struct TlsSegment {
    pub vaddr: u64,
    pub memsz: u64,
    pub align: u64,
}

/// How a TLS symbol is reached, read off the dynamic relocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsReloc {
    /// `R_X86_64_DTPMOD64` at this GOT address: general/local dynamic.
    Dtpmod { got: u64 },
    /// `R_X86_64_TPOFF64` at this GOT address: initial exec.
    Tpoff { got: u64 },
}

impl ElfImage {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let data = map(&file).with_context(|| format!("mapping {}", path.display()))?;
        let image = Self { data };
        image
            .parse()
            .with_context(|| format!("parsing ELF {}", path.display()))?;
        Ok(image)
    }

    fn parse(&self) -> Result<ElfFile64<'_, Endianness>> {
        Ok(ElfFile64::parse(&self.data[..])?)
    }

    /// A symbol by name, from .dynsym or, when the file has one, .symtab.
    pub fn symbol(&self, name: &str) -> Option<Symbol> {
        let file = self.parse().ok()?;
        let found = file
            .dynamic_symbols()
            .chain(file.symbols())
            .find(|s| s.name() == Ok(name) && s.is_definition())?;
        Some(Symbol {
            value: found.address(),
            tls: found.kind() == object::SymbolKind::Tls,
        })
    }

    pub fn is_shared_object(&self) -> bool {
        self.parse()
            .map(|f| f.elf_header().e_type.get(f.endian()) == elf::ET_DYN && !self.has_interp())
            .unwrap_or(false)
    }

    fn has_interp(&self) -> bool {
        self.program_headers().iter().any(|p| p.0 == elf::PT_INTERP)
    }

    /// (p_type, p_vaddr, p_offset, p_memsz, p_align) of every program header.
    fn program_headers(&self) -> Vec<(u32, u64, u64, u64, u64)> {
        let Ok(file) = self.parse() else {
            return Vec::new();
        };
        let e = file.endian();
        file.elf_program_headers()
            .iter()
            .map(|p| {
                (
                    p.p_type(e),
                    p.p_vaddr(e),
                    p.p_offset(e),
                    p.p_memsz(e),
                    p.p_align(e),
                )
            })
            .collect()
    }

    pub fn tls_segment(&self) -> Option<TlsSegment> {
        self.program_headers()
            .into_iter()
            .find(|p| p.0 == elf::PT_TLS)
            .map(|p| TlsSegment {
                vaddr: p.1,
                memsz: p.3,
                align: p.4.max(1),
            })
    }

    /// The GOT slot through which the dynamic linker resolves TLS symbol `name`.
    pub fn tls_reloc(&self, name: &str) -> Option<TlsReloc> {
        let file = self.parse().ok()?;
        let dynsyms = file.dynamic_symbol_table()?;
        for (offset, reloc) in file.dynamic_relocations()? {
            let RelocationFlags::Elf { r_type } = reloc.flags() else {
                continue;
            };
            let RelocationTarget::Symbol(index) = reloc.target() else {
                continue;
            };
            let Ok(sym) = dynsyms.symbol_by_index(index) else {
                continue;
            };
            if sym.name() != Ok(name) {
                continue;
            }
            match r_type {
                elf::R_X86_64_DTPMOD64 => return Some(TlsReloc::Dtpmod { got: offset }),
                elf::R_X86_64_TPOFF64 => return Some(TlsReloc::Tpoff { got: offset }),
                _ => {}
            }
        }
        None
    }

    /// `len` bytes of the file's image at virtual address `vaddr` (from a section with file data).
    pub fn bytes_at(&self, vaddr: u64, len: u64) -> Option<Vec<u8>> {
        let file = self.parse().ok()?;
        for section in file.sections() {
            let (start, size) = (section.address(), section.size());
            if vaddr >= start && vaddr < start + size {
                let data = section.data().ok()?;
                let from = (vaddr - start) as usize;
                let to = (from + len as usize).min(data.len());
                return Some(data[from..to].to_vec());
            }
        }
        None
    }

    /// The load bias of this file in a process, from the mappings of its path:
    /// runtime address = bias + st_value.
    pub fn load_bias(&self, mappings: &[&Mapping]) -> Option<u64> {
        let loads: Vec<_> = self
            .program_headers()
            .into_iter()
            .filter(|p| p.0 == elf::PT_LOAD)
            .collect();
        let first = mappings.iter().min_by_key(|m| m.start)?;
        // The PT_LOAD holding the first mapped file offset tells which vaddr starts there.
        let seg = loads.iter().find(|p| {
            let page_off = p.2 & !0xfff;
            first.offset >= page_off && first.offset < p.2 + p.3.max(1)
        })?;
        let vaddr = seg.1 - (seg.2 - first.offset);
        Some(first.start.wrapping_sub(vaddr & !0xfff))
    }
}

/// A regular file mapped read-only. Its pages stay the page cache's: only
/// those parsed are touched, and they are let go with the map. Read whole
/// instead, every program exec'd beside the agent put its largest library on
/// rprof's heap (over 100 MB for rustdoc's), and glibc kept some 20 MB of it.
pub fn map(file: &File) -> Result<Mmap> {
    if !file.metadata()?.is_file() {
        // A device mapped executable (`/dev/zero`) has no ELF to read, and no end.
        bail!("not a regular file");
    }
    // SAFETY: read-only, and dropped once parsed (the target's VM while it is
    // inspected, a native file while its table is built). A file truncated in
    // place meanwhile would fault rprof as it faults every process mapping it;
    // packages and deploys replace files by renaming, which leaves this map whole.
    Ok(unsafe { Mmap::map(file) }?)
}

/// The thread-pointer offset of the executable's TLS symbol at `sym_value`
/// (x86_64 TLS variant II: the executable's block sits right below the TCB).
pub fn exec_tls_tp_offset(tls: TlsSegment, sym_value: u64) -> i64 {
    let align = tls.align.max(1);
    let firstbyte = tls.vaddr.wrapping_neg() & (align - 1);
    let block = (tls.memsz - firstbyte).div_ceil(align) * align + firstbyte;
    sym_value as i64 - block as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_offset_of_the_executables_tls_block() {
        // 16 bytes of TLS, 8-aligned: the block is the 16 bytes under the TCB.
        let tls = TlsSegment {
            vaddr: 0x3a43d0,
            memsz: 0x10,
            align: 8,
        };
        assert_eq!(exec_tls_tp_offset(tls, 8), -8);
        let tls = TlsSegment {
            vaddr: 0x1000,
            memsz: 0x24,
            align: 16,
        };
        assert_eq!(exec_tls_tp_offset(tls, 0), -48);
    }

    #[test]
    fn finds_our_own_symbols_and_bias() {
        let exe = std::fs::read_link("/proc/self/exe").expect("exe");
        let image = ElfImage::open(&exe).expect("parses");
        assert!(!image.is_shared_object(), "a test binary is a program");
        let maps = crate::process::Process::open(std::process::id())
            .expect("self")
            .maps()
            .expect("maps");
        let ours: Vec<&Mapping> = maps.iter().filter(|m| Path::new(&m.path) == exe).collect();
        let bias = image.load_bias(&ours).expect("bias");
        let sym = image.symbol("main").expect("main is in .symtab");
        let addr = bias + sym.value;
        assert!(ours.iter().any(|m| addr >= m.start && addr < m.end));
    }
}
