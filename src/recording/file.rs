//! The recording file, written as the recording goes so that whatever stops
//! rprof (Ctrl-C, the target exiting, a full disk, SIGKILL) leaves a file
//! `report` reads, short of at most the last epoch.
//!
//! Layout: the magic `RPROFREC`, the format version (u32, little-endian),
//! then blocks, each one write: its length (u32), the CRC-32 of its bytes
//! (u32), and its bytes, a deflated postcard encoding of a list of
//! [`Record`]s. The first record is the header. Processes, threads, frames
//! and stacks are interned: each is written once, the first time an epoch
//! refers to it, and numbered by its order in the file. Every epoch ends a
//! block; the summary is the last record. A reader stops cleanly at an
//! incomplete last block (the recording was cut short) and refuses anything
//! else it does not understand, saying at which byte.

use foldhash::{HashMap, HashMapExt, HashSet};
use std::fs::File;
use std::hash::Hash;
use std::io::{Read, Write};
use std::path::Path;
use std::rc::Rc;

use flamegraphs::{Epoch, Frame, ProcessInfo, ThreadInfo};
use serde::{Deserialize, Serialize};

use super::{EpochCounts, Header, Numbering, Recording, Summary};
use crate::error::UserError;

pub const MAGIC: &[u8; 8] = b"RPROFREC";
/// Raised when a reader of an older version would misread the file.
pub const VERSION: u32 = 1;
/// No block is larger, compressed (a sanity bound for damaged lengths).
const MAX_BLOCK: u32 = 64 << 20;
/// Nor, decompressed.
const MAX_DECOMPRESSED: u64 = 512 << 20;
/// Epochs per block when a whole recording is written at once.
const EPOCHS_PER_BLOCK: usize = 64;

/// One entry of the file. Variants are only ever appended: postcard numbers them.
#[derive(Debug, Serialize, Deserialize)]
enum Record {
    Header(Header),
    Process(ProcessInfo),
    Thread(ThreadInfo),
    Frame(Frame),
    Stack(Vec<u32>),
    Epoch(Epoch),
    Summary(Summary),
}

/// What is wrong with a file given to `report`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("it is not an rprof recording (it does not start with RPROFREC)")]
    Foreign,
    #[error("it is a JSON recording of rprof 0.1, which this rprof no longer reads: record it again")]
    OldJson,
    #[error("it is a version {0} recording and this rprof reads version {VERSION}: read it with the rprof that wrote it")]
    Version(u32),
    #[error("it is empty: rprof was stopped before it wrote the header")]
    NoHeader,
    #[error("it is damaged at byte {offset}: {what}")]
    Damaged { offset: u64, what: String },
}

/// A recording as read, and where it was cut short if it was.
pub struct ReadRecording {
    pub recording: Recording,
    /// Byte where the complete blocks end, and why reading stopped there.
    pub cut_short: Option<(u64, &'static str)>,
}

/// Streams a recording into a file, an epoch at a time.
pub struct Writer {
    file: File,
    /// Its path, or what it is, for messages.
    pub name: String,
    tables: Tables,
    /// End of the last complete block.
    good: u64,
    /// Set after a failed write: the file ends at `good`, and stays so.
    broken: bool,
}

impl Writer {
    /// Starts a recording in `file`, which must be empty.
    pub fn new(mut file: File, name: String, header: &Header) -> std::io::Result<Self> {
        let mut start = MAGIC.to_vec();
        start.extend(VERSION.to_le_bytes());
        start.extend(block(&[Record::Header(header.clone())])?);
        file.write_all(&start)?;
        Ok(Self {
            file,
            name,
            tables: Tables::default(),
            good: start.len() as u64,
            broken: false,
        })
    }

    /// Writes one epoch, and before it what it refers to for the first time.
    pub fn epoch(&mut self, counts: &EpochCounts) -> std::io::Result<()> {
        let epoch = counts.add_to(&mut self.tables, 0);
        let mut records = std::mem::take(&mut self.tables.new);
        records.push(Record::Epoch(epoch));
        let written = self.write(&records);
        self.tables.forget(&counts.ended);
        written
    }

