//! --native: what BPF needs to unwind native stacks, kept up to date as
//! processes come and go. Each ELF file mapped executable gets its table
//! once (`files.rs`, built from its .eh_frame by `eh_frame.rs`), whatever
//! process maps it; each distinct set of executable mappings (an address
//! space) is given to BPF once and shared by the processes that have it, so
//! a cluster's workers, forked from one master, share one space and every
//! table. Tables and spaces nobody uses any more are freed.

mod eh_frame;
mod files;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::bpf::{types, Probe};
use crate::process::{Mapping, Process};
pub use files::NativeFile;
use files::{FileKey, Opened};

/// BPF's `unwind_rows` holds this many rows (8 bytes each) unless told
/// otherwise: the tables of a large application (libruby ~50k rows, libc
/// ~20k, every native gem and library) fit many times over.
pub const DEFAULT_ROWS: u32 = 1 << 21;
/// Distinct rules (rules repeat across files: a few thousand at most).
pub const MAX_RULES: u32 = 1 << 16;
/// Files with tables at once.
pub const MAX_FILES: u32 = 1 << 14;
/// Address spaces at once.
pub const MAX_SPACES: u32 = 1 << 13;
/// A process whose stacks leave its known mappings is looked at again at
/// most this often (a library loaded after rprof looked: a gem required late).
const RESCAN_EVERY: Duration = Duration::from_millis(500);

/// Where a process's VM enters the interpreter (`rb_vm_exec`): a file and vaddr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeAddress {
    pub file: u32,
    pub vaddr: u64,
}

/// What BPF gets to know of a process's VM, for stitching.
#[derive(Debug, Clone)]
pub struct VmImage {
    /// The path of the VM's ELF file as /proc/PID/maps shows it.
    pub maps_path: String,
    /// `rb_vm_exec` in that file, if found.
    pub vm_exec: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SpaceMapping {
    start: u64,
    end: u64,
    bias: u64,
    file: u32,
    kind: u32,
}

struct Space {
    mappings: Vec<SpaceMapping>,
    refs: u32,
}

struct Followed {
    start_ticks: u64,
    space: u32,
    vm_exec: Option<CodeAddress>,
    vm: Option<VmImage>,
    rescanned: Option<Instant>,
}

pub struct Unwinder {
    rules: eh_frame::Rules,
    rules_sent: usize,
    files: Vec<Option<NativeFile>>,
    by_key: HashMap<FileKey, u32>,
    /// Free places in `unwind_rows` and `unwind_pages`.
    rows: Runs,
    pages: Runs,
    spaces: HashMap<u32, Space>,
    by_content: HashMap<Vec<SpaceMapping>, u32>,
    next_space: u32,
    processes: HashMap<u32, Followed>,
    /// Files made so far (each file's serial).
    serial: u64,
    /// Files whose table did not fit in BPF's maps (named, not unwound through).
    pub no_room: u64,
    /// Say on stderr what each table cost (`RPROF_SAY_TABLES=1`, the benchmarks).
    say_tables: bool,
}

impl Unwinder {
    pub fn new(rows: u32) -> Self {
        Self {
            rules: eh_frame::Rules::default(),
            rules_sent: 0,
            files: vec![None],
            by_key: HashMap::new(),
            rows: Runs(vec![(0, rows)]),
            pages: Runs(vec![(0, pages_for(rows))]),
            spaces: HashMap::new(),
            by_content: HashMap::new(),
            next_space: 1,
            processes: HashMap::new(),
            serial: 0,
            no_room: 0,
            say_tables: std::env::var_os("RPROF_SAY_TABLES").is_some(),
        }
    }

    /// Every file with its id.
    pub fn files(&self) -> impl Iterator<Item = (u32, &NativeFile)> {
        self.files
            .iter()
            .enumerate()
            .filter_map(|(i, f)| f.as_ref().map(|f| (i as u32, f)))
    }

