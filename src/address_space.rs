//! Where Ruby's memory is read from: a live process (process_vm_readv), or
//! in tests a core dump of a Ruby that this machine cannot run. Reading an
//! object is the same in both, so the resolver and the layout proof are
//! written against this trait (py-spy's `ProcessMemory` is the model).

use std::io;

use crate::process::Process;

/// Memory of one process, read by address.
pub trait AddressSpace {
    /// Reads `buf.len()` bytes at `addr`; an error if any of them is missing.
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()>;

    /// Reads several ranges, in order (a live process: one system call).
    fn read_many(&self, ranges: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        ranges
            .iter_mut()
            .try_for_each(|(addr, buf)| self.read(*addr, buf))
    }

    fn read_u64(&self, addr: u64) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn read_u32(&self, addr: u64) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.read(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Whether the memory never changes (a core dump): the GC's clock then
    /// stands still, and a reading is as true as the sample's.
    fn is_still(&self) -> bool {
        false
    }
}

impl AddressSpace for Process {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        Process::read(self, addr, buf)
    }

    fn read_many(&self, ranges: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        Process::read_many(self, ranges)
    }
}
