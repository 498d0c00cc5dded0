//! The simulator engine's own floor: a replay with a policy that runs inside the engine (the
//! least-loaded worker of the fleet, cache-blind), so no Python is involved and what is timed
//! is the event loop, the worker model (chunked prefill steps, decode segments) and the
//! emulated caches. 24 workers in 3 regions, 2,000 requests of 1,024-token prompts (64 blocks
//! of 16 tokens) drawn from 200 shared prefixes, 16 output tokens each, at 400 req/s of
//! simulated time; caches of 4,096 VRAM and 8,192 DRAM blocks, so they fill and evict.
//! Reported per request (`Throughput::Elements`).
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvcompass::block_cache::BlockCache;
use kvcompass::sim::{Config, Cost, Engine, Pcg64, Policy, RequestSpec, Step, WorkerSetup};
use std::hint::black_box;
use std::time::Duration;

const REGIONS: usize = 3;
const PER_REGION: usize = 8;
const REQUESTS: usize = 2000;
const PROMPT: u64 = 1024;
const BLOCK: u32 = 16;

fn engine() -> Engine {
    let n = REGIONS * PER_REGION;
    let cost = Cost {
        prefill_ms_per_token: 0.07,
        prefill_base_ms: 0.0,
        reload_ms_per_token: 0.005,
        decode_base_ms: 6.0,
        decode_ms_per_seq: 0.05,
        decode_compute_ms_per_token: 0.07,
        decode_ms_per_context_token: 0.0001,
        kv_bytes_per_token: 131072,
    };
    let rtt: Vec<f64> = (0..REGIONS * REGIONS).map(|i| if i / REGIONS == i % REGIONS { 1.0 } else { 80.0 }).collect();
    let region_workers: Vec<Vec<u32>> = (0..REGIONS).map(|r| (0..PER_REGION).map(|j| (r * PER_REGION + j) as u32).collect()).collect();
    let cfg = Config {
        cost,
        transfer_gbps: 100.0,
        chunked: true,
        max_batched_tokens: 2048,
        wan_jitter: 0.0,
        segment_steps: 64,
        indexed: false,
        handoff: false,
        rtt,
        has_edge: vec![true; REGIONS],
        region_workers,
        decoders: vec![Vec::new(); REGIONS],
        kv_pool: true,
    };
    let workers = (0..n)
        .map(|i| WorkerSetup { region: (i / PER_REGION) as u16, beta: 0.07, cache: BlockCache::new(BLOCK as usize, 4096, 8192, false, i as u64).unwrap(), publish: false, queue_to_edge: false })
        .collect();
    let mut g = Pcg64::seeded(7);
    let blocks = PROMPT.div_ceil(BLOCK as u64) as usize;
    let mut ids = Vec::with_capacity(REQUESTS * blocks);
    let mut offs = vec![0usize];
    let mut reqs = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS {
        let family = g.integers(200);
        let shared = 48; // the first 48 blocks are the family's, the rest the request's own
        for b in 0..blocks as u64 {
            ids.push(if b < shared { family * 1000 + b } else { (i as u64 + 1) << 20 | b });
        }
        offs.push(ids.len());
        let region = g.integers(REGIONS as u64) as u16;
        reqs.push(RequestSpec { arrival_ms: i as f64 * 2.5, region, edge_region: region, input_length: PROMPT, output_length: 16, block_size: BLOCK, salt: 0, salt_seed: 0, runs: false });
    }
    let mut e = Engine::new(cfg, workers, reqs, ids, offs, Pcg64::seeded(1), Pcg64::seeded(2), 1 << 40).unwrap();
    e.set_policy(Policy::LeastLoaded { pools: vec![(0..n as u32).collect()], per_region: false }).unwrap();
    e
}

fn run(mut e: Engine) -> u64 {
    e.start();
    while let Some(step) = e.next().unwrap() {
        match step {
            Step::Out => {
                black_box(e.take_out());
            }
            other => panic!("a native policy asks the driver nothing, got {other:?}"),
        }
    }
    assert_eq!(e.completed(), REQUESTS as u64);
    e.events_processed
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("sim_engine");
    g.throughput(Throughput::Elements(REQUESTS as u64));
    g.sample_size(10).measurement_time(Duration::from_secs(8));
    g.bench_function("least_loaded_2000_requests", |b| b.iter_batched(engine, run, criterion::BatchSize::LargeInput));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