    pub fn file(&self, id: u32) -> Option<&NativeFile> {
        self.files.get(id as usize).and_then(Option::as_ref)
    }

    /// Where the interpreter's entry (`rb_vm_exec`) is in process `pid`.
    pub fn vm_exec(&self, pid: u32) -> Option<CodeAddress> {
        self.processes.get(&pid).and_then(|p| p.vm_exec)
    }

    /// The executable mapping of process `pid` holding absolute address `addr`.
    fn mapping_at(&self, pid: u32, addr: u64) -> Option<&SpaceMapping> {
        let space = self.spaces.get(&self.processes.get(&pid)?.space)?;
        let i = space
            .mappings
            .partition_point(|m| m.start <= addr)
            .checked_sub(1)?;
        Some(&space.mappings[i]).filter(|m| addr < m.end)
    }

    /// The file and vaddr of absolute address `addr` in process `pid`.
    pub fn locate(&self, pid: u32, addr: u64) -> Option<CodeAddress> {
        let m = self.mapping_at(pid, addr).filter(|m| m.file != 0)?;
        Some(CodeAddress {
            file: m.file,
            vaddr: addr.wrapping_sub(m.bias),
        })
    }

    /// Whether `addr` is in anonymous executable memory of process `pid` (JIT code).
    pub fn is_jit(&self, pid: u32, addr: u64) -> bool {
        self.mapping_at(pid, addr)
            .is_some_and(|m| m.kind == types::rprof_mapping_kind::RPROF_MAPPING_JIT.0)
    }

    /// Reads the executable mappings of `process` and gives BPF their
    /// tables and the space they make; returns the space for its recipe.
    pub fn attach(
        &mut self,
        probe: &mut Probe,
        process: Process,
        start_ticks: u64,
        vm: Option<VmImage>,
    ) -> Result<u32> {
        self.forget(probe, process.pid);
        let (space, vm_exec) = self.space_of(probe, process, vm.as_ref())?;
        self.processes.insert(
            process.pid,
            Followed {
                start_ticks,
                space,
                vm_exec,
                vm,
                rescanned: None,
            },
        );
        Ok(space)
    }

    /// `child` was forked by `parent`: BPF gave it its parent's recipe, and
    /// with it the parent's space.
    pub fn inherit(&mut self, child: u32, child_start: u64, parent: u32) {
        let Some(p) = self.processes.get(&parent) else {
            return;
        };
        let (space, vm_exec, vm) = (p.space, p.vm_exec, p.vm.clone());
        if let Some(s) = self.spaces.get_mut(&space) {
            s.refs += 1;
        }
        if let Some(old) = self.processes.insert(
            child,
            Followed {
                start_ticks: child_start,
                space,
                vm_exec,
                vm,
                rescanned: None,
            },
        ) {
            self.release(old.space);
        }
    }

    /// Process `pid`'s stacks left its known mappings: it may have loaded a
    /// library since. Looks again (not too often); a new space goes to its
    /// recipe in BPF.
    pub fn rescan(&mut self, probe: &mut Probe, pid: u32) -> Result<()> {
        let Some(p) = self.processes.get_mut(&pid) else {
            return Ok(());
        };
        if p.rescanned.is_some_and(|t| t.elapsed() < RESCAN_EVERY) {
            return Ok(());
        }
        p.rescanned = Some(Instant::now());
        let (old, start_ticks, vm) = (p.space, p.start_ticks, p.vm.clone());
        let process = Process { pid };
        if !process.is_alive_since(start_ticks) {
            return Ok(());
        }
        let (space, vm_exec) = self.space_of(probe, process, vm.as_ref())?;
        if space == old {
            self.release(space); // space_of counted one more user
            return Ok(());
        }
        probe.set_native_space(pid, start_ticks, space);
        if let Some(p) = self.processes.get_mut(&pid) {
            p.space = space;
            p.vm_exec = vm_exec.or(p.vm_exec);
        }
        self.release_and_free(probe, old);
        Ok(())
    }

