//! The worker agent's block forest: which engine blocks a worker holds, where each sits in its
//! chain, and which registration-length prefix keys the chains hold, in which tier.
//!
//! `kvcompass/agent/agent.py` documents the model (block identity for chained and content
//! hashes, parents, removal runs, orphans, unindexed blocks, salts, tombstones, what counts as
//! held); `WorkerAgent` keeps the message sequencing, replays and incarnations in Python and
//! hands every decoded event to this structure, which was its Python block tree rule for rule.
//! It moved here because the simulator files every block every emulated engine stores (tens of
//! blocks per request on every worker it reaches) and a Python object per block was the largest
//! share of a KVCompass run; the services' agents run the same code.
//!
//! Keys: a block keeps the SHA-256 state after its last token, so a new block costs one block of
//! hashing and a key at a registration length `c` inside it costs a copy, the partial block and
//! a digest; keys equal [`crate::chunk_hash::prefix_keys`] of the same tokens.
//!
//! Bytes: a simulated fleet holds millions of blocks here (every block every worker caches), so
//! a block keeps the state's open parts (chaining value, length, the first 32 uncompressed
//! bytes: all of them when blocks are a multiple of 16 tokens under a 32-byte namespace digest)
//! instead of a 112-byte `Sha256`, its one registration key inline, its children without
//! their hashes, and the index from (group, hash) to blocks is a table of block ids by a
//! fingerprint with the blocks sharing one linked through the blocks themselves (it was a map
//! holding each hash a second time).

use std::collections::hash_map::Entry;

use rustc_hash::{FxHashMap, FxHashSet};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::block_table::BlockTable;
use crate::chunk_hash::Midstate;
use crate::error::{CoreError, Result};
use crate::token_ids::mix64;

/// An engine block hash: an unsigned 64-bit int or bytes (the decoder normalises both). Bytes
/// sit behind a thin pointer so a hash is 16 bytes, not 24 (every block holds one).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BHash {
    Int(u64),
    Bytes(Box<Box<[u8]>>),
}

impl BHash {
    /// A canonical byte form (for digests): the kind, then the value.
    fn put(&self, out: &mut Vec<u8>) {
        match self {
            BHash::Int(v) => {
                out.push(0);
                out.extend_from_slice(&v.to_le_bytes());
            }
            BHash::Bytes(b) => {
                out.push(1);
                out.extend_from_slice(&(b.len() as u32).to_le_bytes());
                out.extend_from_slice(b);
            }
        }
    }
}

type Slot = (u32, BHash);
type Bid = u32;

/// No block (the end of a fingerprint chain).
const NIL: Bid = Bid::MAX;

/// The fingerprint a (group, hash) is indexed under; blocks whose fingerprints collide share a
/// chain and are told apart by their own group and hash.
fn fingerprint(group: u32, h: &BHash) -> u64 {
    match h {
        BHash::Int(v) => fingerprint_int(group, *v),
        BHash::Bytes(b) => fingerprint_bytes(group, b),
    }
}

/// Blocks ahead of a store's walk whose fingerprint slots are prefetched.
const FP_AHEAD: usize = 8;

/// The fingerprint's slot key in [`Forest::by_fp`] (its top bits; 0 is kept aside by the table).
#[inline]
fn fp_key(f: u64) -> u32 {
    (f >> 32) as u32
}

fn fingerprint_int(group: u32, v: u64) -> u64 {
    mix64(v ^ mix64(u64::from(group)))
}

fn fingerprint_bytes(group: u32, b: &[u8]) -> u64 {
    xxh3_64_with_seed(b, u64::from(group) ^ 0x5bd1_e995_0000_0001)
}

/// One hash of a BlockRemoved: (group, medium id, hash).
pub type Removal = (u32, u16, BHash);

/// The tier a medium maps to: `GPU` VRAM (1), `CPU*` DRAM (2), anything else none (0).
pub fn medium_tier(name: &str) -> u8 {
    if name == "GPU" {
        1
    } else if name.starts_with("CPU") {
        2
    } else {
        0
    }
}

/// The agent's counters that the forest moves (the rest are the sequencer's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ForestStats {
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub orphans: u64,
    pub adopted: u64,
    pub unindexed: u64,
    pub unknown_removals: u64,
    pub conflicts: u64,
    pub ambiguous_parents: u64,
    pub ambiguous_removals: u64,
}

/// A block's children: a lone child inline, by id (its hash is the child's own), or, for a
/// block with several, a map by hash beside the forest (`Forest::many_kids`); a hash table per
/// block was a third of a fleet-sized forest's bytes. A parent's children have distinct hashes.
enum KidsIter<'a> {
    One(Option<Bid>),
    Many(std::collections::hash_map::Values<'a, BHash, Bid>),
}

impl Iterator for KidsIter<'_> {
    type Item = Bid;
    fn next(&mut self) -> Option<Bid> {
        match self {
            KidsIter::One(b) => b.take(),
            KidsIter::Many(it) => it.next().copied(),
        }
    }
}

/// One engine block: 112 bytes, the fields a walk reads (hash, links, flags) first. A forest
/// holds millions of them at fleet scale in the simulator, where their bytes were most of a
/// run's memory (144 before the hash, the media and the start shrank; 128 with the store clock
/// and the byte count at 64 bits, the group and the block size at 32, a byte per flag).
#[repr(C)]
struct Block {
    /// The engine's hash when it is an int (not [`Block::bytes_hash`]); a bytes hash is kept
    /// in `Forest::byte_hashes` and this is 0.
    hash: u64,
    /// The block's registration key when it has exactly one (`nkeys() == 1`; with more, all
    /// are in `Forest::more_keys`).
    key: u64,
    /// The store clock at the block's last store (48 bits, a tick per stored block: never
    /// reached) above the media holding it: ids below [`INLINE_MEDIA`] as bits (others in
    /// `Forest::more_media`).
    touched_media: u64,
    /// The parent ([`NIL`]: a prompt start or an orphan).
    up: Bid,
    /// The lone child ([`NIL`]: none, or several, then `many_kids`).
    kid: Bid,
    /// The next block under the same (group, hash) fingerprint, in storing order ([`NIL`]).
    same: Bid,
    /// Bytes hashed up to the block's end, when keyed (see `cv`).
    total: u32,
    /// The engine's KV group and the block's token count (the event decoder holds both below
    /// 2^16, [`MAX_FIELD`]).
    group: u16,
    size: u16,
    own: u8,
    chain: u8,
    /// [`KEYED`], [`LONG_TAIL`], [`MANY_KIDS`], [`MORE_MEDIA`], [`BYTES_HASH`] and the key
    /// count (0, 1 or 2 for more) in the top bits.
    flags: u8,
    opaque: bool,
    /// The hashing state after the block's last token, when keyed (see `Forest::state`):
    /// bytes hashed (`total`: the namespace digest's [`ROOT_BYTES`] and 4 a token, so the
    /// block's first token sits at `(total - ROOT_BYTES) / 4 - size`), chaining value, the
    /// first 32 uncompressed bytes (all of them unless long-tailed, then `Forest::long_tails`
    /// holds them).
    cv: [u32; 8],
    tail: [u8; 32],
}

const _: () = assert!(std::mem::size_of::<Block>() == 112 && std::mem::size_of::<Option<Block>>() == 112);

/// The largest KV group and block size a forest stores (16 bits in a block).
pub const MAX_FIELD: u32 = u16::MAX as u32;

