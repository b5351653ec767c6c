//! Finds the Ruby VM in a process: which ELF file holds it, its version and
//! layout, how a thread reaches its own `ruby_current_ec`, and where the
//! symbol table that names C methods lives. The result is a recipe for BPF.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::rc::Rc;

use anyhow::{bail, Context, Result};
use ruby_structs::{Layout, RubyVersion};

use crate::address_space::AddressSpace;
use crate::bpf::types;
use crate::disasm::{self, TlsAccess};
use crate::elf::{self, ElfImage, TlsReloc};
use crate::error::UserError;
use crate::gc_time::GcClock;
use crate::process::{Mapping, Process};
use crate::unwind::VmImage;

/// How a thread's execution context is found from its thread pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EcAccess {
    /// A global holding the EC of the thread that holds the GVL (Ruby < 3.0,
    /// when the VM's thread list cannot be used).
    Global { addr: u64 },
    /// Ruby < 3.0: `th->ec` of the rb_thread_t running on this native thread,
    /// found through the VM's thread list (`vm_ptr` holds the VM's address).
    ThreadMap { vm_ptr: u64 },
    /// `dtv[module].val + offset`: dynamic TLS (PIC libruby).
    TlsDtv { module: u64, offset: u64 },
    /// `tp + offset`: static TLS (initial exec, or local exec in a static ruby).
    TlsTpOffset { offset: i64 },
}

#[derive(Clone)]
pub struct RubyTarget {
    pub process: Process,
    /// With the PID, the process's identity (see `Process::start_ticks`).
    pub start_ticks: u64,
    pub version: RubyVersion,
    pub layout: Layout,
    pub ec_access: EcAccess,
    /// Where `ruby_global_symbols` is, to name C methods.
    pub global_symbols: GlobalSymbols,
    /// Where the GC keeps its clock; None until the VM has been set up.
    pub gc: Option<GcClock>,
    /// The VM's ELF file and its interpreter entry, to stitch native stacks.
    pub vm: VmImage,
    /// `mjit_opts.on` (Ruby 2.7 to 3.1): MJIT's code writes a frame's pc only
    /// before instructions that may call out, and marks no frame, so while it
    /// runs the leaf frame's line cannot be trusted.
    pub mjit_on: Option<u64>,
    /// `ruby_description` ("ruby 3.1.2p20 (2022-04-12 revision ...) [...]"):
    /// which Ruby this is, patch level and build included, for the user.
    pub description: String,
    /// Where `rb_cObject` is: a class whose name is known, for the proof.
    pub object_class: Option<u64>,
    /// Where `ruby_current_vm_ptr` is (Ruby 3.2 names classes through the VM).
    pub vm_ptr: Option<u64>,
    /// `alloc`: the layout's allocation functions found in the VM, with
    /// where each is loaded.
    pub alloc_functions: Vec<(ruby_structs::AllocFunction, u64)>,
    /// Where `rb_cBasicObject` is (`alloc`: its allocator, on some Rubies).
    pub basic_object_class: Option<u64>,
}

