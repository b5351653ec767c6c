//! Renders profiles: stacks of frames with sample counts.
//!
//! The profiler records [`Samples`] (processes, threads, interned stacks and
//! their counts per epoch of time); this crate renders them: an icicle or
//! flame graph SVG (through inferno) and folded stacks from the [`Profile`]
//! they sum to, speedscope's JSON per thread, pprof's gzipped protobuf, and a
//! summary table. It knows nothing of Ruby or BPF, so it can be tested and
//! reused on its own.
//!
//! ```
//! use flamegraphs::{Frame, Profile, SvgOptions};
//! let mut p = Profile::default();
//! p.add(&[Frame::thread("main [42]"), Frame::code("Object#work", "/app/a.rb", 3)], 5);
//! let mut folded = Vec::new();
//! p.write_folded(&mut folded).unwrap();
//! assert_eq!(String::from_utf8(folded).unwrap(), "main [42];Object#work (/app/a.rb:3) 5\n");
//! let mut svg = Vec::new();
//! p.write_svg(&mut svg, &SvgOptions::default()).unwrap();
//! assert!(svg.starts_with(b"<?xml"));
//! ```

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Write};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub mod diff;
pub mod html;
pub mod pprof;
mod samples;
pub mod speedscope;
pub mod summary;

pub use samples::{BadReference, Count, Epoch, ProcessInfo, Samples, Split, ThreadInfo, Unit};

/// What a frame stands for; decides nothing but how it is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum FrameKind {
    /// A process, at the root of its stacks (under its parent's).
    Process,
    /// A thread, at the root of its stacks.
    Thread,
    /// Code with a source location (a Ruby method, block, ...).
    Code,
    /// A Ruby method implemented in C: no source line of its own.
    #[serde(alias = "Native")]
    CMethod,
    /// A native function (C, the interpreter, libc), shown `name_[n]`.
    NativeCode,
    /// A kernel function, shown `name_[k]`.
    Kernel,
    /// The traced event itself (a system call), at the leaf.
    Event,
    /// What a thread was doing (`wall`), at the leaf: `[running]`,
    /// `[waiting for the GVL]`, `[blocked: read]`...
    State,
    /// Not code: `[truncated]`, `[unknown]`, `[GVL released]`...
    Marker,
    /// A garbage collection the thread was running, under the stack that
    /// triggered it: `[GC: marking (minor)]`, `[GC: sweeping]`...
    Gc,
}

/// One frame of a stack.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Frame {
    pub kind: FrameKind,
    /// Shared, not owned: a profiler names the same function in many
    /// stacks, and a stack is built and dropped for each new sample.
    pub name: Arc<str>,
    pub file: Option<Arc<str>>,
    pub line: Option<u32>,
}

impl Frame {
    pub fn process(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::Process, name)
    }
    pub fn thread(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::Thread, name)
    }
    pub fn code(name: impl Into<Arc<str>>, file: impl Into<Arc<str>>, line: u32) -> Self {
        Self {
            kind: FrameKind::Code,
            name: name.into(),
            file: Some(file.into()),
            line: Some(line),
        }
    }
    /// A Ruby method implemented in C (`Integer#times`).
    pub fn cmethod(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::CMethod, name)
    }
    /// A native function (`rb_ary_sort_bang`, `libruby.so.3.4+0x1f2e0`).
    pub fn native_code(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::NativeCode, name)
    }
    /// A kernel function.
    pub fn kernel(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::Kernel, name)
    }
    pub fn event(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::Event, name)
    }
    pub fn marker(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::Marker, name)
    }

    /// A garbage collection the thread was running.
    pub fn gc(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::Gc, name)
    }

    /// What a thread was doing (`wall`).
    pub fn state(name: impl Into<Arc<str>>) -> Self {
        Self::named(FrameKind::State, name)
    }
    fn named(kind: FrameKind, name: impl Into<Arc<str>>) -> Self {
        Self {
            kind,
            name: name.into(),
            file: None,
            line: None,
        }
    }
}

