//! Time as the target's garbage collector sees it, and the one rule that
//! decides whether something read from the target's memory describes a sample.
//!
//! BPF names frames by address (iseq, method entry), and userspace reads what
//! is at those addresses later. In between, the GC may free an object and hand
//! its slot to a new one, or move it (compaction). So every sample carries the
//! GC's time at the moment it was taken, every read of the target's memory is
//! bracketed by two readings of that time, and a fact read at one time is used
//! for a sample of another only when Ruby's GC guarantees the object cannot
//! have changed in between:
//!
//! * Time is `2 * count + phase`, where `count` is `objspace->profile.count`
//!   (GCs started) and `phase` is 0 while that GC is marking, 1 after. Objects
//!   are freed only by a GC's sweep, which follows its marking, and moved only
//!   by compaction, which follows marking too. An object a frame referenced
//!   when marking was over (phase 1) was marked, so it stays at its address
//!   until the next GC's marking ends. During marking (phase 0) a frame may
//!   pop and its object die in that same GC's sweep, which is why the phase is
//!   part of the time and not just the count.
//! * So a fact read at time t describes a sample of time t, and of any time
//!   with no end of a marking in between: from GC k's end of marking (2k + 1)
//!   to GC k + 1's (2k + 2) the same objects sit at the same addresses.
//! * An *old* object (`RUBY_FL_PROMOTED`) is freed or moved only by a major
//!   GC. A fact about an old object read at time r also describes a sample of
//!   time s when no major GC ended its marking between the two, and, if the
//!   sample is the earlier one, when fewer than three GCs separate them (an
//!   object allocated after the sample cannot be old three GCs later).
//!
//! * A GC's edges have no phase of their own: inside a GC (`during_gc`) with
//!   no mode, it has either counted itself and not begun marking (time
//!   `2 * count`, objects as before it) or finished (`2 * count + 1`), or not
//!   yet counted itself (`2 * count + 1` of the GC before). BPF flags a sample
//!   taken then (`RPROF_SAMPLE_GC_EDGE`, a `SampleTime` with two candidate
//!   times) and names its frames only with facts true at both; a reading of
//!   the clock then is `unsettled`.
//! * The major count tells minor GCs from major ones. A GC counts itself,
//!   starts marking, then bumps it; `Reading` says which GCs a reading's
//!   major counts certainly include and exclude, from the order of its reads.
//!
//! The one exception is compaction, which moves objects after marking without
//! a new count: BPF flags a sample taken while a compacting GC is past its
//! marking (`RPROF_SAMPLE_GC_MOVING`) and its Ruby frames are not named, and a
//! reading of the clock in that state is `unsettled`, so nothing read then is
//! kept. (Ruby 2.7 compacts after its GC has finished, but with
//! `during_compacting` set throughout.) Such a sample's frames are named by
//! their pc instead: see `Resolver::moving_stack`.

use std::collections::VecDeque;
use std::fmt;

use crate::address_space::AddressSpace;

/// A point on the target GC's timeline: `2 * count + phase` (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GcTime(pub u64);

impl GcTime {
    pub fn new(count: u64, marking: bool) -> Self {
        GcTime(count * 2 + u64::from(!marking))
    }

    /// The GCs started before this time.
    pub fn count(self) -> u64 {
        self.0 / 2
    }
}

impl fmt::Display for GcTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let phase = if self.0.is_multiple_of(2) {
            "marking"
        } else {
            "after marking"
        };
        write!(f, "GC {} {phase}", self.count())
    }
}

/// When a sample was taken: at `latest`, or, if BPF caught the GC at an edge
/// (`RPROF_SAMPLE_GC_EDGE`), at `earliest` or at `latest`, which it cannot
/// tell apart. What names the sample's frames must hold at both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleTime {
    pub earliest: GcTime,
    pub latest: GcTime,
    /// The object asked about was old at the sample (BPF saw it promoted).
    pub old: bool,
}

impl SampleTime {
    pub fn at(t: GcTime) -> Self {
        Self {
            earliest: t,
            latest: t,
            old: false,
        }
    }

    /// A sample BPF read at `t` (after GC `t.count()`'s marking, as far as
    /// the flags said) while that GC was at an edge: it may also be a sample
    /// of the GC's marking time, when the GC has counted itself but not begun.
    pub fn at_edge(t: GcTime) -> Self {
        Self {
            earliest: GcTime::new(t.count(), true),
            latest: t,
            old: false,
        }
    }