impl RubyTarget {
    /// Inspects process `pid`. `force_version` picks a layout for a Ruby
    /// version rprof does not know ("3.2" uses the 3.1 layout, say).
    pub fn inspect(pid: u32, force_version: Option<&str>) -> Result<Self> {
        let process = Process::open(pid)?;
        let start_ticks = process.start_ticks().ok_or(UserError::NoSuchProcess { pid })?;
        // A process that ended (or is a zombie) has no memory left: say so,
        // rather than that it is not Ruby.
        let (image, vm_path, bias) =
            process
                .maps()
                .and_then(|maps| find_vm(&process, &maps))
                .map_err(|e| {
                    if process.is_alive_since(start_ticks) {
                        e
                    } else {
                        UserError::TargetGone { pid }.into()
                    }
                })?;
        let version_sym = image
            .symbol("ruby_version")
            .context("the Ruby VM has no ruby_version symbol")?;
        let version_text = process.read_cstr(bias + version_sym.value, 32).map_err(|e| {
            if e.raw_os_error() == Some(libc::EPERM) {
                anyhow::Error::from(UserError::CannotReadMemory {
                    pid,
                    why: e.to_string(),
                })
            } else {
                anyhow::Error::from(e).context(format!("reading ruby_version of process {pid}"))
            }
        })?;
        let version = RubyVersion::parse(&version_text).ok_or_else(|| UserError::NotRuby {
            pid,
            exe: process.exe_name(),
        })?;
        let layout_version = match force_version {
            Some(forced) => RubyVersion::parse(forced).ok_or_else(|| UserError::BadForcedVersion {
                given: forced.to_string(),
            })?,
            None => version,
        };
        let layout = match std::env::var_os("RPROF_LAYOUT_FILE") {
            Some(file) => own_layout(&file)?,
            None => ruby_structs::layout_for(layout_version).map_err(UserError::from)?,
        };
        if layout_version != version {
            eprintln!(
                "rprof: warning: Ruby {version} read with the Ruby {} layout (--force-version)",
                layout.version
            );
        }
        let ec_access = find_ec_access(&process, &image, bias, version, &layout).with_context(|| {
            format!("finding how threads of Ruby {version} reach their execution context")
        })?;
        let global_symbols = find_global_symbols(&process, &image, bias, &layout);
        let gc = find_gc_clock(&process, &image, bias, &layout)
            .with_context(|| format!("finding the GC state of Ruby {version}"))?;
        let vm = VmImage {
            maps_path: vm_path,
            vm_exec: find_vm_exec(&image),
        };
        let mjit_on = image.symbol("mjit_opts").map(|s| bias + s.value);
        let description = image
            .symbol("ruby_description")
            .and_then(|s| process.read_cstr(bias + s.value, 256).ok())
            .unwrap_or_else(|| format!("Ruby {version}"));
        let object_class = image.symbol("rb_cObject").map(|s| bias + s.value);
        let vm_ptr = image.symbol("ruby_current_vm_ptr").map(|s| bias + s.value);
        let alloc_functions = layout
            .alloc
            .iter()
            .flat_map(|a| &a.functions)
            .filter_map(|f| Some((f.clone(), bias + image.symbol(&f.name)?.value)))
            .collect();
        let basic_object_class = image.symbol("rb_cBasicObject").map(|s| bias + s.value);
        Ok(Self {
            process,
            start_ticks,
            version,
            layout,
            ec_access,
            global_symbols,
            gc,
            vm,
            mjit_on,
            description,
            object_class,
            vm_ptr,
            alloc_functions,
            basic_object_class,
        })
    }

    /// The same Ruby in `child`, a fork of this process that has not exec'd:
    /// it has this process's memory layout.
    pub fn forked(&self, child: Process, start_ticks: u64) -> Self {
        Self {
            process: child,
            start_ticks,
            ..self.clone()
        }
    }

    /// Whether the dynamic linker has finished with the VM (a just-started
    /// process may not have its TLS module id filled in yet) and the VM exists.
    pub fn ready(&self) -> bool {
        !matches!(self.ec_access, EcAccess::TlsDtv { module: 0, .. }) && self.gc.is_some()
    }

    /// For Rubies without a thread-local EC: (thread pointer, rb_thread_t) of
    /// every living Ruby thread, from the VM's thread list. Empty otherwise.
    pub fn ruby_threads(&self) -> Result<Vec<(u64, u64)>> {
        let EcAccess::ThreadMap { vm_ptr } = self.ec_access else {
            return Ok(Vec::new());
        };
        let t = &self.layout.thread;
        let (Some(list_off), Some(node_off)) = (t.vm_living_threads, t.living_threads_node) else {
            return Ok(Vec::new());
        };
        let p = &self.process;
        let vm = p.read_u64(vm_ptr).context("reading ruby_current_vm_ptr")?;
        if vm == 0 {
            return Ok(Vec::new());
        }
        let head = vm + list_off as u64;
        let mut node = p.read_u64(head).context("reading the VM's thread list")?;
        let mut out = Vec::new();
        // A circular list: the head's own node ends it. Bounded against a list
        // caught mid-update.
        while node != head && node != 0 && out.len() < 100_000 {
            let th = node - node_off as u64;
            let tp = p
                .read_u64(th + t.native_thread_id as u64)
                .context("reading a thread's id")?;
            out.push((tp, th));
            node = p.read_u64(node).context("walking the VM's thread list")?;
        }
        Ok(out)
    }