impl Frame {
    /// The name with its kind's suffix (`_[n]`, `_[k]`) but no source
    /// location: a function, for formats that keep the file and line apart.
    pub fn to_string_without_location(&self) -> String {
        match self.kind {
            FrameKind::NativeCode => format!("{}_[n]", self.name),
            FrameKind::Kernel => format!("{}_[k]", self.name),
            _ => self.name.to_string(),
        }
    }
}

impl fmt::Display for Frame {
    /// `label (path:line)`, or the bare name for frames without a location;
    /// native and kernel functions carry the suffixes `_[n]` and `_[k]`
    /// (FlameGraph's convention for kernel frames).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.file, self.line) {
            (Some(file), Some(line)) => write!(f, "{} ({}:{})", self.name, file, line),
            (Some(file), None) => write!(f, "{} ({})", self.name, file),
            _ => write!(f, "{}", self.name),
        }?;
        match self.kind {
            FrameKind::NativeCode => f.write_str("_[n]"),
            FrameKind::Kernel => f.write_str("_[k]"),
            _ => Ok(()),
        }
    }
}

/// Stacks (root first) with their sample counts. Frames are interned.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(from = "SavedProfile", into = "SavedProfile")]
pub struct Profile {
    frames: Vec<Frame>,
    index: HashMap<Frame, u32>,
    stacks: HashMap<Vec<u32>, u64>,
}

/// A profile as saved: frames, and stacks as (frame indexes, count) pairs.
#[derive(Serialize, Deserialize)]
struct SavedProfile {
    frames: Vec<Frame>,
    stacks: Vec<(Vec<u32>, u64)>,
}

impl From<Profile> for SavedProfile {
    fn from(p: Profile) -> Self {
        let mut stacks: Vec<(Vec<u32>, u64)> = p.stacks.into_iter().collect();
        stacks.sort();
        SavedProfile {
            frames: p.frames,
            stacks,
        }
    }
}

impl From<SavedProfile> for Profile {
    fn from(saved: SavedProfile) -> Self {
        let index = saved
            .frames
            .iter()
            .enumerate()
            .map(|(i, f)| (f.clone(), i as u32))
            .collect();
        let n = saved.frames.len() as u32;
        let mut stacks = HashMap::new();
        for (ids, count) in saved.stacks {
            // A damaged file must not index past the frames.
            if ids.iter().all(|&i| i < n) {
                *stacks.entry(ids).or_insert(0) += count;
            }
        }
        Profile {
            frames: saved.frames,
            index,
            stacks,
        }
    }
}

impl Profile {
    /// Adds `count` samples of `stack`, given root first.
    pub fn add(&mut self, stack: &[Frame], count: u64) {
        if count == 0 {
            return;
        }
        let ids: Vec<u32> = stack.iter().map(|f| self.intern(f)).collect();
        let sum = self.stacks.entry(ids).or_insert(0);
        *sum = sum.saturating_add(count);
    }

    fn intern(&mut self, frame: &Frame) -> u32 {
        if let Some(&id) = self.index.get(frame) {
            return id;
        }
        let id = self.frames.len() as u32;
        self.frames.push(frame.clone());
        self.index.insert(frame.clone(), id);
        id
    }

    /// Total samples.
    pub fn total(&self) -> u64 {
        self.stacks.values().fold(0u64, |sum, n| sum.saturating_add(*n))
    }

    /// Every distinct stack, root first, with its count, in a stable order.
    pub fn stacks(&self) -> Vec<(Vec<&Frame>, u64)> {
        let mut out: Vec<(Vec<&Frame>, u64)> = self
            .stacks
            .iter()
            .map(|(ids, &n)| (ids.iter().map(|&i| &self.frames[i as usize]).collect(), n))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// One line per distinct stack: frames root first joined by `;`, a space, the count.
    pub fn write_folded<W: Write>(&self, mut w: W) -> io::Result<()> {
        for line in self.folded_lines() {
            writeln!(w, "{line}")?;
        }
        Ok(())
    }

    fn folded_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .stacks()
            .into_iter()
            .map(|(frames, n)| {
                let names: Vec<String> = frames.iter().map(|f| folded_name(f)).collect();
                format!("{} {}", names.join(";"), n)
            })
            .collect();
        lines.sort();
        lines
    }

