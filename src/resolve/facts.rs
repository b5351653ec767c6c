//! What rprof remembers about the target's objects, and when it may use it.
//!
//! A fact is something read at an address (an iseq, a method entry, a class),
//! stamped with the GC time of the read and whether the object was old then.
//! It answers for a sample only when `MajorLog::describes` shows that the
//! object at that address was the same at both times (src/gc_time.rs): this is
//! the only way anything read from the target is used, so an address the GC
//! freed and refilled, or an object it moved, is never named after what was
//! there before. Facts read while resolving one stack are pending until the GC
//! clock read after the reads shows that no GC step happened during them.

use foldhash::{HashMap, HashMapExt};

use crate::gc_time::{GcTime, MajorLog, SampleTime};

/// When a fact was read, and over which GC times it is known to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The time of the reading...
    pub first: GcTime,
    /// ... and the latest time the object is known to have still been there
    /// (checked on every tick, so facts about long-lived code carry forward).
    pub last: GcTime,
    /// The object was old (promoted) when read: only a major GC frees or moves it.
    pub old: bool,
}

impl Stamp {
    pub fn read_at(at: GcTime, old: bool) -> Self {
        Self {
            first: at,
            last: at,
            old,
        }
    }

    /// Whether the object read is the one at the address at time `t`, when
    /// it was `old_then` at `t` (as far as known).
    pub fn describes(&self, log: &MajorLog, t: GcTime, old_then: bool) -> bool {
        if t < self.first {
            log.describes(self.first, t, self.old, old_then)
        } else if t > self.last {
            log.describes(self.last, t, self.old, old_then)
        } else {
            true
        }
    }
}

#[derive(Debug)]
struct Entry<T> {
    value: T,
    stamp: Stamp,
    /// Unique per reading, so caches derived from this reading (lines) can
    /// tell it from a later reading of the same address.
    serial: u64,
}

/// Facts of one kind, by address; a committed table and the pending readings.
/// An address keeps every reading that a sample still in flight may need, so
/// a sample taken before the GC replaced an object and named after a newer
/// reading of its address still finds the reading that describes it.
#[derive(Debug)]
pub struct Facts<T> {
    /// Readings of each address, oldest first.
    committed: HashMap<u64, Vec<Entry<T>>>,
    pending: HashMap<u64, Entry<T>>,
}

impl<T> Default for Facts<T> {
    fn default() -> Self {
        Self {
            committed: HashMap::new(),
            pending: HashMap::new(),
        }
    }
}

/// A fact found for a sample: its value, the serial of its reading, and
/// whether it also describes the present (so more can be read from it).
pub struct Found<'a, T> {
    pub value: &'a T,
    pub serial: u64,
    pub current: bool,
}