const KEYED: u8 = 1;
const LONG_TAIL: u8 = 2;
const MANY_KIDS: u8 = 4;
const MORE_MEDIA: u8 = 8;
const BYTES_HASH: u8 = 16;
const NKEYS_SHIFT: u32 = 5;

/// Media ids a block's `media` bits hold.
const INLINE_MEDIA: u16 = 16;
/// Bytes of a prompt's hashing root (a namespace digest) before its first token.
const ROOT_BYTES: u64 = 32;

impl Block {
    #[inline]
    fn parent(&self) -> Option<Bid> {
        (self.up != NIL).then_some(self.up)
    }
    #[inline]
    fn flag(&self, f: u8) -> bool {
        self.flags & f != 0
    }
    #[inline]
    fn set_flag(&mut self, f: u8, on: bool) {
        if on {
            self.flags |= f;
        } else {
            self.flags &= !f;
        }
    }
    #[inline]
    fn keyed(&self) -> bool {
        self.flag(KEYED)
    }
    #[inline]
    fn long_tail(&self) -> bool {
        self.flag(LONG_TAIL)
    }
    #[inline]
    fn many_kids(&self) -> bool {
        self.flag(MANY_KIDS)
    }
    #[inline]
    fn more_media(&self) -> bool {
        self.flag(MORE_MEDIA)
    }
    #[inline]
    fn bytes_hash(&self) -> bool {
        self.flag(BYTES_HASH)
    }
    #[inline]
    fn nkeys(&self) -> u8 {
        self.flags >> NKEYS_SHIFT
    }
    #[inline]
    fn set_nkeys(&mut self, n: u8) {
        debug_assert!(n <= 2);
        self.flags = (self.flags & ((1 << NKEYS_SHIFT) - 1)) | (n << NKEYS_SHIFT);
    }
    #[inline]
    fn media(&self) -> u16 {
        self.touched_media as u16
    }
    #[inline]
    fn set_media(&mut self, m: u16) {
        self.touched_media = (self.touched_media & !0xFFFF) | u64::from(m);
    }
    #[inline]
    fn touched(&self) -> u64 {
        self.touched_media >> 16
    }
    #[inline]
    fn set_touched(&mut self, t: u64) {
        self.touched_media = (t << 16) | (self.touched_media & 0xFFFF);
    }
}

/// One BlockStored, as the agent hands it over (medium already normalised, tokens packed as
/// little-endian u32, the first block's salt resolved to its tenant's namespace digest).
pub struct Stored<'a> {
    pub group: u32,
    pub medium: &'a str,
    pub block_size: u32,
    pub tokens: &'a [u8],
    pub lora: bool,
    pub parent: Option<BHash>,
    pub hashes: Vec<BHash>,
    /// Per block: the event carries an extra key for it.
    pub extra: Vec<bool>,
    /// The first block's extra key names a salt this agent serves: its namespace digest.
    pub salt_root: Option<[u8; 32]>,
}

/// The blocks by id: a slab whose freed ids are reused, so a forest is a vector of blocks
/// rather than a hash table of them (no hashing on every parent and child step, a third less
/// memory). Ids are only names: nothing orders blocks by id, and a freed id has no reference
/// left (a block's removal unlinks it from its parent, the hash index, the roots and the
/// orphans first).
///
/// Blocks live in fixed chunks of [`SLAB_CHUNK`] that are never moved: a forest grows a chunk
/// at a time, with no copy of what it holds and no freed buffer left behind. (One vector grown
/// by doubling copied every block at each growth; with blocks aligned to cache lines its
/// freed buffers also stayed in the allocator's heap, a quarter of the process's memory in a
/// paper-scale simulation.)
#[derive(Default)]
struct Slab {
    chunks: Vec<Box<[Option<Block>]>>,
    /// Ids handed out so far (the next fresh one).
    next: Bid,
    free: Vec<Bid>,
    live: usize,
}

/// Blocks a slab chunk holds (64 KiB of them).
const SLAB_CHUNK: usize = 512;

impl Slab {
    #[inline]
    fn at(bid: Bid) -> (usize, usize) {
        (bid as usize / SLAB_CHUNK, bid as usize % SLAB_CHUNK)
    }
    /// The id the next [`Slab::insert`] must use.
    fn vacant(&self) -> Bid {
        self.free.last().copied().unwrap_or(self.next)
    }
    fn insert(&mut self, bid: Bid, x: Block) {
        debug_assert_eq!(bid, self.vacant());
        if self.free.last() == Some(&bid) {
            self.free.pop();
        } else {
            self.next += 1;
            if bid as usize == self.chunks.len() * SLAB_CHUNK {
                self.chunks.push((0..SLAB_CHUNK).map(|_| None).collect());
            }
        }
        let (c, i) = Self::at(bid);
        self.chunks[c][i] = Some(x);
        self.live += 1;
    }
    #[inline]
    fn get(&self, bid: &Bid) -> Option<&Block> {
        let (c, i) = Self::at(*bid);
        self.chunks.get(c).and_then(|k| k[i].as_ref())
    }
    #[inline]
    fn get_mut(&mut self, bid: &Bid) -> Option<&mut Block> {
        let (c, i) = Self::at(*bid);
        self.chunks.get_mut(c).and_then(|k| k[i].as_mut())
    }
    fn remove(&mut self, bid: &Bid) -> Option<Block> {
        let (c, i) = Self::at(*bid);
        let x = self.chunks.get_mut(c)?[i].take()?;
        self.free.push(*bid);
        self.live -= 1;
        Some(x)
    }
    fn len(&self) -> usize {
        self.live
    }
    fn is_empty(&self) -> bool {
        self.live == 0
    }
    fn clear(&mut self) {
        self.chunks.clear();
        self.next = 0;
        self.free.clear();
        self.live = 0;
    }
    fn iter(&self) -> impl Iterator<Item = (Bid, &Block)> {
        self.chunks.iter().enumerate().flat_map(|(c, k)| k.iter().enumerate().filter_map(move |(i, x)| x.as_ref().map(|x| ((c * SLAB_CHUNK + i) as Bid, x))))
    }
    /// Heap bytes: the chunks, their table and the free list.
    fn bytes(&self) -> usize {
        self.chunks.len() * SLAB_CHUNK * std::mem::size_of::<Option<Block>>() + self.chunks.capacity() * std::mem::size_of::<Box<[Option<Block>]>>() + self.free.capacity() * std::mem::size_of::<Bid>()
    }
}

impl std::ops::Index<&Bid> for Slab {
    type Output = Block;
    fn index(&self, bid: &Bid) -> &Block {
        self.get(bid).expect("a live block id")
    }
}

