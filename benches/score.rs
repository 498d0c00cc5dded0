//! The route loop on a realistic edge: 14 workers in 3 regions (8 / 2 / 4), one table per
//! region split into 2 shards (keys go to `key % 2`), 5 indexed prefix lengths per region between
//! 256 and 4096 tokens, and a 4096-token prompt (16 KiB of token bytes) whose prefixes are
//! registered for some workers at some levels, in VRAM or DRAM.
//!
//! Tables use 8-bit fingerprints (see [`FP_BITS`]). Each shard view also holds ~100k unrelated keys so probes touch a table of realistic size
//! rather than a few cache lines. `route_with` reuses one `RouteScratch`; next to it, a raw
//! SHA-256 of the same 16 KiB, so the ratio route / hash floor is visible (all reported in
//! bytes of prompt per second). The route repeats one prompt, so after its first call every
//! length comes from the process's prefix memo (`prefix_memo.rs`): the figure is a route of a
//! prompt seen before (a fingerprint pass, no SHA-256); `route_with_first_sight` is the route of
//! one seen first (every prefix hashed, as `bench_core.py`'s `route_over_sha256` measures it),
//! the raw hash beside them.
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvcompass::chunk_hash::{namespace_digest, prefix_keys, shard_of};
use kvcompass::ludo::hash::mix64;
use kvcompass::ludo::maintenance::{LudoTable, TableConfig};
use kvcompass::ludo::LudoView;
use kvcompass::score::{route_with, RouteScratch, RouteTable, ScoreParams, WorkerArrays, TIER_DRAM, TIER_VRAM};
use sha2::{Digest, Sha256};
use std::hint::black_box;
use std::time::Duration;

const SHARDS: u32 = 2;
const PROMPT: usize = 4096;
const BACKGROUND_PER_SHARD: u64 = 100_000;
/// Without fingerprints a keyless view answers an absent prefix with some other key's value
/// (a structural false hit), which on a well-filled table means nearly every miss looks like a
/// hit; 8-bit fingerprints cut that to ~1/256 per probe.
const FP_BITS: u8 = 8;

struct Scenario {
    plan: Vec<Vec<u32>>,
    /// Global worker indices of each region's table fields.
    workers: Vec<Vec<u32>>,
    /// One follower view per (region, shard), built from the writer's snapshot.
    views: Vec<Vec<LudoView>>,
    region: Vec<u32>,
    beta: Vec<f64>,
    wan: Vec<f64>,
    tq: Vec<f64>,
    belief: Vec<f64>,
}