    /// The recipe the BPF program follows for this process.
    pub fn recipe(&self) -> types::rprof_proc {
        let l = &self.layout;
        let (ec_access, ec_addr, tls_module) = match self.ec_access {
            EcAccess::Global { addr } => (types::rprof_ec_access::RPROF_EC_GLOBAL, addr, 0),
            EcAccess::ThreadMap { .. } => {
                (types::rprof_ec_access::RPROF_EC_THREAD_MAP, l.thread.ec as u64, 0)
            }
            EcAccess::TlsDtv { module, offset } => (types::rprof_ec_access::RPROF_EC_TLS_DTV, offset, module),
            EcAccess::TlsTpOffset { offset } => {
                (types::rprof_ec_access::RPROF_EC_TLS_TPOFF, offset as u64, 0)
            }
        };
        types::rprof_proc {
            start_ticks: self.start_ticks,
            ec_addr,
            tls_module,
            ec_access: ec_access.0,
            dtv_entry_size: 16,
            ec_vm_stack: l.execution_context.vm_stack,
            ec_vm_stack_size: l.execution_context.vm_stack_size,
            ec_cfp: l.execution_context.cfp,
            ec_thread_ptr: l.execution_context.thread_ptr,
            th_native_thread: l.thread.native_thread.unwrap_or(0),
            th_native_id: l.thread.native_thread_id,
            // The global EC is the GVL holder's: only trust it on that thread.
            // Thread-local ECs are checked on request (RPROF_VERIFY_EC=1, the
            // tests): a read or two per event that a correct recipe never needs.
            verify_thread: u32::from(
                matches!(self.ec_access, EcAccess::Global { .. })
                    || std::env::var_os("RPROF_VERIFY_EC").is_some(),
            ),
            cfp_size: l.control_frame.size,
            cfp_pc: l.control_frame.pc,
            cfp_iseq: l.control_frame.iseq,
            cfp_ep: l.control_frame.ep,
            cfp_jit_return: l.control_frame.jit_return.unwrap_or(0),
            tls_tp_offset: 0,
            frame_magic_mask: l.frame.magic_mask,
            frame_magic_cfunc: l.frame.magic_cfunc,
            env_flag_local: l.frame.env_flag_local,
            imemo_ment_mask: l.value.type_mask | (l.imemo.type_mask << l.imemo.type_shift),
            imemo_ment_value: l.value.t_imemo | (l.imemo.type_ment << l.imemo.type_shift),
            imemo_svar_value: l.value.t_imemo | (l.imemo.type_svar << l.imemo.type_shift),
            imemo_ifunc_value: l.value.t_imemo | (l.imemo.type_ifunc << l.imemo.type_shift),
            svar_cref_or_me: u64::from(l.imemo.svar_cref_or_me),
            gc_flags_addr: self.gc.map_or(0, |g| g.flags),
            gc_count_addr: self.gc.map_or(0, |g| g.count),
            gc_minor_bit: l.gc.during_minor_gc_bit,
            gc_major_from_count: l.gc.major_gc_count_from_count as i32,
            gc_minor_from_count: l.gc.minor_gc_count_from_count as i32,
            gc_time_addr: self.gc.map_or([0; 2], |g| g.time_ns),
            th_dedicated_byte: l.thread.dedicated_nt_byte.unwrap_or(0),
            th_dedicated_mask: l.thread.dedicated_nt_mask.map_or(0, u32::from),
            native_space: 0,
            frame_flag_finish: l.frame.flag_finish as u32,
            fl_promoted: l.value.fl_promoted,
            ..wall_recipe(l)
        }
    }
}

/// What `wall_reason` in BPF reads of a thread that leaves the CPU.
fn wall_recipe(l: &Layout) -> types::rprof_proc {
    let w = &l.waits;
    let fields = [
        w.status_byte,
        w.blocking_region_buffer,
        w.unblock_func,
        w.locking_mutex,
        w.gvl_node,
        w.gvl_base,
    ];
    // BPF copies this much of rb_thread_t at once (512 bytes at most).
    let read_len = fields.iter().max().map_or(0, |&m| m + 8);
    types::rprof_proc {
        th_status_byte: w.status_byte,
        th_status_shift: u32::from(w.status_shift),
        th_status_mask: if read_len <= 512 {
            u32::from(w.status_mask)
        } else {
            0
        },
        th_blocking_region: w.blocking_region_buffer,
        th_unblock_func: w.unblock_func,
        th_locking_mutex: w.locking_mutex,
        th_gvl_node: w.gvl_node,
        th_gvl_node_ubf: u32::from(w.gvl_node_shares_ubf),
        th_gvl_base: w.gvl_base,
        gvl_holder: w.gvl_holder,
        th_read_len: read_len.min(512),
        ..Default::default()
    }
}