    /// The sample, known to be no later than `t` (the clock read after it):
    /// a sample taken at a GC's edge while that GC is still marking at `t`
    /// was taken before its marking began, not after it ended.
    pub fn no_later_than(self, t: GcTime) -> Self {
        if self.earliest <= t && t < self.latest {
            Self { latest: t, ..self }
        } else {
            self
        }
    }

    /// The same time, asked about an object BPF saw `old` at the sample.
    pub fn of_object(self, old: bool) -> Self {
        Self { old, ..self }
    }

    /// Whether `holds_at` is true at every time the sample may have been taken.
    pub fn holds(self, holds_at: impl Fn(GcTime) -> bool) -> bool {
        holds_at(self.earliest) && holds_at(self.latest)
    }
}

/// `objspace->flags.mode` values (`enum gc_mode`), the same in Ruby 2.7 to 3.4.
const MODE_MASK: u32 = 3;
const MODE_NONE: u32 = 0;
const MODE_MARKING: u32 = 1;
const MODE_COMPACTING: u32 = 3;
/// `objspace->flags.during_gc`, bit 5 in Ruby 2.7 to 3.4.
const DURING_GC: u32 = 1 << 5;
/// `objspace->flags.during_compacting`, bit 6 in Ruby 2.7 to 3.4 (3.3+ also
/// have `gc_mode_compacting`).
const DURING_COMPACTING: u32 = 1 << 6;

/// Where a target's GC keeps its clock (absolute addresses in the target).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcClock {
    /// `objspace->flags`, a 32-bit bitfield.
    pub flags: u64,
    /// `objspace->profile.count`.
    pub count: u64,
    /// `objspace->profile.major_gc_count`.
    pub major_count: u64,
    /// The fields whose sum is `GC.stat(:time)` in ns (0: none), which
    /// `wall` splits a GVL wait by (not part of the clock's rule).
    pub time_ns: [u64; 2],
}

/// One reading of the GC clock. Its three words are read in this order:
/// `major_count`, `count`, `flags`, `major_count` again (one system call
/// copies them in that order), which is what makes each field below true.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// `count` and the phase of the GC the flags show (read after `count`:
    /// if a GC started in between, the time is earlier than the truth, and a
    /// bracket around reads, which needs two equal times, rejects it).
    pub time: GcTime,
    /// Majors counted before `count` was read: no GC numbered above
    /// `time.count()` is among them.
    pub majors_before: u64,
    /// Majors counted after the flags were read: every major GC numbered up
    /// to `majors_through` is among them.
    pub majors_after: u64,
    /// A GC counts itself, then starts marking, then bumps the major count:
    /// GC `count` is included only once its marking is known to have begun
    /// and the bump to be done (the flags show it past marking).
    pub majors_through: u64,
    /// The time does not say what memory holds: a compacting GC is past its
    /// marking (objects may be moving), or a GC has counted itself but not yet
    /// started marking.
    pub unsettled: bool,
}

impl Reading {
    /// The clock of memory that never changes (a core dump): one settled
    /// time, before any collection.
    pub const STILL: Reading = Reading {
        time: GcTime(1),
        majors_before: 0,
        majors_after: 0,
        majors_through: 0,
        unsettled: false,
    };
}

impl GcClock {
    /// `GC.stat(:time)` now, in ns; None where Ruby keeps none (2.7) or it
    /// cannot be read.
    pub fn time(&self, space: &dyn AddressSpace) -> Option<u64> {
        if self.time_ns[0] == 0 {
            return None;
        }
        self.time_ns
            .iter()
            .filter(|&&addr| addr != 0)
            .try_fold(0u64, |sum, &addr| {
                Some(sum.saturating_add(space.read_u64(addr).ok()?))
            })
    }

    /// Reads the clock (one system call).
    pub fn read(&self, space: &dyn AddressSpace) -> Option<Reading> {
        let mut major_a = [0u8; 8];
        let mut count = [0u8; 8];
        let mut flags = [0u8; 4];
        let mut major_b = [0u8; 8];
        space
            .read_many(&mut [
                (self.major_count, &mut major_a[..]),
                (self.count, &mut count[..]),
                (self.flags, &mut flags[..]),
                (self.major_count, &mut major_b[..]),
            ])
            .ok()?;
        Some(Reading::of_words(
            u64::from_le_bytes(major_a),
            u64::from_le_bytes(count),
            u32::from_le_bytes(flags),
            u64::from_le_bytes(major_b),
        ))
    }
}

