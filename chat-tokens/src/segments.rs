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
            each(Piece::Token(self.ids[m.pattern().as_usize()]))?;
            at = m.end();
        }
        if at < text.len() {
            each(Piece::Text(&text[at..]))?;
        }
        Ok(())
    }
}

/// A piece of the text: text to encode, or an added token's id.
pub(crate) enum Piece<'a> {
    Text(&'a str),
    Token(u32),
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
