//! How many block events a router's KV-event path takes per second on one core: decoding one of
//! vLLM's batches (bytes from vLLM v0.34.0's own classes: 8 `BlockStored` of 32 blocks of 16
//! tokens and a `BlockRemoved` of the same 256 blocks, kv-events/tests/fixtures) and applying it
//! to the exact index, which re-keys each stored block over its token ids and forgets it again
//! (target: 100,000 block events/s per router).
//!
//! `cargo bench -p data-plane --bench kv_events`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use data_plane::kv_index::KvIndex;
use kv_events::{decode_batch, DecodeLimits, Event};

fn throughput(c: &mut Criterion) {
    let payload = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kv-events/tests/fixtures/v0_34_0_step_256_blocks.bin"
    ))
    .expect("the fixture");
    let limits = DecodeLimits::default();
    let batch = decode_batch(&payload, &limits).expect("vLLM's bytes decode");
    let blocks: u64 = batch
        .events
        .iter()
        .map(|e| match e {
            Event::Stored { hashes, .. } | Event::Removed { hashes, .. } => hashes.len() as u64,
            Event::Cleared => 0,
        })
        .sum();
    assert_eq!(blocks, 512);
    let index = KvIndex::default();
    let mut group = c.benchmark_group("kv_events");
    group.throughput(Throughput::Elements(blocks));
    group.bench_function("decode_256_stored_256_removed", |b| {
        b.iter(|| black_box(decode_batch(black_box(&payload), &limits).unwrap()))
    });
    group.bench_function("decode_and_apply_256_stored_256_removed", |b| {
        b.iter(|| {
            let batch = decode_batch(black_box(&payload), &limits).unwrap();
            for event in &batch.events {
                index.apply(7, event);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, throughput);
criterion_main!(benches);