pub struct Forest {
    lengths: Vec<u32>,
    root: Midstate,
    media: Vec<(String, u8)>,
    medium_ids: FxHashMap<String, u16>,
    blocks: Slab,
    roots: FxHashMap<Slot, Bid>,
    /// (group, hash) fingerprint's top 32 bits -> the first block of its chain (see
    /// [`Block::same`]; the chain's blocks are told apart by their own group and hash, so
    /// 32 bits lose nothing but a rare longer chain, and a slot is 8 bytes, not 12).
    by_fp: BlockTable<Bid, u32>,
    orphans: FxHashMap<Slot, Vec<(BHash, Bid)>>,
    // Rare per-block facts, kept beside the blocks so every block does not carry room for them:
    /// An orphan's parent hash (a block whose parent was never seen).
    waits: FxHashMap<Bid, BHash>,
    /// The tokens of a block that cannot be keyed yet (its parent is not keyed).
    pending: FxHashMap<Bid, Box<[u8]>>,
    /// A salted prompt start: its tenant's hash root.
    salted: FxHashMap<Bid, Midstate>,
    /// The keys of a block with more than one.
    more_keys: FxHashMap<Bid, Box<[u64]>>,
    /// The uncompressed bytes of a keyed block whose state holds more than 32 of them.
    long_tails: FxHashMap<Bid, [u8; 64]>,
    /// The children of a block with several, by hash.
    many_kids: FxHashMap<Bid, FxHashMap<BHash, Bid>>,
    /// Media ids of [`INLINE_MEDIA`] and above holding a block.
    more_media: FxHashMap<Bid, Vec<u16>>,
    /// The hash of a block whose engine hash is bytes.
    byte_hashes: FxHashMap<Bid, Box<[u8]>>,
    tick: u64,
    counts: FxHashMap<u64, [i64; 2]>,
    step_old: FxHashMap<u64, u8>,
    /// `refresh`'s work stack, kept between calls (it runs on every store and removal that
    /// changes a block's tier).
    refresh_stack: Vec<Bid>,
    pub stats: ForestStats,
}

fn tier_of(c: &[i64; 2]) -> u8 {
    if c[0] != 0 {
        1
    } else if c[1] != 0 {
        2
    } else {
        0
    }
}

impl Forest {
    /// `lengths`: the registration lengths (sorted, unique); `namespace`: the digest of the
    /// namespace unsalted prompts are keyed in.
    pub fn new(mut lengths: Vec<u32>, namespace: &[u8]) -> Self {
        lengths.sort_unstable();
        lengths.dedup();
        let mut root = Midstate::default();
        root.update(namespace);
        Forest {
            lengths,
            root,
            media: Vec::new(),
            medium_ids: FxHashMap::default(),
            blocks: Slab::default(),
            roots: FxHashMap::default(),
            by_fp: BlockTable::new(),
            orphans: FxHashMap::default(),
            waits: FxHashMap::default(),
            pending: FxHashMap::default(),
            salted: FxHashMap::default(),
            more_keys: FxHashMap::default(),
            long_tails: FxHashMap::default(),
            many_kids: FxHashMap::default(),
            more_media: FxHashMap::default(),
            byte_hashes: FxHashMap::default(),
            tick: 0,
            counts: FxHashMap::default(),
            step_old: FxHashMap::default(),
            refresh_stack: Vec::new(),
            stats: ForestStats::default(),
        }
    }

