//! The Ludo index at scale: a 1M-capacity table filled to 95% of `capacity()`.
//!
//! Read side (the keyless view every edge holds): single and batched lookups of present keys in
//! shuffled order, without fingerprints and with 8-bit fingerprints. Write side (the single
//! writer): value updates, steady-state remove+insert at 95%, tier-field batches, and the patch
//! path to a follower view (take_batch + apply_batch, and decode alone).
//!
//! The write benches mutate one shared table; pending ops are drained with `take_batch` so the
//! buffer stays bounded. Rebuilds (fallback over its limit) are counted and printed, because one
//! rebuild of ~950k keys is part of the amortised cost of the remove+insert bench.
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use kvcompass::ludo::hash::mix64;
use kvcompass::ludo::maintenance::{LudoTable, TableConfig};
use kvcompass::ludo::LudoView;
use kvcompass::patch::decode_batch;
use std::hint::black_box;
use std::time::{Duration, Instant};

const CAPACITY: u64 = 1_000_000;
const BATCH: usize = 1024;
/// Drain the writer's pending buffer once it holds this many ops.
const DRAIN_AT: u32 = 4096;

/// Deterministic PRNG: SplitMix64 over a counter.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (((self.next() >> 32) * n as u64) >> 32) as usize
    }
}

fn shuffle(v: &mut [u64], rng: &mut Rng) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i + 1));
    }
}

fn key(i: u64) -> u64 {
    mix64(i) >> 1
}

/// A nonzero 32-bit value for key index `i`.
fn value(i: u64) -> u64 {
    (mix64(i ^ 0x5555_5555) & 0xffff_ffff) | 1
}

struct Filled {
    table: LudoTable,
    /// Present keys, shuffled.
    keys: Vec<u64>,
    /// Next unused key index.
    next: u64,
}

fn filled(fp_bits: u8) -> Filled {
    let t0 = Instant::now();
    let cfg = TableConfig { capacity: CAPACITY, value_bits: 32, fp_bits, seed: 7, ..TableConfig::default() };
    let cap = LudoTable::new(cfg).unwrap().capacity();
    let n = cap * 95 / 100;
    let entries: Vec<(u64, u64)> = (0..n).map(|i| (key(i), value(i))).collect();
    let table = LudoTable::build(cfg, &entries).unwrap();
    let mut keys: Vec<u64> = entries.iter().map(|e| e.0).collect();
    shuffle(&mut keys, &mut Rng(fp_bits as u64 + 1));
    eprintln!(
        "ludo fp{fp_bits}: capacity {} len {} ({:.1}%) fallback {} rebuilds {} view {:.1} MiB, built in {:.2?}",
        table.capacity(),
        table.len(),
        100.0 * table.len() as f64 / table.capacity() as f64,
        table.fallback_len(),
        table.rebuilds(),
        table.view().memory_bytes() as f64 / (1 << 20) as f64,
        t0.elapsed()
    );
    Filled { table, keys, next: n }
}

fn drain(t: &mut LudoTable) {
    if t.pending_ops() >= DRAIN_AT {
        black_box(t.take_batch());
    }
}

fn bench_view(c: &mut Criterion, f: &mut Filled, fp_bits: u8) {
    let view = f.table.view();
    let keys = &f.keys;
    let mut g = c.benchmark_group("ludo_view");
    g.throughput(Throughput::Elements(1));
    g.bench_function(BenchmarkId::new("lookup", format!("fp{fp_bits}")), |b| {
        let mut i = 0usize;
        b.iter(|| {
            let k = keys[i];
            i += 1;
            if i == keys.len() {
                i = 0;
            }
            view.lookup(black_box(k))
        })
    });
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function(BenchmarkId::new("lookup_batch_1024", format!("fp{fp_bits}")), |b| {
        let mut out = vec![0u64; BATCH];
        let chunks = keys.len() / BATCH;
        let mut i = 0usize;
        b.iter(|| {
            view.lookup_batch(black_box(&keys[i * BATCH..(i + 1) * BATCH]), &mut out);
            i += 1;
            if i == chunks {
                i = 0;
            }
            black_box(out[BATCH - 1])
        })
    });
    // Sanity: the keyless view returns every present key's own value (sampled).
    for &k in keys.iter().step_by(997) {
        assert_eq!(view.lookup(k), f.table.get(k).unwrap());
    }

    // `lookup_batch` only takes its prefetching path while the fallback is empty; at 95% a
    // fill usually leaves an entry or two there. Remove those keys and measure again.
    if f.table.fallback_len() > 0 {
        let gone: Vec<u64> = f.table.view().fallback_entries().iter().map(|e| e.0).collect();
        for &k in &gone {
            f.table.remove(k).unwrap();
        }
        f.table.take_batch();
        f.keys.retain(|k| !gone.contains(k));
        let (view, keys) = (f.table.view(), &f.keys);
        g.bench_function(BenchmarkId::new("lookup_batch_1024", format!("fp{fp_bits}_fallback_empty")), |b| {
            let mut out = vec![0u64; BATCH];
            let chunks = keys.len() / BATCH;
            let mut i = 0usize;
            b.iter(|| {
                view.lookup_batch(black_box(&keys[i * BATCH..(i + 1) * BATCH]), &mut out);
                i += 1;
                if i == chunks {
                    i = 0;
                }
                black_box(out[BATCH - 1])
            })
        });
    }
    g.finish();
}