/// RPROF_LAYOUT_FILE: a layout file of the user's own, used for every process.
fn own_layout(file: &std::ffi::OsStr) -> Result<Layout> {
    let path = std::path::Path::new(file);
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading RPROF_LAYOUT_FILE {}", path.display()))?;
    let layout = ruby_structs::parse_layout(&path.display().to_string(), &text).map_err(UserError::from)?;
    Ok(layout)
}

/// Where the GC keeps its flags and counts, read off the target's own code:
/// `rb_during_gc` is `return vm->objspace->flags.during_gc` (through the GOT
/// or a hidden `ruby_current_vm_ptr`), `rb_gc_count` ends in
/// `return objspace->profile.count`. The objspace is allocated once when the
/// VM starts, so the addresses hold for the life of the process (and of its
/// forks). None while the VM does not exist yet.
fn find_gc_clock(process: &Process, image: &ElfImage, bias: u64, layout: &Layout) -> Result<Option<GcClock>> {
    let code = |name: &str| -> Result<(Vec<u8>, u64)> {
        let sym = image
            .symbol(name)
            .with_context(|| format!("the Ruby VM exports no {name}"))?;
        let code = image
            .bytes_at(sym.value, 96)
            .with_context(|| format!("no code for {name}"))?;
        Ok((code, sym.value))
    };
    let (during, during_at) = code("rb_during_gc")?;
    let chain = disasm::load_chain(&during, during_at)
        .filter(|c| c.offsets.len() >= 2)
        .context(
            "rb_during_gc does not read vm->objspace->flags as expected (a Ruby built \
             --with-modular-gc calls its GC through a table of functions, which rprof cannot follow)",
        )?;
    let (count_code, count_at) = code("rb_gc_count")?;
    let count_off = disasm::last_load_into_rax(&count_code, count_at)
        .context("rb_gc_count does not read objspace->profile.count as expected")?;
    // Follow the chain to the objspace; the last load is the flags word.
    let start = bias + chain.start;
    let mut reg = if chain.start_is_load {
        process
            .read_u64(start)
            .context("reading the VM pointer's GOT slot")?
    } else {
        start
    };
    let (flags_off, path) = chain.offsets.split_last().context("empty load chain")?;
    for off in path {
        reg = process
            .read_u64(reg.wrapping_add(*off as u64))
            .context("following the VM pointer to the GC's objspace")?;
        if reg == 0 {
            return Ok(None); // the VM is not set up yet
        }
    }
    let objspace = reg;
    let clock = GcClock {
        flags: objspace.wrapping_add(*flags_off as u64),
        count: objspace.wrapping_add(count_off as u64),
        major_count: objspace
            .wrapping_add(count_off as u64)
            .wrapping_add(layout.gc.major_gc_count_from_count as u64),
        time_ns: gc_time_fields(
            objspace.wrapping_add(count_off as u64),
            &layout.gc.time_ns_from_count,
        )?,
    };
    // Whether the code led to a GC is for the proof to say: its major and
    // minor counts must add up to its count.
    Ok(Some(clock))
}

/// The absolute addresses of the GC's time fields (`GC.stat(:time)`), by the
/// layout's offsets from `profile.count`.
fn gc_time_fields(count: u64, offsets: &[i64]) -> Result<[u64; 2]> {
    let mut fields = [0; 2];
    if offsets.len() > fields.len() {
        bail!(
            "the layout gives {} GC time fields, rprof reads at most 2",
            offsets.len()
        );
    }
    for (field, off) in fields.iter_mut().zip(offsets) {
        *field = count.wrapping_add(*off as u64);
    }
    Ok(fields)
}