    /// The complete blocks written so far, read back from the file.
    pub fn read_back(&self) -> anyhow::Result<Vec<u8>> {
        use std::os::unix::fs::FileExt;
        let mut bytes = vec![0; self.good as usize];
        self.file
            .read_exact_at(&mut bytes, 0)
            .map_err(anyhow::Error::from)
            .map_err(|e| e.context("reading the recording back"))?;
        Ok(bytes)
    }

    /// Whether a write failed: the file ends at its last complete block.
    pub fn broken(&self) -> bool {
        self.broken
    }

    /// Ends the recording with its summary.
    pub fn finish(&mut self, summary: &Summary) -> std::io::Result<()> {
        self.write(&[Record::Summary(summary.clone())])?;
        self.file.sync_data()
    }

    /// One block in one write; if it fails (a full disk), the file is cut
    /// back to its last complete block and nothing more is written to it.
    fn write(&mut self, records: &[Record]) -> std::io::Result<()> {
        if self.broken {
            return Err(std::io::Error::other("an earlier write failed"));
        }
        let bytes = block(records)?;
        if let Err(e) = self.file.write_all(&bytes) {
            self.broken = true;
            let _ = self.file.set_len(self.good);
            return Err(e);
        }
        self.good += bytes.len() as u64;
        Ok(())
    }
}

/// What a file has numbered, so that each process, thread, frame and stack
/// is written once; what is new waits in `new` for the next block. A process
/// that ended is forgotten with its threads (nothing of it comes again), so
/// that following a million short-lived processes keeps this small.
#[derive(Default)]
struct Tables {
    processes: Index<ProcessInfo>,
    threads: Index<ThreadInfo>,
    frames: Index<Frame>,
    stacks: Index<Vec<u32>>,
    new: Vec<Record>,
}

/// One table of a file: the number of each value it holds, and how many it
/// ever held (the next one's number).
struct Index<T> {
    ids: HashMap<T, u32>,
    len: u32,
}

impl<T> Default for Index<T> {
    fn default() -> Self {
        Self {
            ids: HashMap::new(),
            len: 0,
        }
    }
}

impl<T: Clone + Eq + Hash> Index<T> {
    /// The number of `v`; if new, numbered next and its record added to `new`.
    fn number(&mut self, v: &T, new: &mut Vec<Record>, record: fn(T) -> Record) -> u32 {
        if let Some(&i) = self.ids.get(v) {
            return i;
        }
        let i = self.len;
        self.len += 1;
        self.ids.insert(v.clone(), i);
        new.push(record(v.clone()));
        i
    }
}

impl Tables {
    fn forget(&mut self, ended: &[Rc<ProcessInfo>]) {
        let gone: HashSet<u32> = ended
            .iter()
            .filter_map(|p| self.processes.ids.remove(p))
            .collect();
        if !gone.is_empty() {
            self.threads.ids.retain(|t, _| !gone.contains(&t.process));
        }
    }
}

impl Numbering for Tables {
    fn process(&mut self, p: &ProcessInfo) -> u32 {
        self.processes.number(p, &mut self.new, Record::Process)
    }

    fn thread(&mut self, t: &ThreadInfo) -> u32 {
        self.threads.number(t, &mut self.new, Record::Thread)
    }