    /// Process `pid` ended or exec'd: what only it used is freed.
    pub fn forget(&mut self, probe: &mut Probe, pid: u32) {
        if let Some(p) = self.processes.remove(&pid) {
            self.release_and_free(probe, p.space);
        }
    }

    /// The space (counted one more user) of the executable mappings of `process`.
    fn space_of(
        &mut self,
        probe: &mut Probe,
        process: Process,
        vm: Option<&VmImage>,
    ) -> Result<(u32, Option<CodeAddress>)> {
        let maps = process.maps()?;
        let root = Path::new("/proc").join(process.pid.to_string()).join("root");
        let mut mappings = Vec::new();
        let mut vm_exec = None;
        for m in maps.iter().filter(|m| m.perms.contains('x')) {
            let (file, bias, kind) = if m.path.starts_with('/') {
                match self.file_of(probe, process, m, &root) {
                    Some(id) => {
                        let bias = self.file(id).and_then(|f| f.bias(m.start, m.offset)).unwrap_or(0);
                        (id, bias, types::rprof_mapping_kind::RPROF_MAPPING_FILE)
                    }
                    // Unreadable: unwinding stops there, with a reason.
                    None => (0, 0, types::rprof_mapping_kind::RPROF_MAPPING_FILE),
                }
            } else if m.path == "[vdso]" {
                let id = self.vdso(probe, process, m).unwrap_or(0);
                (id, m.start, types::rprof_mapping_kind::RPROF_MAPPING_FILE)
            } else if m.path == "[vsyscall]" {
                continue;
            } else {
                // Anonymous executable memory: code a JIT (YJIT) wrote.
                (0, 0, types::rprof_mapping_kind::RPROF_MAPPING_JIT)
            };
            if let (Some(vm), true) = (vm, file != 0) {
                if m.path == vm.maps_path {
                    vm_exec = vm.vm_exec.map(|vaddr| CodeAddress { file, vaddr });
                }
            }
            mappings.push(SpaceMapping {
                start: m.start,
                end: m.end,
                bias,
                file,
                kind: kind.0,
            });
        }
        mappings.sort_by_key(|m| m.start);
        // More than BPF takes: the highest (least likely code: stacks, JIT
        // regions at the top of the address space) are left out.
        mappings.truncate(types::rprof_space::default().mappings.len());
        self.send_rules(probe)?;
        if let Some(&id) = self.by_content.get(&mappings) {
            if let Some(s) = self.spaces.get_mut(&id) {
                s.refs += 1;
                // The files it maps were counted again by file_of.
                for m in &mappings {
                    self.unref_file(m.file);
                }
                return Ok((id, vm_exec));
            }
        }
        let id = self.next_space;
        self.next_space = self.next_space.wrapping_add(1).max(1);
        let mut value = types::rprof_space {
            count: mappings.len() as u32,
            ..Default::default()
        };
        for (slot, m) in value.mappings.iter_mut().zip(&mappings) {
            *slot = types::rprof_mapping {
                start: m.start,
                end: m.end,
                bias: m.bias,
                file: m.file,
                kind: m.kind,
            };
        }
        probe.set_space(id, &value)?;
        self.by_content.insert(mappings.clone(), id);
        self.spaces.insert(id, Space { mappings, refs: 1 });
        Ok((id, vm_exec))
    }

    /// The file behind mapping `m` (counted one more user), its table in BPF.
    fn file_of(&mut self, probe: &mut Probe, process: Process, m: &Mapping, root: &Path) -> Option<u32> {
        // Known by inode already (the common case: skip reading it again).
        let inode_key = FileKey::Inode {
            dev: m.dev.clone(),
            inode: m.inode,
        };
        if let Some(&id) = self.by_key.get(&inode_key) {
            return self.ref_file(id);
        }
        let candidates = process.mapped_file_candidates(m);
        let opened = match Opened::open(
            &candidates,
            &m.path,
            root,
            (m.dev.clone(), m.inode),
            &mut self.rules,
        ) {
            Ok(o) => o,
            Err(e) => {
                if self.say_tables {
                    eprintln!("rprof: no unwind table for {}: {e:#}", m.path);
                }
                return None;
            }
        };
        if let Some(&id) = self.by_key.get(&opened.key) {
            self.by_key.insert(inode_key, id);
            return self.ref_file(id);
        }
        let key = opened.key.clone();
        let id = self.add_file(probe, opened)?;
        self.by_key.insert(key, id);
        self.by_key.insert(inode_key, id);
        self.ref_file(id)
    }

