//! A thread's Ruby stack read from userspace, frame by frame as BPF reads it
//! (`walk_frame`, `frame_method_entry` and `prepare_frame` in
//! bpf/rprof.bpf.c; a change there must be made here too). Used for threads
//! BPF cannot walk because they never run while rprof looks: those `wall`
//! finds blocked since before the recording (their stacks cannot change
//! until they run), and the main threads of core dumps (the tests).

use ruby_structs::Layout;

use crate::address_space::AddressSpace;
use crate::bpf::types;

/// Env levels followed for a block's method entry (`RPROF_ENV_CHAIN_MAX`).
const ENV_CHAIN_MAX: usize = 8;
/// Frames read at most (`RPROF_MAX_FRAMES`).
const MAX_FRAMES: u64 = 4096;

/// The frames of the EC at `ec`, leaf first, as BPF sends them (the dummy
/// base frame left out); None if a read failed, as a partial stack would lie.
pub fn frames(space: &dyn AddressSpace, l: &Layout, ec: u64) -> Option<Vec<types::rprof_frame>> {
    let e = &l.execution_context;
    let c = &l.control_frame;
    let word = |at: u64| space.read_u64(at).ok();
    let vm_stack = word(ec + u64::from(e.vm_stack))?;
    let end = (vm_stack + 8 * word(ec + u64::from(e.vm_stack_size))?).checked_sub(u64::from(c.size))?;
    let mut cfp = word(ec + u64::from(e.cfp))?;
    if cfp < vm_stack || cfp > end || c.size == 0 || (end - cfp) / u64::from(c.size) > MAX_FRAMES {
        return None;
    }
    let mut frames = Vec::new();
    while cfp < end {
        let (pc, iseq, ep) = (
            word(cfp + u64::from(c.pc))?,
            word(cfp + u64::from(c.iseq))?,
            word(cfp + u64::from(c.ep))?,
        );
        let jit = match c.jit_return {
            Some(j) => word(cfp + u64::from(j))? != 0,
            None => false,
        };
        cfp += u64::from(c.size);
        let (me, flags) = (word(ep.wrapping_sub(16))?, word(ep)?);
        let mut f = types::rprof_frame::default();
        if iseq != 0 {
            f.iseq = iseq;
            f.pc = pc;
            f.cme = method_entry(space, l, ep);
            if flags & l.frame.flag_finish != 0 {
                f.flags |= types::rprof_frame_flags::RPROF_FRAME_FINISH.0;
            }
            if jit {
                f.flags |= types::rprof_frame_flags::RPROF_FRAME_JIT.0;
            }
        } else if flags & l.frame.magic_mask == l.frame.magic_cfunc {
            f.cme = me;
        } else {
            continue;
        }
        frames.push(prepare(space, l, f));
    }
    Some(frames)
}

/// `frame_method_entry`: the local env's method entry, or a block's that
/// runs as a method.
fn method_entry(space: &dyn AddressSpace, l: &Layout, mut ep: u64) -> u64 {
    for _ in 0..ENV_CHAIN_MAX {
        let word = |at: u64| space.read_u64(at).unwrap_or(0);
        let (me, specval, flags) = (word(ep.wrapping_sub(16)), word(ep.wrapping_sub(8)), word(ep));
        if flags & l.frame.env_flag_local != 0 {
            return me;
        }
        if me != 0 && me & 7 == 0 && imemo(l, word(me)) == Some(l.imemo.type_ment) {
            return me;
        }
        ep = specval & !3;
        if ep == 0 {
            return 0;
        }
    }
    0
}

/// `prepare_frame`: an svar gives way to the method entry it holds, a block
/// written in C is flagged, and so are old objects.
fn prepare(space: &dyn AddressSpace, l: &Layout, mut f: types::rprof_frame) -> types::rprof_frame {
    let flags = |v: u64| {
        if v == 0 || v & 7 != 0 {
            return 0;
        }
        space.read_u64(v).unwrap_or(0)
    };
    let old = |v: u64| l.value.fl_promoted != 0 && flags(v) & l.value.fl_promoted == l.value.fl_promoted;
    if f.iseq != 0 && imemo(l, flags(f.cme)) == Some(l.imemo.type_svar) {
        f.cme = space
            .read_u64(f.cme + u64::from(l.imemo.svar_cref_or_me))
            .unwrap_or(0);
    }
    if old(f.cme) {
        f.flags |= types::rprof_frame_flags::RPROF_FRAME_CME_OLD.0;
    }
    if old(f.iseq) {
        f.flags |= types::rprof_frame_flags::RPROF_FRAME_ISEQ_OLD.0;
    }
    if imemo(l, flags(f.iseq)) == Some(l.imemo.type_ifunc) {
        f.flags |= types::rprof_frame_flags::RPROF_FRAME_IFUNC.0;
    }
    f
}

/// The imemo type of an object with these flags, if it is an imemo.
fn imemo(l: &Layout, flags: u64) -> Option<u64> {
    (flags & l.value.type_mask == l.value.t_imemo).then(|| (flags >> l.imemo.type_shift) & l.imemo.type_mask)
}
