//! Reading x86-64 machine code of exported Ruby functions to find variables
//! the library hides (`ruby_current_ec`, `ruby_global_symbols` on Ruby 3.3+)
//! and fields of structs no header declares (`rb_objspace`).

use iced_x86::{Code, Decoder, DecoderOptions, FlowControl, Instruction, Mnemonic, OpKind, Register};

/// How a function reaches a thread-local variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsAccess {
    /// General dynamic: `lea tls_index(%rip),%rdi; call __tls_get_addr`.
    GeneralDynamic { tls_index: u64 },
    /// Initial exec: `mov got(%rip),%reg; mov %fs:(%reg),...`; the GOT slot holds the TP offset.
    InitialExec { got: u64 },
    /// Local exec: `mov %fs:offset,...`.
    LocalExec { tp_offset: i64 },
}

fn decode(code: &[u8], ip: u64, max: usize) -> Vec<Instruction> {
    let mut decoder = Decoder::with_ip(64, code, ip, DecoderOptions::NONE);
    let mut out = Vec::new();
    while decoder.can_decode() && out.len() < max {
        let insn = decoder.decode();
        if insn.is_invalid() {
            break;
        }
        let stop = matches!(insn.flow_control(), FlowControl::Return);
        out.push(insn);
        if stop {
            break;
        }
    }
    out
}

/// The first thread-local access in `code` (a function at address `ip`).
pub fn first_tls_access(code: &[u8], ip: u64) -> Option<TlsAccess> {
    let insns = decode(code, ip, 64);
    for (i, insn) in insns.iter().enumerate() {
        let next = insns.get(i + 1);
        if insn.mnemonic() == Mnemonic::Lea
            && insn.is_ip_rel_memory_operand()
            && insn.op0_register() == Register::RDI
            && next.is_some_and(|n| n.flow_control() == FlowControl::Call)
        {
            return Some(TlsAccess::GeneralDynamic {
                tls_index: insn.ip_rel_memory_address(),
            });
        }
        if insn.mnemonic() == Mnemonic::Mov
            && insn.is_ip_rel_memory_operand()
            && insn.op0_kind() == OpKind::Register
        {
            let reg = insn.op0_register();
            if next.is_some_and(|n| n.segment_prefix() == Register::FS && n.memory_base() == reg) {
                return Some(TlsAccess::InitialExec {
                    got: insn.ip_rel_memory_address(),
                });
            }
        }
        if insn.segment_prefix() == Register::FS
            && insn.memory_base() == Register::None
            && insn.memory_index() == Register::None
            && insn.mnemonic() == Mnemonic::Mov
        {
            let disp = insn.memory_displacement64() as i64;
            // %fs:0x28 is the stack protector canary, not a variable.
            if disp != 0x28 {
                return Some(TlsAccess::LocalExec { tp_offset: disp });
            }
        }
    }
    None
}

/// Addresses of every RIP-relative data operand in `code` (not branches).
pub fn rip_relative_data(code: &[u8], ip: u64, max: usize) -> Vec<u64> {
    decode(code, ip, max)
        .iter()
        .filter(|i| i.is_ip_rel_memory_operand() && i.mnemonic() != Mnemonic::Lea && i.code() != Code::Nopd)
        .map(|i| i.ip_rel_memory_address())
        .collect()
}

/// A chain of loads through one register, as a function like `rb_during_gc`
/// compiles `vm->objspace->flags`: the register starts at a RIP-relative
/// address (`lea`) or at the word stored there (`mov`), then each step loads
/// from register + offset. The last offset is the field the function returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadChain {
    /// The RIP-relative address the chain starts from.
    pub start: u64,
    /// Whether the first instruction loads the word at `start` (`mov`) rather
    /// than taking its address (`lea`).
    pub start_is_load: bool,
    /// Displacements of the loads that follow, in order.
    pub offsets: Vec<i64>,
}