    /// The id of a (normalised) medium name. Ids are 16-bit: a forest tells at most 65,536
    /// media apart, and a new name past them is refused (its id wrapped to the first medium's).
    pub fn medium(&mut self, name: &str) -> Result<u16> {
        if let Some(&m) = self.medium_ids.get(name) {
            return Ok(m);
        }
        let m = u16::try_from(self.media.len()).map_err(|_| CoreError::InvalidArgument(format!("medium {name:?}: a forest tells at most {} media apart", u32::from(u16::MAX) + 1)))?;
        self.media.push((name.to_string(), medium_tier(name)));
        self.medium_ids.insert(name.to_string(), m);
        Ok(m)
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes held on the heap: every table at its capacity (a hash table's slot plus its
    /// control byte) and what the entries own (byte hashes, key lists, child maps).
    pub fn memory_bytes(&self) -> usize {
        self.memory_breakdown().iter().map(|(_, n)| n).sum()
    }

    /// [`Forest::memory_bytes`] by part: the block slab (with its free list and byte hashes),
    /// the fingerprint index, the key counts, the children maps of blocks with several, and
    /// the other side tables.
    pub fn memory_breakdown(&self) -> [(&'static str, usize); 5] {
        fn map<K, V>(m: &FxHashMap<K, V>) -> usize {
            m.capacity() * (std::mem::size_of::<(K, V)>() + 1)
        }
        let slab = self.blocks.bytes()
            + map(&self.byte_hashes)
            + self.byte_hashes.values().map(|b| b.len()).sum::<usize>();
        let sides = map(&self.roots)
            + map(&self.orphans)
            + self.orphans.values().map(|v| v.capacity() * std::mem::size_of::<(BHash, Bid)>()).sum::<usize>()
            + map(&self.waits)
            + map(&self.pending)
            + self.pending.values().map(|t| t.len()).sum::<usize>()
            + map(&self.salted)
            + map(&self.more_keys)
            + self.more_keys.values().map(|k| k.len() * 8).sum::<usize>()
            + map(&self.long_tails)
            + map(&self.more_media)
            + self.more_media.values().map(|v| v.capacity() * 2).sum::<usize>()
            + map(&self.step_old)
            + map(&self.medium_ids);
        let kids = map(&self.many_kids) + self.many_kids.values().map(map).sum::<usize>();
        [("blocks", slab), ("fingerprints", self.by_fp.capacity() * BlockTable::<Bid, u32>::SLOT_BYTES), ("key_counts", map(&self.counts)), ("children", kids), ("other", sides)]
    }
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Every key held now with its tier (1 VRAM, 2 DRAM).
    pub fn held(&self) -> Vec<(u64, u8)> {
        self.counts.iter().map(|(&k, c)| (k, tier_of(c))).collect()
    }

    /// Forget everything (an AllBlocksCleared, an engine restart); the keys' old tiers are
    /// remembered for the next [`Self::flush`].
    pub fn clear(&mut self) {
        for (k, c) in &self.counts {
            self.step_old.entry(*k).or_insert_with(|| tier_of(c));
        }
        self.counts.clear();
        self.blocks.clear();
        self.roots.clear();
        self.by_fp.clear();
        self.orphans.clear();
        self.waits.clear();
        self.pending.clear();
        self.salted.clear();
        self.more_keys.clear();
        self.long_tails.clear();
        self.many_kids.clear();
        self.more_media.clear();
        self.byte_hashes.clear();
    }

    fn has_medium(&self, bid: Bid, m: u16) -> bool {
        let x = &self.blocks[&bid];
        if m < INLINE_MEDIA {
            x.media() & (1 << m) != 0
        } else {
            x.more_media() && self.more_media.get(&bid).is_some_and(|v| v.contains(&m))
        }
    }

    fn add_medium(&mut self, bid: Bid, m: u16) {
        if m < INLINE_MEDIA {
            {
                let x = self.blocks.get_mut(&bid).expect("block");
                x.set_media(x.media() | 1 << m);
            }
        } else if !self.has_medium(bid, m) {
            self.more_media.entry(bid).or_default().push(m);
            self.blocks.get_mut(&bid).expect("block").set_flag(MORE_MEDIA, true);
        }
    }

    fn drop_medium(&mut self, bid: Bid, m: u16) {
        let x = self.blocks.get_mut(&bid).expect("block");
        if m < INLINE_MEDIA {
            x.set_media(x.media() & !(1 << m));
        } else if x.more_media() {
            let v = self.more_media.get_mut(&bid).expect("flagged");
            v.retain(|&y| y != m);
            if v.is_empty() {
                self.more_media.remove(&bid);
                x.set_flag(MORE_MEDIA, false);
            }
        }
    }

    /// Whether any medium holds the block.
    fn held_anywhere(&self, bid: Bid) -> bool {
        let x = &self.blocks[&bid];
        x.media() != 0 || x.more_media()
    }

    /// The block's media ids, ascending bits first, then the others: no allocation (it
    /// runs on every store and removal).
    fn media_of(&self, bid: Bid) -> impl Iterator<Item = u16> + '_ {
        let x = &self.blocks[&bid];
        let mut bits = x.media();
        let low = std::iter::from_fn(move || {
            (bits != 0).then(|| {
                let i = bits.trailing_zeros() as u16;
                bits &= bits - 1;
                i
            })
        });
        let more: &[u16] = if x.more_media() { &self.more_media[&bid] } else { &[] };
        low.chain(more.iter().copied())
    }

    /// `p`'s child with hash `h`.
    fn kid_of(&self, p: Bid, h: &BHash) -> Option<Bid> {
        let x = &self.blocks[&p];
        if x.many_kids() {
            self.many_kids[&p].get(h).copied()
        } else if x.kid != NIL && self.hash_is(x.kid, &self.blocks[&x.kid], h) {
            Some(x.kid)
        } else {
            None
        }
    }

    fn kids_of(&self, p: Bid) -> KidsIter<'_> {
        let x = &self.blocks[&p];
        if x.many_kids() {
            KidsIter::Many(self.many_kids[&p].values())
        } else {
            KidsIter::One((x.kid != NIL).then_some(x.kid))
        }
    }

    fn has_kids(&self, p: Bid) -> bool {
        let x = &self.blocks[&p];
        x.kid != NIL || x.many_kids()
    }

    /// Drop `p`'s child `b`, whose hash is `h`.
    fn drop_kid(&mut self, p: Bid, h: &BHash, b: Bid) {
        let x = self.blocks.get_mut(&p).expect("parent");
        if x.many_kids() {
            let m = self.many_kids.get_mut(&p).expect("flagged");
            m.remove(h);
            if m.is_empty() {
                self.many_kids.remove(&p);
                x.set_flag(MANY_KIDS, false);
            }
        } else if x.kid == b {
            x.kid = NIL;
        }
    }

    // ---- a block's parts kept outside it --------------------------------------------------------

    /// Block `bid`'s engine hash.
    fn hash_of(&self, bid: Bid) -> BHash {
        let x = &self.blocks[&bid];
        if x.bytes_hash() {
            BHash::Bytes(Box::new(self.byte_hashes[&bid].clone()))
        } else {
            BHash::Int(x.hash)
        }
    }

    /// Whether block `x` (id `bid`) has engine hash `h` (no copy of a bytes hash).
    fn hash_is(&self, bid: Bid, x: &Block, h: &BHash) -> bool {
        match h {
            BHash::Int(v) => !x.bytes_hash() && x.hash == *v,
            BHash::Bytes(b) => x.bytes_hash() && self.byte_hashes.get(&bid).is_some_and(|mine| **mine == ***b),
        }
    }

    /// The fingerprint block `bid` is filed under.
    fn fp_of(&self, bid: Bid) -> u64 {
        let x = &self.blocks[&bid];
        if x.bytes_hash() {
            fingerprint_bytes(u32::from(x.group), &self.byte_hashes[&bid])
        } else {
            fingerprint_int(u32::from(x.group), x.hash)
        }
    }

    /// The blocks carrying (group, `h`), in storing order.
    fn carrying(&self, group: u32, h: &BHash) -> Vec<Bid> {
        let mut out = Vec::new();
        let mut cur = self.by_fp.get(&fp_key(fingerprint(group, h))).copied().unwrap_or(NIL);
        while cur != NIL {
            let x = &self.blocks[&cur];
            if u32::from(x.group) == group && self.hash_is(cur, x, h) {
                out.push(cur);
            }
            cur = x.same;
        }
        out
    }

    fn carries(&self, group: u32, h: &BHash) -> bool {
        let mut cur = self.by_fp.get(&fp_key(fingerprint(group, h))).copied().unwrap_or(NIL);
        while cur != NIL {
            let x = &self.blocks[&cur];
            if u32::from(x.group) == group && self.hash_is(cur, x, h) {
                return true;
            }
            cur = x.same;
        }
        false
    }

    /// File a new block under its fingerprint, after the blocks already there.
    fn link_same(&mut self, bid: Bid) {
        let f = fp_key(self.fp_of(bid));
        let Some(&head) = self.by_fp.get(&f) else {
            self.by_fp.insert(f, bid);
            return;
        };
        let mut cur = head;
        loop {
            let next = self.blocks[&cur].same;
            if next == NIL {
                break;
            }
            cur = next;
        }
        self.blocks.get_mut(&cur).expect("chained").same = bid;
    }

    /// Take a block (still in the slab) out of its fingerprint's chain.
    fn unlink_same(&mut self, bid: Bid) {
        let (f, next) = (fp_key(self.fp_of(bid)), self.blocks[&bid].same);
        let head = *self.by_fp.get(&f).expect("a filed block");
        if head == bid {
            if next == NIL {
                self.by_fp.remove(&f);
            } else {
                *self.by_fp.get_mut(&f).expect("filed") = next;
            }
            return;
        }
        let mut cur = head;
        while self.blocks[&cur].same != bid {
            cur = self.blocks[&cur].same;
            debug_assert_ne!(cur, NIL, "a filed block is on its chain");
        }
        self.blocks.get_mut(&cur).expect("chained").same = next;
    }

    /// The registration keys inside block `bid`.
    fn keys_of(&self, bid: Bid) -> &[u64] {
        let x = &self.blocks[&bid];
        match x.nkeys() {
            0 => &[],
            1 => std::slice::from_ref(&x.key),
            _ => &self.more_keys[&bid],
        }
    }

    fn set_keys(&mut self, bid: Bid, keys: Vec<u64>) {
        let x = self.blocks.get_mut(&bid).expect("block");
        let had_more = x.nkeys() > 1;
        x.set_nkeys(keys.len().min(2) as u8);
        x.key = keys.first().copied().unwrap_or(0);
        if keys.len() > 1 {
            self.more_keys.insert(bid, keys.into_boxed_slice());
        } else if had_more {
            self.more_keys.remove(&bid);
        }
    }

    /// The hashing state after block `bid`'s last token (None: not keyed).
    fn state(&self, bid: Bid) -> Option<Midstate> {
        let x = &self.blocks[&bid];
        if !x.keyed() {
            return None;
        }
        let mut m = Midstate { cv: x.cv, buf: [0; 64], total: u64::from(x.total) };
        if x.long_tail() {
            m.buf = self.long_tails[&bid];
        } else {
            m.buf[..32].copy_from_slice(&x.tail);
        }
        Some(m)
    }

    fn set_state(&mut self, bid: Bid, m: Option<&Midstate>) {
        let x = self.blocks.get_mut(&bid).expect("block");
        let had_long = x.long_tail();
        x.set_flag(KEYED, m.is_some());
        let long = m.is_some_and(|m| m.pending() > 32);
        x.set_flag(LONG_TAIL, long);
        if let Some(m) = m {
            x.cv = m.cv;
            x.total = u32::try_from(m.total).expect("under 2^32 bytes hashed: a billion tokens in one prompt");
            x.tail.copy_from_slice(&m.buf[..32]);
            if long {
                self.long_tails.insert(bid, m.buf);
            }
        }
        if had_long && !long {
            self.long_tails.remove(&bid);
        }
    }

    /// Forget which keys changed since the last flush (a new incarnation re-reports all).
    pub fn forget_changes(&mut self) {
        self.step_old.clear();
    }

    /// The key ops since the last flush, per shard: keys whose tier changed (net), and for
    /// the shards in `reset` every key held there. `(shard, keys, tiers)` sorted by shard, ops
    /// sorted by key. `shards` must be at least 1 and every reset shard below it (refused
    /// before anything changes).
    pub fn flush(&mut self, shards: u32, reset: &[u32]) -> Result<Vec<(u32, Vec<u64>, Vec<u8>)>> {
        if shards == 0 {
            return Err(CoreError::InvalidArgument("flush: shards must be >= 1".into()));
        }
        if let Some(&s) = reset.iter().find(|&&s| s >= shards) {
            return Err(CoreError::InvalidArgument(format!("flush: reset shard {s} is not one of the {shards} shards")));
        }
        let mut changed: std::collections::BTreeMap<u32, Vec<(u64, u8)>> = std::collections::BTreeMap::new();
        for (&key, &old) in &self.step_old {
            let new = self.counts.get(&key).map_or(0, tier_of);
            if new != old {
                changed.entry((key % shards as u64) as u32).or_default().push((key, new));
            }
        }
        self.step_old.clear();
        let reset_set: FxHashSet<u32> = reset.iter().copied().collect();
        for &s in reset {
            changed.insert(s, Vec::new());
        }
        if !reset.is_empty() {
            for (&key, c) in &self.counts {
                let s = (key % shards as u64) as u32;
                if reset_set.contains(&s) {
                    changed.get_mut(&s).expect("inserted above").push((key, tier_of(c)));
                }
            }
        }
        Ok(changed
            .into_iter()
            .map(|(s, mut ops)| {
                ops.sort_unstable();
                (s, ops.iter().map(|o| o.0).collect(), ops.iter().map(|o| o.1).collect())
            })
            .collect())
    }

    fn own_of(&self, media: impl Iterator<Item = u16>) -> u8 {
        let mut best = 0u8;
        for m in media {
            let t = self.media[m as usize].1;
            if t != 0 && (best == 0 || t < best) {
                best = t;
            }
        }
        best
    }

    /// Where a BlockStored's first block hangs: (parent, None), or (None, its hash) under a
    /// parent the agent does not know (an orphan), or (None, None) at a prompt start.
    fn parent_of(&mut self, group: u32, ph: Option<&BHash>, first: Option<&BHash>) -> (Option<Bid>, Option<BHash>) {
        let Some(ph) = ph else { return (None, None) };
        let slot = (group, ph.clone());
        if let (Some(waiting), Some(first)) = (self.orphans.get(&slot), first) {
            if waiting.iter().any(|(h, _)| h == first) {
                return (None, Some(ph.clone())); // that orphan, stored again
            }
        }
        let cands = self.carrying(group, ph);
        if cands.is_empty() {
            return (None, Some(ph.clone()));
        }
        if cands.len() == 1 {
            return (Some(cands[0]), None);
        }
        // Content hashes: the same page at several places; the most recently stored live one.
        self.stats.ambiguous_parents += 1;
        let blocks = &self.blocks;
        let mut best = cands[0];
        let score = |b: Bid| (blocks[&b].media() != 0 || blocks[&b].more_media(), blocks[&b].touched());
        for &c in &cands[1..] {
            if score(c) > score(best) {
                best = c;
            }
        }
        (Some(best), None)
    }

    fn child(&self, group: u32, parent: Option<Bid>, wait: Option<&BHash>, h: &BHash) -> Option<Bid> {
        if let Some(p) = parent {
            return self.kid_of(p, h);
        }
        if let Some(w) = wait {
            return self.orphans.get(&(group, w.clone())).and_then(|v| v.iter().find(|(x, _)| x == h).map(|(_, b)| *b));
        }
        self.roots.get(&(group, h.clone())).copied()
    }

    /// A store that names blocks by hash alone, with no tokens and no parent: vLLM's offloading
    /// connector (0.11 on) reports the blocks it copied to host memory so. Each named block
    /// the forest holds once gains `medium` (and the store clock's touch a re-store gives); a
    /// hash it does not hold, or holds more than once (content hashes), cannot be placed
    /// without tokens and is left out, never guessed (under-claiming is the safe side).
    /// Returns how many were left out.
    pub fn copied(&mut self, group: u32, medium: &str, hashes: &[BHash]) -> Result<u64> {
        let m = self.medium(medium)?;
        let mut left_out = 0;
        for h in hashes {
            let found = self.carrying(group, h);
            let [bid] = found[..] else {
                left_out += 1;
                continue;
            };
            self.tick += 1;
            let tick = self.tick;
            self.blocks.get_mut(&bid).expect("a carried block").set_touched(tick);
            if !self.has_medium(bid, m) {
                self.add_medium(bid, m);
                self.set_own(bid);
            }
        }
        Ok(left_out)
    }

    /// A BlockStored event. A block size of 0 (or past [`MAX_FIELD`], as a group) and a medium
    /// past the 65,536 a forest tells apart are refused before anything changes.
    pub fn stored(&mut self, e: &Stored<'_>) -> Result<()> {
        if e.block_size == 0 || e.block_size > MAX_FIELD || e.group > MAX_FIELD {
            return Err(CoreError::InvalidArgument(format!("group {} / block size {}: a block forest keeps each below {} (and a block size of at least 1)", e.group, e.block_size, MAX_FIELD + 1)));
        }
        let group = e.group;
        let medium = self.medium(e.medium)?;
        let n = e.block_size;
        let (mut parent, mut wait) = self.parent_of(group, e.parent.as_ref(), e.hashes.first());
        let own_new = self.own_of(std::iter::once(medium));
        // A new block files itself under its fingerprint: a slot of a table of millions that no
        // CPU cache holds, and most of a store's time went waiting for it. The hashes are known
        // up front, so the slots a few blocks ahead are asked for early and the misses overlap.
        for h in e.hashes.iter().take(FP_AHEAD) {
            self.by_fp.prefetch(fp_key(fingerprint(group, h)));
        }
        for (i, h) in e.hashes.iter().enumerate() {
            if let Some(next) = e.hashes.get(i + FP_AHEAD) {
                self.by_fp.prefetch(fp_key(fingerprint(group, next)));
            }
            self.tick += 1;
            if let Some(bid) = self.child(group, parent, wait.as_ref(), h) {
                let tick = self.tick;
                let x = self.blocks.get_mut(&bid).expect("a known block");
                if u32::from(x.size) != n {
                    self.stats.conflicts += 1;
                    return Ok(()); // the rest of the event hangs off a block we cannot place
                }
                x.set_touched(tick);
                if !self.has_medium(bid, medium) {
                    self.add_medium(bid, medium);
                    self.set_own(bid);
                }
                parent = Some(bid);
                wait = None;
                continue;
            }
            let slot = (group, h.clone());
            if wait.is_some() && self.carries(group, h) {
                // A known hash under a parent never seen: see the module notes.
                self.stats.conflicts += 1;
                return Ok(());
            }
            let bid = self.blocks.vacant();
            let mut root: Option<Midstate> = None;
            let mut opaque = e.lora;
            if e.extra.get(i).copied().unwrap_or(false) {
                if i == 0 && parent.is_none() && wait.is_none() {
                    root = e.salt_root.map(|d| {
                        let mut r = Midstate::default();
                        r.update(&d);
                        r
                    });
                }
                opaque = opaque || root.is_none();
            }
            let p_opaque = parent.map(|p| self.blocks[&p].opaque);
            debug_assert!(group <= MAX_FIELD && n <= MAX_FIELD, "the decoder holds groups and block sizes below 2^16");
            let mut x = Block {
                hash: match h {
                    BHash::Int(v) => *v,
                    BHash::Bytes(_) => 0,
                },
                key: 0,
                touched_media: 0,
                up: parent.unwrap_or(NIL),
                kid: NIL,
                same: NIL,
                total: 0,
                group: group as u16,
                size: n as u16,
                own: own_new,
                chain: 0,
                flags: 0,
                opaque: opaque || p_opaque.unwrap_or(false),
                cv: [0; 8],
                tail: [0; 32],
            };
            x.set_touched(self.tick);
            x.set_flag(BYTES_HASH, matches!(h, BHash::Bytes(_)));
            if let BHash::Bytes(b) = h {
                self.byte_hashes.insert(bid, (**b).clone());
            }
            if let Some(r) = root {
                self.salted.insert(bid, r);
            }
            if let Some(w) = &wait {
                self.waits.insert(bid, w.clone());
            }
            let x_opaque = x.opaque;
            self.blocks.insert(bid, x);
            self.add_medium(bid, medium);
            self.link_same(bid);
            self.stats.blocks_stored += 1;
            if let Some(p) = parent {
                self.add_kid(p, h, bid);
            } else if let Some(w) = &wait {
                self.orphans.entry((group, w.clone())).or_default().push((h.clone(), bid));
                self.stats.orphans += 1;
            } else {
                self.roots.insert(slot.clone(), bid);
            }
            let lo = (i * n as usize * 4).min(e.tokens.len());
            let hi = ((i + 1) * n as usize * 4).min(e.tokens.len());
            let chunk = &e.tokens[lo..hi];
            let p_keyed = parent.map(|p| self.blocks[&p].keyed());
            if x_opaque {
                self.stats.unindexed += 1;
            } else if wait.is_none() && p_keyed.unwrap_or(true) {
                self.key(bid, chunk);
                // refresh(bid) for a block with no children and no chain tier yet
                let tier = if own_new == 0 {
                    0
                } else {
                    match parent {
                        None => own_new,
                        Some(p) => {
                            let pc = self.blocks[&p].chain;
                            if pc != 0 {
                                own_new.max(pc)
                            } else {
                                0
                            }
                        }
                    }
                };
                if tier != 0 {
                    let keys = self.keys_of(bid).to_vec();
                    if !keys.is_empty() {
                        self.count(&keys, tier, 1);
                    }
                    self.blocks.get_mut(&bid).expect("new block").chain = tier;
                }
            } else {
                self.pending.insert(bid, chunk.into());
            }
            if let Some(waiting) = self.orphans.get(&slot) {
                let kids: Vec<Bid> = waiting.iter().map(|(_, b)| *b).collect();
                for child in kids {
                    if child != bid {
                        self.adopt(bid, child);
                    }
                }
            }
            parent = Some(bid);
            wait = None;
        }
        Ok(())
    }

    /// Key block `bid` (its parent is keyed, or it starts the prompt) from its tokens.
    fn key(&mut self, bid: Bid, tokens: &[u8]) {
        let (start, mut h) = {
            let x = &self.blocks[&bid];
            match x.parent() {
                None => (0i64, self.salted.get(&bid).copied().unwrap_or(self.root)),
                Some(p) => {
                    let px = &self.blocks[&p];
                    // The child starts where the parent's hashed bytes end.
                    let st = self.state(p).expect("a keyed parent");
                    (((u64::from(px.total) - ROOT_BYTES) / 4) as i64, st)
                }
            }
        };
        let size = self.blocks[&bid].size as i64;
        let end = start + size;
        let lengths = &self.lengths;
        let lo = lengths.partition_point(|&c| (c as i64) <= start);
        let mut keys = Vec::new();
        if lo < lengths.len() && (lengths[lo] as i64) <= end {
            let hi = lo + lengths[lo..].partition_point(|&c| (c as i64) <= end);
            let mut pos = start;
            for &c in &lengths[lo..hi] {
                let a = (((pos - start) * 4) as usize).min(tokens.len());
                let b = (((c as i64 - start) * 4) as usize).min(tokens.len());
                h.update(&tokens[a..b]);
                pos = c as i64;
                let d = h.finalize();
                keys.push(u64::from_be_bytes(d[..8].try_into().expect("8 bytes")) >> 1);
            }
            let a = (((pos - start) * 4) as usize).min(tokens.len());
            h.update(&tokens[a..]);
        } else {
            h.update(tokens);
        }
        self.set_state(bid, Some(&h));
        self.set_keys(bid, keys);
        self.pending.remove(&bid);
    }

    /// Hang block `b` (hash `h`) under `p`, which has no child of that hash.
    fn add_kid(&mut self, p: Bid, h: &BHash, b: Bid) {
        let x = &self.blocks[&p];
        if x.many_kids() {
            self.many_kids.get_mut(&p).expect("flagged").insert(h.clone(), b);
        } else if x.kid == NIL {
            self.blocks.get_mut(&p).expect("parent").kid = b;
        } else {
            let o = x.kid;
            let oh = self.hash_of(o);
            debug_assert!(oh != *h, "a parent's children have distinct hashes");
            let mut m = FxHashMap::default();
            m.insert(oh, o);
            m.insert(h.clone(), b);
            self.many_kids.insert(p, m);
            let x = self.blocks.get_mut(&p).expect("parent");
            x.kid = NIL;
            x.set_flag(MANY_KIDS, true);
        }
    }

    fn set_own(&mut self, bid: Bid) {
        let own = self.own_of(self.media_of(bid));
        let x = self.blocks.get_mut(&bid).expect("block");
        if own != x.own {
            x.own = own;
            self.refresh(bid);
        }
    }

    fn chain_of(&self, bid: Bid) -> u8 {
        let x = &self.blocks[&bid];
        if !x.keyed() || x.own == 0 {
            return 0;
        }
        match x.parent() {
            None => x.own,
            Some(p) => {
                let pc = self.blocks[&p].chain;
                if pc != 0 {
                    x.own.max(pc)
                } else {
                    0
                }
            }
        }
    }

    /// Recompute the chain tier of `bid` and, where it changed, of its descendants.
    fn refresh(&mut self, bid: Bid) {
        let mut stack = std::mem::take(&mut self.refresh_stack);
        stack.clear();
        stack.push(bid);
        while let Some(cid) = stack.pop() {
            let new = self.chain_of(cid);
            let old = self.blocks[&cid].chain;
            if new == old {
                continue;
            }
            // Most blocks carry at most one key, inline: no copy of a key list for them.
            let x = &self.blocks[&cid];
            let (one, many) = match x.nkeys() {
                0 => (None, None),
                1 => (Some([x.key]), None),
                _ => (None, Some(self.more_keys[&cid].clone())),
            };
            let keys: &[u64] = match (&one, &many) {
                (Some(k), _) => k,
                (None, Some(v)) => v,
                (None, None) => &[],
            };
            if old != 0 {
                self.count(keys, old, -1);
            }
            if new != 0 {
                self.count(keys, new, 1);
            }
            let x = self.blocks.get_mut(&cid).expect("block");
            x.chain = new;
            stack.extend(self.kids_of(cid));
        }
        self.refresh_stack = stack;
    }

    fn count(&mut self, keys: &[u64], tier: u8, delta: i64) {
        let i = (tier - 1) as usize;
        for &k in keys {
            // One probe of the counts for the old tier and the change (an absent key's [0, 0]
            // is tier 0, as its absence was).
            let c = self.counts.entry(k).or_insert([0, 0]);
            let cur = tier_of(c);
            c[i] += delta;
            let gone = c[0] == 0 && c[1] == 0;
            self.step_old.entry(k).or_insert(cur);
            if gone {
                self.counts.remove(&k);
            }
        }
    }

    fn adopt(&mut self, pid: Bid, cid: Bid) {
        let c_hash = self.hash_of(cid);
        if self.is_ancestor(cid, pid) || self.kid_of(pid, &c_hash).is_some() {
            self.stats.conflicts += 1;
            self.make_opaque(cid);
            return;
        }
        let group = u32::from(self.blocks[&cid].group);
        let w = self.waits.remove(&cid).expect("an orphan waits");
        self.unlink_orphan(group, &w, &c_hash);
        self.blocks.get_mut(&cid).expect("orphan").up = pid;
        self.add_kid(pid, &c_hash, cid);
        self.stats.adopted += 1;
        let (p_opaque, p_keyed) = {
            let p = &self.blocks[&pid];
            (p.opaque, p.keyed())
        };
        if p_opaque {
            self.make_opaque(cid);
        } else if p_keyed {
            self.key_subtree(cid);
        }
    }

    fn unlink_orphan(&mut self, group: u32, wait: &BHash, h: &BHash) {
        let slot = (group, wait.clone());
        if let Entry::Occupied(mut o) = self.orphans.entry(slot) {
            o.get_mut().retain(|(x, _)| x != h);
            if o.get().is_empty() {
                o.remove();
            }
        }
    }

    fn is_ancestor(&self, a: Bid, b: Bid) -> bool {
        let mut cur = Some(b);
        while let Some(c) = cur {
            if c == a {
                return true;
            }
            cur = self.blocks[&c].parent();
        }
        false
    }

    fn make_opaque(&mut self, bid: Bid) {
        let mut stack = vec![bid];
        while let Some(cid) = stack.pop() {
            let keyed = {
                let x = self.blocks.get_mut(&cid).expect("block");
                if x.opaque {
                    continue;
                }
                x.opaque = true;
                x.keyed()
            };
            self.pending.remove(&cid);
            if keyed {
                self.set_state(cid, None);
                self.refresh(cid);
                self.set_keys(cid, Vec::new());
            }
            self.stats.unindexed += 1;
            stack.extend(self.kids_of(cid));
        }
    }

    fn key_subtree(&mut self, bid: Bid) {
        let mut stack = vec![bid];
        while let Some(cid) = stack.pop() {
            let tokens = {
                let x = &self.blocks[&cid];
                match self.pending.get(&cid) {
                    Some(t) if !x.opaque && !x.keyed() => t.clone(),
                    _ => continue,
                }
            };
            self.key(cid, &tokens);
            self.refresh(cid);
            stack.extend(self.kids_of(cid));
        }
    }

    // ---- removals ------------------------------------------------------------------------------

    fn holding(&self, r: &Removal) -> Vec<Bid> {
        let (group, medium, h) = r;
        let mut cands = self.carrying(*group, h);
        cands.retain(|&b| self.has_medium(b, *medium));
        cands
    }

    fn is_leaf(&self, bid: Bid, medium: u16) -> bool {
        !self.kids_of(bid).any(|k| self.has_medium(k, medium))
    }

    fn removable(&self, cands: &[Bid], r: &Removal, todo: &Todo) -> Vec<Bid> {
        let (group, medium, _) = r;
        let mut out = Vec::new();
        'cand: for &c in cands {
            let mut need: FxHashMap<BHash, u64> = FxHashMap::default();
            let mut stack = vec![c];
            while let Some(b) = stack.pop() {
                let h = self.hash_of(b);
                let n = need.entry(h.clone()).or_insert(0);
                *n += 1;
                if *n > todo.get(&(*group, *medium, h)) {
                    continue 'cand;
                }
                stack.extend(self.kids_of(b).filter(|&k| self.has_medium(k, *medium)));
            }
            out.push(c);
        }
        out
    }

