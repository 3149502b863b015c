//! vLLM's KV-cache events, decoded and subscribed to, so that a router can keep an exact
//! per-instance index of the blocks each engine holds.
//!
//! Map:
//! - [`decode`]: one ZeroMQ message `[topic, seq, payload]` into a [`Batch`] of [`Event`]s
//!   (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`), from either encoding vLLM has used
//!   (tagged arrays up to v0.23, maps since v0.24); block hashes normalised to a `u64`.
//! - [`subscriber`]: a task per instance with a SUB socket, sequence tracking, gap filling from
//!   the publisher's replay socket, and a [`Sink`] that receives the events or is told to reset.
//! - [`template`]: endpoint templates such as `tcp://{host}:5557` filled from an instance URL.
//!
//! Invariants: the sink sees each batch at most once and in publisher order; whenever the
//! stream cannot vouch for that (a gap the replay cannot fill, an engine restart, a dropped
//! connection, a stop) the sink is told to reset the instance before anything newer is applied.
//! Nothing here panics on what a publisher sends, and each message's cost is bounded by
//! [`DecodeLimits`]. Absences: no metrics library (plain atomic [`Counters`]), no index (the
//! sink is the caller's), no I/O besides the ZeroMQ sockets.

pub mod decode;
mod msgpack;
pub mod subscriber;
pub mod template;

pub use decode::{
    block_hash_of_bytes, decode_batch, decode_message, decode_seq, Batch, BlockHash, DecodeError,
    DecodeLimits, Event, Message,
};
pub use msgpack::Found;
pub use subscriber::{Counters, CountersSnapshot, Sink, SpawnError, Subscriber, SubscriberConfig};
pub use template::{fill as fill_template, TemplateError, TemplateProblem};