    fn stack(&mut self, frames: &[Frame]) -> u32 {
        let ids: Vec<u32> = frames
            .iter()
            .map(|f| self.frames.number(f, &mut self.new, Record::Frame))
            .collect();
        self.stacks.number(&ids, &mut self.new, Record::Stack)
    }
}

/// Writes a whole recording at once (`report --format rprof`, a rotated part).
pub fn write_whole(r: &Recording, w: &mut dyn Write) -> std::io::Result<()> {
    w.write_all(MAGIC)?;
    w.write_all(&VERSION.to_le_bytes())?;
    let s = &r.samples;
    let mut first = vec![Record::Header(r.header.clone())];
    first.extend(s.processes().iter().cloned().map(Record::Process));
    first.extend(s.threads().iter().cloned().map(Record::Thread));
    first.extend(s.frames().iter().cloned().map(Record::Frame));
    first.extend(s.stacks().iter().cloned().map(Record::Stack));
    w.write_all(&block(&first)?)?;
    for epochs in s.epochs().chunks(EPOCHS_PER_BLOCK) {
        let records: Vec<Record> = epochs.iter().cloned().map(Record::Epoch).collect();
        w.write_all(&block(&records)?)?;
    }
    if let Some(summary) = &r.summary {
        w.write_all(&block(&[Record::Summary(summary.clone())])?)?;
    }
    Ok(())
}

fn block(records: &[Record]) -> std::io::Result<Vec<u8>> {
    let payload = postcard::to_allocvec(records).map_err(std::io::Error::other)?;
    let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
    z.write_all(&payload)?;
    let data = z.finish()?;
    let mut out = Vec::with_capacity(8 + data.len());
    out.extend((data.len() as u32).to_le_bytes());
    out.extend(crc32fast::hash(&data).to_le_bytes());
    out.extend(data);
    Ok(out)
}

/// Reads the recording at `path`.
pub fn read(path: &Path) -> anyhow::Result<ReadRecording> {
    use anyhow::Context;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&bytes).map_err(|why| {
        UserError::BadRecording {
            path: path.display().to_string(),
            why,
        }
        .into()
    })
}