    fn remove(&mut self, bid: Bid, medium: u16) {
        self.drop_medium(bid, medium);
        self.stats.blocks_removed += 1;
        self.set_own(bid);
        self.collect(bid);
    }

    /// Drop `bid` and then its ancestors while they hold nothing and have no children.
    fn collect(&mut self, bid: Bid) {
        let mut cur = Some(bid);
        while let Some(c) = cur {
            if self.blocks.get(&c).is_none() || self.held_anywhere(c) || self.has_kids(c) {
                return;
            }
            self.unlink_same(c);
            let h = self.hash_of(c);
            let x = self.blocks.remove(&c).expect("checked");
            if x.bytes_hash() {
                self.byte_hashes.remove(&c);
            }
            let slot = (u32::from(x.group), h);
            self.pending.remove(&c);
            self.salted.remove(&c);
            if x.nkeys() > 1 {
                self.more_keys.remove(&c);
            }
            if x.long_tail() {
                self.long_tails.remove(&c);
            }
            if x.more_media() {
                self.more_media.remove(&c);
            }
            if let Some(p) = x.parent() {
                self.drop_kid(p, &slot.1, c);
            } else if let Some(w) = self.waits.remove(&c) {
                self.unlink_orphan(u32::from(x.group), &w, &slot.1);
            } else {
                self.roots.remove(&slot);
            }
            cur = x.parent();
        }
    }