fn bench_writes(c: &mut Criterion, f: &mut Filled) {
    let mut g = c.benchmark_group("ludo_write");

    // Value updates of present keys; each call changes the value so it always emits a SetValue.
    g.throughput(Throughput::Elements(1));
    {
        let Filled { table, keys, .. } = f;
        let mut i = 0usize;
        let mut flip = 0u64;
        g.bench_function("set_update", |b| {
            b.iter(|| {
                let k = keys[i];
                i += 1;
                if i == keys.len() {
                    i = 0;
                    flip ^= 2;
                }
                let r = table.set(black_box(k), value(k) ^ 2 ^ flip).unwrap();
                drain(table);
                r
            })
        });
        table.take_batch();
    }

    // Steady state at 95%: remove a random present key, insert a fresh one (one timed pair).
    {
        let rebuilds0 = f.table.rebuilds();
        let Filled { table, keys, next } = f;
        let mut rng = Rng(99);
        g.bench_function("remove_insert_pair_95pct", |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let j = rng.below(keys.len());
                    let old = keys[j];
                    let new = key(*next);
                    *next += 1;
                    let t0 = Instant::now();
                    black_box(table.remove(old).unwrap());
                    black_box(table.insert(new, value(new)).unwrap());
                    total += t0.elapsed();
                    keys[j] = new;
                    drain(table);
                }
                total
            })
        });
        table.take_batch();
        eprintln!(
            "remove_insert: len {} ({:.1}%) fallback {} rebuilds during bench {}",
            table.len(),
            100.0 * table.len() as f64 / table.capacity() as f64,
            table.fallback_len(),
            table.rebuilds() - rebuilds0
        );
    }

    // Tier-field batches: 768 field changes on present keys (tier cycles 0 -> 1 -> 2 across the
    // three op sets, so every op changes a field), plus 128 churn keys inserted by their first
    // field and removed again later in the same batch, so occupancy stays at 95%.
    {
        let Filled { table, keys, next } = f;
        let mut rng = Rng(1234);
        let upd: Vec<(u64, u32)> = (0..768).map(|_| (keys[rng.below(keys.len())], rng.below(16) as u32)).collect();
        let churn: Vec<(u64, u32)> = (0..128)
            .map(|_| {
                let k = key(*next);
                *next += 1;
                (k, rng.below(16) as u32)
            })
            .collect();
        let base: Vec<u8> = (0..768).map(|_| rng.below(3) as u8).collect();
        let sets: Vec<(Vec<u64>, Vec<u32>, Vec<u8>)> = (0..3u8)
            .map(|s| {
                let (mut ks, mut fs, mut ts) = (Vec::new(), Vec::new(), Vec::new());
                for (j, &(k, fi)) in upd.iter().enumerate() {
                    // Interleave the churn inserts and removes with the updates.
                    if j % 12 == 0 {
                        let (ck, cf) = churn[j / 12 % 128];
                        ks.push(ck);
                        fs.push(cf);
                        ts.push(1 + s % 2);
                    }
                    ks.push(k);
                    fs.push(fi);
                    ts.push((base[j] + s) % 3);
                }
                for &(ck, cf) in &churn[64..] {
                    ks.push(ck);
                    fs.push(cf);
                    ts.push(1 + s % 2);
                }
                for &(ck, cf) in &churn {
                    ks.push(ck);
                    fs.push(cf);
                    ts.push(0);
                }
                assert_eq!(ks.len(), BATCH);
                (ks, fs, ts)
            })
            .collect();
        let len0 = table.len();
        let mut s = 0usize;
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function("apply_field_ops_1024", |b| {
            b.iter(|| {
                let (ks, fs, ts) = &sets[s];
                s = (s + 1) % 3;
                let n = table.apply_field_ops(black_box(ks), fs, ts).unwrap();
                black_box(table.take_batch());
                n
            })
        });
        eprintln!("apply_field_ops: len {} -> {} rebuilds {}", len0, table.len(), table.rebuilds());
    }
    g.finish();
}

