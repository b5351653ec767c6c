//! What a recording holds: processes, threads, interned frames and stacks, and
//! the counts of each (thread, stack) per epoch, the unit of time a report can
//! cut. Every format is rendered from it.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::{Frame, Profile};

/// A process met in the recording.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: u32,
    /// Start time, in seconds since the Unix epoch.
    pub started: u64,
    pub command: String,
    /// What runs in it (`Ruby 3.3.8`); empty if not profiled.
    pub runtime: String,
    /// Its frame when a profile is split by process (`process 42:"puma"`).
    pub label: String,
    /// The frames of its ancestors in the recording, root first.
    pub parents: Vec<String>,
}

/// A thread of a process.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ThreadInfo {
    /// Index of its process.
    pub process: u32,
    /// Kernel thread id; 0 for a thread of the runtime that moves between
    /// kernel threads (Ruby's M:N threads).
    pub tid: u32,
    pub name: String,
    /// Its frame when a profile is split by thread (`worker [43]`).
    pub label: String,
}

/// Counts over one stretch of time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Epoch {
    /// Nanoseconds since the recording started.
    pub start_ns: u64,
    pub end_ns: u64,
    pub counts: Vec<Count>,
}

/// `count` events of thread `thread` with stack `stack` (indexes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Count {
    pub thread: u32,
    pub stack: u32,
    pub count: u64,
}

/// What one count stands for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Unit {
    /// A sample of a thread on CPU, taken every `period_ns` of its CPU time.
    CpuSamples { period_ns: u64 },
    /// One traced event (a system call), of the kind named.
    Events { name: String },
    /// Time of every thread, on CPU or not (`wall`): counts are
    /// nanoseconds; profiles (folded, SVG, summary) are in microseconds.
    Wall,
}

impl Unit {
    /// `samples` or `events`, as counts are named.
    pub fn count_name(&self) -> &'static str {
        match self {
            Unit::CpuSamples { .. } => "samples",
            Unit::Events { .. } => "events",
            Unit::Wall => "µs",
        }
    }

    /// Counts per unit of a profile: wall time, in ns, is shown in µs.
    pub fn per_profile_unit(&self) -> u64 {
        match self {
            Unit::Wall => 1000,
            _ => 1,
        }
    }
}

/// A reference out of range: a damaged or foreign recording.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {index} refers to {target} {refers}, but there are only {len}")]
pub struct BadReference {
    pub what: &'static str,
    pub index: usize,
    pub target: &'static str,
    pub refers: u64,
    pub len: usize,
}

/// Processes, threads, frames and stacks, each interned, and epochs of counts.
#[derive(Debug, Clone)]
pub struct Samples {
    pub unit: Unit,
    processes: Vec<ProcessInfo>,
    threads: Vec<ThreadInfo>,
    frames: Vec<Frame>,
    stacks: Vec<Vec<u32>>,
    epochs: Vec<Epoch>,
    process_index: HashMap<ProcessInfo, u32>,
    thread_index: HashMap<ThreadInfo, u32>,
    frame_index: HashMap<Frame, u32>,
    stack_index: HashMap<Vec<u32>, u32>,
    /// Stacks left by the last `forget_before` that compacted the tables.
    compacted_len: usize,
}

/// How stacks are split when they become a [`Profile`].
#[derive(Debug, Clone, Default)]
pub struct Split {
    /// A root frame per process, under its ancestors'.
    pub processes: bool,
    /// A frame per thread, under its process's.
    pub threads: bool,
    /// A root frame that only says what a thread frame says better (`[no
    /// Ruby frames]`): dropped when stacks are split by thread.
    pub said_by_thread: Option<Frame>,
}

impl Samples {
    pub fn new(unit: Unit) -> Self {
        Self {
            unit,
            processes: Vec::new(),
            threads: Vec::new(),
            frames: Vec::new(),
            stacks: Vec::new(),
            epochs: Vec::new(),
            process_index: HashMap::new(),
            thread_index: HashMap::new(),
            frame_index: HashMap::new(),
            stack_index: HashMap::new(),
            compacted_len: 0,
        }
    }

    pub fn processes(&self) -> &[ProcessInfo] {
        &self.processes
    }
    pub fn threads(&self) -> &[ThreadInfo] {
        &self.threads
    }
    pub fn frames(&self) -> &[Frame] {
        &self.frames
    }
    /// Stacks as frame indexes, root first.
    pub fn stacks(&self) -> &[Vec<u32>] {
        &self.stacks
    }
    pub fn epochs(&self) -> &[Epoch] {
        &self.epochs
    }