impl Reading {
    /// The reading whose words were read in this order: the major count,
    /// the count, the flags, the major count again (by rprof, or by BPF as
    /// it took a sample: `RPROF_SAMPLE_CLOCK`).
    pub fn of_words(major_a: u64, count: u64, flags: u32, major_b: u64) -> Reading {
        let mode = flags & MODE_MASK;
        let at_edge = flags & DURING_GC != 0 && mode == MODE_NONE;
        let past_marking = mode != MODE_MARKING && !at_edge;
        Reading {
            time: GcTime::new(count, mode == MODE_MARKING),
            majors_before: major_a,
            majors_after: major_b,
            majors_through: if past_marking {
                count
            } else {
                count.saturating_sub(1)
            },
            unsettled: mode == MODE_COMPACTING
                || (flags & DURING_COMPACTING != 0 && mode != MODE_MARKING)
                || at_edge,
        }
    }
}

/// Two readings around a batch of reads of the target's memory: what was read
/// is true at `time` if both agree and both are settled.
pub fn bracket(before: Reading, after: Reading) -> Option<GcTime> {
    (before.time == after.time && !before.unsettled && !after.unsettled).then_some(before.time)
}

/// What rprof has seen of the GC's major collections: its readings of the
/// clock, oldest first, to tell whether a major GC happened between two times.
#[derive(Debug, Default)]
pub struct MajorLog {
    /// (count, majors_before, majors_through, majors_after) of each reading.
    readings: VecDeque<(u64, u64, u64, u64)>,
}

/// Readings kept; older facts about old objects are simply read again.
const MAJOR_LOG_LEN: usize = 4096;

impl MajorLog {
    /// Notes a reading. rprof's own come in the order they were made; one
    /// BPF made as it took a sample comes late, and goes where its words
    /// put it (each only grows, so that is about when it was made; two
    /// readings made at once by different CPUs may not order, which
    /// `all_minor` allows for).
    pub fn note(&mut self, r: &Reading) {
        let entry = (r.time.count(), r.majors_before, r.majors_through, r.majors_after);
        let at = match self.readings.back() {
            Some(back) if *back == entry => return,
            Some(back) if *back > entry => self.readings.partition_point(|e| *e < entry),
            _ => self.readings.len(),
        };
        if self.readings.get(at) == Some(&entry) {
            return;
        }
        if self.readings.len() == MAJOR_LOG_LEN {
            if at == 0 {
                return; // older than all kept
            }
            self.readings.pop_front();
            self.readings.insert(at - 1, entry);
        } else {
            self.readings.insert(at, entry);
        }
    }

    /// The log of a process forked when GC `count` was the last to start:
    /// the GCs up to it are its history too, later ones are not.
    pub fn forked(&self, count: u64) -> Self {
        Self {
            readings: self.readings.iter().copied().filter(|r| r.0 <= count).collect(),
        }
    }

    /// Whether every GC numbered `first..=last` is known to have been minor:
    /// a major count read before GC `first` counted itself equals one read
    /// after GC `last` bumped it if it was major. Counts only grow, so the
    /// first of those two reads was made before the second.
    fn all_minor(&self, first: u64, last: u64) -> bool {
        if first > last {
            return true;
        }
        // Readings are kept in the order they were made, so both their
        // counts and the GCs they include only grow: binary searches (this
        // runs for every fact at every new GC time, thousands of times a
        // second). Any two readings that answer the questions prove it, so
        // what the searches find is checked: readings BPF and rprof made at
        // the same moment may not order.
        let i = self.readings.partition_point(|r| r.0 < first);
        let before = i
            .checked_sub(1)
            .and_then(|i| self.readings.get(i))
            .filter(|r| r.0 < first)
            .map(|r| r.1);
        let after = self
            .readings
            .get(self.readings.partition_point(|r| r.2 < last))
            .filter(|r| r.2 >= last)
            .map(|r| r.3);
        matches!((before, after), (Some(a), Some(b)) if a == b)
    }

