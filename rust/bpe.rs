//! A byte-level BPE encoder for ASCII text, exact to HF `tokenizers`' ByteLevel + BPE pipeline
//! (GPT-2's pre-tokenizer regex, merges by rank), for the tokenizer files it accepts.
//!
//! Why: on this project's hosts HF `tokenizers` spends 0.3-0.6 µs a character in its
//! pre-tokenizer regex (`\p{L}`, `\p{N}` and a look-ahead through Oniguruma): 0.25-0.45 ms for a
//! 150-token prompt, a third or more of the front door's CPU per request. ASCII text needs no
//! Unicode tables: a hand scanner of the same regex, then the same merge loop as HF's
//! `Word::merge_all`, gives the same ids two orders of magnitude faster. Text with any non-ASCII
//! byte is left to HF (the caller falls back), so Unicode-version differences between regex
//! engines can never change an id. `tests/test_tokenizer_fast.py` compares the two on every
//! ASCII character in every position class and on seeded random texts.
//!
//! The regex (HF `pre_tokenizers::byte_level`, GPT-2's):
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
//! leftmost-first: at each position the first alternative that matches wins, each greedy.
//! For ASCII, `\p{L}` is `[A-Za-z]`, `\p{N}` is `[0-9]` and `\s` is `[\t\n\x0B\x0C\r ]`.

use std::collections::BinaryHeap;
use std::sync::Mutex;

use rustc_hash::FxHashMap;

/// Words kept in the cache before it starts over (HF keeps 10,000).
const CACHE_WORDS: usize = 65_536;
/// Words longer than this are not cached (HF's limit too: long runs are rare and one-off).
const CACHE_MAX_LEN: usize = 256;

#[inline]
fn is_letter(b: u8) -> bool {
    b.is_ascii_alphabetic()
}

#[inline]
fn is_digit(b: u8) -> bool {
    b.is_ascii_digit()
}

#[inline]
fn is_space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0B | 0x0C | b'\r' | b' ')
}

#[inline]
fn is_other(b: u8) -> bool {
    !(is_letter(b) || is_digit(b) || is_space(b))
}

/// The end of the run of bytes from `i` that satisfy `f`.
#[inline]
fn run(t: &[u8], mut i: usize, f: impl Fn(u8) -> bool) -> usize {
    while i < t.len() && f(t[i]) {
        i += 1;
    }
    i
}

/// The end of the regex's match starting at `i` (ASCII `t`, `i < t.len()`).
fn piece_end(t: &[u8], i: usize) -> usize {
    let n = t.len();
    let c = t[i];
    if c == b'\'' && i + 1 < n {
        // 's 't 're 've 'm 'll 'd, in the regex's order (case-sensitive, no word boundary).
        let rest = &t[i + 1..];
        for s in [&b"s"[..], b"t", b"re", b"ve", b"m", b"ll", b"d"] {
            if rest.starts_with(s) {
                return i + 1 + s.len();
            }
        }
    }
    // ` ?X+` for X = letters, digits, others: the optional space is U+0020 only.
    let j = if c == b' ' && i + 1 < n { i + 1 } else { i };
    let d = t[j];
    if j > i || c != b' ' {
        if is_letter(d) {
            return run(t, j, is_letter);
        }
        if is_digit(d) {
            return run(t, j, is_digit);
        }
        if is_other(d) {
            return run(t, j, is_other);
        }
    }
    // Whitespace: `\s+(?!\S)` backs off one character when the run is followed by a non-space,
    // unless that leaves it empty; then `\s+` takes the one character.
    let end = run(t, i, is_space);
    debug_assert!(end > i, "every ASCII byte is a letter, digit, space or other");
    if end < n && end - i >= 2 {
        end - 1
    } else {
        end
    }
}

/// Byte ranges of the pre-tokenizer's pieces of ASCII `t`.
pub fn pieces(t: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let e = piece_end(t, i);
        out.push((i, e));
        i = e;
    }
    out
}

/// One pending merge: HF's order is the lowest rank first, then the leftmost position.
#[derive(PartialEq, Eq)]
struct Merge {
    pos: usize,
    rank: u32,
    new_id: u32,
}

impl Ord for Merge {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.rank.cmp(&self.rank).then_with(|| other.pos.cmp(&self.pos))
    }
}

impl PartialOrd for Merge {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    c: u32,
    prev: isize,
    next: isize,
    gone: bool,
}

/// The merge table and the byte alphabet of a byte-level BPE.
pub struct ByteLevelBpe {
    byte_id: [u32; 256],
    /// (left id, right id) -> (rank, merged id).
    merges: FxHashMap<u64, (u32, u32)>,
    cache: Mutex<FxHashMap<Box<[u8]>, Box<[u32]>>>,
}

