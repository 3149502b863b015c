//! Decoding one vLLM KV-event message into validated domain types ([`Message`], [`Batch`],
//! [`Event`]).
//!
//! The wire format, as vLLM's `ZmqEventPublisher` sends it (`vllm/distributed/kv_events.py`):
//! a ZeroMQ message of three frames `[topic, seq, payload]`, where `seq` is the batch's sequence
//! number as 8 bytes big-endian (counting from 0 per publisher) and `payload` is one msgpack
//! `KVEventBatch` encoded by msgspec. The batch is `array_like`: `[ts, events,
//! data_parallel_rank]` (a float, an array, an int or nil; the rank may be absent). A map
//! `{"ts": .., "events": .., "data_parallel_rank": ..}` is read too, for a publisher that does
//! not set `array_like` on the batch.
//!
//! Each event is a msgspec tagged union (`tag=True`: the tag is the class name) in one of two
//! encodings, both in use and both read here:
//! - a tagged array, positional fields in declaration order (vLLM up to v0.23.0, SGLang):
//!   `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys, group_idx, ...]`, `["BlockRemoved", block_hashes, medium,
//!   group_idx]`, `["AllBlocksCleared"]`; older releases stop earlier (v0.10.0: BlockStored
//!   ends at `lora_id`, BlockRemoved has only `block_hashes`);
//! - a map, `{"type": "BlockStored", "block_hashes": [..], ...}` (vLLM from v0.24.0), where
//!   msgspec's `omit_defaults` leaves out optional fields that are nil.
//!
//! Fields this crate does not use (`lora_id`, `extra_keys`, `kv_cache_spec_kind`, `locality`,
//! ...) and fields added later are skipped; an event of an unknown type is skipped and counted in
//! [`Batch::unknown_events`], not an error, so a newer engine does not stop the stream.
//!
//! Block hashes are normalised to one `u64` whatever the engine sent: an unsigned integer as is,
//! a negative integer (an engine that sends hashes as signed 64-bit) as the same 64 bits, and
//! bytes (vLLM's sha256 digests with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) as the xxh3-64 of
//! the bytes ([`block_hash_of_bytes`]). A hash is an opaque key: equality is all a consumer may
//! rely on.
//!
//! Bounded: a payload over [`DecodeLimits::max_payload_bytes`], a list (events, hashes, token
//! ids) over [`DecodeLimits::max_items`] or nesting deeper than [`DecodeLimits::max_depth`] is an
//! error, so a hostile stream costs bounded memory and stack. Decoding allocates only the
//! vectors and strings of the result; malformed input is a [`DecodeError`] naming the field and
//! what was found there, never a panic.

use crate::msgpack::{Found, Head, Reader};

/// An engine's block hash, normalised to 64 bits (see the module docs).
pub type BlockHash = u64;

/// One published batch: the events of one engine step, in the order the engine made them.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The engine's wall-clock time when it made the batch (seconds since the Unix epoch).
    pub ts: f64,
    /// The events this crate understands, in order.
    pub events: Vec<Event>,
    /// The data-parallel rank that published the batch, when the publisher stamped it.
    pub dp_rank: Option<i64>,
    /// How many events of an unknown type were skipped.
    pub unknown_events: u32,
}

/// One change to an engine's KV cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Blocks were filled and are now cached (vLLM's `BlockStored`). Only full blocks are
    /// reported: `token_ids` holds the tokens of the blocks in `hashes`, in order.
    Stored {
        /// The new blocks' hashes, in prefix order.
        hashes: Vec<BlockHash>,
        /// The hash of the block before the first new one; `None` at the start of a sequence.
        parent: Option<BlockHash>,
        /// The tokens of the new blocks.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The LoRA adapter the blocks were computed with.
        lora_name: Option<String>,
        /// Where the blocks live (`"GPU"`, `"CPU"`, ...); `None` from releases without it.
        medium: Option<String>,
        /// The KV-cache group (hybrid models have several: full and sliding-window attention);
        /// `None` from releases without it.
        group_idx: Option<u32>,
    },
    /// Blocks were evicted (vLLM's `BlockRemoved`).
    Removed {
        /// The evicted blocks' hashes.
        hashes: Vec<BlockHash>,
        /// Where they were evicted from; `None` from releases without it.
        medium: Option<String>,
        /// The KV-cache group; `None` from releases without it.
        group_idx: Option<u32>,
    },
    /// The engine dropped every cached block (vLLM's `AllBlocksCleared`, e.g. on a cache reset).
    Cleared,
}

