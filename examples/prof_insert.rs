use kvcompass::ludo::hash::mix64;
use kvcompass::ludo::maintenance::{LudoTable, TableConfig};
use std::time::Instant;
fn main() {
    let n: u64 = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(1_000_000);
    let mut t = LudoTable::new(TableConfig { capacity: n, ..TableConfig::default() }).unwrap();
    let cap = t.capacity();
    let a = Instant::now();
    for i in 0..cap { t.insert(mix64(i) >> 1, 1).unwrap(); if i % 1024 == 0 { t.take_batch(); } }
    { use std::sync::atomic::Ordering::Relaxed; use kvcompass::ludo::othello::*; eprintln!("fill: bfs calls {} nodes {} same_root {}", BFS_CALLS.swap(0,Relaxed), BFS_NODES.swap(0,Relaxed), SAME_ROOT.swap(0,Relaxed)); }
    eprintln!("fill {} in {:?} ({:.0} ns/op)", cap, a.elapsed(), a.elapsed().as_nanos() as f64 / cap as f64);
    t.take_batch();
    let m = 300_000u64;
    let mut mv = [0u64; 8]; let mut mvt = [0u128; 8]; let mut ins = Vec::new(); let mut rem = Vec::new(); let mut upd = Vec::new();
    for j in 0..m {
        let old = mix64(j * 3 % cap) >> 1; // may be already removed -> None
        let a = Instant::now(); t.remove(old).unwrap(); let b = Instant::now();
        let pl = t.insert(mix64(cap + j) >> 1, 2).unwrap(); let c = Instant::now(); if let kvcompass::ludo::maintenance::Placement::Bucket{moves} = pl { mv[moves.min(7)] += 1; mvt[moves.min(7)] += (c-b).as_nanos(); }
        t.set(mix64(cap + j / 2) >> 1, 3).unwrap(); let d = Instant::now();
        rem.push((b - a).as_nanos()); ins.push((c - b).as_nanos()); upd.push((d-c).as_nanos());
        if j % 256 == 0 { t.take_batch(); }
    }
    for (name, v) in [("insert", &mut ins), ("remove", &mut rem), ("update", &mut upd)] { v.sort(); eprintln!("{name} p50 {} p99 {}", v[v.len()/2], v[v.len()*99/100]); }
    { use std::sync::atomic::Ordering::Relaxed; use kvcompass::ludo::othello::*; eprintln!("steady: bfs calls {} nodes {} same_root {}", BFS_CALLS.swap(0,Relaxed), BFS_NODES.swap(0,Relaxed), SAME_ROOT.swap(0,Relaxed)); }
    eprintln!("moves {mv:?} mean ns {:?}", (0..8).map(|i| if mv[i]>0 {mvt[i]/mv[i] as u128} else {0}).collect::<Vec<_>>());
    eprintln!("rebuilds {} fallback {}", t.rebuilds(), t.fallback_len());
}
