//! The patch wire format: versioned, checksummed batches of view edits.
//!
//! A maintenance table is the single writer of its (table, shard); every change it makes to its
//! own mirror of the view is emitted as one of these edits, so a view that applies the batches in
//! order stays byte-identical to the writer. Decoding validates everything before anything is
//! applied and never panics on arbitrary bytes.
//!
//! Batch layout (little-endian):
//! ```text
//! "KVCP" | version u8 | flags u8 | reserved u16 | table u32 | shard u32 | epoch u64 | seq u64
//!        | n_ops u32 | payload_len u32 | payload (ops) | crc32 u32 (over everything before it)
//! ```

use crate::error::{CoreError, Result};

pub const MAGIC: &[u8; 4] = b"KVCP";
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 4 + 1 + 1 + 2 + 4 + 4 + 8 + 8 + 4 + 4;
/// Hard limits that bound what a hostile batch can make a decoder allocate.
pub const MAX_STEPS: usize = crate::ludo::MAX_CUCKOO_DEPTH + 1;
pub const MAX_PAYLOAD: usize = 1 << 31;

const TAG_SET_VALUE: u8 = 1;
const TAG_CLEAR_SLOT: u8 = 2;
const TAG_INSERT_PATH: u8 = 3;
const TAG_FALLBACK_SET: u8 = 4;
const TAG_FALLBACK_REMOVE: u8 = 5;
const TAG_SNAPSHOT: u8 = 6;

/// Marks an Othello flip in array B (array A otherwise).
pub const FLIP_B: u32 = 1 << 31;
/// `perm[j] == PERM_EMPTY`: new slot j starts empty.
pub const PERM_EMPTY: u8 = 4;

