//! Frame labels, shared: a stack of old code names the same methods at
//! every sample, and a frame's label would otherwise be formatted into a new
//! allocation for each one (on a Rails app whose every request runs new
//! code, rprof's allocator was a third of its time).

use foldhash::HashSet;
use std::fmt::{self, Write};
use std::sync::Arc;

#[derive(Default)]
pub struct Labels {
    known: HashSet<Arc<str>>,
    /// Where a label is written before it is looked up.
    scratch: String,
    /// How many were known when those no frame holds were last forgotten.
    kept: usize,
}

impl Labels {
    /// The label `args` write, shared with every frame that has it.
    pub fn of(&mut self, args: fmt::Arguments<'_>) -> Arc<str> {
        self.scratch.clear();
        // Writing into a String cannot fail.
        let _ = self.scratch.write_fmt(args);
        if let Some(known) = self.known.get(self.scratch.as_str()) {
            return known.clone();
        }
        let label: Arc<str> = Arc::from(self.scratch.as_str());
        self.known.insert(label.clone());
        label
    }

    /// Forgets the labels no frame holds any more (young code's are new at
    /// every request), once they have doubled since the last time, so that
    /// the cost stays proportional to what is added.
    pub fn forget_unused(&mut self) {
        if self.known.len() < 2 * self.kept.max(512) {
            return;
        }
        self.known.retain(|label| Arc::strong_count(label) > 1);
        self.kept = self.known.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_label_is_one_allocation_until_no_frame_holds_it() {
        let mut labels = Labels::default();
        let a = labels.of(format_args!("{}#{}", "Foo", "bar"));
        let b = labels.of(format_args!("Foo#{}", "bar"));
        assert_eq!(&*a, "Foo#bar");
        assert!(Arc::ptr_eq(&a, &b));
        drop((a, b));
        for i in 0..1100 {
            labels.of(format_args!("young_{i}"));
        }
        let held = labels.of(format_args!("held"));
        labels.forget_unused();
        assert_eq!(labels.known.len(), 1, "only the label a frame holds is kept");
        assert!(Arc::ptr_eq(&held, &labels.of(format_args!("held"))));
    }
}
