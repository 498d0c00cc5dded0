//! The keyless view: what every edge holds for each (table, shard).
//!
//! Per bucket one bit-packed record `[seed:8][fp0..fp3: f bits each][v0..v3: value_bits each]`,
//! plus the two Othello bit arrays. A lookup needs the two candidate bucket addresses and the
//! two Othello cells, all computable from the key alone, so the four reads are issued together
//! and cost about one memory latency. No keys are stored: a never-inserted key reads some other
//! key's slot (a structural false hit) unless fingerprints are enabled.

use sha2::{Digest, Sha256};

use super::hash::{self, Seeds};
use super::mem::HugeBuf;
use super::prefetch;
use super::{MAX_LOAD, MAX_SEED, SLOTS};
use crate::error::{CoreError, Result};
use crate::patch::{self, Batch, Op, Reader, Step, FLIP_B, PERM_EMPTY};

const STATE_MAGIC: &[u8; 4] = b"KVCS";
const STATE_VERSION: u8 = 1;
/// Largest bucket array a geometry may describe (also bounds what a hostile snapshot allocates):
/// 2^27 buckets hold about 510 million entries, and keep the writer's Othello forest (about 9.3
/// nodes per bucket) within its 31-bit node ids.
pub const MAX_BUCKETS: u32 = 1 << 27;
/// Largest fingerprint width.
pub const MAX_FP_BITS: u8 = 16;

/// The shape of a table: everything a keyless reader needs besides the arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub value_bits: u8,
    pub fp_bits: u8,
    pub seed: u64,
    pub n_buckets: u32,
    pub ma: u32,
    pub mb: u32,
}

impl Geometry {
    /// Size a table for `capacity` entries at [`MAX_LOAD`]: Othello B has one node per slot and
    /// A about 4/3 as many, which keeps the random bipartite graph sparse enough to stay a forest.
    pub fn for_capacity(capacity: u64, value_bits: u8, fp_bits: u8, seed: u64) -> Result<Self> {
        let nb = ((capacity.max(1) as f64) / (SLOTS as f64 * MAX_LOAD)).ceil().max(2.0) as u64;
        let mb = nb * SLOTS as u64;
        let ma = mb + mb.div_ceil(3);
        let g = Geometry { value_bits, fp_bits, seed, n_buckets: nb.min(u32::MAX as u64) as u32, ma: ma.min(u32::MAX as u64) as u32, mb: mb.min(u32::MAX as u64) as u32 };
        if nb > MAX_BUCKETS as u64 {
            return Err(CoreError::Capacity { needed: capacity, max: g.max_capacity() });
        }
        g.validate()?;
        Ok(g)
    }

    pub fn validate(&self) -> Result<()> {
        if self.value_bits != 32 && self.value_bits != 64 {
            return Err(CoreError::InvalidArgument(format!("value_bits must be 32 or 64, got {}", self.value_bits)));
        }
        if self.fp_bits > MAX_FP_BITS {
            return Err(CoreError::InvalidArgument(format!("fp_bits must be 0..={MAX_FP_BITS}, got {}", self.fp_bits)));
        }
        if self.n_buckets < 2 || self.n_buckets > MAX_BUCKETS {
            return Err(CoreError::InvalidArgument(format!("n_buckets {} outside 2..={MAX_BUCKETS}", self.n_buckets)));
        }
        if self.ma == 0 || self.mb == 0 || self.ma as u64 + self.mb as u64 > super::othello::MAX_NODES {
            return Err(CoreError::InvalidArgument(format!("Othello sizes ma={} mb={} out of range", self.ma, self.mb)));
        }
        Ok(())
    }

    /// Entries the table is sized for.
    pub fn capacity(&self) -> u64 {
        (self.n_buckets as f64 * SLOTS as f64 * MAX_LOAD).floor() as u64
    }

    pub fn max_capacity(&self) -> u64 {
        (MAX_BUCKETS as f64 * SLOTS as f64 * MAX_LOAD) as u64
    }

    pub fn record_bits(&self) -> usize {
        8 + SLOTS * (self.fp_bits as usize + self.value_bits as usize)
    }

    fn bucket_words(&self) -> usize {
        // One padding word so a two-word read at the last record never runs off the end.
        (self.n_buckets as usize * self.record_bits()).div_ceil(64) + 1
    }

    pub fn value_mask(&self) -> u64 {
        if self.value_bits == 64 {
            u64::MAX
        } else {
            (1u64 << self.value_bits) - 1
        }
    }
}