    /// A run of removals (consecutive BlockRemoved events; they commute): see the module notes.
    pub fn removed(&mut self, run: Vec<Removal>) {
        let mut todo = Todo::with_capacity(run.len());
        for r in run {
            todo.add(r);
        }
        // Each removal starts at its hash's fingerprint slot: asked for a few removals ahead,
        // as a store's are (see `stored`).
        let ahead = |f: &Self, todo: &Todo, idx: usize| {
            if let Some(Some(((group, _, h), _))) = todo.items.get(idx) {
                f.by_fp.prefetch(fp_key(fingerprint(*group, h)));
            }
        };
        for idx in 0..FP_AHEAD {
            ahead(self, &todo, idx);
        }
        while !todo.is_empty() {
            let mut progress = false;
            for idx in 0..todo.items.len() {
                ahead(self, &todo, idx + FP_AHEAD);
                let Some((r, n)) = todo.items[idx].clone() else { continue };
                let mut n = n;
                let medium = r.1;
                let mut cands = self.holding(&r);
                if cands.len() as u64 > n {
                    cands = self.removable(&cands, &r, &todo);
                    if cands.is_empty() || cands.len() as u64 > n {
                        continue;
                    }
                } else if (cands.len() as u64) < n {
                    self.stats.unknown_removals += n - cands.len() as u64;
                    n = cands.len() as u64;
                }
                for &c in &cands {
                    self.remove(c, medium);
                }
                if cands.len() as u64 == n {
                    todo.delete(idx);
                } else {
                    todo.set(idx, n - cands.len() as u64);
                }
                progress = true;
            }
            if !progress {
                let idx = todo.first().expect("not empty");
                let r = todo.items[idx].clone().expect("live").0;
                let holding = self.holding(&r);
                let mut cands = self.removable(&holding, &r, &todo);
                if cands.is_empty() {
                    cands = holding;
                }
                let leaves: Vec<Bid> = cands.iter().copied().filter(|&c| self.is_leaf(c, r.1)).collect();
                if !leaves.is_empty() {
                    cands = leaves;
                }
                self.stats.ambiguous_removals += 1;
                let victim = cands.iter().copied().min_by_key(|c| self.blocks[c].touched()).expect("a candidate");
                self.remove(victim, r.1);
                let left = todo.items[idx].as_ref().expect("live").1;
                if left == 1 {
                    todo.delete(idx);
                } else {
                    todo.set(idx, left - 1);
                }
            }
        }
    }

