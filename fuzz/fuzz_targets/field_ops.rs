//! Key ops on the writer side: `LudoTable::apply_field_ops` over arbitrary (key, field, tier)
//! batches must never panic, must refuse a batch with any invalid op before changing anything,
//! must agree with a plain map model, and every batch it emits must keep a follower view
//! byte-identical to the writer's own view.
//!
//! This is the Rust half of the agents' key-op path. The wire decoding of a `KeyOps` message
//! (protobuf bytes -> u64/u8 arrays) is Python (`maintenance_service.decode_key_ops`) and is
//! covered by the hypothesis tests in `tests/test_bad_input_props.py`; what reaches the core is
//! exactly this call.
//!
//! Input: `[cfg][batches...]`, each batch `[n][n x (key, field, tier)]`.
//! - `cfg & 1`: 8-bit fingerprints; `cfg & 2`: 64-bit values (32 worker fields, else 16);
//!   `cfg & 4`: a small hard maximum (48 keys), so growth hits `Capacity` mid-batch.
//! - key byte `< 0xf8` picks one of 248 valid 63-bit keys (a small pool, so ops collide on
//!   keys and fill buckets); `>= 0xf8` is a key with the reserved top bit (invalid).
//! - field byte modulo (fields + 2): sometimes one past the group (invalid).
//! - tier byte modulo 4: 3 is reserved (invalid).
#![no_main]

use std::collections::HashMap;

use kvcompass::ludo::hash::mix64;
use kvcompass::ludo::maintenance::{LudoTable, TableConfig};
use kvcompass::ludo::LudoView;
use kvcompass::CoreError;
use libfuzzer_sys::fuzz_target;

fn key_of(b: u8) -> u64 {
    let k = mix64(b as u64 + 1);
    if b < 0xf8 {
        k >> 1
    } else {
        k | (1 << 63)
    }
}

fn sorted_entries(t: &LudoTable) -> Vec<(u64, u64)> {
    let mut e = t.entries();
    e.sort_unstable();
    e
}

fuzz_target!(|data: &[u8]| {
    let Some((&cfg, mut rest)) = data.split_first() else { return };
    let fp_bits = if cfg & 1 != 0 { 8 } else { 0 };
    let value_bits = if cfg & 2 != 0 { 64 } else { 32 };
    let max_capacity = if cfg & 4 != 0 { 48 } else { 1 << 20 };
    let fields = value_bits as u32 / 2;
    let tc = TableConfig { capacity: 16, value_bits, fp_bits, seed: 7, max_capacity, fallback_limit: 8, ..TableConfig::default() };
    let mut t = LudoTable::new(tc).expect("a valid config");
    let mut view = LudoView::new(0, 0);
    view.apply_batch(&t.export_snapshot().expect("nothing pending")).expect("own snapshot");
    let mut model: HashMap<u64, u64> = HashMap::new();

    while let Some((&n, tail)) = rest.split_first() {
        let n = (n as usize % 48).min(tail.len() / 3);
        let (ops, next) = tail.split_at(3 * n);
        rest = next;
        let keys: Vec<u64> = ops.chunks_exact(3).map(|o| key_of(o[0])).collect();
        let flds: Vec<u32> = ops.chunks_exact(3).map(|o| o[1] as u32 % (fields + 2)).collect();
        let tiers: Vec<u8> = ops.chunks_exact(3).map(|o| o[2] % 4).collect();
        let invalid = (0..n).any(|i| keys[i] >> 63 != 0 || flds[i] >= fields || tiers[i] > 2);

        let before = (t.view().state_bytes(), t.pending_ops(), t.len(), sorted_entries(&t));
        match t.apply_field_ops(&keys, &flds, &tiers) {
            Ok(applied) => {
                assert!(!invalid, "a batch with an invalid op was accepted");
                assert_eq!(applied, n);
                for i in 0..n {
                    let shift = 2 * flds[i];
                    let cur = model.get(&keys[i]).copied().unwrap_or(0);
                    let new = (cur & !(3u64 << shift)) | ((tiers[i] as u64) << shift);
                    if new == 0 {
                        model.remove(&keys[i]);
                    } else {
                        model.insert(keys[i], new);
                    }
                }
            }
            Err(CoreError::Capacity { needed, max }) => {
                // Documented: growth is not validated up front, so the ops before the failing
                // one stay applied (the maintenance unit refuses such batches before calling
                // this). The table must still be consistent; the model follows the table.
                assert!(!invalid, "validation must come before any growth");
                assert!(needed > max && max == max_capacity);
                t.verify().expect("table consistent after a capacity failure");
                model = t.entries().into_iter().collect();
            }
            Err(e) => {
                assert!(invalid, "a valid batch was refused: {e}");
                assert!(
                    matches!(e, CoreError::InvalidKey(_) | CoreError::InvalidField { .. } | CoreError::InvalidTier(_)),
                    "unexpected error class: {e}"
                );
                let after = (t.view().state_bytes(), t.pending_ops(), t.len(), sorted_entries(&t));
                assert!(after == before, "a refused batch changed the table");
            }
        }
        assert_eq!(t.len(), model.len() as u64, "table and model disagree on the key count");
        for (&k, &v) in &model {
            assert_eq!(t.get(k), Some(v), "table and model disagree on key {k:#x}");
        }
        if let Some(b) = t.take_batch() {
            view.apply_batch(&b).expect("a follower applies every emitted batch");
        }
        assert!(view.state_bytes() == t.view().state_bytes(), "follower diverged from the writer");
    }
    t.verify().expect("keyless view agrees with the keyed table");
    for (&k, &v) in &model {
        assert_eq!(view.lookup(k), v, "follower lookup disagrees on key {k:#x}");
    }
});
