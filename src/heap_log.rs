//! `RPROF_HEAP_LOG=FILE`: rprof's own live heap at the end of every epoch,
//! one line `MILLISECONDS BYTES` each. Resident memory says what the
//! allocator keeps, which steps up with fragmentation and stays up; the live
//! heap says what rprof holds, so this is what shows whether a long
//! recording (--rotate, --flight-recorder) holds more as it goes on.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::time::Duration;

use anyhow::{Context, Result};

pub struct HeapLog(BufWriter<File>);

impl HeapLog {
    /// The log the environment asks for, if any.
    pub fn from_env() -> Result<Option<Self>> {
        let Some(path) = std::env::var_os("RPROF_HEAP_LOG") else {
            return Ok(None);
        };
        let file =
            File::create(&path).with_context(|| format!("creating RPROF_HEAP_LOG {}", path.display()))?;
        Ok(Some(Self(BufWriter::new(file))))
    }

    /// Notes the live heap `elapsed` into the recording.
    pub fn epoch(&mut self, elapsed: Duration) -> Result<()> {
        writeln!(self.0, "{} {}", elapsed.as_millis(), live_heap_bytes())
            .and_then(|()| self.0.flush())
            .context("writing RPROF_HEAP_LOG")
    }
}

/// Bytes allocated and not freed, small chunks and mmapped ones (glibc).
fn live_heap_bytes() -> usize {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let info = unsafe { libc::mallinfo2() };
    info.uordblks + info.hblkhd
}