impl Event {
    /// The event's type as vLLM names it (the msgspec tag), for logs and metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Stored { .. } => STORED,
            Event::Removed { .. } => REMOVED,
            Event::Cleared => CLEARED,
        }
    }
}

/// One decoded ZeroMQ message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The batch's sequence number.
    pub seq: u64,
    /// The batch.
    pub batch: Batch,
}

/// Bounds on what one message may cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeLimits {
    /// The largest payload frame accepted, in bytes.
    pub max_payload_bytes: usize,
    /// The most elements in one list: events in a batch, hashes or token ids in an event.
    pub max_items: usize,
    /// The deepest nesting accepted (skipped fields such as `extra_keys` nest a few levels).
    pub max_depth: usize,
}

impl Default for DecodeLimits {
    /// 1 MiB payloads and 65,536 items per list. vLLM's chunked prefill fills at most
    /// `max_num_batched_tokens` tokens' worth of blocks per step (thousands), so a real batch is
    /// far below both; the bound is for a hostile or broken stream.
    fn default() -> Self {
        DecodeLimits {
            max_payload_bytes: 1 << 20,
            max_items: 65_536,
            max_depth: 32,
        }
    }
}

/// What was wrong with a message. Each names the frame or field and what was found there.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// The message did not have the three frames `[topic, seq, payload]`.
    #[error("a KV-event message has 3 frames [topic, seq, payload], this one has {got}")]
    FrameCount {
        /// How many frames the message had.
        got: usize,
    },
    /// The seq frame was not 8 bytes.
    #[error("the seq frame is {got} bytes, expected 8 (a big-endian u64)")]
    SeqLength {
        /// Its length.
        got: usize,
    },
    /// The payload was over [`DecodeLimits::max_payload_bytes`].
    #[error("the payload is {len} bytes, over the limit of {limit}")]
    PayloadTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The msgpack ended inside a value.
    #[error("truncated msgpack: {needed} more bytes needed at byte {offset}")]
    Truncated {
        /// Where the missing bytes start.
        offset: usize,
        /// How many were needed.
        needed: usize,
    },
    /// The msgpack used the never-used marker 0xc1.
    #[error("invalid msgpack: reserved marker 0xc1 at byte {offset}")]
    ReservedMarker {
        /// Where.
        offset: usize,
    },
    /// Values nested deeper than [`DecodeLimits::max_depth`].
    #[error("msgpack nested deeper than {limit} levels at byte {offset}")]
    TooDeep {
        /// Where.
        offset: usize,
        /// The limit.
        limit: usize,
    },
    /// Bytes followed the batch.
    #[error("{extra} bytes after the batch, which ends at byte {offset}")]
    TrailingBytes {
        /// Where the batch ended.
        offset: usize,
        /// How many bytes followed.
        extra: usize,
    },
    /// A field held a value of the wrong type.
    #[error("{field}: expected {expected}, found {found}")]
    WrongType {
        /// The field.
        field: &'static str,
        /// What it should hold.
        expected: &'static str,
        /// What it held.
        found: Found,
    },
    /// A field held a number out of its range.
    #[error("{field}: {found} is out of range (expected {expected})")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The range.
        expected: &'static str,
        /// The value.
        found: Found,
    },
    /// A list was longer than [`DecodeLimits::max_items`].
    #[error("{field}: {len} items, over the limit of {limit}")]
    TooMany {
        /// The list.
        field: &'static str,
        /// Its claimed length.
        len: u32,
        /// The limit.
        limit: usize,
    },
    /// A required field was missing.
    #[error("{event}: the field {field} is missing")]
    Missing {
        /// The event type or "batch".
        event: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A string was not UTF-8.
    #[error("{field}: the string is not valid UTF-8")]
    BadUtf8 {
        /// The field.
        field: &'static str,
    },
}

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";
const CLEARED: &str = "AllBlocksCleared";

