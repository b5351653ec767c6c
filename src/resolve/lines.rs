//! An iseq's line table, decoded from Ruby's own encoding (iseq.c with
//! `VM_INSN_INFO_TABLE_IMPL == 2`): an array of entries, each with its
//! line, and a succinct index that gives, for an instruction's position, the
//! number of entries starting at or before it (its rank).
//!
//! The table is read whole with its iseq, so that any pc of a sample that
//! reading describes has a line, however late rprof names the sample: the GC
//! frees the table with its iseq, and code compiled per request (Rails's
//! templates) is often freed before a sample of a new pc is named.

/// Positions below this have their ranks packed 7 bits each, 9 to a word
/// (`imm_part`); the rest are in blocks of 512 (`succ_part`).
const IMMEDIATE_TABLE_SIZE: u64 = 54;
/// A `succ_dict_block`: rank (u32, padded), small_block_ranks (u64),
/// bits (8 x u64).
const SUCC_BLOCK_SIZE: u64 = 80;
const IMMEDIATE_WORDS: u64 = IMMEDIATE_TABLE_SIZE / 9;

/// How many bytes Ruby allocates for the index of an iseq of `size`
/// positions (succ_index_table_create with `max_pos` = iseq_size).
pub fn index_len(size: u64) -> u64 {
    if size < IMMEDIATE_TABLE_SIZE {
        size.div_ceil(9) * 8
    } else {
        IMMEDIATE_WORDS * 8 + (size - IMMEDIATE_TABLE_SIZE).div_ceil(512) * SUCC_BLOCK_SIZE
    }
}

/// The rank of `pos` (Ruby's succ_index_lookup), reading the index's
/// bytes with `read(offset, buffer)`.
pub fn rank(read: impl Fn(u64, &mut [u8]) -> Option<()>, pos: u64) -> Option<u64> {
    if pos < IMMEDIATE_TABLE_SIZE {
        let mut word = [0u8; 8];
        read(8 * (pos / 9), &mut word)?;
        return Some((u64::from_le_bytes(word) >> (7 * (pos % 9))) & 0x7f);
    }
    let x = pos - IMMEDIATE_TABLE_SIZE;
    let mut block = [0u8; SUCC_BLOCK_SIZE as usize];
    read(IMMEDIATE_WORDS * 8 + (x / 512) * SUCC_BLOCK_SIZE, &mut block)?;
    let word = |at: usize| u64::from_le_bytes(block[at..at + 8].try_into().unwrap_or_default());
    let rank = u64::from(u32::from_le_bytes(block[..4].try_into().unwrap_or_default()));
    let bit = x % 512;
    let j = bit / 64;
    let small = if j > 0 {
        (word(8) >> ((j - 1) * 9)) & 0x1ff
    } else {
        0
    };
    let pop = u64::from((word(16 + 8 * j as usize) << (63 - bit % 64)).count_ones());
    Some(rank + small + pop)
}