#[inline]
fn pair(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

impl ByteLevelBpe {
    /// `byte_id[b]`: the id of byte `b`'s token; `merges[r] = (left, right, merged)` at rank `r`.
    /// The caller reads the merges from HF's own serialization of a loaded tokenizer, which
    /// lists each pair once at the rank HF applies; should a pair repeat anyway, its first rank
    /// is kept.
    pub fn new(byte_id: [u32; 256], merges: &[(u32, u32, u32)]) -> Self {
        let mut m = FxHashMap::default();
        m.reserve(merges.len());
        for (r, &(a, b, id)) in merges.iter().enumerate() {
            m.entry(pair(a, b)).or_insert((r as u32, id));
        }
        ByteLevelBpe { byte_id, merges: m, cache: Mutex::new(FxHashMap::default()) }
    }

    /// Ids of ASCII `text`, or None when it holds a non-ASCII byte (HF must encode it).
    pub fn encode(&self, text: &[u8]) -> Option<Vec<u32>> {
        if !text.is_ascii() {
            return None;
        }
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut cache = self.cache.try_lock().ok();
        let mut i = 0;
        while i < text.len() {
            let e = piece_end(text, i);
            let word = &text[i..e];
            i = e;
            if let Some(c) = cache.as_deref() {
                if let Some(ids) = c.get(word) {
                    out.extend_from_slice(ids);
                    continue;
                }
            }
            let start = out.len();
            self.merge_word(word, &mut out);
            if let Some(c) = cache.as_deref_mut() {
                if word.len() <= CACHE_MAX_LEN {
                    if c.len() >= CACHE_WORDS {
                        c.clear();
                    }
                    c.insert(word.into(), out[start..].into());
                }
            }
        }
        Some(out)
    }

    /// HF's `Word::merge_all` on one piece's bytes, appending the final ids to `out`.
    fn merge_word(&self, word: &[u8], out: &mut Vec<u32>) {
        let n = word.len();
        let mut sym: Vec<Symbol> = word
            .iter()
            .enumerate()
            .map(|(k, &b)| Symbol { c: self.byte_id[b as usize], prev: k as isize - 1, next: if k + 1 < n { k as isize + 1 } else { -1 }, gone: false })
            .collect();
        let mut queue: BinaryHeap<Merge> = sym
            .windows(2)
            .enumerate()
            .filter_map(|(pos, w)| self.merges.get(&pair(w[0].c, w[1].c)).map(|&(rank, new_id)| Merge { pos, rank, new_id }))
            .collect();
        while let Some(top) = queue.pop() {
            let s = sym[top.pos];
            if s.gone || s.next < 0 {
                continue;
            }
            let next_pos = s.next as usize;
            let right = sym[next_pos];
            // An entry whose pair has changed since it was queued is stale.
            match self.merges.get(&pair(s.c, right.c)) {
                Some(&(_, id)) if id == top.new_id => {}
                _ => continue,
            }
            sym[top.pos].c = top.new_id;
            sym[top.pos].next = right.next;
            sym[next_pos].gone = true;
            if right.next >= 0 {
                sym[right.next as usize].prev = top.pos as isize;
            }
            let cur = sym[top.pos];
            if cur.prev >= 0 {
                let p = cur.prev as usize;
                if let Some(&(rank, new_id)) = self.merges.get(&pair(sym[p].c, cur.c)) {
                    queue.push(Merge { pos: p, rank, new_id });
                }
            }
            if cur.next >= 0 {
                if let Some(&(rank, new_id)) = self.merges.get(&pair(cur.c, sym[cur.next as usize].c)) {
                    queue.push(Merge { pos: top.pos, rank, new_id });
                }
            }
        }
        out.extend(sym.iter().filter(|s| !s.gone).map(|s| s.c));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(s: &str) -> Vec<&str> {
        pieces(s.as_bytes()).into_iter().map(|(a, b)| &s[a..b]).collect()
    }

    #[test]
    fn gpt2_pieces() {
        assert_eq!(split("Hello world's end"), ["Hello", " world", "'s", " end"]);
        assert_eq!(split("a  b"), ["a", " ", " b"]);
        assert_eq!(split("a\n\n x"), ["a", "\n\n", " x"]);
        assert_eq!(split("a\nb"), ["a", "\n", "b"]);
        assert_eq!(split("x   "), ["x", "   "]);
        assert_eq!(split("?'s it"), ["?'", "s", " it"]);
        assert_eq!(split("abc123 45!!"), ["abc", "123", " 45", "!!"]);
        assert_eq!(split(" 'll"), [" '", "ll"]);
        assert_eq!(split("don't"), ["don", "'t"]);
        assert_eq!(split(" "), [" "]);
        assert_eq!(split(""), Vec::<&str>::new());
    }

    #[test]
    fn merges_lowest_rank_first_then_leftmost() {
        let mut byte_id = [0u32; 256];
        for (b, id) in byte_id.iter_mut().enumerate() {
            *id = b as u32;
        }
        // a=97. Rank 0: (a, a) -> 300; rank 1: (300, a) -> 301.
        let bpe = ByteLevelBpe::new(byte_id, &[(97, 97, 300), (300, 97, 301)]);
        // Leftmost (a, a) first; the other (a, a) is then stale and (300, a) merges.
        assert_eq!(bpe.encode(b"aaa").unwrap(), vec![301]);
        let bpe2 = ByteLevelBpe::new(byte_id, &[(97, 97, 300), (300, 97, 301), (300, 300, 302)]);
        assert_eq!(bpe2.encode(b"aaaa").unwrap(), vec![302]);
        assert_eq!(bpe.encode("é".as_bytes()), None);
    }
}
