//! The ELF files mapped executable by followed processes, each known once
//! (by build-id, else by device and inode) whatever process maps it, with
//! what BPF and the symbolizer need of it: its unwind table, where its
//! functions start, its load segments, a handle that opens it from rprof
//! even in another mount namespace or after the process ended, and its
//! separate debug file if the target's system has one.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use object::read::elf::{ElfFile64, ProgramHeader, SectionHeader};
use object::{elf, Endianness, Object, ObjectSection};

use super::eh_frame::{self, Rules, Table};

/// What makes two mappings the same file.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FileKey {
    BuildId(Vec<u8>),
    Inode {
        dev: String,
        inode: u64,
    },
    /// The vDSO, by the bytes of its image.
    Vdso(u64),
}

/// A PT_LOAD segment: file offset, vaddr, size in the file.
#[derive(Debug, Clone, Copy)]
struct Segment {
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

pub struct NativeFile {
    /// Never given to another file (ids are reused).
    pub serial: u64,
    /// The file's name as shown in frames without a symbol (`libruby.so.3.4+0x1f2e0`).
    pub name: String,
    /// Opens the file from rprof (`/proc/self/fd/N`), for the symbolizer.
    pub path: PathBuf,
    /// A separate debug file with the full symbol table, if the target's system has one.
    pub debug_file: Option<PathBuf>,
    /// The vaddrs where its functions start (from its CFI), sorted.
    pub function_starts: Vec<u64>,
    /// Where its table is in BPF.
    pub rows: Option<super::Placed>,
    pub table_base: u64,
    pub frame_pointers: bool,
    segments: Vec<Segment>,
    plt: Plt,
    /// Address spaces that map it.
    pub refs: u32,
    _handle: File,
}

/// The PLT: stubs that jump to functions of other files, which symbol
/// tables do not name.
#[derive(Debug, Default)]
struct Plt {
    /// `.plt`: (start, size); its entry i + 1 jumps to `names[i]`.
    plt: (u64, u64),
    names: Vec<String>,
    /// Other stub sections (`.plt.got`, `.plt.sec`).
    others: Vec<(u64, u64)>,
}

/// A file opened from a mapping, parsed, with its table built.
pub struct Opened {
    pub key: FileKey,
    pub name: String,
    pub table: Table,
    pub debug_file: Option<PathBuf>,
    segments: Vec<Segment>,
    plt: Plt,
    handle: File,
    pub build_time: std::time::Duration,
    pub bytes: usize,
}

impl Opened {
    /// Opens the file at the first of `candidates` that opens, and builds
    /// its table; `root` is the target's root, where its debug files are.
    pub fn open(
        candidates: &[PathBuf],
        maps_path: &str,
        root: &Path,
        inode: (String, u64),
        rules: &mut Rules,
    ) -> Result<Self> {
        let (handle, _) = candidates
            .iter()
            .find_map(|c| File::open(c).ok().map(|f| (f, c)))
            .with_context(|| format!("opening {maps_path}"))?;
        let data = crate::elf::map(&handle).with_context(|| format!("mapping {maps_path}"))?;
        let name = maps_path
            .trim_end_matches(" (deleted)")
            .rsplit('/')
            .next()
            .unwrap_or(maps_path)
            .to_string();
        let mut opened = Self::parse(&data, name, handle, rules)?;
        opened.key = match build_id(&data) {
            Some(id) => FileKey::BuildId(id),
            None => FileKey::Inode {
                dev: inode.0,
                inode: inode.1,
            },
        };
        opened.debug_file = debug_file(&data, maps_path, root);
        Ok(opened)
    }

    /// The vDSO of a process, from the bytes of its image (kept in an
    /// anonymous file so that the symbolizer can open it like any other).
    pub fn vdso(image: &[u8], rules: &mut Rules) -> Result<Self> {
        use std::io::Write;
        // SAFETY: memfd_create with a NUL-terminated name and no flags of note.
        let fd = unsafe { libc::memfd_create(c"rprof-vdso".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("creating a file for the vDSO");
        }
        // SAFETY: a new descriptor that we own.
        let mut handle = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        handle.write_all(image).context("copying the vDSO")?;
        let mut opened = Self::parse(image, "[vdso]".to_string(), handle, rules)?;
        opened.key = FileKey::Vdso(fnv(image));
        Ok(opened)
    }

    fn parse(data: &[u8], name: String, handle: File, rules: &mut Rules) -> Result<Self> {
        let started = std::time::Instant::now();
        let elf = ElfFile64::<Endianness>::parse(data)
            .with_context(|| format!("{name} is not a 64-bit ELF file"))?;
        let e = elf.endian();
        let segments = elf
            .elf_program_headers()
            .iter()
            .filter(|p| p.p_type(e) == elf::PT_LOAD)
            .map(|p| Segment {
                offset: p.p_offset(e),
                vaddr: p.p_vaddr(e),
                filesz: p.p_filesz(e),
            })
            .collect();
        let table = eh_frame::build(data, rules).with_context(|| format!("reading the CFI of {name}"))?;
        Ok(Self {
            key: FileKey::Vdso(0),
            name,
            table,
            debug_file: None,
            segments,
            plt: plt(&elf),
            handle,
            build_time: started.elapsed(),
            bytes: data.len(),
        })
    }

    pub fn into_file(self, serial: u64, rows: Option<super::Placed>) -> NativeFile {
        NativeFile {
            serial,
            name: self.name,
            path: PathBuf::from(format!("/proc/self/fd/{}", self.handle.as_raw_fd())),
            debug_file: self.debug_file,
            function_starts: self.table.function_starts,
            rows,
            table_base: self.table.base,
            frame_pointers: self.table.frame_pointers,
            segments: self.segments,
            plt: self.plt,
            refs: 0,
            _handle: self.handle,
        }
    }
}

impl NativeFile {
    /// The load bias of a mapping of this file at `start` from file offset
    /// `offset`: vaddr = address - bias.
    pub fn bias(&self, start: u64, offset: u64) -> Option<u64> {
        let seg = self
            .segments
            .iter()
            .find(|s| offset >= s.offset & !0xfff && offset < s.offset + s.filesz.max(1))?;
        let vaddr = seg.vaddr.wrapping_add(offset).wrapping_sub(seg.offset);
        Some(start.wrapping_sub(vaddr))
    }