#[inline(always)]
fn read_bits(words: &[u64], off: usize, n: u32) -> u64 {
    let w = off >> 6;
    let sh = (off & 63) as u32;
    let mut v = words[w] >> sh;
    if sh + n > 64 {
        v |= words[w + 1] << (64 - sh);
    }
    if n == 64 {
        v
    } else {
        v & ((1u64 << n) - 1)
    }
}

#[inline(always)]
fn write_bits(words: &mut [u64], off: usize, n: u32, val: u64) {
    if n == 0 {
        return;
    }
    let mask = if n == 64 { u64::MAX } else { (1u64 << n) - 1 };
    let val = val & mask;
    let w = off >> 6;
    let sh = (off & 63) as u32;
    words[w] = (words[w] & !(mask << sh)) | (val << sh);
    if sh + n > 64 {
        let hi = 64 - sh;
        let m2 = mask >> hi;
        words[w + 1] = (words[w + 1] & !m2) | (val >> hi);
    }
}

#[inline(always)]
fn bit(words: &[u64], i: u32) -> u64 {
    (words[(i >> 6) as usize] >> (i & 63)) & 1
}

/// Position of a keyed lookup: which bucket and slot a key resolves to in the view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    pub bucket: u32,
    pub slot: usize,
}

/// What applying a batch did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    pub epoch: u64,
    pub seq: u64,
    pub ops: u32,
    pub snapshot: bool,
}

#[derive(Clone, Debug)]
pub struct LudoView {
    table: u32,
    shard: u32,
    epoch: u64,
    seq: u64,
    geo: Option<Geometry>,
    seeds: Seeds,
    words: HugeBuf<u64>,
    oa: HugeBuf<u64>,
    ob: HugeBuf<u64>,
    /// Keys the writer could not place (Othello cycle or no cuckoo path) until its next rebuild;
    /// sorted by key so the encoding is canonical.
    fallback: Vec<(u64, u64)>,
}

impl LudoView {
    /// An empty view bound to (table, shard); it answers nothing until a snapshot arrives.
    pub fn new(table: u32, shard: u32) -> Self {
        LudoView { table, shard, epoch: 0, seq: 0, geo: None, seeds: Seeds::from_table_seed(0), words: HugeBuf::filled(0, 0), oa: HugeBuf::filled(0, 0), ob: HugeBuf::filled(0, 0), fallback: Vec::new() }
    }

    /// A view with the given geometry and all slots empty (what a fresh writer starts from).
    pub fn empty(table: u32, shard: u32, epoch: u64, geo: Geometry) -> Result<Self> {
        geo.validate()?;
        Ok(LudoView {
            table,
            shard,
            epoch,
            seq: 0,
            geo: Some(geo),
            seeds: Seeds::from_table_seed(geo.seed),
            words: HugeBuf::filled(geo.bucket_words(), 0),
            oa: HugeBuf::filled((geo.ma as usize).div_ceil(64), 0),
            ob: HugeBuf::filled((geo.mb as usize).div_ceil(64), 0),
            fallback: Vec::new(),
        })
    }

    pub fn table(&self) -> u32 {
        self.table
    }
    pub fn shard(&self) -> u32 {
        self.shard
    }
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    pub fn seq(&self) -> u64 {
        self.seq
    }
    pub fn geometry(&self) -> Option<Geometry> {
        self.geo
    }
    pub fn is_initialised(&self) -> bool {
        self.geo.is_some()
    }
    pub fn fallback_len(&self) -> usize {
        self.fallback.len()
    }
    /// The keyed fallback entries, sorted by key.
    pub fn fallback_entries(&self) -> &[(u64, u64)] {
        &self.fallback
    }
    /// The fallback's value for `key`, if the key is there.
    #[inline]
    pub fn fallback_get(&self, key: u64) -> Option<u64> {
        if self.fallback.is_empty() {
            return None;
        }
        self.fallback.binary_search_by_key(&key, |e| e.0).ok().map(|i| self.fallback[i].1)
    }
    pub(crate) fn set_position(&mut self, epoch: u64, seq: u64) {
        self.epoch = epoch;
        self.seq = seq;
    }

    fn geo_or_err(&self) -> Result<&Geometry> {
        self.geo.as_ref().ok_or(CoreError::Uninitialised)
    }

    #[inline(always)]
    fn rec_off(g: &Geometry, bucket: u32) -> usize {
        bucket as usize * g.record_bits()
    }

