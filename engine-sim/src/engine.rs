//! The timing model: admission, the shared prefill lane, decode steps, and the engine's counters.
//!
//! A request's life, following vLLM's mechanics:
//! 1. It waits, FIFO, for one of `max_num_seqs` running slots (`vllm:num_requests_waiting`).
//! 2. At admission it looks up its prefix in the KV cache and pins the matched blocks; it then
//!    reserves the engine's single prefill lane for its *uncached* tokens only:
//!    `[max(now, lane_free_at), + uncached / prefill_tokens_per_s)`. Reservations are FIFO, so
//!    a burst of misses delays every first token behind it, hits included (vLLM schedules
//!    prefill chunks first-come first-served under one token budget).
//! 3. When its prefill ends, all its full blocks enter the cache (pinned until it finishes);
//!    its first token comes `ttft_overhead` later.
//! 4. Then one token every `itl * (1 + itl_batch_factor * running)`.
//! 5. When a chat request has produced all its tokens, the blocks of its prompt followed by
//!    `assistant\n` and the generated text are cached too (vLLM keeps generated tokens' KV), so
//!    the next turn of the conversation, which resends the answer, hits it.
//! 6. When it finishes or its client goes away, its blocks are unpinned and its slot freed.
//!
//! Every duration is multiplied by `time_scale`. Waiting uses tokio timers on computed deadlines;
//! the lock guards only bookkeeping and is never held across an `.await`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::{sleep_until, Instant};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::config::{scaled_secs, Config};
use crate::histogram::{Histogram, TTFT_BUCKETS};
use crate::kv_cache::{CacheChange, PrefixCache, PromptBlocks};
use crate::kv_events::{CacheEvent, Outbox};

/// One simulated engine: its configuration, KV cache, scheduler state and counters.
/// Shared (`Arc`) by the HTTP server and any in-process user that wants [`Engine::stats`].
pub struct Engine {
    pub(crate) config: Config,
    admission: Semaphore,
    scheduler: Mutex<Scheduler>,
    pub(crate) counters: Counters,
    pub(crate) ttft: Histogram,
    ttft_overhead: Duration,
    itl: Duration,
    prefill_secs_per_token: f64,
    /// `--tokenizer`: prompts as the engine's token ids.
    pub(crate) tokenizer: Option<Arc<chat_tokens::ChatTokenizer>>,
    /// `--kv-events-endpoint`: the cache's changes, to the publisher task.
    pub(crate) kv_events: Option<Outbox>,
}

struct Scheduler {
    cache: PrefixCache,
    /// When the prefill lane finishes the work reserved so far.
    lane_free_at: Instant,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) requests: AtomicU64,
    pub(crate) queries: AtomicU64,
    pub(crate) hits: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generation_tokens: AtomicU64,
    pub(crate) successes: AtomicU64,
    pub(crate) failures_injected: AtomicU64,
    pub(crate) running: AtomicU64,
    pub(crate) waiting: AtomicU64,
}

/// A snapshot of an engine's counters, for in-process users (the same numbers as `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    /// Completion requests received, any outcome (`engine_sim_requests_total`).
    pub requests_total: u64,
    /// Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Prompt tokens found in the prefix cache (`vllm:prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
    /// Prompt tokens of admitted requests (`vllm:prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Output tokens produced (`vllm:generation_tokens_total`).
    pub generation_tokens: u64,
    /// Requests that produced all their tokens (`vllm:request_success_total`).
    pub requests_succeeded: u64,
    /// Requests answered 500 by `--fail-rate` (`engine_sim_injected_failures_total`).
    pub failures_injected: u64,
    /// Requests holding a running slot (`vllm:num_requests_running`).
    pub running: u64,
    /// Requests waiting for a running slot (`vllm:num_requests_waiting`).
    pub waiting: u64,
    /// Blocks in the prefix cache, pinned or not.
    pub cached_blocks: u64,
    /// Share of the KV capacity pinned by running requests, 0..=1 (`vllm:kv_cache_usage_perc`).
    pub kv_cache_usage: f64,
    /// Observations of `vllm:time_to_first_token_seconds`.
    pub ttft_count: u64,
    /// Sum of the observed TTFTs, in seconds.
    pub ttft_sum_seconds: f64,
}

impl Engine {
    /// An idle engine with an empty cache.
    ///
    /// # Panics
    /// If `config.tokenizer` cannot be loaded or `kv_events_endpoint` is set without it; use
    /// [`Engine::try_new`] to get the error instead.
    pub fn new(config: Config) -> Arc<Self> {
        match Self::try_new(config) {
            Ok(engine) => engine,
            Err(e) => panic!("engine-sim: {e:#}"),
        }
    }