/// The xxh3-64 of a block hash sent as bytes: how such hashes become a [`BlockHash`].
pub fn block_hash_of_bytes(bytes: &[u8]) -> BlockHash {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Reads the seq frame: 8 bytes, big-endian.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLength { got: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decodes one ZeroMQ message, its frames `[topic, seq, payload]`. The topic is not checked:
/// the SUB socket's subscription already filtered on it.
pub fn decode_message<F: AsRef<[u8]>>(
    frames: &[F],
    limits: &DecodeLimits,
) -> Result<Message, DecodeError> {
    let [_topic, seq, payload] = frames else {
        return Err(DecodeError::FrameCount { got: frames.len() });
    };
    let seq = decode_seq(seq.as_ref())?;
    let batch = decode_batch(payload.as_ref(), limits)?;
    Ok(Message { seq, batch })
}

/// Decodes one payload: a msgpack `KVEventBatch`.
pub fn decode_batch(payload: &[u8], limits: &DecodeLimits) -> Result<Batch, DecodeError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(DecodeError::PayloadTooLarge {
            len: payload.len(),
            limit: limits.max_payload_bytes,
        });
    }
    let mut d = Decoder {
        r: Reader::new(payload, limits.max_depth),
        max_items: limits.max_items,
    };
    let batch = d.batch()?;
    let extra = d.r.remaining();
    if extra > 0 {
        return Err(DecodeError::TrailingBytes {
            offset: d.r.position(),
            extra,
        });
    }
    Ok(batch)
}

/// An event field this crate reads; everything else is skipped.
#[derive(Clone, Copy)]
enum Field {
    Hashes,
    Parent,
    TokenIds,
    BlockSize,
    Medium,
    LoraName,
    GroupIdx,
    Skip,
}

/// `BlockStored`'s fields in declaration order, as a tagged array carries them.
const STORED_FIELDS: &[Field] = &[
    Field::Hashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::Skip, // lora_id
    Field::Medium,
    Field::LoraName,
    Field::Skip, // extra_keys
    Field::GroupIdx,
];

/// `BlockRemoved`'s fields in declaration order.
const REMOVED_FIELDS: &[Field] = &[Field::Hashes, Field::Medium, Field::GroupIdx];

