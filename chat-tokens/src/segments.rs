//! The fast path: encode a rendered chat piece by piece, the pieces between the tokenizer's added
//! (special) tokens, and remember each piece's ids, so the system prompt and the earlier turns a
//! conversation resends cost a hash lookup instead of a BPE run.
//!
//! Exact, not approximate: `tokenizers` itself first splits the text on the added tokens that are
//! not normalized (its `AddedVocabulary::extract_and_normalize`, leftmost-longest), and normalizes,
//! pre-tokenizes and models each piece on its own; the post-processor (BOS, ...) runs last, and
//! this path is used only without it (`add_special_tokens` false, the chat default). So the ids of
//! the text are the concatenation of the pieces' ids. The path is off (everything goes through
//! `encode_fast`) when an added token would make the split depend on its neighbours:
//! `lstrip`/`rstrip`/`single_word` tokens, or `encode_special_tokens` set.
//!
//! The memory is bounded: two generations of at most [`SegmentCache::capacity_tokens`] ids each;
//! when the current one fills it becomes the old one and the older is dropped, and a hit in the
//! old one moves the piece to the current one (a cheap approximation of LRU). Pieces are keyed by
//! the xxh3-128 of their bytes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use aho_corasick::{AhoCorasick, MatchKind};
use xxhash_rust::xxh3::xxh3_128;

/// The added tokens the text is split on.
#[derive(Debug)]
pub(crate) struct Splitter {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

impl Splitter {
    /// `None` when the tokenizer's added tokens rule the fast path out (see the module docs), or
    /// when it has none (nothing to split on: one piece, no gain).
    pub(crate) fn new(tokenizer: &tokenizers::Tokenizer) -> Option<Self> {
        if tokenizer.get_encode_special_tokens() {
            return None;
        }
        let mut tokens: Vec<(String, u32)> = Vec::new();
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.lstrip || token.rstrip || token.single_word {
                return None;
            }
            if !token.normalized && !token.content.is_empty() {
                tokens.push((token.content, id));
            }
        }
        if tokens.is_empty() {
            return None;
        }
        tokens.sort();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(tokens.iter().map(|(t, _)| t))
            .ok()?;
        Some(Splitter {
            matcher,
            ids: tokens.into_iter().map(|(_, id)| id).collect(),
        })
    }

    /// Calls `each` with the text between added tokens and with each added token, in order.
    pub(crate) fn split<E>(
        &self,
        text: &str,
        mut each: impl FnMut(Piece<'_>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut at = 0;
        for m in self.matcher.find_iter(text) {
            if m.start() > at {
                each(Piece::Text(&text[at..m.start()]))?;
            }
            each(Piece::Token(self.ids[m.pattern().as_usize()], m.len()))?;
            at = m.end();
        }
        if at < text.len() {
            each(Piece::Text(&text[at..]))?;
        }
        Ok(())
    }
}

/// The smallest chunk [`chunks`] cuts, in bytes.
pub(crate) const CHUNK_BYTES: usize = 512;

/// Cuts a long piece into chunks of at least [`CHUNK_BYTES`] at places where a byte-level BPE's
/// pre-tokenizer (GPT-2's, Llama 3's and their kin) always splits: before a single space that
/// follows a non-space ASCII character and precedes an ASCII letter (`word word`, `end. Next`),
/// so the chunks' ids, encoded one by one and remembered, are the piece's ids whole. That holds
/// for those pre-tokenizers, not for every tokenizer (a SentencePiece `Metaspace`, a normalizer
/// that looks across words): [`Chunking`] checks it on the tokenizer in use.
pub(crate) fn chunks(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= bytes.len() {
            return None;
        }
        let mut at = start + CHUNK_BYTES;
        let cut = loop {
            if at + 1 >= bytes.len() {
                break bytes.len();
            }
            match memchr::memchr(b' ', &bytes[at..bytes.len() - 1]) {
                None => break bytes.len(),
                Some(i) => {
                    let p = at + i;
                    if p > start
                        && bytes[p - 1].is_ascii_graphic()
                        && bytes[p + 1].is_ascii_alphabetic()
                    {
                        break p;
                    }
                    at = p + 1;
                }
            }
        };
        let chunk = &text[start..cut];
        start = cut;
        Some(chunk)
    })
}

