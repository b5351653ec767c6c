//! When the recording loop reads the ring buffer.
//!
//! BPF never wakes rprof for a record (`wakeup_flags` in bpf/rprof.bpf.c):
//! woken by the record of each sample, rprof ran right after every sampling
//! tick, on another CPU just as that CPU's tick came (the per-CPU timers
//! start microseconds apart and keep their phase), and those ticks found
//! rprof instead of the thread it had displaced. A Puma worker got from half
//! to 1.17 of its share of samples (24 workers, 2026-11-25) while a bpftrace
//! sampler at the same rate counted it steadily. Reading at random moments
//! instead, rprof displaces threads as often at a tick as anywhere else.

use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

/// The recording loop's waits between readings.
pub struct Pace {
    /// The wait, in µs, while urgent records come.
    busy_us: RangeInclusive<u64>,
    /// When the last urgent record came: one whose code is young, or a
    /// process's change. A record whose every iseq and method entry BPF saw
    /// old can wait: only a major GC frees or moves old objects, and rprof
    /// tells when one ran before it read (frames it cannot vouch for are
    /// `[unknown]`, counted). A server's code is old a few GCs after boot:
    /// its records then wake rprof as seldom as no records do, where each
    /// wakeup took from the server's CPUs (Puma saturated under `wall`:
    /// 735 wakeups a second, a third of rprof's CPU time).
    last_urgent: Instant,
    /// The last reading stopped at a full batch: more is waiting.
    backlog: bool,
}

impl Pace {
    /// The wait once no urgent record came for [`Pace::QUIET`]. Each wakeup
    /// costs tens of µs in a VM (bench/reader-cost).
    const IDLE_US: RangeInclusive<u64> = 5_000..=15_000;
    /// How long after the last urgent record the fast pace holds: long
    /// enough that a program whose young code runs now and then (churn,
    /// code compiled per request) stays read fast between its bursts,
    /// not only while they last; before old code let rprof slow down, any
    /// record kept it fast for 20 ms.
    const QUIET: Duration = Duration::from_secs(1);

    /// A pace for sampling every `period` (per CPU), for the calling
    /// thread. While urgent records come, it reads every 1/20 to 1/5 of a period
    /// (0.1 to 0.4 ms at 499 Hz): a record's frames must be named before the
    /// target's GC frees their code (per-request code, churn), but each
    /// reading costs a wakeup, and records come at most once a period per
    /// CPU. Its sleeps end when asked: Linux lets a sleep run up to 50 µs
    /// long by default, to the next timer interrupt, which may be a tick's.
    pub fn new(period: Duration) -> Self {
        // SAFETY: changes only this thread's timer slack (1 ns).
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
        }
        let us = period.as_micros() as u64;
        Self {
            busy_us: (us / 20).max(50)..=(us / 5).max(200),
            last_urgent: Instant::now(),
            backlog: false,
        }
    }

    /// Sleeps until the next reading: not at all with a backlog.
    pub fn sleep(&self) {
        if self.backlog {
            return;
        }
        let range = if self.last_urgent.elapsed() < Self::QUIET {
            self.busy_us.clone()
        } else {
            Self::IDLE_US
        };
        std::thread::sleep(Duration::from_micros(fastrand::u64(range)));
    }

    /// A reading stopped with more records left (`full`), or not; `urgent`
    /// if one of them was.
    pub fn read(&mut self, full: bool, urgent: bool) {
        self.backlog = full;
        if urgent {
            self.last_urgent = Instant::now();
        }
    }
}

/// Something the recording loop does now and then, not at every reading
/// (up to a few thousand a second).
pub struct Every {
    period: Duration,
    last: Instant,
}

impl Every {
    pub fn new(period: Duration) -> Self {
        Self {
            period,
            last: Instant::now(),
        }
    }

    /// Whether a period has passed since it was last due.
    pub fn due(&mut self) -> bool {
        let due = self.last.elapsed() >= self.period;
        if due {
            self.last = Instant::now();
        }
        due
    }
}
