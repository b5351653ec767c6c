//! Where Ruby's memory is read from: a live process (process_vm_readv), or
//! in tests a core dump of a Ruby that this machine cannot run. Reading an
//! object is the same in both, so the resolver and the layout proof are
//! written against this trait (py-spy's `ProcessMemory` is the model).

use std::cell::{Cell, RefCell};
use std::io;
use std::rc::Rc;

use foldhash::{HashMap, HashMapExt};

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

/// Reads served from whole pages while a bracket's reads are on
/// (`PageCache::reading`): naming one stack reads hundreds of small fields
/// from a few pages (an iseq, its body, its strings), and a system call per
/// field would be most of rprof's CPU time each time a major GC makes it
/// read its code again. A page is read at its first use in the bracket and forgotten when
/// reading stops, so every byte served was read between the bracket's two
/// clock readings, as a read of its own would have been. `read_many` (the
/// clock's) always reads the memory itself.
pub struct PageCache {
    inner: Rc<dyn AddressSpace>,
    /// Pages read in this bracket; None for one that could not be read whole.
    pages: RefCell<HashMap<u64, Option<Box<[u8]>>>>,
    on: Cell<bool>,
}

const PAGE: u64 = 4096;

impl PageCache {
    pub fn new(inner: Rc<dyn AddressSpace>) -> Self {
        Self {
            inner,
            pages: RefCell::new(HashMap::new()),
            on: Cell::new(false),
        }
    }

    /// Starts (true) or ends (false) a bracket's reads; ending forgets every page.
    pub fn reading(&self, on: bool) {
        self.on.set(on);
        if !on {
            self.pages.borrow_mut().clear();
        }
    }

    /// Copies `buf.len()` bytes at `addr` from cached pages, reading the
    /// missing ones in one system call; false if one cannot be read whole.
    fn copy_from_pages(&self, addr: u64, buf: &mut [u8]) -> bool {
        let Some(end) = addr.checked_add(buf.len() as u64) else {
            return false;
        };
        let first = addr & !(PAGE - 1);
        let mut pages = self.pages.borrow_mut();
        let missing: Vec<u64> = (first..end)
            .step_by(PAGE as usize)
            .filter(|p| !pages.contains_key(p))
            .collect();
        if !missing.is_empty() {
            let mut bufs: Vec<Box<[u8]>> = missing.iter().map(|_| vec![0u8; PAGE as usize].into()).collect();
            let mut ranges: Vec<(u64, &mut [u8])> = missing
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&p, b)| (p, &mut b[..]))
                .collect();
            let whole = self.inner.read_many(&mut ranges).is_ok();
            for (p, b) in missing.into_iter().zip(bufs) {
                pages.insert(p, whole.then_some(b));
            }
        }
        let mut at = addr;
        let mut out = &mut buf[..];
        while !out.is_empty() {
            let page = at & !(PAGE - 1);
            let Some(Some(bytes)) = pages.get(&page) else {
                return false;
            };
            let off = (at - page) as usize;
            let n = out.len().min(PAGE as usize - off);
            out[..n].copy_from_slice(&bytes[off..off + n]);
            out = &mut out[n..];
            at += n as u64;
        }
        true
    }
}

impl AddressSpace for PageCache {
    fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
        // Long reads (line tables) are read as they are.
        if self.on.get() && buf.len() as u64 <= PAGE && self.copy_from_pages(addr, buf) {
            return Ok(());
        }
        self.inner.read(addr, buf)
    }

    fn read_many(&self, ranges: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        self.inner.read_many(ranges)
    }

    fn is_still(&self) -> bool {
        self.inner.is_still()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory of two pages at 0x1000, counting its reads.
    struct Two {
        bytes: Vec<u8>,
        reads: Cell<usize>,
    }

    impl AddressSpace for Two {
        fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<()> {
            self.reads.set(self.reads.get() + 1);
            let at = addr.checked_sub(0x1000).ok_or(io::ErrorKind::InvalidInput)? as usize;
            let bytes = self
                .bytes
                .get(at..at + buf.len())
                .ok_or(io::ErrorKind::InvalidInput)?;
            buf.copy_from_slice(bytes);
            Ok(())
        }
    }

    #[test]
    fn a_bracket_reads_each_page_once_and_forgets_it_at_its_end() {
        let two = Rc::new(Two {
            bytes: (0..2 * PAGE).map(|i| i as u8).collect(),
            reads: Cell::new(0),
        });
        let cache = PageCache::new(two.clone());
        cache.reading(true);
        let mut b = [0u8; 8];
        cache.read(0x1ffc, &mut b).unwrap();
        assert_eq!(b, [0xfc, 0xfd, 0xfe, 0xff, 0, 1, 2, 3]);
        cache.read(0x1010, &mut b).unwrap();
        assert_eq!(b[0], 0x10);
        assert_eq!(two.reads.get(), 2, "two pages, read once each");
        // A read past the memory fails as it would uncached.
        assert!(cache.read(0x2ffc, &mut b).is_err());
        cache.reading(false);
        cache.read(0x1010, &mut b).unwrap();
        let reads = two.reads.get();
        cache.read(0x1010, &mut b).unwrap();
        assert_eq!(
            two.reads.get(),
            reads + 1,
            "outside a bracket every read is the memory's"
        );
    }
}
