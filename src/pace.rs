//! When the recording loop reads the ring buffer, and when it counts what
//! it read.
//!
//! BPF never wakes rprof for a record (`wakeup_flags` in bpf/rprof.bpf.c):
//! woken by the record of each sample, rprof ran right after every sampling
//! tick, on another CPU just as that CPU's tick came (the per-CPU timers
//! start microseconds apart and keep their phase), and those ticks found
//! rprof instead of the thread it had displaced. A Puma worker got from half
//! to 1.17 of its share of samples (24 workers, 2026-11-25) while a bpftrace
//! sampler at the same rate counted it steadily. So rprof reads at random
//! moments. Reading so was not enough: the work a record causes still came
//! at the first reading after the tick that took it, and ended well before
//! the next tick, so ticks hardly ever found rprof at work and found the
//! thread it had displaced instead (a Rails worker got up to 1.16 times the
//! samples its CPU time gives; traced, rprof had 8.1% of the CPUs' time and
//! 2.4% of the ticks). A [`Hold`] starts the counting at a moment spread
//! evenly over a period, where a tick is as likely to come as anywhere; the
//! naming, still done at once, is what is left (bench/tick-share), and BPF
//! keeps each thread's samples to its CPU time (`cpu_sample_weight`).

use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

/// The recording loop's waits between readings.
pub struct Pace {
    /// The wait, in µs, while urgent records come.
    busy_us: RangeInclusive<u64>,
    /// When the last urgent record came: one whose young code rprof had to
    /// read (not named from earlier readings), or a process's change. A
    /// record whose every iseq and method entry BPF saw
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
    /// The shortest waits of the fast pace, in µs (499 Hz's). At 10 kHz,
    /// waits of 50 to 200 µs woke rprof 6,800 times a second, and each
    /// wakeup that preempted the target charged it to rprof from the wakeup
    /// on, not from when rprof ran: the kernel skips the clock update of the
    /// switch a wakeup asks for, and the target runs on until it is made
    /// (8 µs on this VM, median). Traced (`sched_stat_runtime`), rprof ran
    /// 27 ms a second and was charged 89; the target's CPU time fell 7% short
    /// of the time it ran, and its samples were 1% above the time it ran.
    const MIN_BUSY_US: (u64, u64) = (100, 400);

    /// A pace for sampling every `period` (per CPU), for the calling
    /// thread. While urgent records come, it reads every 1/20 to 1/5 of a period
    /// (0.1 to 0.4 ms at 499 Hz), and no more often at higher rates: a
    /// record's frames must be named before the target's GC frees their code
    /// (per-request code, churn), which takes as long whatever the rate, and
    /// each reading costs a wakeup, records come at most once a period per
    /// CPU, and a wakeup that preempts a target moves some of the target's CPU
    /// time to rprof in the kernel's accounts (see `MIN_BUSY_US`). Its sleeps
    /// end when asked: Linux lets a sleep run up to 50 µs long by default, to
    /// the next timer interrupt, which may be a tick's.
    pub fn new(period: Duration) -> Self {
        // SAFETY: changes only this thread's timer slack (1 ns).
        unsafe {
            libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
        }
        let us = period.as_micros() as u64;
        Self {
            busy_us: (us / 20).max(Self::MIN_BUSY_US.0)..=(us / 5).max(Self::MIN_BUSY_US.1),
            last_urgent: Instant::now(),
            backlog: false,
        }
    }

    /// Whether it reads often: urgent records came in the last second.
    pub fn fast(&self) -> bool {
        self.last_urgent.elapsed() < Self::QUIET
    }

    /// Sleeps until the next reading (not at all with a backlog), or until
    /// `until` if that comes first.
    pub fn sleep(&self, until: Option<Instant>) {
        if self.backlog {
            return;
        }
        let range = if self.fast() {
            self.busy_us.clone()
        } else {
            Self::IDLE_US
        };
        let mut wait = Duration::from_micros(fastrand::u64(range));
        if let Some(until) = until {
            wait = wait.min(until.saturating_duration_since(Instant::now()));
        }
        std::thread::sleep(wait);
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

/// When records that came are counted: at a moment drawn evenly over one
/// sampling period after the loop first saw them waiting. Counting them
/// (their native and kernel frames, the profile) is most of rprof's work
/// besides naming their Ruby frames; started at the first reading after a
/// tick, it ended before the next tick nearly always. Started at a moment
/// spread over the period, it is where a tick finds it as often as its
/// share of the time. Ruby frames, whose code the GC may free or move
/// meanwhile, are named as soon as the records are read
/// (`Collector::read_ahead`), not held.
pub struct Hold {
    /// None: records do not come at ticks (traced events); counted at once.
    period: Option<Duration>,
    /// When the records held are due, and how many they are (the first of
    /// those waiting).
    held: Option<(Instant, usize)>,
}

impl Hold {
    pub fn new(period: Option<Duration>) -> Self {
        Self { period, held: None }
    }

    /// How many of the records `waiting` (oldest first) to count now:
    /// held only if `spread` (the pace is fast: at a slow pace, readings 5
    /// to 15 ms apart already come at any moment of a period). Records that
    /// come during a hold wait for the next one: the work would otherwise
    /// grow whenever a tick came meanwhile.
    pub fn due(&mut self, waiting: usize, spread: bool) -> usize {
        let now = Instant::now();
        match (self.period, self.held) {
            (Some(_), Some((until, held))) => {
                if until > now {
                    return 0;
                }
                self.held = None;
                held
            }
            (Some(period), None) if spread && waiting > 0 => {
                self.held = Some((now + period.mul_f64(fastrand::f64()), waiting));
                0
            }
            _ => waiting,
        }
    }

    /// The records held were counted otherwise (an epoch's close).
    pub fn forget(&mut self) {
        self.held = None;
    }

    /// Whether records would be held (they come at ticks).
    pub fn holds(&self) -> bool {
        self.period.is_some()
    }

    /// When the records held are due, if some are.
    pub fn until(&self) -> Option<Instant> {
        self.held.map(|(until, _)| until)
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
