//! The block hasher and the key region's text: characters counted and cut on UTF-8 boundaries
//! (a word at a time), blocks chained as they fill.

use super::*;

/// The chained 64-byte block hash over a byte stream fed piece by piece; no allocation.
#[derive(Clone)]
pub struct BlockHasher {
    pub(super) buf: [u8; BLOCK_BYTES],
    pub(super) filled: usize,
    pub(super) chain: u64,
    pub(super) blocks: u32,
}

impl BlockHasher {
    pub fn new(seed: u64) -> Self {
        BlockHasher {
            buf: [0; BLOCK_BYTES],
            filled: 0,
            chain: seed,
            blocks: 0,
        }
    }

    pub fn feed(&mut self, mut data: &[u8]) {
        if self.filled > 0 {
            let take = (BLOCK_BYTES - self.filled).min(data.len());
            self.buf[self.filled..self.filled + take].copy_from_slice(&data[..take]);
            self.filled += take;
            data = &data[take..];
            if self.filled < BLOCK_BYTES {
                return;
            }
            self.chain = xxh3_64_with_seed(&self.buf, self.chain);
            self.blocks += 1;
            self.filled = 0;
        }
        let mut blocks = data.chunks_exact(BLOCK_BYTES);
        for block in &mut blocks {
            self.chain = xxh3_64_with_seed(block, self.chain);
            self.blocks += 1;
        }
        let rest = blocks.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.filled = rest.len();
    }

    /// (key hash, number of blocks including a trailing partial one).
    pub fn finish(&self) -> (u64, u32) {
        if self.filled > 0 {
            (
                xxh3_64_with_seed(&self.buf[..self.filled], self.chain),
                self.blocks + 1,
            )
        } else {
            (self.chain, self.blocks)
        }
    }
}

/// Canonical text fed in pieces, cut at a character budget.
pub(super) struct TextKey {
    pub(super) hasher: BlockHasher,
    pub(super) remaining: usize,
    pub(super) chars: usize,
    pub(super) full: bool,
    pub(super) bad: bool,
}

impl TextKey {
    pub(super) fn new(limit: usize, seed: u64) -> Self {
        TextKey {
            hasher: BlockHasher::new(seed),
            remaining: limit,
            chars: 0,
            full: limit == 0,
            bad: false,
        }
    }

    /// Where the next search for special bytes from `at` stops (at most `limit`): `remaining`
    /// bytes, moved forward to a character boundary. Every character is at least one byte, so the
    /// window never holds more than the rest of the key and ends on a whole character; for ASCII
    /// one window completes the key, so a long string is not searched past the key region. The
    /// caller loops while the key is not full.
    pub(super) fn window_end(&self, b: &[u8], at: usize, limit: usize) -> usize {
        let mut end = at.saturating_add(self.remaining.max(1)).min(limit);
        while end < limit && (b[end] & 0xC0) == 0x80 {
            end += 1;
        }
        end
    }

    /// Feeds whole characters (`piece` is a run of complete UTF-8 sequences, or ends where the
    /// budget cuts it).
    pub(super) fn push(&mut self, piece: &[u8]) {
        if self.full || piece.is_empty() {
            return;
        }
        let (take, chars) = if piece.len() <= self.remaining {
            (piece.len(), count_chars(piece))
        } else {
            cut_chars(piece, self.remaining)
        };
        let taken = &piece[..take];
        if std::str::from_utf8(taken).is_err() {
            self.bad = true;
            self.full = true;
            return;
        }
        self.hasher.feed(taken);
        self.remaining -= chars;
        self.chars += chars;
        if self.remaining == 0 {
            self.full = true;
        }
    }

    pub(super) fn finish(&self, source: KeySource) -> Option<PromptKey> {
        self.finish_chat(source, false)
    }

    pub(super) fn finish_chat(&self, source: KeySource, head_only: bool) -> Option<PromptKey> {
        if self.bad {
            return None;
        }
        let (hash, blocks) = self.hasher.finish();
        Some(PromptKey {
            hash,
            blocks,
            len: self.chars as u32,
            source,
            head_only,
            first_turn: false,
        })
    }

    /// A fresh budget of `limit` characters from here on (the deep key's first user message).
    pub(super) fn restart_budget(&mut self, limit: usize) {
        self.remaining = limit;
        self.full = limit == 0 || self.bad;
    }
}

/// Characters in UTF-8 bytes: the bytes that are not continuation bytes (`0b10xx_xxxx`), counted
/// eight at a time.
pub(super) fn count_chars(bytes: &[u8]) -> usize {
    let mut continuation = 0usize;
    let mut words = bytes.chunks_exact(8);
    let mut lanes = 0u64; // one counter per byte lane, flushed before it can overflow
    let mut pending = 0;
    for word in &mut words {
        let x = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        lanes += continuation_bits(x) >> 7;
        pending += 1;
        if pending == 255 {
            continuation += sum_lanes(lanes);
            lanes = 0;
            pending = 0;
        }
    }
    continuation += sum_lanes(lanes);
    continuation += words
        .remainder()
        .iter()
        .filter(|&&b| (b & 0xC0) == 0x80)
        .count();
    bytes.len() - continuation
}

/// Bit 7 of each byte lane of `x` (eight bytes, little-endian) set where that byte is a UTF-8
/// continuation byte (`0b10xx_xxxx`).
#[inline]
pub(super) fn continuation_bits(x: u64) -> u64 {
    const HIGH: u64 = 0x8080_8080_8080_8080;
    x & !(x << 1) & HIGH
}

/// Sum of the eight byte lanes of `x`.
pub(super) fn sum_lanes(x: u64) -> usize {
    const LOW_BYTES: u64 = 0x00FF_00FF_00FF_00FF;
    let pairs = (x & LOW_BYTES) + ((x >> 8) & LOW_BYTES); // four 16-bit lanes, each <= 510
    (pairs.wrapping_mul(0x0001_0001_0001_0001) >> 48) as usize
}

/// Byte length and character count of the first `limit` characters of `bytes`.
pub(super) fn cut_chars(bytes: &[u8], limit: usize) -> (usize, usize) {
    let mut chars = 0;
    // Eight bytes at a time while the whole word fits the budget, then byte by byte.
    let mut start = 0;
    for word in bytes.chunks_exact(8) {
        let x = u64::from_le_bytes(word.try_into().expect("8 bytes"));
        let in_word = 8 - continuation_bits(x).count_ones() as usize;
        if chars + in_word > limit {
            break;
        }
        chars += in_word;
        start += 8;
    }
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        if (b & 0xC0) != 0x80 {
            if chars == limit {
                return (i, chars);
            }
            chars += 1;
        }
    }
    (bytes.len(), chars)
}