    #[inline(always)]
    pub(crate) fn seed_at(&self, g: &Geometry, bucket: u32) -> u8 {
        read_bits(&self.words, Self::rec_off(g, bucket), 8) as u8
    }

    #[inline(always)]
    pub(crate) fn value_at(&self, g: &Geometry, bucket: u32, slot: usize) -> u64 {
        let off = Self::rec_off(g, bucket) + 8 + SLOTS * g.fp_bits as usize + slot * g.value_bits as usize;
        read_bits(&self.words, off, g.value_bits as u32)
    }

    #[inline(always)]
    fn fp_at(&self, g: &Geometry, bucket: u32, slot: usize) -> u64 {
        if g.fp_bits == 0 {
            return 0;
        }
        read_bits(&self.words, Self::rec_off(g, bucket) + 8 + slot * g.fp_bits as usize, g.fp_bits as u32)
    }

    fn set_seed(&mut self, g: &Geometry, bucket: u32, s: u8) {
        write_bits(&mut self.words, Self::rec_off(g, bucket), 8, s as u64);
    }

    /// A set-value op: one slot's value, its fingerprint left as it is. (The writer's updates
    /// call this directly, the views through [`Self::apply_op`].)
    #[inline]
    pub(crate) fn set_value(&mut self, g: &Geometry, bucket: u32, slot: usize, value: u64) {
        write_bits(&mut self.words, Self::rec_off(g, bucket) + 8 + SLOTS * g.fp_bits as usize + slot * g.value_bits as usize, g.value_bits as u32, value);
    }

    fn set_slot(&mut self, g: &Geometry, bucket: u32, slot: usize, value: u64, fp: u64) {
        self.set_value(g, bucket, slot, value);
        if g.fp_bits > 0 {
            write_bits(&mut self.words, Self::rec_off(g, bucket) + 8 + slot * g.fp_bits as usize, g.fp_bits as u32, fp);
        }
    }

    #[inline(always)]
    pub(crate) fn othello_bit(&self, ia: u32, ib: u32) -> u64 {
        bit(&self.oa, ia) ^ bit(&self.ob, ib)
    }

    /// Warm the words holding Othello cells (in the patch encoding) that a step will flip.
    #[inline]
    pub(crate) fn prefetch_cells(&self, cells: &[u32]) {
        for &cell in cells {
            let (arr, i) = if cell & FLIP_B != 0 { (&self.ob, cell & !FLIP_B) } else { (&self.oa, cell) };
            prefetch(arr, (i >> 6) as usize);
        }
    }

    pub(crate) fn flip(&mut self, cell: u32) {
        let (arr, i) = if cell & FLIP_B != 0 { (&mut self.ob, cell & !FLIP_B) } else { (&mut self.oa, cell) };
        arr[(i >> 6) as usize] ^= 1 << (i & 63);
    }

    /// Warm the cache lines a lookup or write of `key` will touch (both candidate records and
    /// both Othello cells), so their misses overlap instead of queueing.
    #[inline]
    pub fn prefetch_key(&self, key: u64) {
        let Some(g) = self.geo.as_ref() else { return };
        let (b0, b1) = hash::buckets(key, &self.seeds, g.n_buckets);
        let (ia, ib) = hash::othello_edge(key, &self.seeds, g.ma, g.mb);
        Self::prefetch_record(&self.words, g, b0);
        Self::prefetch_record(&self.words, g, b1);
        prefetch(&self.oa, (ia >> 6) as usize);
        prefetch(&self.ob, (ib >> 6) as usize);
    }

    /// Warm one bucket record.
    #[inline]
    pub fn prefetch_bucket(&self, bucket: u32) {
        if let Some(g) = self.geo.as_ref() {
            Self::prefetch_record(&self.words, g, bucket);
        }
    }

    /// Both ends of a record: a record (136 or 264 bits) is not line-aligned, and about one in
    /// four of the 136-bit ones crosses into a second cache line that would otherwise be fetched
    /// only when the read reaches it.
    #[inline(always)]
    fn prefetch_record(words: &[u64], g: &Geometry, bucket: u32) {
        let start = bucket as usize * g.record_bits();
        let (first, last) = (start >> 9, (start + g.record_bits() - 1) >> 9);
        prefetch(words, first << 3);
        if last != first {
            prefetch(words, last << 3);
        }
    }