/// The load chain of a function that returns a field reached from a global
/// (`return vm->objspace->flags.during_gc`). Null checks (`test`/`jcc`) on the
/// way are skipped; anything else ends the chain.
pub fn load_chain(code: &[u8], ip: u64) -> Option<LoadChain> {
    let insns = decode(code, ip, 32);
    let first = insns.iter().position(|i| {
        matches!(i.mnemonic(), Mnemonic::Lea | Mnemonic::Mov)
            && i.is_ip_rel_memory_operand()
            && i.op0_kind() == OpKind::Register
    })?;
    let head = &insns[first];
    let mut reg = head.op0_register().full_register();
    let mut chain = LoadChain {
        start: head.ip_rel_memory_address(),
        start_is_load: head.mnemonic() == Mnemonic::Mov,
        offsets: Vec::new(),
    };
    for insn in &insns[first + 1..] {
        match insn.mnemonic() {
            Mnemonic::Test
            | Mnemonic::Cmp
            | Mnemonic::Je
            | Mnemonic::Jne
            | Mnemonic::Endbr64
            | Mnemonic::Nop => continue,
            Mnemonic::Mov | Mnemonic::Movzx | Mnemonic::Movsx
                if insn.op1_kind() == OpKind::Memory
                    && insn.memory_base() == reg
                    && insn.memory_index() == Register::None =>
            {
                chain.offsets.push(insn.memory_displacement64() as i64);
                reg = insn.op0_register().full_register();
            }
            _ => break,
        }
    }
    Some(chain)
}

/// The displacement of the last load into `%rax` before the function returns:
/// the field a getter like `rb_gc_count` (`return objspace->profile.count`)
/// reads from the struct it found first, however it found it.
pub fn last_load_into_rax(code: &[u8], ip: u64) -> Option<i64> {
    decode(code, ip, 32)
        .iter()
        .rev()
        .find(|i| {
            i.mnemonic() == Mnemonic::Mov
                && i.op0_register() == Register::RAX
                && i.op1_kind() == OpKind::Memory
                && i.memory_index() == Register::None
                && i.memory_base() != Register::RIP
                && i.memory_base() != Register::None
        })
        .map(|i| i.memory_displacement64() as i64)
}

/// The function `code` (at `ip`) ends by jumping to: its first direct
/// unconditional jump out of `code` (a tail call), e.g. `rb_iseq_eval_main`'s
/// `jmp rb_vm_exec` on Ruby 3.3+, where `rb_vm_exec` is hidden.
pub fn first_tail_call(code: &[u8], ip: u64) -> Option<u64> {
    let end = ip + code.len() as u64;
    decode(code, ip, 96)
        .iter()
        .filter(|i| {
            i.flow_control() == FlowControl::UnconditionalBranch && i.op0_kind() == OpKind::NearBranch64
        })
        .map(|i| i.near_branch_target())
        .find(|&t| t < ip || t >= end)
}