    /// Whether a fact read at `read` describes a sample taken at `sample`, for
    /// an object that was `old` when read, and `old_at_sample` when BPF took
    /// the sample (see the module doc).
    pub fn describes(&self, read: GcTime, sample: GcTime, old: bool, old_at_sample: bool) -> bool {
        // GC k moves and frees once its marking has ended, from time 2k + 1:
        // nothing changes between two times unless a marking ended between
        // them (GCs `first..=last`), and an old object only if one of those
        // GCs was major.
        let (lo, hi) = (read.min(sample), read.max(sample));
        let (first, last) = (lo.0.div_ceil(2), hi.0.saturating_sub(1) / 2);
        if first > last {
            return true;
        }
        if !old || !self.all_minor(first, last) {
            return false;
        }
        // Old when read after the sample: it must already have been there,
        // which BPF saw, or which fewer than three GCs since show.
        read < sample || old_at_sample || read.count() - sample.count() < 3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(count: u64, marking: bool) -> GcTime {
        GcTime::new(count, marking)
    }

    /// A settled reading after GC `count`'s marking, `major` majors so far.
    fn reading(count: u64, major: u64) -> Reading {
        Reading {
            time: t(count, false),
            majors_before: major,
            majors_after: major,
            majors_through: count,
            unsettled: false,
        }
    }

    /// A reading while GC `count` marks, its major bump perhaps still to come.
    fn marking(count: u64, major: u64) -> Reading {
        Reading {
            time: t(count, true),
            majors_through: count - 1,
            ..reading(count, major)
        }
    }

    #[test]
    fn time_orders_marking_before_after() {
        assert!(t(3, true) < t(3, false));
        assert!(t(3, false) < t(4, true));
        assert_eq!(t(7, false).count(), 7);
        assert_eq!(t(7, true).to_string(), "GC 7 marking");
    }

    #[test]
    fn brackets_need_agreement_and_a_settled_heap() {
        let a = reading(5, 1);
        assert_eq!(bracket(a, a), Some(t(5, false)));
        assert_eq!(bracket(a, reading(6, 1)), None);
        let moving = Reading { unsettled: true, ..a };
        assert_eq!(bracket(a, moving), None);
    }

    #[test]
    fn young_objects_only_at_their_own_time() {
        let log = MajorLog::default();
        assert!(log.describes(t(4, false), t(4, false), false, false));
        assert!(!log.describes(t(4, false), t(5, false), false, false));
        assert!(!log.describes(t(4, true), t(4, false), false, false));
        // No marking ends between GC 4's sweep and GC 5's marking.
        assert!(log.describes(t(4, false), t(5, true), false, false));
        assert!(log.describes(t(5, true), t(4, false), false, false));
    }

    #[test]
    fn old_objects_across_minor_gcs_only() {
        let mut log = MajorLog::default();
        // GCs 11 to 13 minor, 14 or 15 major, 16 and 17 minor.
        for r in [reading(10, 2), reading(13, 2), reading(15, 3), reading(17, 3)] {
            log.note(&r);
        }
        assert!(log.describes(t(10, false), t(12, false), true, false));
        assert!(log.describes(t(12, false), t(10, false), true, false));
        assert!(log.describes(t(12, false), t(13, false), true, false));
        // GC 14 may have been major: its marking ended between these two.
        assert!(!log.describes(t(14, true), t(14, false), true, false));
        assert!(!log.describes(t(13, false), t(15, false), true, false));
        // Within GC 14's marking nothing moves, major or not.
        assert!(log.describes(t(14, true), t(14, true), true, false));
        assert!(log.describes(t(15, false), t(17, false), true, false));
        // Nothing known before the first reading.
        assert!(!log.describes(t(5, false), t(10, false), true, false));
    }

    #[test]
    fn an_edge_sample_is_no_later_than_the_clock_read_after_it() {
        let edge = SampleTime::at_edge(t(166, false));
        assert_eq!(edge.no_later_than(t(166, true)), SampleTime::at(t(166, true)));
        assert_eq!(edge.no_later_than(t(166, false)), edge);
        assert_eq!(edge.no_later_than(t(170, false)), edge);
    }

    #[test]
    fn objects_old_at_the_sample_across_any_number_of_minor_gcs() {
        let mut log = MajorLog::default();
        // GCs 11 to 20 minor, 21 major.
        for r in [reading(10, 2), reading(20, 2), reading(21, 3)] {
            log.note(&r);
        }
        // Old when read three or more GCs after the sample: maybe promoted
        // since, unless BPF saw it old at the sample.
        assert!(!log.describes(t(13, false), t(10, false), true, false));
        assert!(log.describes(t(13, false), t(10, false), true, true));
        assert!(log.describes(t(20, false), t(10, false), true, true));
        // A major GC in between, or young when read: not the same object.
        assert!(!log.describes(t(21, false), t(10, false), true, true));
        assert!(!log.describes(t(13, false), t(10, false), false, true));
    }

    #[test]
    fn a_reading_while_marking_does_not_vouch_for_that_gc() {
        let mut log = MajorLog::default();
        log.note(&reading(10, 2));
        // GC 11 has started marking but may not have bumped the count yet.
        log.note(&marking(11, 2));
        assert!(!log.describes(t(10, false), t(11, false), true, false));
        log.note(&reading(11, 2));
        assert!(log.describes(t(10, false), t(11, false), true, false));
        // A major count read after `count` may include the next GC: only
        // the one read before it says what came before.
        let mut log = MajorLog::default();
        log.note(&Reading {
            majors_after: 3,
            ..reading(10, 2)
        });
        log.note(&reading(11, 3));
        assert!(!log.describes(t(10, false), t(11, false), true, false));
    }

    /// rprof read the clock before GC 111 and after GC 112, a major one:
    /// only a reading BPF made with a sample in GC 111's time, noted late,
    /// says GC 111 was minor (seen: rprof starved by CPU burners).
    #[test]
    fn a_reading_noted_late_says_what_rprof_did_not_see() {
        let mut log = MajorLog::default();
        log.note(&reading(110, 1));
        log.note(&reading(112, 2));
        assert!(!log.describes(t(110, false), t(111, false), true, true));
        log.note(&Reading::of_words(1, 111, 0, 1));
        assert!(log.describes(t(110, false), t(111, false), true, true));
        // GC 112 was major all the same.
        assert!(!log.describes(t(111, false), t(112, false), true, true));
        // In its place, once.
        assert_eq!(
            log.readings.iter().map(|r| r.0).collect::<Vec<_>>(),
            [110, 111, 112]
        );
        log.note(&Reading::of_words(1, 111, 0, 1));
        assert_eq!(log.readings.len(), 3);
    }

    /// Readings BPF and rprof make at the same moment may not order (one's
    /// count before a GC began, the other's major count after it bumped it):
    /// what the searches find must answer their questions, or prove nothing.
    #[test]
    fn readings_that_do_not_order_prove_nothing_they_do_not_say() {
        let mut log = MajorLog::default();
        log.note(&reading(10, 2));
        // Count 12 read, GC 12 marking, its major bump not seen yet...
        log.note(&marking(12, 2));
        // ... and one that read count 11 but the major count after GC 12's bump.
        log.note(&Reading {
            majors_after: 3,
            ..reading(11, 2)
        });
        assert!(!log.describes(t(11, false), t(12, false), true, true));
        assert!(!log.describes(t(10, false), t(12, false), true, true));
        log.note(&reading(12, 3));
        assert!(!log.describes(t(11, false), t(12, false), true, true));
    }

    /// A full log keeps the newest readings: one older than all of them is
    /// left out, a newer one goes in its place.
    #[test]
    fn a_full_log_keeps_the_newest() {
        let mut log = MajorLog::default();
        for c in 0..MAJOR_LOG_LEN as u64 {
            log.note(&reading(c * 2 + 10, 0));
        }
        log.note(&reading(1, 0));
        assert_eq!(log.readings.front().map(|r| r.0), Some(10));
        log.note(&reading(13, 0));
        assert_eq!(log.readings.len(), MAJOR_LOG_LEN);
        assert_eq!(log.readings.front().map(|r| r.0), Some(12));
        assert!(log.readings.iter().any(|r| r.0 == 13));
        assert!(log
            .readings
            .iter()
            .zip(log.readings.iter().skip(1))
            .all(|(a, b)| a < b));
    }

    #[test]
    fn an_old_object_read_long_after_the_sample_may_be_a_newer_one() {
        let mut log = MajorLog::default();
        log.note(&reading(0, 0));
        log.note(&reading(20, 0));
        assert!(log.describes(t(10, false), t(8, false), true, false));
        assert!(!log.describes(t(11, false), t(8, false), true, false));
        assert!(log.describes(t(8, false), t(18, false), true, false));
    }

    /// Words of memory at their addresses (a process's, as far as the clock
    /// reads it).
    struct Words(Vec<(u64, u64)>);

    impl AddressSpace for Words {
        fn read(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<()> {
            let (_, word) = self
                .0
                .iter()
                .find(|(at, _)| *at == addr)
                .ok_or(std::io::ErrorKind::NotFound)?;
            buf.copy_from_slice(&word.to_le_bytes()[..buf.len()]);
            Ok(())
        }
    }

    #[test]
    fn the_gc_time_is_the_sum_of_its_fields_or_nothing() {
        let clock = |time_ns| GcClock {
            flags: 0,
            count: 0,
            major_count: 0,
            time_ns,
        };
        let memory = Words(vec![(0x1000, 7_000_000), (0x2000, 5)]);
        assert_eq!(clock([0x1000, 0x2000]).time(&memory), Some(7_000_005));
        assert_eq!(clock([0x1000, 0]).time(&memory), Some(7_000_000));
        // Ruby 2.7 keeps no time; a field that cannot be read gives none.
        assert_eq!(clock([0, 0]).time(&memory), None);
        assert_eq!(clock([0x1000, 0x3000]).time(&memory), None);
    }
}