    /// Where the classifier sends `key`.
    #[inline(always)]
    pub fn probe(&self, key: u64) -> Option<Probe> {
        let g = self.geo.as_ref()?;
        let (b0, b1) = hash::buckets(key, &self.seeds, g.n_buckets);
        let (ia, ib) = hash::othello_edge(key, &self.seeds, g.ma, g.mb);
        let b = if self.othello_bit(ia, ib) == 0 { b0 } else { b1 };
        let s = self.seed_at(g, b);
        Some(Probe { bucket: b, slot: hash::slot(key, &self.seeds, s) })
    }

    /// The value stored for `key`, or 0 for "no holder". Without fingerprints a never-inserted
    /// key may return another key's value (a structural false hit).
    #[inline]
    pub fn lookup(&self, key: u64) -> u64 {
        let Some(g) = self.geo.as_ref() else { return 0 };
        if !self.fallback.is_empty() {
            if let Ok(i) = self.fallback.binary_search_by_key(&key, |e| e.0) {
                return self.fallback[i].1;
            }
        }
        let (b0, b1) = hash::buckets(key, &self.seeds, g.n_buckets);
        let (ia, ib) = hash::othello_edge(key, &self.seeds, g.ma, g.mb);
        // Both candidate records are known before the classifier answers: start all four reads
        // now so they cost one memory latency, not two dependent ones.
        let rb = g.record_bits();
        prefetch(&self.words, (b0 as usize * rb) >> 6);
        prefetch(&self.words, (b1 as usize * rb) >> 6);
        let b = if self.othello_bit(ia, ib) == 0 { b0 } else { b1 };
        let s = self.seed_at(g, b);
        let slot = hash::slot(key, &self.seeds, s);
        if g.fp_bits > 0 && self.fp_at(g, b, slot) != hash::fingerprint(key, &self.seeds, g.fp_bits) {
            return 0;
        }
        self.value_at(g, b, slot)
    }

    /// Batch lookup. Keys are processed in groups whose memory reads are prefetched together,
    /// so the cache misses of different keys overlap instead of running back to back.
    pub fn lookup_batch(&self, keys: &[u64], out: &mut [u64]) {
        const GROUP: usize = 16;
        let n = keys.len().min(out.len());
        let Some(g) = self.geo.as_ref() else {
            out[..n].fill(0);
            return;
        };
        let has_fallback = !self.fallback.is_empty();
        let rb = g.record_bits();
        let mut pos = [(0u32, 0u32, 0u32, 0u32); GROUP];
        let mut i = 0;
        while i < n {
            let m = (n - i).min(GROUP);
            for j in 0..m {
                let k = keys[i + j];
                let (b0, b1) = hash::buckets(k, &self.seeds, g.n_buckets);
                let (ia, ib) = hash::othello_edge(k, &self.seeds, g.ma, g.mb);
                pos[j] = (b0, b1, ia, ib);
                prefetch(&self.oa, (ia >> 6) as usize);
                prefetch(&self.ob, (ib >> 6) as usize);
                prefetch(&self.words, (b0 as usize * rb) >> 6);
                prefetch(&self.words, (b1 as usize * rb) >> 6);
            }
            for j in 0..m {
                let (b0, b1, ia, ib) = pos[j];
                let k = keys[i + j];
                if has_fallback {
                    if let Some(v) = self.fallback_get(k) {
                        out[i + j] = v;
                        continue;
                    }
                }
                let b = if self.othello_bit(ia, ib) == 0 { b0 } else { b1 };
                let s = self.seed_at(g, b);
                let slot = hash::slot(k, &self.seeds, s);
                out[i + j] = if g.fp_bits > 0 && self.fp_at(g, b, slot) != hash::fingerprint(k, &self.seeds, g.fp_bits) { 0 } else { self.value_at(g, b, slot) };
            }
            i += m;
        }
    }

    // ---- applying edits -------------------------------------------------------------------

    fn check_value(g: &Geometry, v: u64) -> Result<()> {
        if v & !g.value_mask() != 0 {
            return Err(CoreError::MalformedPatch(format!("value {v:#x} wider than {} bits", g.value_bits)));
        }
        Ok(())
    }

