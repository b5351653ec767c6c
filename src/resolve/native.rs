//! Names native and kernel frames, through blazesym: a file's own symbol
//! tables, or its separate debug file when the target's system has one
//! (found by `unwind::files`), the kernel's from kallsyms. A function
//! without a symbol (Debian strips libruby's local symbols) is
//! `file+0xVADDR`, which `addr2line -f -e FILE 0xVADDR` resolves once the
//! debug symbols are at hand.

use std::collections::HashMap;
use std::path::Path;
use std::rc::Rc;
use std::sync::Arc;

use blazesym::symbolize::source::{Elf, Kernel, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};
use blazesym::MaybeDefault;

use crate::unwind::Unwinder;

/// What is known of the native function at one address.
#[derive(Debug)]
pub struct NativeSymbol {
    /// Its name, if a symbol table has it.
    pub name: Option<Arc<str>>,
    /// Its first instruction (vaddr), by the file's CFI or symbol.
    pub start: Option<u64>,
    /// The frame's text: the name, or `file+0xVADDR`.
    pub label: Arc<str>,
}

pub struct NativeNames {
    symbolizer: Symbolizer,
    /// Files (by serial) whose symbols are loaded already.
    warm: std::collections::HashSet<u64>,
    kernel_warm: bool,
    /// By (file serial, vaddr): a file id is reused once its file is gone.
    user: HashMap<(u64, u64), Rc<NativeSymbol>>,
    kernel: HashMap<u64, Arc<str>>,
}

impl Default for NativeNames {
    fn default() -> Self {
        Self {
            // Debug files are found by rprof in the target's own root.
            symbolizer: Symbolizer::builder()
                .enable_code_info(false)
                .enable_inlined_fns(false)
                .set_debug_dirs(Some(Vec::<&Path>::new()))
                .build(),
            warm: Default::default(),
            kernel_warm: false,
            user: HashMap::new(),
            kernel: HashMap::new(),
        }
    }
}

impl NativeNames {
    /// Loads the symbols of files new since the last call (and the kernel's
    /// with `kernel`), so that naming the first samples does not wait for
    /// it while the target's GC recycles the Ruby code they ran.
    pub fn warm(&mut self, unwinder: &Unwinder, kernel: bool) {
        let new: Vec<(u32, u64, u64)> = unwinder
            .files()
            .filter(|(_, f)| !self.warm.contains(&f.serial))
            .map(|(id, f)| (id, f.serial, f.function_starts.first().copied().unwrap_or(0)))
            .collect();
        for (id, serial, first) in new {
            self.warm.insert(serial);
            let _ = self.user(unwinder, id, first);
        }
        if kernel && !self.kernel_warm {
            self.kernel_warm = true;
            let _ = self.kernel(0xffffffff81000000);
        }
    }

    /// The function at `vaddr` of file `file` (an id of `unwinder`'s).
    pub fn user(&mut self, unwinder: &Unwinder, file: u32, vaddr: u64) -> Option<Rc<NativeSymbol>> {
        let f = unwinder.file(file)?;
        if let Some(s) = self.user.get(&(f.serial, vaddr)) {
            return Some(s.clone());
        }
        let mut sym = f.plt_name(vaddr).map(|name| (Arc::<str>::from(name), vaddr));
        for path in f.debug_file.iter().chain(std::iter::once(&f.path)) {
            if sym.is_some() {
                break;
            }
            let src = Source::Elf(Elf::new(path));
            if let Ok(Symbolized::Sym(s)) = self.symbolizer.symbolize_single(&src, Input::VirtOffset(vaddr)) {
                // A symbol without a size (`_init`) says nothing of what follows it.
                if s.offset > 0 && s.size.is_none_or(|n| n == 0) {
                    continue;
                }
                // glibc's internal aliases (`__GI___qsort_r`) as its public names.
                let name = s.name.strip_prefix("__GI_").unwrap_or(&s.name);
                sym = Some((Arc::<str>::from(name), s.addr));
            }
        }
        let start = f.function_start(vaddr).or(sym.as_ref().map(|s| s.1));
        let name = sym.map(|s| s.0);
        let label = match &name {
            Some(n) => n.clone(),
            None => format!("{}+{vaddr:#x}", f.name).into(),
        };
        let found = Rc::new(NativeSymbol { name, start, label });
        self.user.insert((f.serial, vaddr), found.clone());
        Some(found)
    }

    /// The kernel function at `addr`, from kallsyms.
    pub fn kernel(&mut self, addr: u64) -> Arc<str> {
        if let Some(name) = self.kernel.get(&addr) {
            return name.clone();
        }
        let src = Source::Kernel(Kernel {
            kallsyms: MaybeDefault::Default,
            vmlinux: MaybeDefault::None,
            debug_syms: false,
            ..Kernel::default()
        });
        let name: Arc<str> = match self.symbolizer.symbolize_single(&src, Input::AbsAddr(addr)) {
            Ok(Symbolized::Sym(s)) => s.name.into(),
            _ => format!("[kernel {addr:#x}]").into(),
        };
        self.kernel.insert(addr, name.clone());
        name
    }
}
