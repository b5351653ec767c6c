//! `alloc`: probes on the allocation functions of each followed Ruby, in
//! that process only. A uprobe traps every call whether or not the event is
//! kept, so a process rprof does not follow must not carry one.

use std::path::Path;

use anyhow::{Context, Result};

use crate::address_space::AddressSpace;
use crate::bpf::{types, Probe, ProcessKey};
use crate::error::UserError;
use crate::process::Mapping;
use crate::processes::Processes;
use crate::target::RubyTarget;

/// `endbr64`: a uprobe on it costs 11-13 µs a hit here, one on the next
/// instruction ~0.8 µs (../shared/notes: offcpu-gvl-alloc.md), so probes
/// go after it. The arguments are still in their registers there.
const ENDBR64: [u8; 4] = [0xf3, 0x0f, 0x1e, 0xfa];
/// `T_OBJECT`, what a plain class's allocator makes.
const T_OBJECT: u64 = 1;

/// The BPF cookie of a probe (`enum rprof_alloc_cookie`): where the class
/// is, and where the flags are or else the object's type.
fn cookie(class_arg: u8, flags_arg: Option<u8>, fixed_type: u64) -> u64 {
    use types::rprof_alloc_cookie as C;
    let flags = flags_arg.map_or(u64::from(C::RPROF_ALLOC_NO_ARG.0), u64::from);
    u64::from(class_arg) | flags << C::RPROF_ALLOC_FLAGS_SHIFT.0 | fixed_type << C::RPROF_ALLOC_TYPE_SHIFT.0
}

/// Probes every followed Ruby that has none yet. A process whose
/// allocations cannot be probed is said once and left out; a root given
/// with -p that cannot is an error (`roots` says so).
pub fn attach_new(probe: &mut Probe, processes: &mut Processes, roots: &[u32]) -> Result<()> {
    for f in processes.all() {
        let pid = f.id.pid;
        let key = (pid, f.id.start_ticks);
        let Some(ruby) = &f.ruby else { continue };
        if probe.has_alloc_probes(key) {
            continue;
        }
        if let Err(e) = attach(probe, key, &ruby.target) {
            probe.no_alloc_probes(key);
            if roots.contains(&pid) {
                return Err(e);
            }
            eprintln!("rprof: process {pid}: allocations not traced: {e:#}");
        }
    }
    Ok(())
}

/// Probes the allocation functions of one Ruby.
fn attach(probe: &mut Probe, key: ProcessKey, target: &RubyTarget) -> Result<()> {
    let pid = target.process.pid;
    let alloc = target.layout.alloc.as_ref().ok_or(UserError::AllocUnknownRuby {
        pid,
        version: target.version.to_string(),
    })?;
    if let Some(missing) = alloc.functions.iter().find(|f| {
        !target
            .alloc_functions
            .iter()
            .any(|(found, _)| found.name == f.name)
    }) {
        anyhow::bail!("the VM has no {} to probe", missing.name);
    }
    let mut sites: Vec<(u64, u64)> = target
        .alloc_functions
        .iter()
        .map(|(f, addr)| {
            let made = u64::from(f.object_type.unwrap_or(0));
            (*addr, cookie(f.class_arg, f.flags_arg, made))
        })
        .collect();
    if let Some(off) = alloc.ext_allocator {
        let allocator = plain_allocator(target, off)
            .context("finding where a plain class's objects are allocated (BasicObject's allocator)")?;
        sites.push((allocator, cookie(0, None, T_OBJECT)));
    }
    let maps = target.process.maps()?;
    // By file (libruby, or a static ruby, holds them all): one link each
    // where the kernel has uprobe.multi.
    let mut by_file: Vec<(&Mapping, Vec<(u64, u64)>)> = Vec::new();
    for (addr, cookie) in sites {
        let m = maps
            .iter()
            .find(|m| m.perms.contains('x') && (m.start..m.end).contains(&addr))
            .with_context(|| format!("no code mapped at {addr:#x}"))?;
        let mut first = [0u8; 4];
        target.process.read(addr, &mut first)?;
        let skip = if first == ENDBR64 { 4 } else { 0 };
        let offset = addr - m.start + m.offset + skip;
        match by_file.iter_mut().find(|(f, _)| f.path == m.path) {
            Some((_, offsets)) => offsets.push((offset, cookie)),
            None => by_file.push((m, vec![(offset, cookie)])),
        }
    }
    for (m, sites) in by_file {
        attach_in(probe, key, target, m, &sites)?;
    }
    Ok(())
}

/// The probes in one file, as this process sees it.
fn attach_in(
    probe: &mut Probe,
    key: ProcessKey,
    target: &RubyTarget,
    m: &Mapping,
    sites: &[(u64, u64)],
) -> Result<()> {
    let mut last = None;
    for file in target.process.mapped_file_candidates(m) {
        match probe.attach_alloc(key, Path::new(&file), sites) {
            Ok(()) => return Ok(()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("{} cannot be opened", m.path)))
}

/// BasicObject's allocator, which every plain class inherits: on Rubies
/// where it allocates inside gc.c, `Class#new` calls no exported function.
fn plain_allocator(target: &RubyTarget, ext_allocator: u32) -> Result<u64> {
    let p = &target.process;
    let at = target
        .basic_object_class
        .context("the VM has no rb_cBasicObject")?;
    let klass = p.read_u64(at)?;
    let c = &target.layout.class;
    let ext = match (c.ext_embedded, c.ext_ptr) {
        (Some(embedded), _) => klass + u64::from(embedded),
        (None, Some(ptr)) => p.read_u64(klass + u64::from(ptr))?,
        (None, None) => anyhow::bail!("the layout does not say where a class's classext is"),
    };
    let allocator = p.read_u64(ext + u64::from(ext_allocator))?;
    anyhow::ensure!(allocator != 0, "BasicObject has no allocator");
    Ok(allocator)
}