    /// An interactive SVG flame graph (icicle: root at the top, by default).
    pub fn write_svg<W: Write>(&self, w: W, options: &SvgOptions) -> Result<(), RenderError> {
        let lines = self.folded_lines();
        let mut opts = inferno::flamegraph::Options::default();
        opts.title = options.title.clone();
        if let Some(subtitle) = &options.subtitle {
            opts.subtitle = Some(subtitle.clone());
        }
        opts.count_name = options.count_name.clone();
        opts.direction = if options.icicle {
            inferno::flamegraph::Direction::Inverted
        } else {
            inferno::flamegraph::Direction::Straight
        };
        opts.hash = true;
        opts.colors =
            inferno::flamegraph::color::Palette::Basic(inferno::flamegraph::color::BasicPalette::Hot);
        // Each kind of frame in its own colours: Ruby red, C methods yellow,
        // native code blue, the kernel green.
        let mut palette = inferno::flamegraph::color::PaletteMap::default();
        for frame in &self.frames {
            palette.insert(folded_name(frame), color_of(frame));
        }
        opts.palette_map = Some(&mut palette);
        if lines.is_empty() {
            // inferno refuses an empty profile; say so in the picture instead.
            opts.subtitle = Some("no samples were recorded".to_string());
            let placeholder = ["[no samples] 1".to_string()];
            return inferno::flamegraph::from_lines(&mut opts, placeholder.iter().map(|s| s.as_str()), w)
                .map_err(RenderError::Svg);
        }
        inferno::flamegraph::from_lines(&mut opts, lines.iter().map(|s| s.as_str()), w)
            .map_err(RenderError::Svg)
    }
}

/// A frame as one folded-stack field: `;` separates frames and the last space
/// separates the count, so neither may appear unescaped inside a name.
fn folded_name(frame: &Frame) -> String {
    frame.to_string().replace(';', ":").replace('\n', " ")
}

/// A frame's colour: its kind's hue, shaded by its name so that neighbours differ.
fn color_of(frame: &Frame) -> inferno::flamegraph::color::Color {
    let h = frame
        .name
        .bytes()
        .fold(0x811c9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x01000193));
    let v = |lo: u8, span: u8, shift: u32| lo + ((h >> shift) % (span as u32 + 1)) as u8;
    let (r, g, b) = match frame.kind {
        FrameKind::Code => (v(205, 50, 0), v(60, 70, 8), v(40, 30, 16)),
        FrameKind::CMethod => (v(215, 40, 0), v(185, 45, 8), v(40, 40, 16)),
        FrameKind::NativeCode => (v(70, 50, 0), v(140, 50, 8), v(205, 45, 16)),
        FrameKind::Kernel => (v(90, 50, 0), v(180, 50, 8), v(80, 40, 16)),
        FrameKind::Process | FrameKind::Thread => (v(160, 30, 0), v(140, 30, 8), v(200, 30, 16)),
        FrameKind::Event => (v(180, 30, 0), v(80, 30, 8), v(80, 30, 16)),
        FrameKind::Marker => (v(170, 30, 0), v(170, 30, 0), v(170, 30, 0)),
        FrameKind::State => state_colour(&frame.name),
        FrameKind::Gc => (v(150, 30, 0), v(100, 30, 8), v(40, 20, 16)),
    };
    inferno::flamegraph::color::Color { r, g, b }
}

/// A state's colour, one per kind of state, so that the eye finds where
/// threads wait: running green, GVL red, another thread's GC brown (as GC
/// frames), CPU busy orange, I/O blue, sleeping grey, locks and queues purple.
fn state_colour(name: &str) -> (u8, u8, u8) {
    let is = |p: &str| name.starts_with(p);
    if is("[running") {
        (60, 170, 60)
    } else if is("[waiting for the GVL") || is("[blocked holding the GVL") {
        (220, 40, 40)
    } else if is("[waiting for GC") {
        (170, 110, 40)
    } else if is("[runnable") {
        (240, 150, 30)
    } else if is("[blocked") {
        (60, 110, 220)
    } else if is("[sleeping") {
        (160, 160, 160)
    } else if is("[waiting") {
        (150, 80, 200)
    } else {
        (120, 120, 120)
    }
}