    /// An idle engine with an empty cache, its tokenizer loaded.
    pub fn try_new(config: Config) -> anyhow::Result<Arc<Self>> {
        if config.kv_events_endpoint.is_some() && config.tokenizer.is_none() {
            anyhow::bail!(
                "--kv-events-endpoint needs --tokenizer: the events carry the prompt's token ids"
            );
        }
        let tokenizer = match &config.tokenizer {
            Some(path) => Some(Arc::new(
                chat_tokens::ChatTokenizer::load(path)
                    .map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?,
            )),
            None => None,
        };
        let permits = (config.max_num_seqs.max(1) as usize).min(Semaphore::MAX_PERMITS);
        let mut cache = PrefixCache::new(config.kv_capacity_blocks());
        let kv_events = config.kv_events_endpoint.as_ref().map(|_| {
            cache.record_changes();
            Outbox::new()
        });
        Ok(Arc::new(Self {
            admission: Semaphore::new(permits),
            scheduler: Mutex::new(Scheduler {
                cache,
                lane_free_at: Instant::now(),
            }),
            counters: Counters::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            ttft_overhead: config.scaled_ms(config.ttft_overhead_ms),
            itl: config.scaled_ms(config.itl_ms),
            prefill_secs_per_token: config.time_scale / config.prefill_tokens_per_s,
            tokenizer,
            kv_events,
            config,
        }))
    }