/// Whether [`chunks`] may be used with this tokenizer: the first [`Chunking::CHECKS`] long
/// pieces (and one in [`Chunking::EVERY`] after) are also encoded whole and compared; a single
/// difference turns chunking off for good.
#[derive(Debug)]
pub(crate) struct Chunking {
    on: std::sync::atomic::AtomicBool,
    seen: std::sync::atomic::AtomicU64,
}

impl Chunking {
    pub(crate) const CHECKS: u64 = 32;
    pub(crate) const EVERY: u64 = 1024;

    pub(crate) fn new() -> Self {
        Chunking {
            on: std::sync::atomic::AtomicBool::new(true),
            seen: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub(crate) fn is_on(&self) -> bool {
        self.on.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether this long piece should be checked against its whole encoding.
    pub(crate) fn check_next(&self) -> bool {
        let n = self.seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        n < Self::CHECKS || n.is_multiple_of(Self::EVERY)
    }

    pub(crate) fn turn_off(&self) {
        self.on.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A piece of the text: text to encode, or an added token's id (and its length in the text).
pub(crate) enum Piece<'a> {
    Text(&'a str),
    Token(u32, usize),
}

/// Ids of pieces already encoded.
#[derive(Debug)]
pub(crate) struct SegmentCache {
    capacity_tokens: usize,
    generations: Mutex<Generations>,
}

#[derive(Debug, Default)]
struct Generations {
    current: HashMap<u128, Arc<[u32]>>,
    current_tokens: usize,
    old: HashMap<u128, Arc<[u32]>>,
}

impl SegmentCache {
    pub(crate) fn new(capacity_tokens: usize) -> Self {
        SegmentCache {
            capacity_tokens,
            generations: Mutex::new(Generations::default()),
        }
    }

    pub(crate) fn capacity_tokens(&self) -> usize {
        self.capacity_tokens
    }

    /// The ids of `piece`, from memory or from `encode` (then remembered).
    pub(crate) fn get_or_encode<E>(
        &self,
        piece: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Arc<[u32]>, E> {
        if self.capacity_tokens == 0 {
            return encode(piece).map(Arc::from);
        }
        let key = xxh3_128(piece.as_bytes());
        {
            let mut g = self.lock();
            if let Some(ids) = g.current.get(&key) {
                return Ok(Arc::clone(ids));
            }
            if let Some(ids) = g.old.remove(&key) {
                self.insert(&mut g, key, Arc::clone(&ids));
                return Ok(ids);
            }
        }
        // Encoded without the lock: another thread may encode the same piece meanwhile, and
        // both insert the same ids.
        let ids: Arc<[u32]> = encode(piece)?.into();
        self.insert(&mut self.lock(), key, Arc::clone(&ids));
        Ok(ids)
    }

    fn insert(&self, g: &mut Generations, key: u128, ids: Arc<[u32]>) {
        if ids.len() > self.capacity_tokens {
            return;
        }
        if g.current_tokens + ids.len() > self.capacity_tokens {
            g.old = std::mem::take(&mut g.current);
            g.current_tokens = 0;
        }
        g.current_tokens += ids.len();
        g.current.insert(key, ids);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Generations> {
        // The maps stay consistent whatever panicked while the lock was held.
        self.generations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_text_and_cut_only_before_a_space_between_a_word_and_a_letter() {
        let text =
            "Intro. ".to_string() + &"alpha beta, gamma; 12 delta.\nÉté x  y \"q\" z ".repeat(200);
        let cut: Vec<&str> = chunks(&text).collect();
        assert!(cut.len() > 5, "{}", cut.len());
        assert_eq!(cut.concat(), text);
        for pair in cut.windows(2) {
            let (a, b) = (pair[0].as_bytes(), pair[1].as_bytes());
            assert!(a.len() >= CHUNK_BYTES);
            assert!(a[a.len() - 1].is_ascii_graphic(), "{:?}", pair[0]);
            assert!(b[0] == b' ' && b[1].is_ascii_alphabetic(), "{:?}", pair[1]);
        }
        // nothing to cut at: one chunk
        let solid = "x".repeat(3000);
        assert_eq!(chunks(&solid).collect::<Vec<_>>(), [solid.as_str()]);
        assert_eq!(chunks("").count(), 0);
    }
}