/// One move of an insert path: re-seed `bucket` (slot j takes old slot `perm[j]`), write
/// (`value`, `fp`) into `slot`, then flip the listed Othello cells.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub bucket: u32,
    pub seed: u8,
    pub perm: [u8; 4],
    pub slot: u8,
    pub value: u64,
    pub fp: u16,
    pub flips: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    SetValue { bucket: u32, slot: u8, value: u64 },
    ClearSlot { bucket: u32, slot: u8 },
    /// Applied in order: the deepest cuckoo move first, the new key last.
    InsertPath { steps: Vec<Step> },
    FallbackSet { key: u64, value: u64 },
    FallbackRemove { key: u64 },
    /// A whole view state (see `LudoView::state_bytes`); only ever the first op of a batch.
    Snapshot { state: Vec<u8> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchHeader {
    pub table: u32,
    pub shard: u32,
    pub epoch: u64,
    pub seq: u64,
    pub n_ops: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub header: BatchHeader,
    pub ops: Vec<Op>,
}

impl Batch {
    pub fn is_snapshot(&self) -> bool {
        matches!(self.ops.first(), Some(Op::Snapshot { .. }))
    }
}

/// Append one op's encoding to `out`.
/// The head of an InsertPath op of `n` steps; [`encode_step`] each step after it. (The writer
/// encodes a path step by step as it executes it, without building the op.)
pub fn encode_insert_path_head(n: usize, out: &mut Vec<u8>) {
    out.push(TAG_INSERT_PATH);
    out.push(n as u8);
}

/// One step of an InsertPath op (after [`encode_insert_path_head`]).
pub fn encode_step(s: &Step, out: &mut Vec<u8>) {
    out.extend_from_slice(&s.bucket.to_le_bytes());
    out.push(s.seed);
    out.extend_from_slice(&s.perm);
    out.push(s.slot);
    out.extend_from_slice(&s.value.to_le_bytes());
    out.extend_from_slice(&s.fp.to_le_bytes());
    out.extend_from_slice(&(s.flips.len() as u32).to_le_bytes());
    for f in &s.flips {
        out.extend_from_slice(&f.to_le_bytes());
    }
}

pub fn encode_op(op: &Op, out: &mut Vec<u8>) {
    match op {
        Op::SetValue { bucket, slot, value } => {
            // One copy of the whole op (the commonest on the wire) instead of four appends.
            let mut b = [0u8; 14];
            b[0] = TAG_SET_VALUE;
            b[1..5].copy_from_slice(&bucket.to_le_bytes());
            b[5] = *slot;
            b[6..].copy_from_slice(&value.to_le_bytes());
            out.extend_from_slice(&b);
        }
        Op::ClearSlot { bucket, slot } => {
            out.push(TAG_CLEAR_SLOT);
            out.extend_from_slice(&bucket.to_le_bytes());
            out.push(*slot);
        }
        Op::InsertPath { steps } => {
            encode_insert_path_head(steps.len(), out);
            for st in steps {
                encode_step(st, out);
            }
        }
        Op::FallbackSet { key, value } => {
            out.push(TAG_FALLBACK_SET);
            out.extend_from_slice(&key.to_le_bytes());
            out.extend_from_slice(&value.to_le_bytes());
        }
        Op::FallbackRemove { key } => {
            out.push(TAG_FALLBACK_REMOVE);
            out.extend_from_slice(&key.to_le_bytes());
        }
        Op::Snapshot { state } => {
            out.push(TAG_SNAPSHOT);
            out.extend_from_slice(&(state.len() as u64).to_le_bytes());
            out.extend_from_slice(state);
        }
    }
}

/// Frame already-encoded ops into a batch.
pub fn encode_batch(h: &BatchHeader, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + 4);
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(0);
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&h.table.to_le_bytes());
    out.extend_from_slice(&h.shard.to_le_bytes());
    out.extend_from_slice(&h.epoch.to_le_bytes());
    out.extend_from_slice(&h.seq.to_le_bytes());
    out.extend_from_slice(&h.n_ops.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A bounds-checked little-endian reader: every read returns an error instead of panicking.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn malformed(msg: impl Into<String>) -> CoreError {
    CoreError::MalformedPatch(msg.into())
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn bytes(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.remaining() < n {
            return Err(malformed(format!(
                "truncated reading {what}: need {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.bytes(1, what)?[0])
    }
    pub fn u16(&mut self, what: &str) -> Result<u16> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.bytes(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
}

/// Decode only the header (after checking magic, version, length and checksum).
pub fn decode_header(buf: &[u8]) -> Result<BatchHeader> {
    let (h, _) = check_frame(buf)?;
    Ok(h)
}

fn check_frame(buf: &[u8]) -> Result<(BatchHeader, &[u8])> {
    if buf.len() < HEADER_LEN + 4 {
        return Err(malformed(format!("{} bytes is shorter than a batch header", buf.len())));
    }
    let mut r = Reader::new(buf);
    if r.bytes(4, "magic")? != MAGIC {
        return Err(malformed("bad magic (not a KVCompass patch batch)"));
    }
    let version = r.u8("version")?;
    if version != VERSION {
        return Err(malformed(format!("unsupported patch version {version} (this build reads {VERSION})")));
    }
    let flags = r.u8("flags")?;
    let reserved = r.u16("reserved")?;
    if flags != 0 || reserved != 0 {
        return Err(malformed("unknown flags set"));
    }
    let table = r.u32("table")?;
    let shard = r.u32("shard")?;
    let epoch = r.u64("epoch")?;
    let seq = r.u64("seq")?;
    let n_ops = r.u32("n_ops")?;
    let payload_len = r.u32("payload_len")? as usize;
    if buf.len() != HEADER_LEN + payload_len + 4 {
        return Err(malformed(format!(
            "length mismatch: header says {} payload bytes, batch has {}",
            payload_len,
            buf.len().saturating_sub(HEADER_LEN + 4)
        )));
    }
    let body = &buf[..HEADER_LEN + payload_len];
    let mut c = [0u8; 4];
    c.copy_from_slice(&buf[HEADER_LEN + payload_len..]);
    if crc32fast::hash(body) != u32::from_le_bytes(c) {
        return Err(malformed("checksum mismatch"));
    }
    Ok((BatchHeader { table, shard, epoch, seq, n_ops }, &buf[HEADER_LEN..HEADER_LEN + payload_len]))
}

/// Decode a whole batch. Structural checks only; geometry checks happen in the view.
pub fn decode_batch(buf: &[u8]) -> Result<Batch> {
    let (header, payload) = check_frame(buf)?;
    let mut r = Reader::new(payload);
    // Every op takes at least 2 bytes, which bounds the allocation a lying n_ops can cause.
    if header.n_ops as usize > payload.len() / 2 + 1 {
        return Err(malformed(format!("{} ops cannot fit in {} payload bytes", header.n_ops, payload.len())));
    }
    let mut ops = Vec::with_capacity(header.n_ops as usize);
    for i in 0..header.n_ops {
        let tag = r.u8("op tag")?;
        let op = match tag {
            TAG_SET_VALUE => Op::SetValue { bucket: r.u32("bucket")?, slot: r.u8("slot")?, value: r.u64("value")? },
            TAG_CLEAR_SLOT => Op::ClearSlot { bucket: r.u32("bucket")?, slot: r.u8("slot")? },
            TAG_INSERT_PATH => {
                let n = r.u8("step count")? as usize;
                if n == 0 || n > MAX_STEPS {
                    return Err(malformed(format!("insert path of {n} steps (1..={MAX_STEPS} allowed)")));
                }
                let mut steps = Vec::with_capacity(n);
                for _ in 0..n {
                    let bucket = r.u32("bucket")?;
                    let seed = r.u8("seed")?;
                    let p = r.bytes(4, "perm")?;
                    let perm = [p[0], p[1], p[2], p[3]];
                    let slot = r.u8("slot")?;
                    let value = r.u64("value")?;
                    let fp = r.u16("fingerprint")?;
                    let nf = r.u32("flip count")? as usize;
                    if nf > r.remaining() / 4 {
                        return Err(malformed(format!("{nf} flips cannot fit in the remaining payload")));
                    }
                    let mut flips = Vec::with_capacity(nf);
                    for _ in 0..nf {
                        flips.push(r.u32("flip")?);
                    }
                    steps.push(Step { bucket, seed, perm, slot, value, fp, flips });
                }
                Op::InsertPath { steps }
            }
            TAG_FALLBACK_SET => Op::FallbackSet { key: r.u64("key")?, value: r.u64("value")? },
            TAG_FALLBACK_REMOVE => Op::FallbackRemove { key: r.u64("key")? },
            TAG_SNAPSHOT => {
                if i != 0 {
                    return Err(malformed("a snapshot may only be the first op of a batch"));
                }
                let n = r.u64("snapshot length")?;
                if n > r.remaining() as u64 {
                    return Err(malformed("snapshot longer than the payload"));
                }
                Op::Snapshot { state: r.bytes(n as usize, "snapshot")?.to_vec() }
            }
            t => return Err(malformed(format!("unknown op tag {t} at op {i}"))),
        };
        ops.push(op);
    }
    if r.remaining() != 0 {
        return Err(malformed(format!("{} trailing payload bytes after {} ops", r.remaining(), header.n_ops)));
    }
    Ok(Batch { header, ops })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample_ops() -> Vec<Op> {
        vec![
            Op::SetValue { bucket: 3, slot: 1, value: 0x15 },
            Op::ClearSlot { bucket: 9, slot: 3 },
            Op::InsertPath {
                steps: vec![
                    Step { bucket: 4, seed: 17, perm: [1, 0, 4, 3], slot: 2, value: 2, fp: 0, flips: vec![1, 5 | FLIP_B] },
                    Step { bucket: 1, seed: 0, perm: [0, 1, 2, 3], slot: 0, value: 1, fp: 0, flips: vec![] },
                ],
            },
            Op::FallbackSet { key: 77, value: 4 },
            Op::FallbackRemove { key: 77 },
        ]
    }

    fn frame(ops: &[Op], seq: u64) -> Vec<u8> {
        let mut p = Vec::new();
        for o in ops {
            encode_op(o, &mut p);
        }
        encode_batch(&BatchHeader { table: 2, shard: 1, epoch: 5, seq, n_ops: ops.len() as u32 }, &p)
    }

    #[test]
    fn roundtrip() {
        let ops = sample_ops();
        let b = decode_batch(&frame(&ops, 9)).unwrap();
        assert_eq!(b.ops, ops);
        assert_eq!(b.header, BatchHeader { table: 2, shard: 1, epoch: 5, seq: 9, n_ops: 5 });
        assert!(!b.is_snapshot());
    }

    #[test]
    fn every_truncation_and_bit_flip_is_rejected() {
        let bytes = frame(&sample_ops(), 1);
        for n in 0..bytes.len() {
            assert!(decode_batch(&bytes[..n]).is_err(), "prefix of {n} bytes accepted");
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(decode_batch(&b).is_err(), "flip at byte {i} accepted");
        }
    }

    #[test]
    fn snapshot_must_come_first() {
        let ops = vec![Op::ClearSlot { bucket: 0, slot: 0 }, Op::Snapshot { state: vec![1, 2, 3] }];
        assert!(matches!(decode_batch(&frame(&ops, 1)), Err(CoreError::MalformedPatch(_))));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_batch(&bytes);
        }

        #[test]
        fn arbitrary_payload_with_valid_frame_never_panics(payload in proptest::collection::vec(any::<u8>(), 0..512), n_ops in 0u32..64) {
            let b = encode_batch(&BatchHeader { table: 0, shard: 0, epoch: 1, seq: 1, n_ops }, &payload);
            let _ = decode_batch(&b);
        }
    }
}