/// Reads a recording from its bytes; never panics, whatever they are.
pub fn parse(bytes: &[u8]) -> Result<ReadRecording, FileError> {
    if bytes.len() < 12 || &bytes[..8] != MAGIC {
        if bytes.first() == Some(&b'{') {
            return Err(FileError::OldJson);
        }
        if bytes.is_empty() || MAGIC.starts_with(bytes) {
            return Err(FileError::NoHeader);
        }
        if bytes.len() < 12 && bytes.starts_with(MAGIC) {
            return Err(FileError::NoHeader);
        }
        return Err(FileError::Foreign);
    }
    let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if version != VERSION {
        return Err(FileError::Version(version));
    }
    let mut pos = 12usize;
    let mut recording: Option<Recording> = None;
    let mut cut_short = None;
    while pos < bytes.len() {
        let damaged = |what: String| FileError::Damaged {
            offset: pos as u64,
            what,
        };
        let rest = &bytes[pos..];
        if rest.len() < 8 {
            cut_short = Some((pos as u64, "its last block is incomplete"));
            break;
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        if len > MAX_BLOCK {
            return Err(damaged(format!(
                "a block of {len} bytes is beyond any rprof writes"
            )));
        }
        let Some(data) = rest.get(8..8 + len as usize) else {
            cut_short = Some((pos as u64, "its last block is incomplete"));
            break;
        };
        if crc32fast::hash(data) != crc {
            return Err(damaged(
                "the block's checksum does not match its bytes".to_string(),
            ));
        }
        let mut payload = Vec::new();
        flate2::read::DeflateDecoder::new(data)
            .take(MAX_DECOMPRESSED)
            .read_to_end(&mut payload)
            .map_err(|e| damaged(format!("the block does not decompress ({e})")))?;
        let records: Vec<Record> = postcard::from_bytes(&payload)
            .map_err(|e| damaged(format!("the block does not decode ({e})")))?;
        for (i, record) in records.into_iter().enumerate() {
            let r = match (&mut recording, record) {
                (None, Record::Header(h)) => {
                    recording = Some(Recording::new(h));
                    continue;
                }
                (None, _) => return Err(damaged("the first block has no header".to_string())),
                (Some(r), record) => (r, record),
            };
            let bad = |e: flamegraphs::BadReference| damaged(format!("record {i}: {e}"));
            match r {
                (_, Record::Header(_)) => return Err(damaged(format!("record {i} is a second header"))),
                (r, Record::Process(p)) => r.samples.push_process(p),
                (r, Record::Thread(t)) => r.samples.push_thread(t).map_err(bad)?,
                (r, Record::Frame(f)) => r.samples.push_frame(f),
                (r, Record::Stack(s)) => r.samples.push_stack(s).map_err(bad)?,
                (r, Record::Epoch(e)) => r.samples.push_epoch(e).map_err(bad)?,
                (r, Record::Summary(s)) => r.summary = Some(s),
            }
        }
        pos += 8 + len as usize;
    }
    let recording = recording.ok_or(FileError::NoHeader)?;
    if cut_short.is_none() && recording.summary.is_none() {
        cut_short = Some((pos as u64, "it has no summary: rprof was stopped before the end"));
    }
    Ok(ReadRecording { recording, cut_short })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixtures() -> Vec<(PathBuf, Vec<u8>)> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/recordings");
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .expect("tests/fixtures/recordings")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "rprof"))
            .map(|p| {
                let bytes = std::fs::read(&p).expect("read");
                (p, bytes)
            })
            .collect();
        files.sort();
        assert!(files.len() >= 3, "real recordings in {}", dir.display());
        files
    }

    /// Blocks of a file: (offset, length with its 8-byte head).
    fn blocks(bytes: &[u8]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut pos = 12;
        while pos + 8 <= bytes.len() {
            let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().expect("4")) as usize;
            if pos + 8 + len > bytes.len() {
                break;
            }
            out.push((pos, 8 + len));
            pos += 8 + len;
        }
        out
    }

    #[test]
    fn a_file_forgets_processes_that_ended_yet_reads_back_every_one() {
        use super::super::ThreadEntry;
        let header = Header {
            rprof_version: "test".into(),
            event: super::super::Event::Cpu { frequency: 99 },
            started_ns: 0,
            target: "storm".into(),
        };
        let file = tempfile::tempfile().expect("tempfile");
        let mut w = Writer::new(file, "test".into(), &header).expect("writer");
        let frames = Rc::new(vec![Frame::code("Object#storm_child", "storm.rb", 11)]);
        for i in 0..1000u32 {
            let process = Rc::new(ProcessInfo {
                pid: 1000 + i,
                started: 1,
                command: "ruby storm.rb".into(),
                runtime: "Ruby 3.1.7".into(),
                label: format!("process {}:\"ruby\"", 1000 + i),
                parents: vec!["process 999:\"ruby\"".into()],
            });
            let thread = Rc::new(ThreadEntry {
                process: process.clone(),
                thread: ThreadInfo {
                    process: 0,
                    tid: 1000 + i,
                    name: "ruby".into(),
                    label: format!("ruby [{}]", 1000 + i),
                },
            });
            let epoch = EpochCounts {
                start_ns: u64::from(i) * 10,
                end_ns: u64::from(i) * 10 + 10,
                counts: vec![(thread, frames.clone(), 3)],
                ended: vec![process],
            };
            w.epoch(&epoch).expect("epoch");
            assert!(w.tables.processes.ids.is_empty() && w.tables.threads.ids.is_empty());
        }
        w.finish(&Summary::default()).expect("finish");
        let back = parse(&w.read_back().expect("read back"))
            .expect("parse")
            .recording;
        let s = &back.samples;
        assert_eq!((s.processes().len(), s.threads().len()), (1000, 1000));
        assert_eq!((s.frames().len(), s.stacks().len()), (1, 1));
        assert_eq!(s.total(), 3000);
        for t in s.threads() {
            assert_eq!(s.processes()[t.process as usize].pid, t.tid);
        }
    }

    #[test]
    fn real_recordings_read_whole_and_write_back_the_same() {
        for (path, bytes) in fixtures() {
            let read = parse(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert!(read.cut_short.is_none(), "{}", path.display());
            let r = read.recording;
            assert!(r.samples.total() > 0 && r.summary.is_some());
            let mut again = Vec::new();
            write_whole(&r, &mut again).expect("write");
            let back = parse(&again).expect("parse again").recording;
            assert_eq!(back.header, r.header);
            assert_eq!(back.summary, r.summary);
            assert_eq!(back.samples.epochs(), r.samples.epochs());
            assert_eq!(back.samples.frames(), r.samples.frames());
        }
    }

    #[test]
    fn a_file_cut_anywhere_reads_up_to_its_last_whole_block() {
        for (_, bytes) in fixtures() {
            let full = parse(&bytes).expect("whole").recording;
            let ends: Vec<usize> = blocks(&bytes).iter().map(|(at, len)| at + len).collect();
            for cut in 0..bytes.len() {
                match parse(&bytes[..cut]) {
                    Ok(read) => {
                        let (at, _) = read.cut_short.expect("a cut file says so");
                        // Everything before the cut's block is there.
                        let whole = ends.iter().filter(|&&e| e <= cut).count();
                        assert_eq!(at as usize, if whole == 0 { 12 } else { ends[whole - 1] });
                        assert!(read.recording.samples.total() <= full.samples.total());
                    }
                    Err(FileError::NoHeader) => assert!(cut < ends[0], "cut at {cut}"),
                    Err(e) => panic!("cut at {cut}: {e}"),
                }
            }
        }
    }

    #[test]
    fn damage_is_named_with_its_byte() {
        let (_, bytes) = &fixtures()[0];
        let (at, len) = blocks(bytes)[1];
        let mut bad = bytes.clone();
        bad[at + len / 2] ^= 0x40;
        let e = parse(&bad).err().expect("damaged");
        assert_eq!(
            e.to_string(),
            format!("it is damaged at byte {at}: the block's checksum does not match its bytes")
        );
        let mut newer = bytes.clone();
        newer[8] = 9;
        assert_eq!(parse(&newer).err(), Some(FileError::Version(9)));
        assert_eq!(parse(b"<svg></svg>").err(), Some(FileError::Foreign));
        assert_eq!(parse(b"{\"pid\":1}").err(), Some(FileError::OldJson));
        assert_eq!(parse(b"RPRO").err(), Some(FileError::NoHeader));
    }

    /// A small, fast, seeded random source: the fuzz loop is reproducible.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    /// Interesting values for lengths and indexes.
    const EDGES: [u64; 8] = [0, 1, 0x7f, 0x80, 0xff, 0xffff, u32::MAX as u64, u64::MAX];

    /// Mutates `bytes` as a fuzzer would: raw bytes (caught by checksums),
    /// or, mostly, one block's decompressed records, recompressed under a
    /// right checksum so that the decoder and the checks behind it are what
    /// is tried.
    fn mutate(rng: &mut XorShift, bytes: &[u8], others: &[(PathBuf, Vec<u8>)]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        let blocks = blocks(bytes);
        if blocks.is_empty() || out.is_empty() {
            out.push(rng.next() as u8);
            return out;
        }
        match rng.below(10) {
            0 => {
                let at = rng.below(out.len());
                out[at] ^= 1 << rng.below(8);
            }
            1 => out.truncate(rng.below(out.len())),
            2 => {
                // A block of another recording spliced in.
                let (_, other) = &others[rng.below(others.len())];
                let theirs = super::tests::blocks(other);
                let (at, len) = theirs[rng.below(theirs.len())];
                let (mine, _) = blocks[rng.below(blocks.len())];
                out.splice(mine..mine, other[at..at + len].iter().copied());
            }
            _ => {
                let (at, len) = blocks[rng.below(blocks.len())];
                let mut payload = Vec::new();
                if flate2::read::DeflateDecoder::new(&bytes[at + 8..at + len])
                    .read_to_end(&mut payload)
                    .is_err()
                {
                    return out;
                }
                for _ in 0..1 + rng.below(4) {
                    if payload.is_empty() {
                        break;
                    }
                    let i = rng.below(payload.len());
                    match rng.below(5) {
                        0 => payload[i] ^= 1 << rng.below(8),
                        1 => payload[i] = rng.next() as u8,
                        2 => {
                            // A varint of an edge value.
                            let mut v = EDGES[rng.below(EDGES.len())];
                            let mut enc = Vec::new();
                            loop {
                                let b = (v & 0x7f) as u8;
                                v >>= 7;
                                if v == 0 {
                                    enc.push(b);
                                    break;
                                }
                                enc.push(b | 0x80);
                            }
                            payload.splice(i..(i + 1).min(payload.len()), enc);
                        }
                        3 => {
                            let n = rng.below(8).min(payload.len() - i);
                            payload.drain(i..i + n);
                        }
                        _ => {
                            let j = rng.below(payload.len());
                            let chunk: Vec<u8> = payload[j..(j + rng.below(16)).min(payload.len())].to_vec();
                            payload.splice(i..i, chunk);
                        }
                    }
                }
                let mut z = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
                z.write_all(&payload).expect("compress");
                let data = z.finish().expect("compress");
                let mut block = Vec::with_capacity(8 + data.len());
                block.extend((data.len() as u32).to_le_bytes());
                block.extend(crc32fast::hash(&data).to_le_bytes());
                block.extend(data);
                out.splice(at..at + len, block);
            }
        }
        out
    }

    /// RPROF_FUZZ_INPUTS inputs (default 1,000,000), derived from the real
    /// recordings in tests/fixtures/recordings: the reader must return, never
    /// panic, and whatever it accepts must render in every format. Inputs
    /// that once broke it are kept in tests/fixtures/recordings/found/.
    #[test]
    fn fuzz_the_reader() {
        let inputs: usize = std::env::var("RPROF_FUZZ_INPUTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1_000_000);
        let seed: u64 = std::env::var("RPROF_FUZZ_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0x5eed_1234_abcd_0001);
        let files = fixtures();
        let mut rng = XorShift(seed);
        let (mut accepted, mut refused) = (0u64, 0u64);
        for i in 0..inputs {
            let (_, base) = &files[i % files.len()];
            let mut input = mutate(&mut rng, base, &files);
            if rng.below(4) == 0 {
                input = mutate(&mut rng, &input.clone(), &files);
            }
            let result = std::panic::catch_unwind(|| match parse(&input) {
                Ok(read) => {
                    // Rendering what was accepted must hold too (now and then:
                    // it is slower than reading).
                    if i % 64 == 0 {
                        for format in [
                            crate::cli::Format::Folded,
                            crate::cli::Format::Pprof,
                            crate::cli::Format::Speedscope,
                            crate::cli::Format::Summary,
                        ] {
                            let mut sink = Vec::new();
                            super::super::render(
                                &read.recording,
                                format,
                                &super::super::RenderOptions {
                                    threads: true,
                                    processes: true,
                                    by_line: true,
                                },
                                &mut sink,
                            )
                            .expect("render");
                        }
                    }
                    true
                }
                Err(_) => false,
            });
            match result {
                Ok(true) => accepted += 1,
                Ok(false) => refused += 1,
                Err(_) => {
                    let found = Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join(format!("tests/fixtures/recordings/found/input-{seed:x}-{i}.bin"));
                    let _ = std::fs::create_dir_all(found.parent().expect("dir"));
                    let _ = std::fs::write(&found, &input);
                    panic!(
                        "input {i} (seed {seed:#x}) panicked the reader: kept in {}",
                        found.display()
                    );
                }
            }
        }
        eprintln!("fuzz: {inputs} inputs, {accepted} accepted, {refused} refused");
        assert!(accepted > 0 && refused > 0, "the mutations reach both outcomes");
    }

    /// Inputs that once broke the reader, read again.
    #[test]
    fn inputs_that_broke_the_reader_stay_fixed() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/recordings/found");
        for entry in std::fs::read_dir(&dir).into_iter().flatten() {
            let bytes = std::fs::read(entry.expect("entry").path()).expect("read");
            let _ = parse(&bytes);
        }
    }
}