thread_local! {
    /// Mapped files (device, inode) known to hold no Ruby VM: `--all` looks
    /// at every program that starts on the host, most of them with the same
    /// libc, and reads each file once rather than at every look.
    static NOT_VM: std::cell::RefCell<std::collections::HashSet<(String, u64)>> = Default::default();
}
/// Files NOT_VM keeps before it starts again.
const NOT_VM_KEPT: usize = 65_536;

/// The mapped ELF file that defines `ruby_version`, with its load bias.
fn find_vm(process: &Process, maps: &[Mapping]) -> Result<(ElfImage, String, u64)> {
    let mut by_path: BTreeMap<&str, Vec<&Mapping>> = BTreeMap::new();
    for m in maps.iter().filter(|m| m.path.starts_with('/')) {
        by_path.entry(m.path.as_str()).or_default().push(m);
    }
    // libruby or the ruby executable first; a VM embedded elsewhere is found too.
    let mut paths: Vec<&str> = by_path.keys().copied().collect();
    paths.sort_by_key(|p| !file_name(p).contains("ruby"));
    for path in paths {
        let mappings = &by_path[path];
        if !mappings.iter().any(|m| m.perms.contains('x')) {
            continue;
        }
        let file = (mappings[0].dev.clone(), mappings[0].inode);
        if NOT_VM.with(|known| known.borrow().contains(&file)) {
            continue;
        }
        let Some(image) = mappings
            .iter()
            .flat_map(|m| process.mapped_file_candidates(m))
            .find_map(|candidate| ElfImage::open(&candidate).ok())
        else {
            continue;
        };
        if image.symbol("ruby_version").is_none() {
            NOT_VM.with(|known| {
                let mut known = known.borrow_mut();
                if known.len() >= NOT_VM_KEPT {
                    known.clear();
                }
                known.insert(file);
            });
            continue;
        }
        let bias = image
            .load_bias(mappings)
            .with_context(|| format!("working out where {path} is loaded"))?;
        return Ok((image, path.to_string(), bias));
    }
    Err(UserError::NotRuby {
        pid: process.pid,
        exe: process.exe_name(),
    }
    .into())
}

/// `rb_vm_exec`, where native code enters the interpreter (`vm_exec` is a
/// macro for it): by name, or, where Ruby 3.3+ hides it, as the function
/// `rb_iseq_eval_main` ends by jumping to (`return vm_exec(ec)`).
fn find_vm_exec(image: &ElfImage) -> Option<u64> {
    if let Some(sym) = image.symbol("rb_vm_exec") {
        return Some(sym.value);
    }
    let main = image.symbol("rb_iseq_eval_main")?;
    let code = image.bytes_at(main.value, 256)?;
    disasm::first_tail_call(&code, main.value)
}

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn find_ec_access(
    process: &Process,
    image: &ElfImage,
    bias: u64,
    version: RubyVersion,
    layout: &Layout,
) -> Result<EcAccess> {
    // A GOT slot of the running process, as the dynamic linker filled it in.
    let got_slot = |addr: u64, what: &str| -> Result<u64> {
        process
            .read_u64(bias + addr)
            .with_context(|| format!("reading the TLS {what} from the GOT"))
    };
    if version.major < 3 {
        if let (Some(vm), Some(_)) = (
            image.symbol("ruby_current_vm_ptr"),
            layout.thread.vm_living_threads,
        ) {
            return Ok(EcAccess::ThreadMap {
                vm_ptr: bias + vm.value,
            });
        }
        let sym = image
            .symbol("ruby_current_execution_context_ptr")
            .context("no ruby_current_execution_context_ptr symbol")?;
        return Ok(EcAccess::Global {
            addr: bias + sym.value,
        });
    }
    if let Some(sym) = image.symbol("ruby_current_ec").filter(|s| s.tls) {
        if !image.is_shared_object() {
            // The executable's TLS block is the first, right below the thread pointer.
            let tls = image
                .tls_segment()
                .context("ruby_current_ec is TLS but there is no TLS segment")?;
            return Ok(EcAccess::TlsTpOffset {
                offset: elf::exec_tls_tp_offset(tls, sym.value),
            });
        }
        match image.tls_reloc("ruby_current_ec") {
            Some(TlsReloc::Dtpmod { got }) => {
                return Ok(EcAccess::TlsDtv {
                    module: got_slot(got, "module id")?,
                    offset: sym.value,
                });
            }
            Some(TlsReloc::Tpoff { got }) => {
                return Ok(EcAccess::TlsTpOffset {
                    offset: got_slot(got, "offset")? as i64,
                });
            }
            None => {}
        }
    }
    // Hidden symbol (Debian's 3.3+): an exported function that reads the EC shows the way.
    for func in ["rb_errinfo", "rb_current_execution_context", "rb_thread_current"] {
        let Some(sym) = image.symbol(func) else { continue };
        let Some(code) = image.bytes_at(sym.value, 256) else {
            continue;
        };
        match disasm::first_tls_access(&code, sym.value) {
            Some(TlsAccess::GeneralDynamic { tls_index }) => {
                // tls_index: { module id, offset }
                return Ok(EcAccess::TlsDtv {
                    module: got_slot(tls_index, "module id")?,
                    offset: got_slot(tls_index + 8, "offset")?,
                });
            }
            Some(TlsAccess::InitialExec { got }) => {
                return Ok(EcAccess::TlsTpOffset {
                    offset: got_slot(got, "offset")? as i64,
                });
            }
            Some(TlsAccess::LocalExec { tp_offset }) => {
                return Ok(EcAccess::TlsTpOffset { offset: tp_offset })
            }
            None => {}
        }
    }
    anyhow::bail!("found neither the ruby_current_ec symbol nor code that reads it")
}