    fn vdso(&mut self, probe: &mut Probe, process: Process, m: &Mapping) -> Option<u32> {
        let mut image = vec![0u8; (m.end - m.start) as usize];
        process.read(m.start, &mut image).ok()?;
        let key = FileKey::Vdso(files::fnv(&image));
        if let Some(&id) = self.by_key.get(&key) {
            return self.ref_file(id);
        }
        let opened = Opened::vdso(&image, &mut self.rules).ok()?;
        let id = self.add_file(probe, opened)?;
        self.by_key.insert(key, id);
        self.ref_file(id)
    }

    /// Gives BPF a new file's rows; the file is kept (without rows when
    /// they do not fit) so that its frames can still be named.
    fn add_file(&mut self, probe: &mut Probe, opened: Opened) -> Option<u32> {
        let id = match self.files.iter().skip(1).position(Option::is_none) {
            Some(i) => i as u32 + 1,
            None if (self.files.len() as u32) < MAX_FILES => {
                self.files.push(None);
                self.files.len() as u32 - 1
            }
            None => return None,
        };
        let n = opened.table.rows.len() as u32;
        let np = opened.table.pages.len() as u32;
        let mut rows = None;
        if n > 0 {
            match (self.rows.alloc(n), self.pages.alloc(np)) {
                (Some(first), Some(first_page))
                    if probe.set_unwind_rows(first, &opened.table.rows).is_ok()
                        && probe.set_unwind_pages(first_page, &opened.table.pages).is_ok() =>
                {
                    rows = Some(Placed {
                        first,
                        count: n,
                        first_page,
                        pages: np,
                    });
                }
                (first, first_page) => {
                    if let Some(f) = first {
                        self.rows.free(f, n);
                    }
                    if let Some(f) = first_page {
                        self.pages.free(f, np);
                    }
                    self.no_room += 1;
                }
            }
        }
        if self.say_tables {
            eprintln!(
                "rprof: unwind table for {}: {} bytes of ELF, {} rows ({} KiB), {} functions, {} unsupported, {} frame pointers, built in {:.2} ms",
                opened.name,
                opened.bytes,
                n,
                n as usize * std::mem::size_of::<types::rprof_unwind_row>() / 1024,
                opened.table.function_starts.len(),
                opened.table.unsupported,
                if opened.table.frame_pointers { "with" } else { "without" },
                opened.build_time.as_secs_f64() * 1000.0
            );
        }
        self.serial += 1;
        let file = opened.into_file(self.serial, rows);
        let value = types::rprof_unwind_file {
            first: rows.map_or(0, |r| r.first),
            count: rows.map_or(0, |r| r.count),
            base: file.table_base,
            flags: if file.frame_pointers {
                types::rprof_file_flags::RPROF_FILE_FRAME_POINTERS.0
            } else {
                0
            },
            first_page: rows.map_or(0, |r| r.first_page),
            pages: rows.map_or(0, |r| r.pages),
            pad: 0,
        };
        if self.send_rules(probe).is_err() || probe.set_unwind_file(id, &value).is_err() {
            self.free_placed(rows);
            return None;
        }
        self.files[id as usize] = Some(file);
        Some(id)
    }