fn map_field(key: &[u8]) -> Field {
    match key {
        b"block_hashes" => Field::Hashes,
        b"parent_block_hash" => Field::Parent,
        b"token_ids" => Field::TokenIds,
        b"block_size" => Field::BlockSize,
        b"medium" => Field::Medium,
        b"lora_name" => Field::LoraName,
        b"group_idx" => Field::GroupIdx,
        _ => Field::Skip,
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn kind_of(tag: &[u8]) -> Kind {
    match tag {
        b"BlockStored" => Kind::Stored,
        b"BlockRemoved" => Kind::Removed,
        b"AllBlocksCleared" => Kind::Cleared,
        _ => Kind::Unknown,
    }
}

/// The fields of one event as read, before the event type decides which are required.
#[derive(Default)]
struct Fields {
    hashes: Option<Vec<BlockHash>>,
    parent: Option<BlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    medium: Option<String>,
    lora_name: Option<String>,
    group_idx: Option<u32>,
}

impl Fields {
    fn into_event(self, kind: Kind) -> Result<Option<Event>, DecodeError> {
        Ok(Some(match kind {
            Kind::Stored => Event::Stored {
                hashes: self.hashes.ok_or(DecodeError::Missing {
                    event: STORED,
                    field: "block_hashes",
                })?,
                parent: self.parent,
                token_ids: self.token_ids.ok_or(DecodeError::Missing {
                    event: STORED,
                    field: "token_ids",
                })?,
                block_size: self.block_size.ok_or(DecodeError::Missing {
                    event: STORED,
                    field: "block_size",
                })?,
                lora_name: self.lora_name,
                medium: self.medium,
                group_idx: self.group_idx,
            },
            Kind::Removed => Event::Removed {
                hashes: self.hashes.ok_or(DecodeError::Missing {
                    event: REMOVED,
                    field: "block_hashes",
                })?,
                medium: self.medium,
                group_idx: self.group_idx,
            },
            Kind::Cleared => Event::Cleared,
            Kind::Unknown => return Ok(None),
        }))
    }
}

struct Decoder<'a> {
    r: Reader<'a>,
    max_items: usize,
}

fn wrong(field: &'static str, expected: &'static str, head: Head<'_>) -> DecodeError {
    DecodeError::WrongType {
        field,
        expected,
        found: head.found(),
    }
}

impl<'a> Decoder<'a> {
    fn batch(&mut self) -> Result<Batch, DecodeError> {
        let mut ts = None;
        let mut events = None;
        let mut dp_rank = None;
        match self.r.head()? {
            Head::Array(n) => {
                for i in 0..n {
                    match i {
                        0 => ts = Some(self.ts()?),
                        1 => events = Some(self.events()?),
                        2 => dp_rank = self.dp_rank()?,
                        _ => self.r.skip()?,
                    }
                }
            }
            Head::Map(n) => {
                for _ in 0..n {
                    match self.r.head()? {
                        Head::Str(b"ts") => ts = Some(self.ts()?),
                        Head::Str(b"events") => events = Some(self.events()?),
                        Head::Str(b"data_parallel_rank") => dp_rank = self.dp_rank()?,
                        Head::Str(_) => self.r.skip()?,
                        other => return Err(wrong("batch field name", "a string", other)),
                    }
                }
            }
            other => {
                return Err(wrong(
                    "batch",
                    "an array [ts, events, data_parallel_rank]",
                    other,
                ))
            }
        }
        let ts = ts.ok_or(DecodeError::Missing {
            event: "batch",
            field: "ts",
        })?;
        let (events, unknown_events) = events.ok_or(DecodeError::Missing {
            event: "batch",
            field: "events",
        })?;
        Ok(Batch {
            ts,
            events,
            dp_rank,
            unknown_events,
        })
    }

    fn ts(&mut self) -> Result<f64, DecodeError> {
        match self.r.head()? {
            Head::Float(v) => Ok(v),
            // An integer timestamp is still a timestamp; precision loss past 2^53 s is moot.
            Head::Uint(v) => Ok(v as f64),
            Head::Int(v) => Ok(v as f64),
            other => Err(wrong("ts", "a float", other)),
        }
    }

    fn dp_rank(&mut self) -> Result<Option<i64>, DecodeError> {
        match self.r.head()? {
            Head::Nil => Ok(None),
            Head::Int(v) => Ok(Some(v)),
            Head::Uint(v) => i64::try_from(v)
                .map(Some)
                .map_err(|_| DecodeError::OutOfRange {
                    field: "data_parallel_rank",
                    expected: "a 64-bit signed integer",
                    found: Found::Uint(v),
                }),
            other => Err(wrong("data_parallel_rank", "an integer or nil", other)),
        }
    }

    /// A list's length, checked against the limit.
    fn list(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        match self.r.head()? {
            Head::Array(n) if n as usize > self.max_items => Err(DecodeError::TooMany {
                field,
                len: n,
                limit: self.max_items,
            }),
            Head::Array(n) => Ok(n),
            other => Err(wrong(field, "an array", other)),
        }
    }

    /// Capacity for a list of `n`: never more than the bytes left could hold.
    fn capacity(&self, n: u32) -> usize {
        (n as usize).min(self.r.remaining())
    }

    fn events(&mut self) -> Result<(Vec<Event>, u32), DecodeError> {
        let n = self.list("events")?;
        let mut events = Vec::with_capacity(self.capacity(n));
        let mut unknown = 0u32;
        for _ in 0..n {
            match self.event()? {
                Some(event) => events.push(event),
                None => unknown += 1,
            }
        }
        Ok((events, unknown))
    }

    /// One event; `None` for an unknown type (skipped whole).
    fn event(&mut self) -> Result<Option<Event>, DecodeError> {
        let mut fields = Fields::default();
        match self.r.head()? {
            Head::Array(0) => Err(DecodeError::Missing {
                event: "event",
                field: "the type tag",
            }),
            Head::Array(n) => {
                let kind = match self.r.head()? {
                    Head::Str(tag) => kind_of(tag),
                    other => return Err(wrong("event type tag", "a string", other)),
                };
                let layout: &[Field] = match kind {
                    Kind::Stored => STORED_FIELDS,
                    Kind::Removed => REMOVED_FIELDS,
                    Kind::Cleared | Kind::Unknown => &[],
                };
                for i in 1..n as usize {
                    let field = layout.get(i - 1).copied().unwrap_or(Field::Skip);
                    self.field(field, &mut fields)?;
                }
                if kind == Kind::Stored && (n as usize) < 5 {
                    // The first four fields are required (and have no defaults) in every
                    // release: a shorter array is not a BlockStored vLLM sent.
                    let missing = [
                        "block_hashes",
                        "parent_block_hash",
                        "token_ids",
                        "block_size",
                    ];
                    return Err(DecodeError::Missing {
                        event: STORED,
                        field: missing[(n as usize).saturating_sub(1).min(3)],
                    });
                }
                fields.into_event(kind)
            }
            Head::Map(n) => {
                let mut kind = None;
                for i in 0..n {
                    let key = match self.r.head()? {
                        Head::Str(key) => key,
                        other => return Err(wrong("event field name", "a string", other)),
                    };
                    if key == b"type" {
                        let k = match self.r.head()? {
                            Head::Str(tag) => kind_of(tag),
                            other => return Err(wrong("event type tag", "a string", other)),
                        };
                        kind = Some(k);
                        if k == Kind::Unknown {
                            // msgspec writes the tag first: skip the rest of an unknown event
                            // unread, whatever types its fields have.
                            for _ in i + 1..n {
                                self.r.skip()?;
                                self.r.skip()?;
                            }
                            return Ok(None);
                        }
                    } else {
                        self.field(map_field(key), &mut fields)?;
                    }
                }
                match kind {
                    Some(kind) => fields.into_event(kind),
                    None => Err(DecodeError::Missing {
                        event: "event",
                        field: "type",
                    }),
                }
            }
            other => Err(wrong(
                "event",
                "a tagged array or a map with a \"type\"",
                other,
            )),
        }
    }

    fn field(&mut self, field: Field, fields: &mut Fields) -> Result<(), DecodeError> {
        match field {
            Field::Hashes => fields.hashes = Some(self.hashes("block_hashes")?),
            Field::Parent => {
                fields.parent = match self.r.head()? {
                    Head::Nil => None,
                    head => Some(hash("parent_block_hash", head)?),
                }
            }
            Field::TokenIds => fields.token_ids = Some(self.token_ids()?),
            Field::BlockSize => {
                fields.block_size = Some(small_uint("block_size", 1, self.r.head()?)?)
            }
            Field::Medium => fields.medium = self.opt_string("medium")?,
            Field::LoraName => fields.lora_name = self.opt_string("lora_name")?,
            Field::GroupIdx => {
                fields.group_idx = match self.r.head()? {
                    Head::Nil => None,
                    head => Some(small_uint("group_idx", 0, head)?),
                }
            }
            Field::Skip => self.r.skip()?,
        }
        Ok(())
    }

    fn hashes(&mut self, field: &'static str) -> Result<Vec<BlockHash>, DecodeError> {
        let n = self.list(field)?;
        let mut out = Vec::with_capacity(self.capacity(n));
        for _ in 0..n {
            out.push(hash(field, self.r.head()?)?);
        }
        Ok(out)
    }

    fn token_ids(&mut self) -> Result<Vec<u32>, DecodeError> {
        let n = self.list("token_ids")?;
        let mut out = Vec::with_capacity(self.capacity(n));
        for _ in 0..n {
            out.push(small_uint("token_ids", 0, self.r.head()?)?);
        }
        Ok(out)
    }

    fn opt_string(&mut self, field: &'static str) -> Result<Option<String>, DecodeError> {
        match self.r.head()? {
            Head::Nil => Ok(None),
            Head::Str(s) => std::str::from_utf8(s)
                .map(|s| Some(s.to_owned()))
                .map_err(|_| DecodeError::BadUtf8 { field }),
            other => Err(wrong(field, "a string or nil", other)),
        }
    }
}

/// An integer from `min` (0 or 1) to `u32::MAX`.
fn small_uint(field: &'static str, min: u64, head: Head<'_>) -> Result<u32, DecodeError> {
    let out_of_range = || DecodeError::OutOfRange {
        field,
        expected: if min == 0 {
            "0..=4294967295"
        } else {
            "1..=4294967295"
        },
        found: head.found(),
    };
    match head {
        Head::Uint(v) if v >= min => u32::try_from(v).map_err(|_| out_of_range()),
        Head::Uint(_) | Head::Int(_) => Err(out_of_range()),
        other => Err(wrong(field, "an integer", other)),
    }
}

/// One block hash, normalised (see the module docs).
fn hash(field: &'static str, head: Head<'_>) -> Result<BlockHash, DecodeError> {
    match head {
        Head::Uint(v) => Ok(v),
        // Same 64 bits: an engine that sends signed hashes means the same key.
        Head::Int(v) => Ok(v as u64),
        Head::Bin(bytes) => Ok(block_hash_of_bytes(bytes)),
        other => Err(wrong(field, "an integer or bytes", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seq_is_eight_bytes_big_endian() {
        assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(258));
        assert_eq!(
            decode_seq(&[1, 2, 3]),
            Err(DecodeError::SeqLength { got: 3 })
        );
    }

    #[test]
    fn error_messages_name_the_field_and_the_value() {
        let e = DecodeError::WrongType {
            field: "token_ids",
            expected: "integers",
            found: Found::Str(3),
        };
        assert_eq!(
            e.to_string(),
            "token_ids: expected integers, found a string of 3 bytes"
        );
        let e = DecodeError::OutOfRange {
            field: "token_ids",
            expected: "0..=4294967295",
            found: Found::Int(-3),
        };
        assert_eq!(
            e.to_string(),
            "token_ids: integer -3 is out of range (expected 0..=4294967295)"
        );
    }
}