/// Targets of direct calls and jumps in `code`, in order.
pub fn branch_targets(code: &[u8], ip: u64, max: usize) -> Vec<u64> {
    decode(code, ip, max)
        .iter()
        .filter(|i| {
            matches!(
                i.flow_control(),
                FlowControl::Call | FlowControl::UnconditionalBranch | FlowControl::ConditionalBranch
            ) && matches!(i.op0_kind(), OpKind::NearBranch64)
        })
        .map(|i| i.near_branch_target())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_call_out_of_the_function() {
        // call +0x10; jmp to itself (inside); jmp 0x5000 (out); ret
        let code = [
            0xe8, 0x10, 0x00, 0x00, 0x00, // call
            0xeb, 0xfe, // jmp to itself
            0xe9, 0xf4, 0x0f, 0x00, 0x00, // jmp ip+12+0xff4 = 0x5000
            0xc3,
        ];
        assert_eq!(first_tail_call(&code, 0x4000), Some(0x5000));
        assert_eq!(first_tail_call(&code[..7], 0x4000), None);
    }

    #[test]
    fn general_dynamic_sequence() {
        // data16 lea 0x1000(%rip),%rdi; data16 data16 rex.W call *; mov (%rax),%rax
        let code = [
            0x66, 0x48, 0x8d, 0x3d, 0x00, 0x10, 0x00, 0x00, // lea
            0x66, 0x66, 0x48, 0xe8, 0x00, 0x00, 0x00, 0x00, // call
            0x48, 0x8b, 0x00, 0xc3,
        ];
        assert_eq!(
            first_tls_access(&code, 0x4000),
            Some(TlsAccess::GeneralDynamic {
                tls_index: 0x4000 + 8 + 0x1000
            })
        );
    }

    #[test]
    fn local_exec_skips_the_stack_canary() {
        // mov %fs:0x28,%rax; mov %fs:0xfffffffffffffff8,%rax; ret
        let code = [
            0x64, 0x48, 0x8b, 0x04, 0x25, 0x28, 0x00, 0x00, 0x00, //
            0x64, 0x48, 0x8b, 0x04, 0x25, 0xf8, 0xff, 0xff, 0xff, 0xc3,
        ];
        assert_eq!(
            first_tls_access(&code, 0),
            Some(TlsAccess::LocalExec { tp_offset: -8 })
        );
    }

    #[test]
    fn initial_exec_sequence() {
        // mov 0x200(%rip),%rax; mov %fs:(%rax),%rax; ret
        let code = [
            0x48, 0x8b, 0x05, 0x00, 0x02, 0x00, 0x00, 0x64, 0x48, 0x8b, 0x00, 0xc3,
        ];
        assert_eq!(
            first_tls_access(&code, 0x100),
            Some(TlsAccess::InitialExec {
                got: 0x100 + 7 + 0x200
            })
        );
    }

    #[test]
    fn load_chain_through_the_got() {
        // Ruby 3.1's rb_during_gc: mov 0x1000(%rip),%rax; mov (%rax),%rax;
        // mov 0x458(%rax),%rax; movzbl 0x10(%rax),%eax; shr $5,%al; and $1,%eax; ret
        let code = [
            0x48, 0x8b, 0x05, 0x00, 0x10, 0x00, 0x00, 0x48, 0x8b, 0x00, 0x48, 0x8b, 0x80, 0x58, 0x04, 0x00,
            0x00, 0x0f, 0xb6, 0x40, 0x10, 0xc0, 0xe8, 0x05, 0x83, 0xe0, 0x01, 0xc3,
        ];
        assert_eq!(
            load_chain(&code, 0x100),
            Some(LoadChain {
                start: 0x100 + 7 + 0x1000,
                start_is_load: true,
                offsets: vec![0, 0x458, 0x10],
            })
        );
    }

    #[test]
    fn load_chain_skips_null_checks() {
        // Ruby 3.3's: endbr64; lea 0x2000(%rip),%rax; mov (%rax),%rax; test %rax,%rax;
        // je +0; mov 0x518(%rax),%rax; movzbl 0x10(%rax),%eax; ret
        let code = [
            0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x8d, 0x05, 0x00, 0x20, 0x00, 0x00, 0x48, 0x8b, 0x00, 0x48, 0x85,
            0xc0, 0x74, 0x00, 0x48, 0x8b, 0x80, 0x18, 0x05, 0x00, 0x00, 0x0f, 0xb6, 0x40, 0x10, 0xc3,
        ];
        let chain = load_chain(&code, 0).expect("a chain");
        assert_eq!(chain.start, 11 + 0x2000);
        assert!(!chain.start_is_load);
        assert_eq!(chain.offsets, vec![0, 0x518, 0x10]);
    }

    #[test]
    fn last_load_after_a_call() {
        // Ruby 3.4's rb_gc_count: endbr64; sub $8,%rsp; call +0; mov 0x3f0(%rax),%rax; add $8,%rsp; ret
        let code = [
            0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x83, 0xec, 0x08, 0xe8, 0x00, 0x00, 0x00, 0x00, 0x48, 0x8b, 0x80,
            0xf0, 0x03, 0x00, 0x00, 0x48, 0x83, 0xc4, 0x08, 0xc3,
        ];
        assert_eq!(last_load_into_rax(&code, 0), Some(0x3f0));
    }

    #[test]
    fn data_references_and_branches() {
        // cmp %edi,0x10(%rip); jmp +0; ret
        let code = [
            0x39, 0x3d, 0x10, 0x00, 0x00, 0x00, 0xe9, 0x00, 0x00, 0x00, 0x00, 0xc3,
        ];
        assert_eq!(rip_relative_data(&code, 0, 8), vec![6 + 0x10]);
        assert_eq!(branch_targets(&code, 0, 8), vec![11]);
    }
}