    // ---- inspection ----------------------------------------------------------------------------

    /// SHA-256 of the forest's state: blocks named by their place (group, then the chain of
    /// hashes from the prompt start or from an orphan's missing parent), never by internal ids,
    /// and the store clock by rank, so equal histories of the engine's cache digest equally.
    pub fn digest(&self) -> [u8; 32] {
        let mut names: FxHashMap<Bid, [u8; 32]> = FxHashMap::default();
        let name = |bid: Bid, names: &mut FxHashMap<Bid, [u8; 32]>| -> [u8; 32] {
            let mut path = Vec::new();
            let mut cur = Some(bid);
            while let Some(c) = cur {
                if names.contains_key(&c) {
                    break;
                }
                path.push(c);
                cur = self.blocks[&c].parent();
            }
            for &b in path.iter().rev() {
                let x = &self.blocks[&b];
                let mut up = Vec::new();
                match x.parent() {
                    Some(p) => up.extend_from_slice(&names[&p]),
                    None => {
                        up.extend_from_slice(b"root");
                        up.extend_from_slice(&u32::from(x.group).to_le_bytes());
                        match self.waits.get(&b) {
                            None => up.push(0),
                            Some(w) => {
                                up.push(1);
                                w.put(&mut up);
                            }
                        }
                    }
                }
                self.hash_of(b).put(&mut up);
                names.insert(b, Sha256::digest(&up).into());
            }
            names[&bid]
        };
        let mut order: Vec<(u64, Bid)> = self.blocks.iter().map(|(b, x)| (x.touched(), b)).collect();
        order.sort_unstable();
        let rank: FxHashMap<Bid, usize> = order.iter().enumerate().map(|(i, &(_, b))| (b, i)).collect();
        let mut rows: Vec<Vec<u8>> = Vec::with_capacity(self.blocks.len());
        for (bid, x) in self.blocks.iter() {
            let mut row = Vec::new();
            row.extend_from_slice(&name(bid, &mut names));
            match x.parent() {
                Some(p) => {
                    row.push(1);
                    row.extend_from_slice(&name(p, &mut names));
                }
                None => row.push(0),
            }
            match self.waits.get(&bid) {
                Some(w) => {
                    row.push(1);
                    w.put(&mut row);
                }
                None => row.push(0),
            }
            row.extend_from_slice(&u32::from(x.size).to_le_bytes());
            // The first token's position (-1: never keyed).
            let start = if x.keyed() { ((u64::from(x.total) - ROOT_BYTES) / 4) as i64 - i64::from(x.size) } else { -1 };
            row.extend_from_slice(&start.to_le_bytes());
            match self.state(bid) {
                Some(s) => {
                    row.push(1);
                    row.extend_from_slice(&s.finalize());
                }
                None => row.push(0),
            }
            match self.pending.get(&bid) {
                Some(t) => {
                    row.push(1);
                    row.extend_from_slice(&(t.len() as u32).to_le_bytes());
                    row.extend_from_slice(t);
                }
                None => row.push(0),
            }
            let keys = self.keys_of(bid);
            row.extend_from_slice(&(keys.len() as u32).to_le_bytes());
            for k in keys {
                row.extend_from_slice(&k.to_le_bytes());
            }
            let mut media: Vec<&str> = self.media_of(bid).map(|m| self.media[m as usize].0.as_str()).collect();
            media.sort_unstable();
            row.extend_from_slice(&(media.len() as u32).to_le_bytes());
            for m in media {
                row.extend_from_slice(&(m.len() as u32).to_le_bytes());
                row.extend_from_slice(m.as_bytes());
            }
            row.extend_from_slice(&[x.own, x.chain, x.opaque as u8]);
            row.extend_from_slice(&(rank[&bid] as u64).to_le_bytes());
            rows.push(row);
        }
        rows.sort_unstable();
        let mut h = Sha256::new();
        h.update((rows.len() as u64).to_le_bytes());
        for r in &rows {
            h.update((r.len() as u32).to_le_bytes());
            h.update(r);
        }
        let mut counts: Vec<(u64, [i64; 2])> = self.counts.iter().map(|(&k, &c)| (k, c)).collect();
        counts.sort_unstable();
        for (k, c) in counts {
            h.update(k.to_le_bytes());
            h.update(c[0].to_le_bytes());
            h.update(c[1].to_le_bytes());
        }
        h.finalize().into()
    }
}