/// 256 writer ops: 192 value updates, 32 removes and 32 inserts of fresh keys.
fn make_256_ops(f: &mut Filled, rng: &mut Rng, round: u64) {
    let Filled { table, keys, next } = f;
    for _ in 0..192 {
        let k = keys[rng.below(keys.len())];
        table.set(k, (value(k) ^ (round << 8)) & 0xffff_ffff | 1).unwrap();
    }
    for _ in 0..32 {
        let j = rng.below(keys.len());
        table.remove(keys[j]).unwrap();
        let new = key(*next);
        *next += 1;
        table.insert(new, value(new)).unwrap();
        keys[j] = new;
    }
}

fn bench_patch(c: &mut Criterion, f: &mut Filled) {
    let mut g = c.benchmark_group("ludo_patch");
    f.table.take_batch();
    let snap = f.table.export_snapshot().unwrap();
    let mut follower = LudoView::new(f.table.config().table, f.table.config().shard);
    follower.apply_batch(&snap).unwrap();

    let mut rng = Rng(4242);
    let mut round = 0u64;
    let mut ops = 0u64;
    let mut batches = 0u64;
    g.throughput(Throughput::Elements(256));
    g.bench_function("take_batch_apply_256_ops", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                round += 1;
                make_256_ops(f, &mut rng, round);
                let t0 = Instant::now();
                let batch = f.table.take_batch().unwrap();
                let a = follower.apply_batch(black_box(&batch)).unwrap();
                total += t0.elapsed();
                ops += a.ops as u64;
                batches += 1;
            }
            total
        })
    });
    assert_eq!(follower.state_bytes(), f.table.view().state_bytes(), "follower diverged");
    eprintln!("patch: {batches} batches, {:.1} ops per batch on average (a rebuild would make one a snapshot)", ops as f64 / batches.max(1) as f64);

    // Decode alone: one representative 256-op batch, and the full snapshot.
    make_256_ops(f, &mut rng, round + 1);
    let batch = f.table.take_batch().unwrap();
    follower.apply_batch(&batch).unwrap();
    g.throughput(Throughput::Bytes(batch.len() as u64));
    g.bench_with_input(BenchmarkId::new("decode_batch", format!("{}_ops_{}B", decode_batch(&batch).unwrap().ops.len(), batch.len())), &batch, |b, x| {
        b.iter(|| decode_batch(black_box(x)).unwrap())
    });
    let snap = f.table.export_snapshot().unwrap();
    g.throughput(Throughput::Bytes(snap.len() as u64));
    g.sample_size(20);
    g.bench_with_input(BenchmarkId::new("decode_batch", format!("snapshot_{:.1}MiB", snap.len() as f64 / (1 << 20) as f64)), &snap, |b, x| {
        b.iter(|| decode_batch(black_box(x)).unwrap())
    });
    g.bench_function("apply_snapshot_to_fresh_view", |b| {
        b.iter_batched(
            || LudoView::new(f.table.config().table, f.table.config().shard),
            |mut v| {
                v.apply_batch(black_box(&snap)).unwrap();
                v
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn bench(c: &mut Criterion) {
    let mut f8 = filled(8);
    bench_view(c, &mut f8, 8);
    drop(f8);
    let mut f0 = filled(0);
    bench_view(c, &mut f0, 0);
    bench_writes(c, &mut f0);
    bench_patch(c, &mut f0);
    f0.table.verify().unwrap();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
