//! The threads of a process with their thread pointers (bpf/threads.bpf.c),
//! for the layout proof. Its own BPF object, loaded in about a millisecond:
//! a process whose layout does not fit is refused before rprof.bpf.c's
//! programs are loaded, which takes the kernel a quarter of a second or more.

use std::mem::MaybeUninit;

use anyhow::{Context, Result};
use libbpf_rs::skel::{OpenSkel, SkelBuilder};
use libbpf_rs::{MapCore, MapFlags};

#[allow(clippy::all, clippy::pedantic, non_camel_case_types, dead_code)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/threads.skel.rs"));
}

use skel::{ThreadsSkel, ThreadsSkelBuilder};

pub struct ThreadLister {
    skel: ThreadsSkel<'static>,
}

impl ThreadLister {
    /// Loads the iterator (not attached: each listing attaches it anew).
    pub fn load() -> Result<Self> {
        super::set_libbpf_print();
        let open_object = Box::leak(Box::new(MaybeUninit::uninit()));
        let open = ThreadsSkelBuilder::default()
            .open(open_object)
            .context("opening the thread lister's BPF object")?;
        let skel = open
            .load()
            .context("loading the thread lister's BPF program (RPROF_DEBUG=1 shows libbpf's log)")?;
        Ok(ThreadLister { skel })
    }

    /// (tid, thread pointer) of each thread of process `pid`.
    pub fn list(&self, pid: u32) -> Result<Vec<(u32, u64)>> {
        self.skel
            .maps
            .iter_tgid
            .update(&0u32.to_ne_bytes(), &pid.to_ne_bytes(), MapFlags::ANY)
            .context("choosing the process whose threads to list")?;
        // The type as rprof.bpf.c's skeleton has it (this one's BTF lists
        // only its maps' types), from the same header.
        let threads: Vec<super::types::rprof_thread_pointer> = super::run_iter(
            &self.skel.progs.thread_pointers,
            "listing the threads of a process",
        )?;
        Ok(threads.into_iter().map(|t| (t.tid, t.tp)).collect())
    }
}