    /// Publishes what the cache changed in the last insertion of the blocks `hashes` of a
    /// prompt whose token ids are `token_ids` (`None`: a prompt without ids, whose stored blocks
    /// cannot be described; its evictions still are). Called with the scheduler lock held.
    fn publish_changes(&self, s: &mut Scheduler, hashes: &[u64], token_ids: Option<&[u32]>) {
        let Some(outbox) = &self.kv_events else {
            return;
        };
        let block = self.config.block_size as usize;
        let mut batch: Vec<CacheEvent> = Vec::new();
        for change in s.cache.take_changes() {
            match (change, batch.last_mut()) {
                (CacheChange::Evicted(h), Some(CacheEvent::Removed { hashes })) => hashes.push(h),
                (CacheChange::Evicted(h), _) => batch.push(CacheEvent::Removed { hashes: vec![h] }),
                (CacheChange::Stored(i), last) => {
                    let Some(ids) = token_ids else { continue };
                    let Some(block_ids) = ids.get(i * block..(i + 1) * block) else {
                        continue;
                    };
                    match last {
                        Some(CacheEvent::Stored {
                            hashes: stored,
                            token_ids,
                            ..
                        }) if i > 0 && stored.last() == Some(&hashes[i - 1]) => {
                            stored.push(hashes[i]);
                            token_ids.extend_from_slice(block_ids);
                        }
                        _ => batch.push(CacheEvent::Stored {
                            hashes: vec![hashes[i]],
                            parent: i.checked_sub(1).map(|p| hashes[p]),
                            token_ids: block_ids.to_vec(),
                        }),
                    }
                }
            }
        }
        outbox.send(batch);
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        let (cached_blocks, kv_cache_usage) = {
            let s = self.lock();
            (s.cache.len() as u64, s.cache.usage())
        };
        Stats {
            requests_total: c.requests.load(Relaxed),
            prefix_cache_queries: c.queries.load(Relaxed),
            prefix_cache_hits: c.hits.load(Relaxed),
            prompt_tokens: c.prompt_tokens.load(Relaxed),
            generation_tokens: c.generation_tokens.load(Relaxed),
            requests_succeeded: c.successes.load(Relaxed),
            failures_injected: c.failures_injected.load(Relaxed),
            running: c.running.load(Relaxed),
            waiting: c.waiting.load(Relaxed),
            cached_blocks,
            kv_cache_usage,
            ttft_count: self.ttft.count(),
            ttft_sum_seconds: self.ttft.sum_seconds(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Scheduler> {
        // The bookkeeping under this lock cannot panic halfway; a poisoned lock is still sound.
        self.scheduler.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a received completion request; returns its number (seeds ids and fault draws).
    pub(crate) fn count_request(&self) -> u64 {
        self.counters.requests.fetch_add(1, Relaxed)
    }

    /// A reproducible pseudo-random u64 for request number `n` and purpose `salt`.
    pub(crate) fn draw(&self, n: u64, salt: u64) -> u64 {
        xxh3_64_with_seed(&n.to_le_bytes(), self.config.seed ^ salt)
    }

    /// Whether `--fail-rate` fails request number `n`.
    pub(crate) fn should_fail(&self, n: u64) -> bool {
        let rate = self.config.fail_rate;
        rate > 0.0 && (self.draw(n, 0xFA11) as f64 / u64::MAX as f64) < rate
    }

    /// Waits for a running slot (FIFO), then looks the prompt up in the cache and reserves its
    /// prefill. Dropping the future while it waits leaves no trace.
    pub async fn admit(self: &Arc<Self>, prompt: PromptBlocks) -> Sequence {
        self.admit_tokens(prompt, None).await
    }

    /// [`Engine::admit`] for a prompt of token ids (`prompt` their digest,
    /// [`PromptBlocks::from_token_ids`]), which the KV events of its blocks carry.
    pub async fn admit_tokens(
        self: &Arc<Self>,
        prompt: PromptBlocks,
        token_ids: Option<Arc<[u32]>>,
    ) -> Sequence {
        let arrival = Instant::now();
        {
            let _waiting = GaugeGuard::increment(&self.counters.waiting);
            // The semaphore is never closed; the permit is returned by `Sequence::drop`.
            if let Ok(permit) = self.admission.acquire().await {
                permit.forget();
            }
        }
        self.counters.running.fetch_add(1, Relaxed);
        let prompt_tokens = prompt.prompt_tokens();
        let block_size = u64::from(self.config.block_size);
        let (matched, prefill_done_at) = {
            let mut s = self.lock();
            let matched = s.cache.lookup_and_pin(&prompt.hashes);
            let uncached = prompt_tokens.saturating_sub(matched as u64 * block_size);
            let prefill = scaled_secs(uncached as f64, self.prefill_secs_per_token);
            let start = s.lane_free_at.max(Instant::now());
            let end = start.checked_add(prefill).unwrap_or(start);
            s.lane_free_at = end;
            (matched, end)
        };
        let cached_tokens = matched as u64 * block_size;
        let c = &self.counters;
        c.queries.fetch_add(prompt_tokens, Relaxed);
        c.hits.fetch_add(cached_tokens, Relaxed);
        c.prompt_tokens.fetch_add(prompt_tokens, Relaxed);
        let first_token_at = prefill_done_at
            .checked_add(self.ttft_overhead)
            .unwrap_or(prefill_done_at);
        Sequence {
            engine: Arc::clone(self),
            hashes: prompt.hashes,
            token_ids,
            pinned: matched,
            inserted: false,
            prompt_tokens,
            cached_tokens,
            arrival,
            prefill_done_at,
            next_token_at: first_token_at,
            tokens: 0,
        }
    }

    /// The interval to the next token at the current batch size.
    fn token_interval(&self) -> Duration {
        let running = self.counters.running.load(Relaxed) as f64;
        scaled_secs(
            self.itl.as_secs_f64(),
            1.0 + self.config.itl_batch_factor * running,
        )
    }
}

/// An admitted request: holds a running slot and pins its cached blocks until dropped.
pub struct Sequence {
    engine: Arc<Engine>,
    hashes: Vec<u64>,
    /// The prompt's token ids, when it was tokenized (for KV events).
    token_ids: Option<Arc<[u32]>>,
    /// Leading blocks of `hashes` this request pins.
    pinned: usize,
    inserted: bool,
    prompt_tokens: u64,
    cached_tokens: u64,
    arrival: Instant,
    prefill_done_at: Instant,
    next_token_at: Instant,
    tokens: u64,
}

impl Sequence {
    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens
    }

    /// Prompt tokens found in the cache at admission.
    pub fn cached_tokens(&self) -> u64 {
        self.cached_tokens
    }

    /// Tokens produced so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Waits for the end of the prefill (then caches the prompt's blocks) and for the first
    /// token; records and returns the time to first token (from the call to `admit`).
    pub async fn first_token(&mut self) -> Duration {
        sleep_until_deadline(self.prefill_done_at).await;
        if !self.inserted {
            let mut s = self.engine.lock();
            self.pinned = s.cache.insert_and_pin(&self.hashes, self.pinned);
            self.engine
                .publish_changes(&mut s, &self.hashes, self.token_ids.as_deref());
            self.inserted = true;
        }
        sleep_until_deadline(self.next_token_at).await;
        let ttft = Instant::now().saturating_duration_since(self.arrival);
        self.engine.ttft.observe(ttft);
        self.tokens = 1;
        self.engine.counters.generation_tokens.fetch_add(1, Relaxed);
        ttft
    }

    /// Waits for the next output token (after the first).
    pub async fn next_token(&mut self) {
        self.advance(1);
        sleep_until_deadline(self.next_token_at).await;
        self.tokens += 1;
        self.engine.counters.generation_tokens.fetch_add(1, Relaxed);
    }

    /// Waits until `n` more tokens are done, in one timer (the batch size read once):
    /// for non-streaming responses, which need no per-token wake-up.
    pub async fn next_tokens(&mut self, n: u64) {
        self.advance(n);
        sleep_until_deadline(self.next_token_at).await;
        self.tokens += n;
        self.engine.counters.generation_tokens.fetch_add(n, Relaxed);
    }

    fn advance(&mut self, n: u64) {
        let step = self.engine.token_interval();
        let total = step
            .checked_mul(u32::try_from(n).unwrap_or(u32::MAX))
            .unwrap_or(Duration::MAX);
        self.next_token_at = self
            .next_token_at
            .checked_add(total)
            .unwrap_or(self.next_token_at);
    }

    /// Caches the blocks of the prompt followed by the generated text, as vLLM keeps the KV of
    /// generated tokens: `extended` must be the digest of this prompt's bytes plus more bytes
    /// (so its leading hashes are this prompt's). The blocks stay pinned until the request ends.
    pub fn cache_output(&mut self, extended: PromptBlocks) {
        if !self.inserted || extended.hashes.len() <= self.hashes.len() {
            return;
        }
        debug_assert_eq!(extended.hashes[..self.hashes.len()], self.hashes[..]);
        let mut s = self.engine.lock();
        self.pinned = s.cache.insert_and_pin(&extended.hashes, self.pinned);
        // The output's token ids are not known: its stored blocks are not described.
        self.engine.publish_changes(&mut s, &extended.hashes, None);
        self.hashes = extended.hashes;
    }

    /// Marks the request as complete (counted in `vllm:request_success_total`) and frees it.
    pub fn finish(self) {
        self.engine.counters.successes.fetch_add(1, Relaxed);
    }
}

impl Drop for Sequence {
    fn drop(&mut self) {
        {
            let mut s = self.engine.lock();
            s.cache.release(&self.hashes[..self.pinned]);
        }
        self.engine.counters.running.fetch_sub(1, Relaxed);
        self.engine.admission.add_permits(1);
    }
}

async fn sleep_until_deadline(deadline: Instant) {
    if deadline > Instant::now() {
        sleep_until(deadline).await;
    }
}

/// Increments a gauge for as long as it lives (so a cancelled wait un-counts itself).
struct GaugeGuard<'a>(&'a AtomicU64);

impl<'a> GaugeGuard<'a> {
    fn increment(g: &'a AtomicU64) -> Self {
        g.fetch_add(1, Relaxed);
        Self(g)
    }
}

impl Drop for GaugeGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::BlockHasher;

    /// An 8,000-token prompt (32,000 bytes, exactly 500 blocks) made of `c`.
    fn prompt(c: u8) -> PromptBlocks {
        BlockHasher::hash_prompt(&vec![c; 32_000], 64)
    }

    fn engine(f: impl FnOnce(&mut Config)) -> Arc<Engine> {
        let mut c = Config {
            itl_batch_factor: 0.0,
            ..Config::default()
        };
        f(&mut c);
        Engine::new(c)
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }

    /// tokio's timer has a 1 ms resolution; the model itself is exact.
    fn assert_ms(got: Duration, want_ms: f64) {
        assert!(
            (ms(got) - want_ms).abs() <= 1.5,
            "got {:.3} ms, want {want_ms:.3} ms",
            ms(got)
        );
    }

    const PREFILL_8K_MS: f64 = 8000.0 / 36_000.0 * 1000.0;

    #[tokio::test(start_paused = true)]
    async fn a_miss_queued_behind_a_miss_waits_for_its_prefill_and_a_hit_is_fast() {
        let e = engine(|_| {});
        let mut a = e.admit(prompt(b'a')).await;
        let mut b = e.admit(prompt(b'b')).await;
        assert_eq!((a.cached_tokens(), b.cached_tokens()), (0, 0));
        let (ta, tb) = tokio::join!(a.first_token(), b.first_token());
        assert_ms(ta, 60.0 + PREFILL_8K_MS);
        assert_ms(tb, 60.0 + 2.0 * PREFILL_8K_MS);
        // The same prompt again: a full hit, only the fixed overhead.
        let mut hit = e.admit(prompt(b'a')).await;
        assert_eq!(hit.cached_tokens(), 8000);
        assert_ms(hit.first_token().await, 60.0);
        drop((a, b, hit));
        let s = e.stats();
        assert_eq!(s.prefix_cache_queries, 24_000);
        assert_eq!(s.prefix_cache_hits, 8_000);
        assert_eq!(s.ttft_count, 3);
        assert_eq!((s.running, s.waiting), (0, 0));
        assert_eq!(s.kv_cache_usage, 0.0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_hit_waits_behind_queued_prefill_work_like_vllm_fcfs() {
        let e = engine(|_| {});
        let mut warm = e.admit(prompt(b'a')).await;
        warm.first_token().await;
        drop(warm);
        let mut miss = e.admit(prompt(b'b')).await;
        let mut hit = e.admit(prompt(b'a')).await;
        assert_eq!(hit.cached_tokens(), 8000);
        let (_, th) = tokio::join!(miss.first_token(), hit.first_token());
        assert_ms(th, 60.0 + PREFILL_8K_MS);
    }

    #[tokio::test(start_paused = true)]
    async fn admission_is_fifo_and_a_queued_request_hits_what_the_first_cached() {
        let e = engine(|c| {
            c.max_num_seqs = 1;
            c.itl_ms = 10.0;
        });
        let start = Instant::now();
        let e2 = Arc::clone(&e);
        let first = tokio::spawn(async move {
            let mut s = e2.admit(prompt(b'a')).await;
            s.first_token().await;
            s.next_tokens(9).await;
            s.finish();
        });
        let e3 = Arc::clone(&e);
        let second = tokio::spawn(async move {
            // Wait on the condition (not a sleep): the first request holds the only slot.
            while e3.stats().running == 0 {
                tokio::task::yield_now().await;
            }
            let mut s = e3.admit(prompt(b'a')).await;
            let cached = s.cached_tokens();
            s.first_token().await;
            (cached, Instant::now() - start)
        });
        while e.stats().waiting == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!((e.stats().running, e.stats().waiting), (1, 1));
        first.await.unwrap();
        let (cached, done) = second.await.unwrap();
        assert_eq!(
            cached, 8000,
            "looked up at admission, after the first cached its blocks"
        );
        // first: 60 + prefill + 9 x 10 ms of decode; second: admitted then, full hit: + 60.
        assert_ms(done, 60.0 + PREFILL_8K_MS + 90.0 + 60.0);
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_follow_the_interval_growing_with_the_batch_and_time_scale() {
        let e = engine(|c| {
            c.itl_ms = 20.0;
            c.itl_batch_factor = 0.5;
            c.time_scale = 0.5;
        });
        let mut a = e.admit(prompt(b'a')).await;
        let b = e.admit(prompt(b'b')).await;
        // Scaled: overhead 30 ms, prefill halved.
        assert_ms(a.first_token().await, 30.0 + PREFILL_8K_MS / 2.0);
        let t0 = Instant::now();
        a.next_token().await;
        // 2 running: 20 ms x (1 + 0.5 x 2) x 0.5 = 20 ms.
        assert_ms(Instant::now() - t0, 20.0);
        drop(b);
        let t1 = Instant::now();
        a.next_tokens(2).await;
        // 1 running: 20 ms x (1 + 0.5 x 1) x 0.5 = 15 ms per token.
        assert_ms(Instant::now() - t1, 30.0);
        assert_eq!(a.tokens(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_request_releases_its_slot_and_pins() {
        let e = engine(|c| {
            c.max_num_seqs = 1;
            c.kv_capacity_tokens = 16 * 100;
        });
        let mut a = e.admit(prompt(b'a')).await;
        a.first_token().await;
        // The 500-block prompt only partly fits in 100 blocks: that part is pinned.
        assert_eq!(e.stats().kv_cache_usage, 1.0);
        assert_eq!(e.stats().cached_blocks, 100);
        // A waiter that gives up leaves no trace.
        let waiting = tokio::time::timeout(Duration::from_millis(5), e.admit(prompt(b'b'))).await;
        assert!(waiting.is_err());
        assert_eq!(e.stats().waiting, 0);
        drop(a);
        let s = e.stats();
        assert_eq!((s.running, s.waiting, s.kv_cache_usage), (0, 0, 0.0));
        let mut again = e.admit(prompt(b'a')).await;
        assert_eq!(
            again.cached_tokens(),
            1600,
            "the first 100 blocks stayed cached"
        );
        again.first_token().await;
    }
}