    /// `name@plt` for an address in a PLT stub (`[plt]` when the stub's
    /// target is not known), None elsewhere.
    pub fn plt_name(&self, vaddr: u64) -> Option<String> {
        let (start, size) = self.plt.plt;
        if vaddr >= start && vaddr < start + size {
            let entry = ((vaddr - start) / 16) as usize;
            return Some(match entry.checked_sub(1).and_then(|i| self.plt.names.get(i)) {
                Some(name) => format!("{name}@plt"),
                None => "[plt]".to_string(),
            });
        }
        self.plt
            .others
            .iter()
            .any(|&(s, n)| vaddr >= s && vaddr < s + n)
            .then(|| "[plt]".to_string())
    }

    /// Where the function holding `vaddr` starts, by its CFI.
    pub fn function_start(&self, vaddr: u64) -> Option<u64> {
        let i = self.function_starts.partition_point(|&s| s <= vaddr);
        i.checked_sub(1).map(|i| self.function_starts[i])
    }
}

/// The PLT sections of an ELF file, and the functions `.plt`'s entries
/// jump to (in the order of `.rela.plt`).
fn plt(elf: &ElfFile64<'_, Endianness>) -> Plt {
    let range = |name: &str| elf.section_by_name(name).map(|s| (s.address(), s.size()));
    let e = elf.endian();
    let data = elf.data();
    let mut names = Vec::new();
    let sections = elf.elf_section_table();
    let relas = sections
        .section_by_name(e, b".rela.plt")
        .and_then(|(_, sh)| sh.rela(e, data).ok().flatten());
    let dynsym = sections.symbols(e, data, elf::SHT_DYNSYM).ok();
    if let (Some((relas, _)), Some(symbols)) = (relas, dynsym) {
        for r in relas {
            let name = symbols
                .symbol(object::SymbolIndex(r.r_sym(e, false) as usize))
                .ok()
                .and_then(|sym| symbols.symbol_name(e, sym).ok())
                .and_then(|n| std::str::from_utf8(n).ok());
            names.push(name.unwrap_or("?").to_string());
        }
    }
    Plt {
        plt: range(".plt").unwrap_or((0, 0)),
        names,
        others: [".plt.got", ".plt.sec"].iter().filter_map(|n| range(n)).collect(),
    }
}

/// The GNU build-id note of an ELF file.
pub fn build_id(data: &[u8]) -> Option<Vec<u8>> {
    let elf = ElfFile64::<Endianness>::parse(data).ok()?;
    elf.build_id().ok().flatten().map(<[u8]>::to_vec)
}

/// The separate debug file of the ELF file `data` mapped from `maps_path`,
/// looked for where GDB looks, under the target's root: by build-id in
/// /usr/lib/debug/.build-id, then by .gnu_debuglink next to the file, in its
/// .debug directory, and under /usr/lib/debug.
fn debug_file(data: &[u8], maps_path: &str, root: &Path) -> Option<PathBuf> {
    let elf = ElfFile64::<Endianness>::parse(data).ok()?;
    let under_root = |p: &str| root.join(p.trim_start_matches('/'));
    let id = elf.build_id().ok().flatten();
    if let Some(id) = id.filter(|id| id.len() > 1) {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        let path = under_root(&format!(
            "/usr/lib/debug/.build-id/{}/{}.debug",
            &hex[..2],
            &hex[2..]
        ));
        if path.is_file() {
            return Some(path);
        }
    }
    let link = elf.section_by_name(".gnu_debuglink")?.data().ok()?;
    let name = std::str::from_utf8(link.split(|&b| b == 0).next()?).ok()?;
    let dir = Path::new(maps_path).parent()?.to_str()?;
    [
        format!("/usr/lib/debug{dir}/{name}"),
        format!("{dir}/.debug/{name}"),
        format!("{dir}/{name}"),
    ]
    .iter()
    .map(|p| under_root(p))
    // The file itself may be named like its debug link.
    .find(|p| p.is_file() && p.to_str() != Some(maps_path))
    .filter(|p| {
        // A debug file of another build names the wrong functions.
        let Some(want) = id else { return true };
        File::open(p)
            .ok()
            .and_then(|f| crate::elf::map(&f).ok())
            .and_then(|d| build_id(&d))
            .is_some_and(|got| got == want)
    })
}

/// FNV-1a of some bytes (the vDSO's identity).
pub fn fnv(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}