impl<T> Facts<T> {
    /// The fact about `addr` that describes a sample taken at `sample`, if one
    /// is known; `now` is the time of the reads in progress, if any.
    pub fn get(
        &self,
        addr: u64,
        sample: SampleTime,
        now: Option<GcTime>,
        log: &MajorLog,
    ) -> Option<Found<'_, T>> {
        let committed = self.committed.get(&addr).into_iter().flatten().rev();
        self.pending
            .get(&addr)
            .into_iter()
            .chain(committed)
            .find(|e| sample.holds(|t| e.stamp.describes(log, t, sample.old)))
            .map(|e| Found {
                value: &e.value,
                serial: e.serial,
                current: now.is_some_and(|now| e.stamp.describes(log, now, false)),
            })
    }

    /// Notes a reading made at `stamp.at`, pending until `commit`.
    pub fn read(&mut self, addr: u64, value: T, stamp: Stamp, serial: u64) {
        self.pending.insert(addr, Entry { value, stamp, serial });
    }

    /// The reads since the last commit happened while the GC stood still.
    pub fn commit(&mut self) {
        for (addr, e) in self.pending.drain() {
            self.committed.entry(addr).or_default().push(e);
        }
    }

    /// The reads since the last commit may have seen the GC at work.
    pub fn roll_back(&mut self) {
        self.pending.clear();
    }

    /// At a new GC time `now`: carries forward the facts still true, and
    /// forgets those no sample still in flight can use (read or last known
    /// true more than two GCs ago).
    pub fn tick(&mut self, now: GcTime, log: &MajorLog) {
        self.committed.retain(|_, readings| {
            readings.retain_mut(|e| {
                if e.stamp.describes(log, now, false) {
                    e.stamp.last = e.stamp.last.max(now);
                    true
                } else {
                    e.stamp.last.count() + 2 >= now.count()
                }
            });
            !readings.is_empty()
        });
    }

    /// What a process forked at GC time `at` knows: readings made before
    /// `at` (so before the fork; one made at `at` may have seen this
    /// process's objects allocated after it), as of then: the child's memory
    /// was a copy of this one's, and its GC history this one's, until then.
    pub fn forked(&self, at: GcTime) -> Self
    where
        T: Clone,
    {
        let committed = self
            .committed
            .iter()
            .filter_map(|(&addr, readings)| {
                let kept: Vec<Entry<T>> = readings
                    .iter()
                    .filter(|e| e.stamp.first < at)
                    .map(|e| Entry {
                        value: e.value.clone(),
                        stamp: Stamp {
                            last: e.stamp.last.min(at),
                            ..e.stamp
                        },
                        serial: e.serial,
                    })
                    .collect();
                (!kept.is_empty()).then_some((addr, kept))
            })
            .collect();
        Self {
            committed,
            pending: HashMap::new(),
        }
    }

    pub fn serials(&self) -> impl Iterator<Item = u64> + '_ {
        self.committed.values().flatten().map(|e| e.serial)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.committed.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gc_time::Reading;

    fn after_marking(count: u64) -> GcTime {
        GcTime::new(count, false)
    }

    /// What rprof knows after reading the clock past the marking of each
    /// GC `count`, with `major` majors so far.
    fn log_of(readings: &[(u64, u64)]) -> MajorLog {
        let mut log = MajorLog::default();
        for &(count, major) in readings {
            log.note(&Reading {
                time: after_marking(count),
                majors_before: major,
                majors_after: major,
                majors_through: count,
                unsettled: false,
            });
        }
        log
    }

    #[test]
    fn a_young_fact_answers_only_for_its_own_gc_time() {
        let log = MajorLog::default();
        let mut f = Facts::default();
        let stamp = Stamp::read_at(after_marking(4), false);
        f.read(0x1000, "churn_1", stamp, 1);
        assert!(f
            .get(0x1000, SampleTime::at(after_marking(4)), None, &log)
            .is_some());
        f.commit();
        assert_eq!(
            f.get(0x1000, SampleTime::at(after_marking(4)), None, &log)
                .map(|x| *x.value),
            Some("churn_1")
        );
        // After GC 5 marked, the slot may hold another object.
        assert!(f
            .get(0x1000, SampleTime::at(after_marking(5)), None, &log)
            .is_none());
        assert!(f
            .get(0x2000, SampleTime::at(after_marking(4)), None, &log)
            .is_none());
    }

    #[test]
    fn rolled_back_reads_are_forgotten() {
        let log = MajorLog::default();
        let mut f = Facts::default();
        let stamp = Stamp::read_at(after_marking(4), false);
        f.read(0x1000, 1, stamp, 1);
        f.roll_back();
        f.commit();
        assert!(f
            .get(0x1000, SampleTime::at(after_marking(4)), None, &log)
            .is_none());
    }

    #[test]
    fn old_facts_survive_minor_gcs_and_eviction() {
        let log = log_of(&[(3, 1), (9, 1)]);
        let mut f = Facts::default();
        f.read(0x1000, "Object#main", Stamp::read_at(after_marking(4), true), 7);
        f.read(0x2000, "young", Stamp::read_at(after_marking(4), false), 8);
        f.commit();
        let found = f
            .get(
                0x1000,
                SampleTime::at(after_marking(8)),
                Some(after_marking(8)),
                &log,
            )
            .unwrap();
        assert_eq!((found.serial, found.current), (7, true));
        f.tick(after_marking(8), &log);
        assert_eq!(f.len(), 1);
    }

    #[test]
    fn facts_carry_forward_while_no_marking_ends() {
        let log = MajorLog::default();
        let mut f = Facts::default();
        f.read(0x1000, "churn_1", Stamp::read_at(after_marking(4), false), 1);
        f.commit();
        // GC 5 is marking: nothing has moved yet.
        f.tick(GcTime::new(5, true), &log);
        assert!(f
            .get(0x1000, SampleTime::at(GcTime::new(5, true)), None, &log)
            .is_some());
        // Once it has marked, the slot may hold another object.
        f.tick(after_marking(5), &log);
        assert!(f
            .get(0x1000, SampleTime::at(after_marking(5)), None, &log)
            .is_none());
        assert!(f
            .get(0x1000, SampleTime::at(GcTime::new(5, true)), None, &log)
            .is_some());
    }

    #[test]
    fn a_late_sample_finds_the_reading_of_its_own_time() {
        let log = log_of(&[(3, 1), (4, 1), (5, 2)]);
        let mut f = Facts::default();
        f.read(0x1000, "churn_1", Stamp::read_at(after_marking(4), true), 1);
        f.commit();
        // GC 5 was major: the address is read again for a sample after it...
        f.tick(after_marking(5), &log);
        f.read(0x1000, "churn_2", Stamp::read_at(after_marking(5), true), 2);
        f.commit();
        let at = |t| f.get(0x1000, SampleTime::at(t), None, &log).map(|x| *x.value);
        assert_eq!(at(after_marking(5)), Some("churn_2"));
        // ... and a sample taken before it, named late, still gets its own.
        assert_eq!(at(after_marking(4)), Some("churn_1"));
        assert_eq!(at(GcTime::new(5, true)), Some("churn_1"));
    }

    #[test]
    fn a_sample_at_a_gc_edge_needs_a_fact_true_on_both_sides() {
        let log = MajorLog::default();
        let edge = SampleTime::at_edge(after_marking(5));
        let mut f = Facts::default();
        // Young: read after GC 5 marked, or while it marked, it may be
        // either side's object.
        f.read(0x1000, "after", Stamp::read_at(after_marking(5), false), 1);
        f.read(0x2000, "during", Stamp::read_at(GcTime::new(5, true), false), 2);
        f.commit();
        assert!(f.get(0x1000, edge, None, &log).is_none());
        assert!(f.get(0x2000, edge, None, &log).is_none());
        assert!(f
            .get(0x2000, SampleTime::at(GcTime::new(5, true)), None, &log)
            .is_some());
        // Old, and GC 5 known to be minor: the same object on both sides.
        f.read(0x3000, "old", Stamp::read_at(after_marking(5), true), 3);
        f.commit();
        assert!(f.get(0x3000, edge, None, &log).is_none());
        let log = log_of(&[(4, 1), (5, 1)]);
        assert!(f.get(0x3000, edge, None, &log).is_some());
    }

    #[test]
    fn a_fork_keeps_only_what_was_read_before_it() {
        let mut f = Facts::default();
        f.read(0x1000, "before", Stamp::read_at(after_marking(3), true), 1);
        f.read(0x2000, "same period", Stamp::read_at(after_marking(4), false), 2);
        f.commit();
        let log = log_of(&[(2, 0), (3, 0), (4, 0), (5, 0)]);
        f.tick(after_marking(5), &log);
        let child = f.forked(after_marking(4));
        assert_eq!(child.len(), 1);
        // Known in the child up to the fork, not beyond what its own GCs say.
        let child_log = log_of(&[(2, 0), (3, 0), (4, 0)]);
        assert!(child
            .get(0x1000, SampleTime::at(after_marking(4)), None, &child_log)
            .is_some());
        assert!(child
            .get(0x1000, SampleTime::at(after_marking(5)), None, &child_log)
            .is_none());
        assert!(child
            .get(0x2000, SampleTime::at(after_marking(4)), None, &child_log)
            .is_none());
    }
}
