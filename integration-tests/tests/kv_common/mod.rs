//! Helpers shared by the KV-events tests (`kv_events.rs` on engine-sims, `vllm_cpu.rs` on vLLM).

/// The value of `name{...instance="INSTANCE"...}` in a `/metrics` text.
pub fn metric_value(metrics: &str, name: &str, instance: &str) -> Option<f64> {
    let line = metrics.lines().find(|l| {
        l.starts_with(&format!("{name}{{")) && l.contains(&format!("instance=\"{instance}\""))
    })?;
    line.rsplit(' ').next()?.parse().ok()
}

/// The first instance of the key's rendezvous ranking for a chat `body`, as every router
/// computes it (instance ids are their URLs; `prefix_length` 2048, the default seed).
pub fn rendezvous_first(instances: &[String], body: &[u8]) -> usize {
    let hashes: Vec<u64> = instances
        .iter()
        .map(|i| xxhash_rust::xxh3::xxh3_64(i.as_bytes()))
        .collect();
    let key = data_plane::prompt::prompt_key(
        data_plane::prompt::BodyKind::OpenAi,
        body,
        2048,
        data_plane::prompt::DEFAULT_SEED,
    );
    data_plane::placement::rendezvous_top(&hashes, key.hash).0
}