/// The first position of each entry, from the index (Ruby's
/// succ_index_table_invert): where the rank steps up.
fn positions(size: u64, index: &[u8]) -> Vec<u32> {
    let word = |at: u64| {
        let at = at as usize;
        index
            .get(at..at + 8)
            .map_or(0, |w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
    };
    let mut out = Vec::new();
    let mut last = None;
    for pos in 0..size.min(IMMEDIATE_TABLE_SIZE) {
        let r = (word(8 * (pos / 9)) >> (7 * (pos % 9))) & 0x7f;
        if last != Some(r) {
            out.push(pos as u32);
        }
        last = Some(r);
    }
    let blocks = index_len(size).saturating_sub(IMMEDIATE_WORDS * 8) / SUCC_BLOCK_SIZE;
    for k in 0..blocks {
        for j in 0..8 {
            let bits = word(IMMEDIATE_WORDS * 8 + k * SUCC_BLOCK_SIZE + 16 + 8 * j);
            for i in (0..64).filter(|i| bits & (1 << i) != 0) {
                out.push((IMMEDIATE_TABLE_SIZE + k * 512 + j * 64 + i) as u32);
            }
        }
    }
    out
}

/// Which line each instruction of an iseq is on.
#[derive(Debug, PartialEq, Eq)]
pub struct LineTable {
    /// (first position, line) of each run of instructions on one line, in
    /// order of position.
    runs: Box<[(u32, u32)]>,
}

impl LineTable {
    /// The table of an iseq of `size` positions from its index's bytes and
    /// its entries' lines, if they agree (one entry needs no index).
    pub fn decode(size: u64, index: &[u8], lines: &[u32]) -> Option<Self> {
        let starts = match lines.len() {
            0 => return None,
            1 => vec![0],
            _ => positions(size, index),
        };
        // The first entry starts at position 0 (a rank of 0 names no entry).
        if starts.len() != lines.len() || starts.first() != Some(&0) {
            return None;
        }
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for (&start, &line) in starts.iter().zip(lines) {
            if runs.last().is_none_or(|&(_, l)| l != line) {
                runs.push((start, line));
            }
        }
        Some(LineTable { runs: runs.into() })
    }

    /// The line of the instruction at `pos`: that of the last entry that
    /// starts at or before it.
    pub fn at(&self, pos: u64) -> Option<u32> {
        let i = self.runs.partition_point(|&(start, _)| u64::from(start) <= pos);
        Some(self.runs.get(i.checked_sub(1)?)?.1)
    }

    /// The one line all instructions sit on, if they do.
    pub fn single(&self) -> Option<u32> {
        match *self.runs {
            [(_, line)] => Some(line),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ruby's succ_index_table_create for entries starting at `starts`.
    fn index(size: u64, starts: &[u64]) -> Vec<u8> {
        let mut out = vec![0u8; index_len(size) as usize];
        let imm_words = (index_len(size).min(IMMEDIATE_WORDS * 8) / 8) as usize;
        let mut r = 0;
        for j in 0..imm_words {
            let mut w = 0u64;
            for i in 0..9 {
                if r < starts.len() && starts[r] == (j * 9 + i) as u64 {
                    r += 1;
                }
                w |= (r as u64) << (7 * i);
            }
            out[j * 8..j * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        let blocks = (index_len(size) as usize - imm_words * 8) / SUCC_BLOCK_SIZE as usize;
        for k in 0..blocks {
            let at = imm_words * 8 + k * SUCC_BLOCK_SIZE as usize;
            out[at..at + 4].copy_from_slice(&(r as u32).to_le_bytes());
            let (mut small, mut ranks) = (0u64, 0u64);
            for j in 0..8 {
                if j > 0 {
                    ranks |= small << (9 * (j - 1));
                }
                let mut bits = 0u64;
                for i in 0..64 {
                    let pos = IMMEDIATE_TABLE_SIZE as usize + k * 512 + j * 64 + i;
                    if r < starts.len() && starts[r] == pos as u64 {
                        bits |= 1 << i;
                        r += 1;
                    }
                }
                out[at + 16 + 8 * j..at + 24 + 8 * j].copy_from_slice(&bits.to_le_bytes());
                small += u64::from(bits.count_ones());
            }
            out[at + 8..at + 16].copy_from_slice(&ranks.to_le_bytes());
        }
        out
    }

    /// Every position's line, from the decoded table and from Ruby's
    /// lookup on the index, agree with the entries they were made from.
    #[test]
    fn decoded_tables_agree_with_rubys_lookup() {
        for size in [1u64, 5, 53, 54, 55, 100, 566, 567, 1200] {
            let starts: Vec<u64> = (0..size).filter(|p| p % 7 == 0 || p % 11 == 3).collect();
            let lines: Vec<u32> = (0..starts.len() as u32).map(|i| 10 + i / 2).collect();
            let idx = index(size, &starts);
            let table = LineTable::decode(size, &idx, &lines).expect("a table");
            let read = |at: u64, buf: &mut [u8]| {
                buf.copy_from_slice(idx.get(at as usize..at as usize + buf.len())?);
                Some(())
            };
            for pos in 0..size {
                let entry = starts.iter().rposition(|&s| s <= pos).expect("an entry");
                let ranked = rank(read, pos).expect("a rank");
                assert_eq!(ranked, entry as u64 + 1, "rank of {pos} in {size}");
                assert_eq!(table.at(pos), Some(lines[entry]), "line of {pos} in {size}");
            }
        }
    }

    #[test]
    fn one_line_and_one_entry() {
        assert_eq!(LineTable::decode(9, &[], &[4]).map(|t| t.single()), Some(Some(4)));
        let idx = index(20, &[0, 3, 9]);
        let table = LineTable::decode(20, &idx, &[7, 7, 7]).expect("a table");
        assert_eq!((table.single(), table.at(19)), (Some(7), Some(7)));
        let table = LineTable::decode(20, &idx, &[7, 8, 7]).expect("a table");
        assert_eq!((table.single(), table.at(4)), (None, Some(8)));
        // An index that does not match its entries is no table.
        assert_eq!(LineTable::decode(20, &idx, &[7, 8]), None);
        assert_eq!(LineTable::decode(20, &idx, &[]), None);
    }
}
