//! A byte-level BPE encoder exact to HF `tokenizers`' ByteLevel + BPE pipeline (GPT-2's
//! pre-tokenizer regex, merges by rank) for the tokenizer files it accepts, on text made of the
//! characters whose regex class it knows ([`class_of`]: ASCII and the Latin and punctuation
//! blocks English text carries).
//!
//! Why: on this project's hosts HF `tokenizers` spends 0.3-0.6 µs a character in its
//! pre-tokenizer regex (`\p{L}`, `\p{N}` and a look-ahead through Oniguruma): 0.25-0.45 ms for a
//! 150-token prompt, a third or more of the front door's CPU per request. A hand scanner of the
//! same regex over a class table, then the same merge loop as HF's `Word::merge_all`, gives the
//! same ids two orders of magnitude faster. Text with any other character is left to HF (the
//! caller falls back), so a Unicode-version difference between regex engines can never change
//! an id. `tests/test_svc_tokenizer_fast.py` compares the two on every supported character in
//! every position class and on seeded random texts.
//!
//! The regex (HF `pre_tokenizers::byte_level`, GPT-2's):
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
//! leftmost-first: at each position the first alternative that matches wins, each greedy.

use std::collections::BinaryHeap;
use std::sync::Mutex;

use rustc_hash::FxHashMap;

/// Words kept in the cache before it starts over (HF keeps 10,000).
const CACHE_WORDS: usize = 65_536;
/// Words longer than this are not cached (HF's limit too: long runs are rare and one-off).
const CACHE_MAX_LEN: usize = 256;

/// The classes the GPT-2 regex tells apart (`\p{L}`, `\p{N}`, `\s`, everything else).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Digit,
    Space,
    Other,
}

/// The class of `c`, for the characters whose class no Unicode version has changed and that
/// the tests compare against HF one by one: ASCII, Latin-1 Supplement, Latin Extended-A and
/// General Punctuation (curly quotes, dashes, ellipsis, the typographic spaces: what English
/// text pasted from an editor holds besides ASCII). None for anything else, which HF encodes.
fn class_of(c: char) -> Option<Class> {
    use Class::*;
    let u = c as u32;
    Some(match u {
        0x30..=0x39 => Digit,
        0x41..=0x5A | 0x61..=0x7A => Letter,
        0x09..=0x0D | 0x20 => Space,
        0x00..=0x7F => Other,
        0x85 | 0xA0 => Space,
        0xAA | 0xB5 | 0xBA | 0xC0..=0xD6 | 0xD8..=0xF6 | 0xF8..=0x17F => Letter,
        0xB2 | 0xB3 | 0xB9 | 0xBC..=0xBE => Digit,
        0x80..=0xFF => Other,
        0x2000..=0x200A | 0x2028 | 0x2029 | 0x202F | 0x205F => Space,
        // U+2065 is unassigned: a later version may give it a class.
        0x2065 => return None,
        0x200B..=0x206F => Other,
        _ => return None,
    })
}

/// One character of a text: itself, its class and where its bytes start.
#[derive(Clone, Copy)]
struct Ch {
    c: char,
    k: Class,
    at: usize,
}

/// The characters of `text` with their classes, or None when one is outside [`class_of`].
fn classify(text: &str) -> Option<Vec<Ch>> {
    let mut out = Vec::with_capacity(text.len());
    if text.is_ascii() {
        // Most prompts: no UTF-8 decoding, one table per byte.
        for (at, &b) in text.as_bytes().iter().enumerate() {
            let c = b as char;
            out.push(Ch { c, k: class_of(c)?, at });
        }
        return Some(out);
    }
    for (at, c) in text.char_indices() {
        out.push(Ch { c, k: class_of(c)?, at });
    }
    Some(out)
}

/// The end of the run of characters from `i` of class `k`.
#[inline]
fn run(t: &[Ch], mut i: usize, k: Class) -> usize {
    while i < t.len() && t[i].k == k {
        i += 1;
    }
    i
}

/// The end (a character index) of the regex's match starting at character `i < t.len()`.
fn piece_end(t: &[Ch], i: usize) -> usize {
    let n = t.len();
    let c = t[i].c;
    if c == '\'' && i + 1 < n {
        // 's 't 're 've 'm 'll 'd, in the regex's order (case-sensitive, no word boundary).
        for s in ["s", "t", "re", "ve", "m", "ll", "d"] {
            let m = s.len();
            if i + 1 + m <= n && s.chars().zip(&t[i + 1..i + 1 + m]).all(|(a, b)| a == b.c) {
                return i + 1 + m;
            }
        }
    }
    // ` ?X+` for X = letters, digits, others: the optional space is U+0020 only.
    let j = if c == ' ' && i + 1 < n { i + 1 } else { i };
    let k = t[j].k;
    if (j > i || c != ' ') && k != Class::Space {
        return run(t, j, k);
    }
    // Whitespace: `\s+(?!\S)` backs off one character when the run is followed by a non-space,
    // unless that leaves it empty; then `\s+` takes the one character.
    let end = run(t, i, Class::Space);
    debug_assert!(end > i, "a character that starts no other alternative is a space");
    if end < n && end - i >= 2 {
        end - 1
    } else {
        end
    }
}

/// Byte ranges of the pre-tokenizer's pieces of classified text `t` (of `len` bytes).
fn piece_ranges(t: &[Ch], len: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        if i >= t.len() {
            return None;
        }
        let e = piece_end(t, i);
        let range = (t[i].at, t.get(e).map_or(len, |x| x.at));
        i = e;
        Some(range)
    })
}

/// Byte ranges of the pre-tokenizer's pieces of `text`, or None when it holds a character
/// outside [`class_of`].
pub fn pieces(text: &str) -> Option<Vec<(usize, usize)>> {
    let t = classify(text)?;
    Some(piece_ranges(&t, text.len()).collect())
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

/// A piece's bytes -> its ids.
type WordCache = FxHashMap<Box<[u8]>, Box<[u32]>>;

/// The merge table and the byte alphabet of a byte-level BPE.
pub struct ByteLevelBpe {
    byte_id: [u32; 256],
    /// (left id, right id) -> (rank, merged id).
    merges: FxHashMap<u64, (u32, u32)>,
    cache: Mutex<WordCache>,
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

    /// Ids of `text`, or None when it holds a character outside [`class_of`] (HF must encode it).
    pub fn encode(&self, text: &str) -> Option<Vec<u32>> {
        let t = classify(text)?;
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut cache = self.cache.try_lock().ok();
        for (a, b) in piece_ranges(&t, bytes.len()) {
            let word = &bytes[a..b];
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
        pieces(s).expect("supported characters").into_iter().map(|(a, b)| &s[a..b]).collect()
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
        assert_eq!(split("café — “naïve”"), ["café", " —", " “", "naïve", "”"]);
        assert_eq!(split("a\u{2003}\u{2003}b"), ["a", "\u{2003}", "\u{2003}", "b"]);
        assert_eq!(pieces("日本"), None);
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
        assert_eq!(bpe.encode("aaa").unwrap(), vec![301]);
        let bpe2 = ByteLevelBpe::new(byte_id, &[(97, 97, 300), (300, 97, 301), (300, 300, 302)]);
        assert_eq!(bpe2.encode("aaaa").unwrap(), vec![302]);
        assert_eq!(bpe.encode("é").unwrap(), vec![0xC3, 0xA9]); // two bytes, no merges
        assert_eq!(bpe.encode("日"), None);
    }
}