    /// Validate a batch's ops in order against this view, so applying them cannot fail and
    /// cannot produce a state no writer could have (e.g. a value in an empty slot). Slot
    /// occupancy of buckets touched earlier in the batch is tracked in a small overlay.
    fn validate_ops(&self, g: &Geometry, ops: &[Op]) -> Result<()> {
        let mut overlay: std::collections::HashMap<u32, u8> = std::collections::HashMap::new();
        let occupied = |ov: &std::collections::HashMap<u32, u8>, b: u32| -> u8 {
            ov.get(&b).copied().unwrap_or_else(|| (0..SLOTS).fold(0u8, |m, j| m | (((self.value_at(g, b, j) != 0) as u8) << j)))
        };
        for op in ops {
            Self::validate_op(g, op)?;
            match op {
                Op::SetValue { bucket, slot, .. } => {
                    if occupied(&overlay, *bucket) & (1 << slot) == 0 {
                        return Err(CoreError::MalformedPatch(format!("set-value into empty slot {slot} of bucket {bucket}")));
                    }
                }
                Op::ClearSlot { bucket, slot } => {
                    let m = occupied(&overlay, *bucket) & !(1 << slot);
                    overlay.insert(*bucket, m);
                }
                Op::InsertPath { steps } => {
                    for st in steps {
                        let old = occupied(&overlay, st.bucket);
                        let mut m = 0u8;
                        for (j, &p) in st.perm.iter().enumerate() {
                            if p < PERM_EMPTY {
                                if old & (1 << p) == 0 {
                                    return Err(CoreError::MalformedPatch(format!("slot permutation of bucket {} moves empty slot {p}", st.bucket)));
                                }
                                m |= 1 << j;
                            }
                        }
                        if m & (1 << st.slot) != 0 {
                            return Err(CoreError::MalformedPatch(format!("insert step overwrites occupied slot {} of bucket {}", st.slot, st.bucket)));
                        }
                        overlay.insert(st.bucket, m | (1 << st.slot));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Geometric validation of one op against `g`.
    fn validate_op(g: &Geometry, op: &Op) -> Result<()> {
        let bad = |m: String| Err(CoreError::MalformedPatch(m));
        let bucket_ok = |b: u32| b < g.n_buckets;
        match op {
            Op::SetValue { bucket, slot, value } => {
                if !bucket_ok(*bucket) || *slot as usize >= SLOTS {
                    return bad(format!("set-value at bucket {bucket} slot {slot} outside {} buckets", g.n_buckets));
                }
                if *value == 0 {
                    return bad("set-value writes 0 (a removal is a clear-slot)".into());
                }
                Self::check_value(g, *value)
            }
            Op::ClearSlot { bucket, slot } => {
                if !bucket_ok(*bucket) || *slot as usize >= SLOTS {
                    return bad(format!("clear at bucket {bucket} slot {slot} outside {} buckets", g.n_buckets));
                }
                Ok(())
            }
            Op::InsertPath { steps } => {
                for Step { bucket, seed, perm, slot, value, fp, flips } in steps {
                    if !bucket_ok(*bucket) || *slot as usize >= SLOTS || *seed > MAX_SEED {
                        return bad(format!("insert step at bucket {bucket} slot {slot} seed {seed} out of range"));
                    }
                    let mut seen = 0u8;
                    for &p in perm {
                        if p > PERM_EMPTY {
                            return bad(format!("slot permutation entry {p} out of range"));
                        }
                        if p < PERM_EMPTY {
                            if seen & (1 << p) != 0 {
                                return bad("slot permutation repeats a source slot".into());
                            }
                            seen |= 1 << p;
                        }
                    }
                    Self::check_value(g, *value)?;
                    if *value == 0 {
                        return bad("insert step writes value 0".into());
                    }
                    if (g.fp_bits == 0 && *fp != 0) || (g.fp_bits > 0 && (*fp == 0 || (*fp as u64) >> g.fp_bits != 0)) {
                        return bad(format!("fingerprint {fp} invalid for {} fingerprint bits", g.fp_bits));
                    }
                    for &c in flips {
                        let (lim, i) = if c & FLIP_B != 0 { (g.mb, c & !FLIP_B) } else { (g.ma, c) };
                        if i >= lim {
                            return bad(format!("Othello flip {i} outside array of {lim}"));
                        }
                    }
                }
                Ok(())
            }
            Op::FallbackSet { key, value } => {
                if key >> 63 != 0 || *value == 0 {
                    return bad(format!("fallback entry key {key:#x} value {value:#x} invalid"));
                }
                Self::check_value(g, *value)
            }
            Op::FallbackRemove { key } => {
                if key >> 63 != 0 {
                    return bad(format!("fallback key {key:#x} invalid"));
                }
                Ok(())
            }
            Op::Snapshot { .. } => bad("snapshot in the middle of a batch".into()),
        }
    }

    /// Apply one validated insert step: re-seed the bucket (slot j takes old slot perm[j]), write
    /// the new slot, flip the Othello cells.
    pub(crate) fn apply_step(&mut self, st: &Step) {
        let Some(g) = self.geo else { return };
        let old: [(u64, u64); SLOTS] = std::array::from_fn(|j| (self.value_at(&g, st.bucket, j), self.fp_at(&g, st.bucket, j)));
        for (j, &p) in st.perm.iter().enumerate() {
            let (v, f) = if p < PERM_EMPTY { old[p as usize] } else { (0, 0) };
            self.set_slot(&g, st.bucket, j, v, f);
        }
        self.set_seed(&g, st.bucket, st.seed);
        self.set_slot(&g, st.bucket, st.slot as usize, st.value, st.fp as u64);
        for &c in &st.flips {
            self.flip(c);
        }
    }

    /// Apply one already-validated, non-snapshot op. Shared by the writer (on its own mirror)
    /// and by every remote view, which is what keeps them byte-identical.
    pub(crate) fn apply_op(&mut self, op: &Op) {
        let g = match self.geo {
            Some(g) => g,
            None => return,
        };
        match op {
            Op::SetValue { bucket, slot, value } => self.set_value(&g, *bucket, *slot as usize, *value),
            Op::ClearSlot { bucket, slot } => self.set_slot(&g, *bucket, *slot as usize, 0, 0),
            Op::InsertPath { steps } => {
                for st in steps {
                    self.apply_step(st);
                }
            }
            Op::FallbackSet { key, value } => match self.fallback.binary_search_by_key(key, |e| e.0) {
                Ok(i) => self.fallback[i].1 = *value,
                Err(i) => self.fallback.insert(i, (*key, *value)),
            },
            Op::FallbackRemove { key } => {
                if let Ok(i) = self.fallback.binary_search_by_key(key, |e| e.0) {
                    self.fallback.remove(i);
                }
            }
            Op::Snapshot { .. } => {}
        }
    }

    /// Apply an encoded batch. Only the next seq of the current epoch is applied; a snapshot batch
    /// is applied when it is not older than the view. On any error the view is unchanged.
    pub fn apply_batch(&mut self, bytes: &[u8]) -> Result<Applied> {
        let batch = patch::decode_batch(bytes)?;
        self.apply_decoded(&batch)
    }

    pub fn apply_decoded(&mut self, batch: &Batch) -> Result<Applied> {
        let h = &batch.header;
        if h.table != self.table || h.shard != self.shard {
            return Err(CoreError::WrongTable { table: self.table, shard: self.shard, got_table: h.table, got_shard: h.shard });
        }
        if let Some(Op::Snapshot { .. }) = batch.ops.first() {
            *self = self.with_snapshot(batch)?;
            return Ok(Applied { epoch: h.epoch, seq: h.seq, ops: h.n_ops, snapshot: true });
        }
        let g = *self.geo_or_err()?;
        if h.epoch < self.epoch || (h.epoch == self.epoch && h.seq <= self.seq) {
            return Err(CoreError::StalePatch { epoch: self.epoch, seq: self.seq, got_epoch: h.epoch, got_seq: h.seq });
        }
        if h.epoch > self.epoch {
            return Err(CoreError::EpochChanged { epoch: self.epoch, got_epoch: h.epoch });
        }
        if h.seq != self.seq + 1 {
            return Err(CoreError::SequenceGap { epoch: self.epoch, expected: self.seq + 1, got: h.seq });
        }
        self.validate_ops(&g, &batch.ops)?;
        for op in &batch.ops {
            self.apply_op(op);
        }
        self.seq = h.seq;
        Ok(Applied { epoch: h.epoch, seq: h.seq, ops: h.n_ops, snapshot: false })
    }

    /// The view that applying the snapshot batch `batch` would leave, with every check
    /// [`Self::apply_decoded`] makes of it, and this view unchanged: for a caller that must
    /// check several views before it changes any.
    pub fn with_snapshot(&self, batch: &Batch) -> Result<LudoView> {
        let h = &batch.header;
        if h.table != self.table || h.shard != self.shard {
            return Err(CoreError::WrongTable { table: self.table, shard: self.shard, got_table: h.table, got_shard: h.shard });
        }
        let Some(Op::Snapshot { state }) = batch.ops.first() else {
            return Err(CoreError::MalformedPatch("expected a snapshot batch".into()));
        };
        if self.geo.is_some() && (h.epoch, h.seq) < (self.epoch, self.seq) {
            return Err(CoreError::StalePatch { epoch: self.epoch, seq: self.seq, got_epoch: h.epoch, got_seq: h.seq });
        }
        let mut fresh = LudoView::from_state(self.table, self.shard, state)?;
        let g = fresh.geo.ok_or(CoreError::Uninitialised)?;
        fresh.validate_ops(&g, &batch.ops[1..])?;
        for op in &batch.ops[1..] {
            fresh.apply_op(op);
        }
        fresh.epoch = h.epoch;
        fresh.seq = h.seq;
        Ok(fresh)
    }

    // ---- state encoding -------------------------------------------------------------------

    /// The canonical encoding of the view's contents (not its position): two views with equal
    /// state bytes answer every lookup identically.
    pub fn state_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + 8 * (self.words.len() + self.oa.len() + self.ob.len()) + 16 * self.fallback.len());
        out.extend_from_slice(STATE_MAGIC);
        out.push(STATE_VERSION);
        let g = match self.geo {
            Some(g) => g,
            None => {
                out.push(0);
                return out;
            }
        };
        out.push(1);
        out.push(g.value_bits);
        out.push(g.fp_bits);
        out.extend_from_slice(&g.seed.to_le_bytes());
        out.extend_from_slice(&g.n_buckets.to_le_bytes());
        out.extend_from_slice(&g.ma.to_le_bytes());
        out.extend_from_slice(&g.mb.to_le_bytes());
        out.extend_from_slice(&(self.fallback.len() as u32).to_le_bytes());
        for arr in [&self.words, &self.oa, &self.ob] {
            for w in arr.iter() {
                out.extend_from_slice(&w.to_le_bytes());
            }
        }
        for (k, v) in &self.fallback {
            out.extend_from_slice(&k.to_le_bytes());
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    /// SHA-256 of [`Self::state_bytes`]: what operators compare across edges and writers.
    pub fn digest(&self) -> [u8; 32] {
        Sha256::digest(self.state_bytes()).into()
    }

    /// Rebuild a view from state bytes, validating every field.
    pub fn from_state(table: u32, shard: u32, state: &[u8]) -> Result<Self> {
        let bad = |m: &str| CoreError::MalformedPatch(format!("snapshot: {m}"));
        let mut r = Reader::new(state);
        if r.bytes(4, "snapshot magic")? != STATE_MAGIC {
            return Err(bad("bad magic"));
        }
        if r.u8("snapshot version")? != STATE_VERSION {
            return Err(bad("unsupported version"));
        }
        if r.u8("snapshot flag")? != 1 {
            return Err(bad("state of an uninitialised view"));
        }
        let g = Geometry { value_bits: r.u8("value bits")?, fp_bits: r.u8("fp bits")?, seed: r.u64("seed")?, n_buckets: r.u32("buckets")?, ma: r.u32("ma")?, mb: r.u32("mb")? };
        g.validate().map_err(|e| bad(&e.to_string()))?;
        let nf = r.u32("fallback count")? as usize;
        let (nw, na, nbw) = (g.bucket_words(), (g.ma as usize).div_ceil(64), (g.mb as usize).div_ceil(64));
        let need = (nw + na + nbw) * 8 + nf * 16;
        if r.remaining() != need {
            return Err(bad(&format!("{} bytes of arrays, geometry needs {need}", r.remaining())));
        }
        let mut read_words = |n: usize, what: &str| -> Result<HugeBuf<u64>> {
            let b = r.bytes(n * 8, what)?;
            let mut out = HugeBuf::filled(n, 0u64);
            for (w, c) in out.iter_mut().zip(b.chunks_exact(8)) {
                *w = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            }
            Ok(out)
        };
        let words = read_words(nw, "buckets")?;
        let oa = read_words(na, "othello A")?;
        let ob = read_words(nbw, "othello B")?;
        let mut fallback = Vec::with_capacity(nf);
        for _ in 0..nf {
            let k = r.u64("fallback key")?;
            let v = r.u64("fallback value")?;
            if k >> 63 != 0 || v == 0 || v & !g.value_mask() != 0 {
                return Err(bad("invalid fallback entry"));
            }
            if let Some(&(pk, _)) = fallback.last() {
                if pk >= k {
                    return Err(bad("fallback entries not sorted"));
                }
            }
            fallback.push((k, v));
        }
        let view = LudoView { table, shard, epoch: 0, seq: 0, geo: Some(g), seeds: Seeds::from_table_seed(g.seed), words, oa, ob, fallback };
        // Reject bytes that no writer could have produced, so a corrupt snapshot cannot pass as
        // a valid one: seeds in range, padding bits zero, fingerprints consistent with values.
        let total_bits = g.n_buckets as usize * g.record_bits();
        for b in 0..g.n_buckets {
            if view.seed_at(&g, b) > MAX_SEED {
                return Err(bad("bucket seed out of range"));
            }
            for s in 0..SLOTS {
                let empty_v = view.value_at(&g, b, s) == 0;
                if g.fp_bits > 0 && empty_v != (view.fp_at(&g, b, s) == 0) {
                    return Err(bad("fingerprint and value disagree on an empty slot"));
                }
            }
        }
        if tail_nonzero(&view.words, total_bits) || tail_nonzero(&view.oa, g.ma as usize) || tail_nonzero(&view.ob, g.mb as usize) {
            return Err(bad("nonzero padding bits"));
        }
        Ok(view)
    }

    // ---- accounting -------------------------------------------------------------------------

    /// Heap plus inline bytes held by this view.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.words.bytes() + self.oa.bytes() + self.ob.bytes() + 16 * self.fallback.capacity()
    }

    /// Occupied bucket slots plus fallback entries (a view scan; for statistics, not hot paths).
    pub fn count_entries(&self) -> u64 {
        let Some(g) = self.geo else { return 0 };
        let mut n = self.fallback.len() as u64;
        for b in 0..g.n_buckets {
            for s in 0..SLOTS {
                n += (self.value_at(&g, b, s) != 0) as u64;
            }
        }
        n
    }
}

fn tail_nonzero(words: &[u64], used_bits: usize) -> bool {
    let full = used_bits / 64;
    let rem = used_bits % 64;
    let mut i = full;
    if rem != 0 {
        if words.get(full).is_some_and(|&w| w >> rem != 0) {
            return true;
        }
        i += 1;
    }
    words.get(i..).is_some_and(|t| t.iter().any(|&w| w != 0))
}


impl crate::score::TierLookup for LudoView {
    #[inline]
    fn lookup(&self, key: u64) -> u64 {
        LudoView::lookup(self, key)
    }
    #[inline]
    fn prefetch(&self, key: u64) {
        self.prefetch_key(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bit_io_roundtrips_across_word_boundaries() {
        let mut w = vec![0u64; 8];
        write_bits(&mut w, 60, 32, 0xdead_beef);
        write_bits(&mut w, 100, 64, u64::MAX - 5);
        write_bits(&mut w, 200, 8, 0xab);
        assert_eq!(read_bits(&w, 60, 32), 0xdead_beef);
        assert_eq!(read_bits(&w, 100, 64), u64::MAX - 5);
        assert_eq!(read_bits(&w, 200, 8), 0xab);
        write_bits(&mut w, 60, 32, 0);
        assert_eq!(read_bits(&w, 100, 64), u64::MAX - 5);
    }

    #[test]
    fn geometry_bits_per_entry_theory() {
        let g = Geometry::for_capacity(1_000_000, 32, 0, 1).unwrap();
        let v = LudoView::empty(0, 0, 1, g).unwrap();
        let bits = (v.memory_bytes() * 8) as f64 / g.capacity() as f64;
        assert!(bits < 40.0, "{bits}");
    }

    #[test]
    fn uninitialised_view_answers_zero_and_rejects_deltas() {
        let v = LudoView::new(1, 2);
        assert_eq!(v.lookup(5), 0);
        assert!(v.probe(5).is_none());
    }

    #[test]
    fn state_roundtrip_and_corrupt_snapshots_rejected() {
        let g = Geometry::for_capacity(100, 32, 8, 3).unwrap();
        let mut v = LudoView::empty(0, 0, 1, g).unwrap();
        v.apply_op(&Op::InsertPath { steps: vec![Step { bucket: 1, seed: 3, perm: [0, 1, 2, 3], slot: 2, value: 5, fp: 9, flips: vec![3, 2 | FLIP_B] }] });
        v.apply_op(&Op::FallbackSet { key: 42, value: 7 });
        let s = v.state_bytes();
        let w = LudoView::from_state(0, 0, &s).unwrap();
        assert_eq!(w.state_bytes(), s);
        assert_eq!(w.lookup(42), 7);
        for n in 0..s.len().min(200) {
            assert!(LudoView::from_state(0, 0, &s[..n]).is_err());
        }
    }
}
