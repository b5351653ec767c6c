//! What a recording counts: CPU samples at a frequency, traced system
//! calls, every thread's time, or allocations. Each kind knows how it is
//! checked, attached, described and paced, so the recording loop never asks
//! which one it has.

use std::time::Duration;

use anyhow::Result;

use crate::bpf::Probe;
use crate::error::UserError;
use crate::processes::Processes;
use crate::recording::Event;
use crate::system;

use super::collector::Collector;
use super::{alloc, wall};

/// Highest sampling frequency accepted.
const MAX_FREQUENCY: u64 = 100_000;
/// Sparsest allocation sampling accepted (`alloc --every`).
const MAX_EVERY: u64 = 1_000_000;

pub enum EventSpec {
    Cpu {
        frequency: u64,
    },
    /// Tracepoints of the `syscalls` group, by their tracefs name (`sys_enter_getpid`).
    Syscalls(Vec<String>),
    /// Every thread's time: on CPU, sampled at `frequency`; off CPU, each
    /// interval counted whole at the context switches, with its reason.
    Wall {
        frequency: u64,
    },
    /// Object allocations, 1 in `every` walked (and weighing `every`).
    Alloc {
        every: u64,
    },
}

impl EventSpec {
    /// Refuses what cannot be recorded, before anything is loaded.
    pub fn check(&self) -> Result<()> {
        match self {
            EventSpec::Cpu { frequency } | EventSpec::Wall { frequency }
                if *frequency == 0 || *frequency > MAX_FREQUENCY =>
            {
                Err(UserError::BadFrequency {
                    given: *frequency,
                    max: MAX_FREQUENCY,
                }
                .into())
            }
            EventSpec::Cpu { .. } | EventSpec::Wall { .. } => Ok(()),
            EventSpec::Syscalls(_) => system::tracefs().map(|_| ()).map_err(Into::into),
            EventSpec::Alloc { every } if *every == 0 || *every > MAX_EVERY => {
                Err(UserError::BadAllocEvery {
                    given: *every,
                    max: MAX_EVERY,
                }
                .into())
            }
            EventSpec::Alloc { .. } => Ok(()),
        }
    }

    /// What BPF's event numbers stand for, from 1 (0 is a CPU sample).
    pub fn names(&self) -> Vec<String> {
        match self {
            EventSpec::Cpu { .. } => vec!["cpu".to_string()],
            EventSpec::Wall { .. } => vec!["wall".to_string()],
            EventSpec::Syscalls(names) => names.clone(),
            EventSpec::Alloc { .. } => vec!["alloc".to_string()],
        }
    }

    /// The event as the recording's header keeps it (with its unit).
    pub fn recorded(&self) -> Event {
        match self {
            EventSpec::Cpu { frequency } => Event::Cpu {
                frequency: *frequency,
            },
            EventSpec::Syscalls(names) => Event::Syscalls(names.clone()),
            EventSpec::Wall { frequency } => Event::Wall {
                frequency: *frequency,
            },
            EventSpec::Alloc { every } => Event::Alloc { every: *every },
        }
    }

    pub fn attach(&self, probe: &mut Probe) -> Result<()> {
        match self {
            EventSpec::Cpu { frequency } => probe.attach_cpu_clock(*frequency),
            // The switches first: a thread's first sample then finds when it
            // was first seen.
            EventSpec::Wall { frequency } => {
                probe.attach_wall()?;
                probe.attach_cpu_clock(*frequency)
            }
            EventSpec::Syscalls(names) => names
                .iter()
                .enumerate()
                .try_for_each(|(i, name)| probe.attach_tracepoint("syscalls", name, i as u32 + 1)),
            // In each process, as it is found (attach_processes).
            EventSpec::Alloc { .. } => Ok(()),
        }
    }

    /// Probes in the followed processes that have none yet (`alloc`, whose
    /// probes are per process). A process among `roots` that cannot be
    /// probed is an error; another is said and left out.
    pub fn attach_processes(
        &self,
        probe: &mut Probe,
        processes: &mut Processes,
        roots: &[u32],
    ) -> Result<()> {
        match self {
            EventSpec::Alloc { .. } => alloc::attach_new(probe, processes, roots),
            _ => Ok(()),
        }
    }

    /// `alloc`: 1 in how many allocations is walked.
    pub fn alloc_every(&self) -> Option<u32> {
        match self {
            EventSpec::Alloc { every } => Some(*every as u32),
            _ => None,
        }
    }

    /// "sampling at 99 Hz", as the first line says it.
    pub fn describe(&self) -> String {
        match self {
            EventSpec::Cpu { frequency } => format!("sampling at {frequency} Hz"),
            EventSpec::Wall { frequency } => {
                format!("timing every thread, on CPU or not (on CPU sampled at {frequency} Hz)")
            }
            EventSpec::Syscalls(names) => format!("tracing {}", names.join(", ")),
            EventSpec::Alloc { every: 1 } => "tracing every allocation".to_string(),
            EventSpec::Alloc { every } => {
                format!("tracing 1 in {every} allocations at random (counts scaled by {every})")
            }
        }
    }

    pub fn is_wall(&self) -> bool {
        matches!(self, EventSpec::Wall { .. })
    }

    /// Whether it is counted at tracepoints (system calls) rather than by
    /// CPU samples.
    pub fn is_traced(&self) -> bool {
        matches!(self, EventSpec::Syscalls(_))
    }

    /// Before each epoch closes: `wall` counts the waits still open up to
    /// now, and seeds threads it has not seen.
    pub fn epoch_ends(
        &self,
        probe: &mut Probe,
        processes: &mut Processes,
        collector: &mut Collector,
    ) -> Result<()> {
        match self {
            EventSpec::Wall { .. } => wall::sweep(probe, processes, collector),
            _ => Ok(()),
        }
    }

    /// As the recording stops (BPF counts nothing more): `wall` notes each
    /// process's GC clock, which splits the GVL waits still open.
    pub fn stops(&self, probe: &mut Probe, processes: &mut Processes) {
        if let EventSpec::Wall { .. } = self {
            wall::note_stop_clocks(probe, processes);
        }
    }

    /// How often records may come: what the recording loop paces its
    /// reading by.
    pub fn period(&self) -> Duration {
        match self {
            EventSpec::Cpu { frequency } | EventSpec::Wall { frequency } => {
                Duration::from_secs(1) / (*frequency).max(1) as u32
            }
            // Traced events come whenever the target makes them, not at ticks.
            EventSpec::Syscalls(_) | EventSpec::Alloc { .. } => Duration::from_millis(2),
        }
    }

    /// The period of the ticks that take its samples on every CPU, if it is
    /// sampled at ticks: the recording loop counts their records at moments
    /// spread over it (src/pace.rs, `Hold`).
    pub fn tick_period(&self) -> Option<Duration> {
        match self {
            EventSpec::Cpu { .. } | EventSpec::Wall { .. } => Some(self.period()),
            EventSpec::Syscalls(_) | EventSpec::Alloc { .. } => None,
        }
    }
}