fn scenario(ns: &[u8; 32], prompt: &[u32]) -> Scenario {
    let plan: Vec<Vec<u32>> = vec![vec![256, 512, 1024, 2048, 4096], vec![384, 768, 1536, 3072, 4096], vec![256, 640, 1280, 2560, 4000]];
    let sizes = [8usize, 2, 4];
    let mut workers = Vec::new();
    let mut region = Vec::new();
    for (r, &n) in sizes.iter().enumerate() {
        workers.push((region.len() as u32..(region.len() + n) as u32).collect::<Vec<u32>>());
        region.extend(std::iter::repeat_n(r as u32, n));
    }
    let w = region.len();
    assert_eq!(w, 14);

    let mut views = Vec::new();
    for (r, fields) in workers.iter().enumerate() {
        let mut tables: Vec<LudoTable> = (0..SHARDS)
            .map(|s| {
                let cfg = TableConfig { table: r as u32, shard: s, capacity: 131_072, value_bits: 32, fp_bits: FP_BITS, seed: 11 + r as u64, ..TableConfig::default() };
                // Unrelated prefixes held by random workers of this region.
                let bg: Vec<(u64, u64)> = (0..BACKGROUND_PER_SHARD)
                    .map(|i| {
                        let k = ((mix64(i ^ ((r as u64) << 40) ^ ((s as u64) << 48)) >> 1) & !1) | s as u64;
                        let f = (mix64(k) % fields.len() as u64) as u32;
                        (k, 1u64 << (2 * f))
                    })
                    .collect();
                LudoTable::build(cfg, &bg).unwrap()
            })
            .collect();
        let mut follow: Vec<LudoView> = tables
            .iter()
            .map(|t| {
                let mut v = LudoView::new(t.config().table, t.config().shard);
                v.apply_batch(&t.export_snapshot().unwrap()).unwrap();
                v
            })
            .collect();
        // Register the prompt: field f holds the first (f % 6) levels (0..=5), VRAM on even
        // global workers, DRAM on odd ones.
        let keys = prefix_keys(ns, prompt, &plan[r]).unwrap();
        for (f, &gw) in fields.iter().enumerate() {
            let held = f % 6;
            let tier = if gw % 2 == 0 { TIER_VRAM } else { TIER_DRAM };
            // Field 3 also claims the longest level without the one below it: a gap that only
            // the closure rule discounts.
            let gap = if f == 3 { &keys[4..] } else { &keys[..0] };
            for &k in keys[..held].iter().chain(gap) {
                tables[shard_of(k, SHARDS) as usize].set_field(k, f as u32, tier).unwrap();
            }
        }
        for (t, v) in tables.iter_mut().zip(follow.iter_mut()) {
            if let Some(b) = t.take_batch() {
                v.apply_batch(&b).unwrap();
            }
            assert_eq!(v.state_bytes(), t.view().state_bytes());
        }
        views.push(follow);
    }

    let beta = (0..w).map(|i| 0.05 + 0.01 * (i % 5) as f64).collect();
    let wan = region.iter().map(|&r| [2.0, 35.0, 80.0][r as usize]).collect();
    let tq = (0..w).map(|i| (i * 7 % 13) as f64).collect();
    let belief = (0..w).map(|i| 1.0 - 0.02 * (i % 4) as f64).collect();
    Scenario { plan, workers, views, region, beta, wan, tq, belief }
}

fn bench(c: &mut Criterion) {
    let ns = namespace_digest("llama-3.1-8b", "bench");
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| mix64(i as u64) as u32 % 128_000).collect();
    let cold: Vec<u32> = prompt.iter().map(|t| t ^ 1).collect();
    let sc = scenario(&ns, &prompt);
    let tables: Vec<RouteTable<'_, LudoView>> =
        (0..3).map(|r| RouteTable { region: r as u32, workers: &sc.workers[r], shards: &sc.views[r] }).collect();
    let wa = WorkerArrays { region: &sc.region, beta: &sc.beta, wan: &sc.wan, tq: &sc.tq, belief: &sc.belief };
    let open = ScoreParams { gamma: 0.01, lambda: 0.1, closure: false, block: 0 };
    let closed = ScoreParams { closure: true, ..open };

    let mut scratch = RouteScratch::new();
    for (name, p, t) in [("hit", &open, &prompt), ("hit_closure", &closed, &prompt), ("cold", &open, &cold)] {
        let w = route_with(&mut scratch, &ns, t, &sc.plan, &tables, &wa, p, None).unwrap();
        eprintln!("route {name}: winner {} score {:.1} matches {:?} tiers {:?}", w.winner, w.score, scratch.matches(), scratch.tiers());
    }
    // With 8-bit fingerprints a cold probe false-hits with p ~ 1/256 per (table, level).
    let false_hits = scratch.matches().iter().filter(|&&m| m != 0).count();
    assert!(false_hits <= 4, "cold prompt matched {false_hits} workers");

    let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
    let mut g = c.benchmark_group("route_14w_3r_2shards");
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    for (name, p, t) in [("hit", &open, &prompt), ("hit_closure", &closed, &prompt), ("cold", &open, &cold)] {
        g.bench_function(BenchmarkId::new("route_with", name), |b| {
            b.iter(|| route_with(&mut scratch, &ns, black_box(t), &sc.plan, &tables, &wa, p, None).unwrap())
        });
    }
    // The same route of a prompt seen for the first time: every prefix hashed afresh.
    let mut first = RouteScratch::cold();
    g.bench_function(BenchmarkId::new("route_with_first_sight", "hit_closure"), |b| {
        b.iter(|| route_with(&mut first, &ns, black_box(&prompt), &sc.plan, &tables, &wa, &closed, None).unwrap())
    });
    g.bench_function("sha256_raw_16KiB", |b| b.iter(|| Sha256::digest(black_box(&bytes))));
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