/// The pending removals of a run, in first-named order, with how often each is named.
#[derive(Default)]
struct Todo {
    items: Vec<Option<(Removal, u64)>>,
    index: FxHashMap<Removal, usize>,
    live: usize,
}

impl Todo {
    /// Sized for a run of `n` removals (a demotion's run is tens of blocks: no regrowth).
    fn with_capacity(n: usize) -> Self {
        let mut index = FxHashMap::default();
        index.reserve(n);
        Todo { items: Vec::with_capacity(n), index, live: 0 }
    }
    fn add(&mut self, r: Removal) {
        match self.index.get(&r) {
            Some(&i) => self.items[i].as_mut().expect("live").1 += 1,
            None => {
                self.index.insert(r.clone(), self.items.len());
                self.items.push(Some((r, 1)));
                self.live += 1;
            }
        }
    }
    fn get(&self, r: &Removal) -> u64 {
        self.index.get(r).and_then(|&i| self.items[i].as_ref()).map_or(0, |x| x.1)
    }
    fn set(&mut self, i: usize, n: u64) {
        self.items[i].as_mut().expect("live").1 = n;
    }
    fn delete(&mut self, i: usize) {
        if let Some((r, _)) = self.items[i].take() {
            self.index.remove(&r);
            self.live -= 1;
        }
    }
    fn first(&self) -> Option<usize> {
        self.items.iter().position(|x| x.is_some())
    }
    fn is_empty(&self) -> bool {
        self.live == 0
    }
}



#[cfg(test)]
mod tests {
    use super::*;

    /// A fleet-sized forest holds millions of blocks: keep one at two cache lines (it was 248
    /// with an opaque `Sha256` state, plus a second copy of its hash in the hash index, then
    /// 144).
    #[test]
    fn a_block_stays_small() {
        assert_eq!(std::mem::size_of::<Option<Block>>(), 112);
    }

    #[test]
    fn packed_fields_keep_their_neighbours() {
        let mut x = Block { hash: 1, key: 2, touched_media: 0, up: NIL, kid: NIL, same: NIL, total: 0, group: 0, size: 16, own: 0, chain: 0, flags: 0, opaque: false, cv: [0; 8], tail: [0; 32] };
        x.set_touched((1 << 48) - 1);
        x.set_media(0xABCD);
        assert_eq!((x.touched(), x.media()), ((1 << 48) - 1, 0xABCD));
        x.set_media(1);
        x.set_touched(7);
        assert_eq!((x.touched(), x.media()), (7, 1));
        for f in [KEYED, LONG_TAIL, MANY_KIDS, MORE_MEDIA, BYTES_HASH] {
            x.set_flag(f, true);
        }
        x.set_nkeys(2);
        assert!(x.keyed() && x.long_tail() && x.many_kids() && x.more_media() && x.bytes_hash());
        assert_eq!(x.nkeys(), 2);
        x.set_flag(MANY_KIDS, false);
        x.set_nkeys(1);
        assert!(x.keyed() && !x.many_kids() && x.bytes_hash());
        assert_eq!(x.nkeys(), 1);
    }
}
