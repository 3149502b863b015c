//! `engine-sim`: a vLLM-like simulated model server with a real prefix KV cache, so a whole
//! fleet of "LLM inference servers" runs on a laptop and routing strategies can be compared
//! honestly. A router cannot tell it from a real OpenAI-compatible server; its timing and cache
//! behaviour follow vLLM's mechanics (automatic prefix caching, FIFO admission, shared prefill).
//!
//! Map:
//! - [`config`]: [`Config`], the binary's flags (clap) and the in-process configuration.
//! - [`prompt`]: the canonical prompt text of a request, **shared with the router**
//!   ([`canonical_prompt`], zero-copy [`visit_canonical_prompt`]), and request validation.
//! - [`kv_cache`]: the pure prefix-cache model: chained block hashes (over the canonical prompt's
//!   bytes, or over token ids with `--tokenizer`), pinning, LRU eviction, recorded changes.
//! - `kv_events`: the cache's changes published as vLLM's KV events (ZeroMQ PUB + replay ROUTER,
//!   msgpack), off the engine's path through a bounded channel.
//! - [`engine`]: the timing model (admission, prefill lane, decode steps) and counters
//!   ([`Engine`], [`Stats`]).
//! - `metrics`: Prometheus exposition with vLLM's metric names.
//! - `embeddings` (`/v1/embeddings`, deterministic unit vectors) and `responses` (`/v1/responses`,
//!   non-streaming, through the same engine as completions).
//! - `openai`: response bodies and SSE framing; `server`: HTTP routes, graceful shutdown and the
//!   `completion` / `queue` / `prefill` / `decode` spans ([`serve`], [`serve_engine`]).
//!
//! Invariants:
//! - Nothing is persisted: all state is in memory and dies with the engine.
//! - The cache never exceeds its capacity and never evicts a block a running request pins;
//!   lookups cost O(blocks of the prompt), never a scan of the cache.
//! - No lock is held across an `.await`; waiting is done on tokio timers (no polling loops).
//! - No input makes the server panic: bad requests get an OpenAI-style 400/404/405/413.
//! - Nothing is logged at info level per request.

pub mod config;
mod embeddings;
pub mod engine;
mod histogram;
pub mod kv_cache;
mod kv_events;
mod metrics;
mod openai;
pub mod prompt;
mod reply;
mod responses;
mod server;

pub use config::Config;
pub use engine::{Engine, Sequence, Stats};
pub use kv_cache::{BlockHasher, CacheChange, PrefixCache, PromptBlocks};
pub use prompt::{canonical_prompt, canonical_prompt_for, visit_canonical_prompt, ApiKind};
pub use server::{serve, serve_engine};

/// Bytes of prompt text that make one token (rounded up).
pub const BYTES_PER_TOKEN: usize = 4;