    /// The index of this process, added if new.
    pub fn process(&mut self, p: &ProcessInfo) -> u32 {
        intern(&mut self.processes, &mut self.process_index, p)
    }

    /// The index of this thread (its `process` an index of this), added if new.
    pub fn thread(&mut self, t: &ThreadInfo) -> u32 {
        intern(&mut self.threads, &mut self.thread_index, t)
    }

    /// The index of this stack (root first), added if new.
    pub fn stack(&mut self, frames: &[Frame]) -> u32 {
        let ids: Vec<u32> = frames
            .iter()
            .map(|f| intern(&mut self.frames, &mut self.frame_index, f))
            .collect();
        intern(&mut self.stacks, &mut self.stack_index, &ids)
    }

    /// Appends a process as read from a file, whatever it repeats.
    pub fn push_process(&mut self, p: ProcessInfo) {
        self.process_index
            .entry(p.clone())
            .or_insert(self.processes.len() as u32);
        self.processes.push(p);
    }

    pub fn push_thread(&mut self, t: ThreadInfo) -> Result<(), BadReference> {
        check(
            "thread",
            self.threads.len(),
            "process",
            t.process as u64,
            self.processes.len(),
        )?;
        self.thread_index
            .entry(t.clone())
            .or_insert(self.threads.len() as u32);
        self.threads.push(t);
        Ok(())
    }

    pub fn push_frame(&mut self, f: Frame) {
        self.frame_index
            .entry(f.clone())
            .or_insert(self.frames.len() as u32);
        self.frames.push(f);
    }

    pub fn push_stack(&mut self, ids: Vec<u32>) -> Result<(), BadReference> {
        for &i in &ids {
            check("stack", self.stacks.len(), "frame", i as u64, self.frames.len())?;
        }
        self.stack_index
            .entry(ids.clone())
            .or_insert(self.stacks.len() as u32);
        self.stacks.push(ids);
        Ok(())
    }

    /// Appends an epoch whose counts refer to this one's threads and stacks.
    pub fn push_epoch(&mut self, e: Epoch) -> Result<(), BadReference> {
        for c in &e.counts {
            let index = self.epochs.len();
            check("epoch", index, "thread", c.thread as u64, self.threads.len())?;
            check("epoch", index, "stack", c.stack as u64, self.stacks.len())?;
        }
        self.epochs.push(e);
        Ok(())
    }

    /// All counts summed.
    pub fn total(&self) -> u64 {
        // Saturating: a damaged file may hold any counts.
        self.epochs
            .iter()
            .flat_map(|e| &e.counts)
            .fold(0u64, |sum, c| sum.saturating_add(c.count))
    }

    /// The frames of stack `id`, root first.
    pub fn stack_frames(&self, id: u32) -> impl Iterator<Item = &Frame> {
        self.stacks[id as usize].iter().map(|&f| &self.frames[f as usize])
    }

    /// A copy holding only the epochs and threads kept, and only what they
    /// refer to.
    pub fn filter(
        &self,
        mut keep_epoch: impl FnMut(&Epoch) -> bool,
        mut keep_thread: impl FnMut(&ThreadInfo, &ProcessInfo) -> bool,
    ) -> Samples {
        let mut out = Samples::new(self.unit.clone());
        let kept: Vec<bool> = self
            .threads
            .iter()
            .map(|t| keep_thread(t, &self.processes[t.process as usize]))
            .collect();
        let mut threads = HashMap::new();
        let mut stacks = HashMap::new();
        for e in self.epochs.iter().filter(|e| keep_epoch(e)) {
            let mut counts = Vec::new();
            for c in e.counts.iter().filter(|c| kept[c.thread as usize]) {
                let thread = *threads
                    .entry(c.thread)
                    .or_insert_with(|| out.copy_thread(self, c.thread));
                let stack = *stacks.entry(c.stack).or_insert_with(|| {
                    let frames: Vec<Frame> = self.stack_frames(c.stack).cloned().collect();
                    out.stack(&frames)
                });
                counts.push(Count {
                    thread,
                    stack,
                    count: c.count,
                });
            }
            out.epochs.push(Epoch {
                start_ns: e.start_ns,
                end_ns: e.end_ns,
                counts,
            });
        }
        out
    }

