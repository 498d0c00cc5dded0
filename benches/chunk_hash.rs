//! Prefix-key hashing: one pass over a prompt at several lengths vs a plain SHA-256 of the same
//! bytes (the floor the route loop is measured against).
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvcompass::chunk_hash::{namespace_digest, prefix_keys};
use sha2::{Digest, Sha256};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let ns = namespace_digest("llama-3.1-8b", "bench");
    let mut g = c.benchmark_group("chunk_hash");
    for n in [512usize, 4096, 16384] {
        let tokens: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761)).collect();
        let lengths: Vec<u32> = (1..=15u32).map(|i| i * n as u32 / 15).collect();
        g.throughput(Throughput::Bytes(4 * n as u64));
        g.bench_with_input(BenchmarkId::new("prefix_keys_15_lengths", n), &tokens, |b, t| b.iter(|| prefix_keys(&ns, black_box(t), &lengths).unwrap()));
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        g.bench_with_input(BenchmarkId::new("sha256_raw", n), &bytes, |b, x| b.iter(|| Sha256::digest(black_box(x))));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