/// Where `ruby_global_symbols` (the table that names IDs, so C methods) is:
/// by name, or among the addresses the code of `rb_id2str` uses, the one whose
/// contents look like that table. A just-started Ruby may not have filled it
/// yet, so until one candidate passes, they are checked again when a name is
/// needed.
#[derive(Debug, Clone)]
pub struct GlobalSymbols {
    found: Cell<Option<u64>>,
    candidates: Rc<[u64]>,
}

impl GlobalSymbols {
    /// The table at a known address (the `ruby_global_symbols` symbol).
    pub fn at(addr: u64) -> Self {
        Self {
            found: Cell::new(Some(addr)),
            candidates: Rc::from([]),
        }
    }

    pub fn base(&self, space: &dyn AddressSpace, layout: &Layout) -> Option<u64> {
        if let Some(base) = self.found.get() {
            return Some(base);
        }
        let base = self
            .candidates
            .iter()
            .copied()
            .find(|&base| is_symbol_table(space, base, layout))?;
        self.found.set(Some(base));
        Some(base)
    }
}

fn is_symbol_table(space: &dyn AddressSpace, base: u64, layout: &Layout) -> bool {
    let check = || -> Option<bool> {
        let last_id = space.read_u32(base + layout.symbols.last_id as u64).ok()?;
        let ids = space.read_u64(base + layout.symbols.ids as u64).ok()?;
        if !(100..100_000_000).contains(&last_id) || ids == 0 || ids & 7 != 0 {
            return Some(false);
        }
        let flags = space.read_u64(ids).ok()?;
        Some(flags & layout.value.type_mask == layout.value.t_array)
    };
    check().unwrap_or(false)
}

fn find_global_symbols(process: &Process, image: &ElfImage, bias: u64, layout: &Layout) -> GlobalSymbols {
    if let Some(sym) = image.symbol("ruby_global_symbols") {
        return GlobalSymbols::at(bias + sym.value);
    }
    let mut candidates = Vec::new();
    if let Some(id2str) = image.symbol("rb_id2str") {
        let mut funcs = vec![id2str.value];
        let mut seen = Vec::new();
        while let Some(func) = funcs.pop() {
            if seen.contains(&func) || seen.len() > 6 {
                continue;
            }
            seen.push(func);
            let Some(code) = image.bytes_at(func, 512) else {
                continue;
            };
            candidates.extend(disasm::rip_relative_data(&code, func, 96));
            if seen.len() < 3 {
                funcs.extend(disasm::branch_targets(&code, func, 12).into_iter().rev());
            }
        }
    }
    let candidates: Rc<[u64]> = candidates
        .into_iter()
        .filter_map(|addr| (bias + addr).checked_sub(layout.symbols.last_id as u64))
        .collect();
    let symbols = GlobalSymbols {
        found: Cell::new(None),
        candidates,
    };
    symbols.base(process, layout);
    symbols
}