    /// Thread `id` of `from`, and its process, added to this.
    pub fn copy_thread(&mut self, from: &Samples, id: u32) -> u32 {
        let t = &from.threads[id as usize];
        let process = self.process(&from.processes[t.process as usize]);
        self.thread(&ThreadInfo { process, ..t.clone() })
    }

    /// A copy whose epochs start `offset_ns` earlier: a window of a
    /// recording, as a recording of its own.
    pub fn rebased(&self, offset_ns: u64) -> Samples {
        let mut out = self.clone();
        for e in &mut out.epochs {
            e.start_ns = e.start_ns.saturating_sub(offset_ns);
            e.end_ns = e.end_ns.saturating_sub(offset_ns);
        }
        out
    }

    /// Drops the epochs that ended before `ns`, and, once the stacks have
    /// doubled since the last time, what nothing refers to any more: a window
    /// over a long recording holds at most twice what its epochs use, and
    /// each compaction is paid for by as many stacks added.
    pub fn forget_before(&mut self, ns: u64) {
        let first = self
            .epochs
            .iter()
            .position(|e| e.end_ns > ns)
            .unwrap_or(self.epochs.len());
        self.epochs.drain(..first);
        if self.stacks.len() > 2 * self.compacted_len.max(64) {
            *self = self.filter(|_| true, |_, _| true);
            self.compacted_len = self.stacks.len();
        }
    }

    /// The counts summed over time, as stacks root first, split as asked.
    pub fn profile(&self, split: &Split) -> Profile {
        let mut sums: HashMap<(u32, u32), u64> = HashMap::new();
        for c in self.epochs.iter().flat_map(|e| &e.counts) {
            let thread = if split.threads || split.processes {
                c.thread
            } else {
                0
            };
            let sum = sums.entry((thread, c.stack)).or_default();
            *sum = sum.saturating_add(c.count);
        }
        let mut profile = Profile::default();
        let per = self.unit.per_profile_unit();
        for ((thread, stack), n) in sums {
            let n = (n + per / 2) / per;
            if n == 0 {
                continue;
            }
            let mut frames = Vec::new();
            if let Some(t) = self.threads.get(thread as usize) {
                if split.processes {
                    let p = &self.processes[t.process as usize];
                    frames.extend(p.parents.iter().map(|name| Frame::process(name.as_str())));
                    frames.push(Frame::process(p.label.as_str()));
                }
                if split.threads {
                    frames.push(Frame::thread(t.label.as_str()));
                }
            }
            let mut code = self.stack_frames(stack).peekable();
            if split.threads
                && split
                    .said_by_thread
                    .as_ref()
                    .is_some_and(|s| code.peek() == Some(&s))
            {
                code.next();
            }
            frames.extend(code.cloned());
            profile.add(&frames, n);
        }
        profile
    }
}

fn intern<T: Clone + Eq + std::hash::Hash>(items: &mut Vec<T>, index: &mut HashMap<T, u32>, item: &T) -> u32 {
    if let Some(&id) = index.get(item) {
        return id;
    }
    let id = items.len() as u32;
    items.push(item.clone());
    index.insert(item.clone(), id);
    id
}