/// How an SVG is drawn.
#[derive(Debug, Clone)]
pub struct SvgOptions {
    pub title: String,
    pub subtitle: Option<String>,
    pub count_name: String,
    /// Root at the top (icicle graph) rather than at the bottom.
    pub icicle: bool,
}

impl Default for SvgOptions {
    fn default() -> Self {
        Self {
            title: "rprof".to_string(),
            subtitle: None,
            count_name: "samples".to_string(),
            icicle: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("rendering the flame graph: {0}")]
    Svg(#[source] io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Profile {
        let mut p = Profile::default();
        let t = Frame::thread("worker [7]");
        p.add(
            &[
                t.clone(),
                Frame::code("a", "x.rb", 1),
                Frame::cmethod("Integer#times"),
            ],
            3,
        );
        p.add(
            &[
                t.clone(),
                Frame::code("a", "x.rb", 1),
                Frame::cmethod("Integer#times"),
            ],
            2,
        );
        p.add(&[t, Frame::code("b;c", "x.rb", 9)], 1);
        p
    }

    #[test]
    fn folded_merges_equal_stacks_and_escapes_separators() {
        let mut out = Vec::new();
        sample().write_folded(&mut out).expect("write");
        let text = String::from_utf8(out).expect("utf8");
        assert_eq!(
            text,
            "worker [7];a (x.rb:1);Integer#times 5\nworker [7];b:c (x.rb:9) 1\n"
        );
        assert_eq!(sample().total(), 6);
    }

    #[test]
    fn each_kind_of_frame_has_its_own_colours() {
        let ruby = color_of(&Frame::code("a", "x.rb", 1));
        let cmethod = color_of(&Frame::cmethod("Integer#times"));
        let native = color_of(&Frame::native_code("rb_ary_sort_bang"));
        let kernel = color_of(&Frame::kernel("do_syscall_64"));
        assert!(
            ruby.r > ruby.g && ruby.r > ruby.b,
            "Ruby frames are red: {ruby:?}"
        );
        assert!(
            cmethod.r > cmethod.b && cmethod.g > cmethod.b && cmethod.g > 150,
            "C methods yellow: {cmethod:?}"
        );
        assert!(
            native.b > native.r && native.b > native.g,
            "native frames blue: {native:?}"
        );
        assert!(
            kernel.g > kernel.r && kernel.g > kernel.b,
            "kernel frames green: {kernel:?}"
        );
        let mut p = Profile::default();
        p.add(
            &[
                Frame::code("a", "x.rb", 1),
                Frame::native_code("f"),
                Frame::kernel("k"),
            ],
            1,
        );
        let mut out = Vec::new();
        p.write_svg(&mut out, &SvgOptions::default()).expect("svg");
        let svg = String::from_utf8(out).expect("utf8");
        let fill = |c: inferno::flamegraph::color::Color| format!("rgb({},{},{})", c.r, c.g, c.b);
        // inferno shows a kernel frame without its `_[k]` (FlameGraph's convention).
        for (name, frame) in [("f_[n] (", Frame::native_code("f")), ("k (", Frame::kernel("k"))] {
            assert!(svg.contains(name), "{name} drawn");
            assert!(svg.contains(&fill(color_of(&frame))), "{name} in its colour");
        }
    }

    #[test]
    fn svg_is_an_icicle_by_default_and_survives_no_samples() {
        let mut out = Vec::new();
        sample().write_svg(&mut out, &SvgOptions::default()).expect("svg");
        let svg = String::from_utf8(out).expect("utf8");
        assert!(svg.contains("Integer#times"));
        assert!(
            svg.contains("inverted"),
            "icicle graphs are inferno's inverted direction"
        );
        let mut out = Vec::new();
        Profile::default()
            .write_svg(&mut out, &SvgOptions::default())
            .expect("empty svg");
        assert!(String::from_utf8(out).expect("utf8").contains("no samples"));
    }
}
