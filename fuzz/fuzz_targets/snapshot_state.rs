//! Snapshot state bytes from the wire: `LudoView::from_state` must never panic or over-allocate,
//! and whatever it accepts must re-encode to the same bytes and answer lookups safely.
//!
//! Input: `[mode][rest...]`. `mode & 1 == 0` feeds `rest` as-is. `mode & 1 == 1` "fits" it: a
//! correct magic/version/flag and a small geometry built from the first bytes, then the array
//! section taken from the remaining bytes and zero-padded or cut to exactly the length that
//! geometry needs, so the fuzzer spends its time in the per-bucket validation instead of
//! failing the length check.
#![no_main]

use kvcompass::ludo::LudoView;
use libfuzzer_sys::fuzz_target;

/// Mirrors the state layout in `rust/ludo/view.rs` (magic "KVCS", version 1, flag 1, then
/// value_bits, fp_bits, seed, n_buckets, ma, mb, fallback count, arrays, fallback entries).
fn fitted(rest: &[u8]) -> Vec<u8> {
    let mut hdr = [0u8; 12];
    let n = rest.len().min(12);
    hdr[..n].copy_from_slice(&rest[..n]);
    let arrays = rest.get(12..).unwrap_or(&[]);
    let value_bits: u8 = match hdr[0] % 4 {
        0 | 1 => 32,
        2 => 64,
        _ => hdr[0], // sometimes invalid on purpose
    };
    let fp_bits = hdr[1] % 18; // 16 is the maximum; 17 is invalid on purpose
    let seed = u32::from_le_bytes([hdr[2], hdr[3], hdr[4], hdr[5]]) as u64;
    let nb = 2 + (hdr[6] % 40) as u32;
    let ma = 1 + u16::from_le_bytes([hdr[7], hdr[8]]) as u32 % 256;
    let mb = 1 + (hdr[9] as u32) % 200;
    let nf = (hdr[10] % 6) as usize;
    let zero_pad = hdr[11] & 1 == 0;

    let record_bits = 8 + 4 * (fp_bits as usize + value_bits as usize);
    let words = (nb as usize * record_bits).div_ceil(64) + 1;
    let need = (words + (ma as usize).div_ceil(64) + (mb as usize).div_ceil(64)) * 8 + nf * 16;

    let mut s = Vec::with_capacity(34 + need);
    s.extend_from_slice(b"KVCS");
    s.push(1);
    s.push(1);
    s.push(value_bits);
    s.push(fp_bits);
    s.extend_from_slice(&seed.to_le_bytes());
    s.extend_from_slice(&nb.to_le_bytes());
    s.extend_from_slice(&ma.to_le_bytes());
    s.extend_from_slice(&mb.to_le_bytes());
    s.extend_from_slice(&(nf as u32).to_le_bytes());
    if zero_pad {
        // Random bytes at the front, zeros after: the fuzzer controls the first buckets.
        let k = arrays.len().min(need);
        s.extend_from_slice(&arrays[..k]);
        s.resize(s.len() + need - k, 0);
    } else {
        // Repeat the input to fill the whole section.
        for i in 0..need {
            s.push(if arrays.is_empty() { 0 } else { arrays[i % arrays.len()] });
        }
    }
    s
}

fuzz_target!(|data: &[u8]| {
    let owned;
    let state: &[u8] = match data {
        [mode, rest @ ..] if mode & 1 == 1 => {
            owned = fitted(rest);
            &owned
        }
        [_, rest @ ..] => rest,
        [] => data,
    };
    let Ok(v) = LudoView::from_state(0, 0, state) else { return };
    assert_eq!(v.state_bytes(), state, "accepted state bytes are not canonical");
    assert!(v.is_initialised());
    let keys: Vec<u64> = (0..64u64).map(|k| kvcompass::ludo::hash::mix64(k) >> 1).collect();
    let mut out = vec![0u64; keys.len()];
    v.lookup_batch(&keys, &mut out);
    for (&k, &o) in keys.iter().zip(&out) {
        assert_eq!(v.lookup(k), o, "batch and single lookup disagree");
        let _ = v.probe(k);
    }
    for &(k, val) in v.fallback_entries() {
        assert_eq!(v.lookup(k), val);
    }
    let _ = v.count_entries();
});