fn check(
    what: &'static str,
    index: usize,
    target: &'static str,
    refers: u64,
    len: usize,
) -> Result<(), BadReference> {
    if refers < len as u64 {
        Ok(())
    } else {
        Err(BadReference {
            what,
            index,
            target,
            refers,
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn two_threads() -> Samples {
        let mut s = Samples::new(Unit::CpuSamples {
            period_ns: 10_000_000,
        });
        let p = s.process(&ProcessInfo {
            pid: 42,
            started: 1,
            command: "ruby app.rb".into(),
            runtime: "Ruby 3.3.8".into(),
            label: "process 42:\"ruby app.rb\"".into(),
            parents: vec![],
        });
        let main = s.thread(&ThreadInfo {
            process: p,
            tid: 42,
            name: "ruby".into(),
            label: "ruby [42]".into(),
        });
        let worker = s.thread(&ThreadInfo {
            process: p,
            tid: 43,
            name: "worker".into(),
            label: "worker [43]".into(),
        });
        let a = s.stack(&[Frame::code("Object#a", "app.rb", 3)]);
        let b = s.stack(&[
            Frame::code("Object#a", "app.rb", 3),
            Frame::cmethod("Integer#times"),
        ]);
        let idle = s.stack(&[Frame::marker("[no code]"), Frame::event("enter_read")]);
        s.push_epoch(Epoch {
            start_ns: 0,
            end_ns: 500_000_000,
            counts: vec![
                Count {
                    thread: main,
                    stack: a,
                    count: 3,
                },
                Count {
                    thread: worker,
                    stack: b,
                    count: 2,
                },
            ],
        })
        .expect("epoch");
        s.push_epoch(Epoch {
            start_ns: 500_000_000,
            end_ns: 1_000_000_000,
            counts: vec![
                Count {
                    thread: worker,
                    stack: a,
                    count: 1,
                },
                Count {
                    thread: main,
                    stack: idle,
                    count: 4,
                },
            ],
        })
        .expect("epoch");
        s
    }

    #[test]
    fn profile_splits_by_thread_or_merges_and_says_what_ran_no_code() {
        let s = two_threads();
        let split = Split {
            threads: true,
            said_by_thread: Some(Frame::marker("[no code]")),
            ..Split::default()
        };
        let p = s.profile(&split);
        assert_eq!(p.total(), 10);
        let mut folded = Vec::new();
        p.write_folded(&mut folded).expect("folded");
        let text = String::from_utf8(folded).expect("utf8");
        assert!(text.contains("worker [43];Object#a (app.rb:3) 1\n"), "{text}");
        assert!(text.contains("ruby [42];enter_read 4\n"), "{text}");
        let merged = s.profile(&Split {
            said_by_thread: Some(Frame::marker("[no code]")),
            ..Split::default()
        });
        let mut folded = Vec::new();
        merged.write_folded(&mut folded).expect("folded");
        let text = String::from_utf8(folded).expect("utf8");
        assert!(text.contains("Object#a (app.rb:3) 4\n"), "{text}");
        assert!(text.contains("[no code];enter_read 4\n"), "{text}");
    }

    #[test]
    fn filter_keeps_what_is_asked_and_only_what_it_refers_to() {
        let s = two_threads();
        let late = s.filter(|e| e.start_ns >= 500_000_000, |_, _| true);
        assert_eq!(late.total(), 5);
        let worker = s.filter(|_| true, |t, _| t.tid == 43);
        assert_eq!(worker.total(), 3);
        assert_eq!(worker.threads().len(), 1);
        assert_eq!(worker.stacks().len(), 2);
        let mut window = s.clone();
        window.forget_before(500_000_000);
        assert_eq!(window.epochs().len(), 1);
        assert_eq!(window.total(), 5);
    }

    #[test]
    fn a_window_holds_at_most_twice_what_its_epochs_use() {
        let mut s = Samples::new(Unit::CpuSamples { period_ns: 1 });
        let two = two_threads();
        let thread = s.copy_thread(&two, 0);
        for i in 0..10_000u64 {
            // Every epoch a stack never seen before, as code churn makes.
            let stack = s.stack(&[Frame::code(format!("churn_{i}"), "gen.rb", 1)]);
            let (start_ns, end_ns) = (i * 10, i * 10 + 10);
            s.push_epoch(Epoch {
                start_ns,
                end_ns,
                counts: vec![Count {
                    thread,
                    stack,
                    count: 1,
                }],
            })
            .expect("epoch");
            s.forget_before(end_ns.saturating_sub(100));
            // 10 epochs use 10 stacks; tables are compacted past twice the
            // last compaction's size, or 64.
            assert!(
                s.stacks().len() <= 2 * 64 + 2,
                "{} stacks at {i}",
                s.stacks().len()
            );
            assert!(
                s.frames().len() <= 2 * 64 + 5,
                "{} frames at {i}",
                s.frames().len()
            );
        }
        assert_eq!(s.epochs().len(), 10);
        assert_eq!(s.total(), 10);
    }

    #[test]
    fn references_out_of_range_are_refused() {
        let mut s = Samples::new(Unit::Events {
            name: "syscalls".into(),
        });
        assert!(s.push_stack(vec![0]).is_err());
        let e = s
            .push_epoch(Epoch {
                start_ns: 0,
                end_ns: 1,
                counts: vec![Count {
                    thread: 3,
                    stack: 0,
                    count: 1,
                }],
            })
            .unwrap_err();
        assert_eq!(e.to_string(), "epoch 0 refers to thread 3, but there are only 0");
    }
}