    fn send_rules(&mut self, probe: &mut Probe) -> Result<()> {
        if self.rules.list.len() > self.rules_sent {
            let new: Vec<types::rprof_unwind_rule> = self.rules.list[self.rules_sent..]
                .iter()
                .map(|r| r.to_bpf())
                .collect();
            probe.set_unwind_rules(self.rules_sent as u32, &new)?;
            self.rules_sent = self.rules.list.len();
        }
        Ok(())
    }

    fn ref_file(&mut self, id: u32) -> Option<u32> {
        let f = self.files.get_mut(id as usize)?.as_mut()?;
        f.refs += 1;
        Some(id)
    }

    fn unref_file(&mut self, id: u32) {
        if let Some(Some(f)) = self.files.get_mut(id as usize) {
            f.refs = f.refs.saturating_sub(1);
        }
    }

    fn release(&mut self, space: u32) {
        if let Some(s) = self.spaces.get_mut(&space) {
            s.refs = s.refs.saturating_sub(1);
        }
    }

    /// One user less of `space`; the last frees it, and the files only it mapped.
    fn release_and_free(&mut self, probe: &mut Probe, space: u32) {
        self.release(space);
        if self.spaces.get(&space).is_none_or(|s| s.refs > 0) {
            return;
        }
        let Some(s) = self.spaces.remove(&space) else {
            return;
        };
        self.by_content.remove(&s.mappings);
        probe.remove_space(space);
        for m in &s.mappings {
            self.unref_file(m.file);
            let unused = self.file(m.file).is_some_and(|f| f.refs == 0);
            if unused {
                self.free_file(probe, m.file);
            }
        }
    }

    fn free_file(&mut self, probe: &mut Probe, id: u32) {
        let Some(file) = self.files.get_mut(id as usize).and_then(Option::take) else {
            return;
        };
        self.by_key.retain(|_, v| *v != id);
        let _ = probe.set_unwind_file(id, &types::rprof_unwind_file::default());
        self.free_placed(file.rows);
    }

    fn free_placed(&mut self, placed: Option<Placed>) {
        if let Some(p) = placed {
            self.rows.free(p.first, p.count);
            self.pages.free(p.first_page, p.pages);
        }
    }
}

/// Where a file's table is in BPF's arrays.
#[derive(Debug, Clone, Copy)]
pub struct Placed {
    pub first: u32,
    pub count: u32,
    pub first_page: u32,
    pub pages: u32,
}

/// Entries of `unwind_pages` for `rows` rows: a page of code has tens of rows.
pub fn pages_for(rows: u32) -> u32 {
    (rows / 8).max(1)
}

/// The free runs of an array, (first, count) sorted, handed out first-fit.
struct Runs(Vec<(u32, u32)>);

impl Runs {
    fn alloc(&mut self, n: u32) -> Option<u32> {
        let i = self.0.iter().position(|&(_, len)| len >= n)?;
        let (first, len) = self.0[i];
        if len == n {
            self.0.remove(i);
        } else {
            self.0[i] = (first + n, len - n);
        }
        Some(first)
    }

    fn free(&mut self, first: u32, n: u32) {
        let runs = &mut self.0;
        let i = runs.partition_point(|&(f, _)| f < first);
        runs.insert(i, (first, n));
        // Merge with the neighbours.
        if i + 1 < runs.len() && runs[i].0 + runs[i].1 == runs[i + 1].0 {
            runs[i].1 += runs[i + 1].1;
            runs.remove(i + 1);
        }
        if i > 0 && runs[i - 1].0 + runs[i - 1].1 == runs[i].0 {
            runs[i - 1].1 += runs[i].1;
            runs.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_allocated_and_freed_first_fit() {
        let mut r = Runs(vec![(0, 100)]);
        assert_eq!(r.alloc(30), Some(0));
        assert_eq!(r.alloc(30), Some(30));
        assert_eq!(r.alloc(50), None);
        r.free(0, 30);
        assert_eq!(r.alloc(10), Some(0));
        r.free(30, 30);
        r.free(0, 10);
        assert_eq!(r.0, vec![(0, 100)], "freed runs merge back into one");
    }
}
