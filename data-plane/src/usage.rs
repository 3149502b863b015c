//! What an engine reports about its own prompt cache, read from its responses as they pass.
//!
//! Every OpenAI-compatible engine says per request how many prompt tokens it served from its
//! cache: `usage.prompt_tokens` with `usage.prompt_tokens_details.cached_tokens` (vLLM, SGLang,
//! OpenAI; in a stream, the final usage chunk when the client asked for it), and llama.cpp's
//! `timings.prompt_n` (tokens evaluated) with `timings.cache_n` (tokens reused), in every
//! response, streamed or not. [`UsageScanner`] finds these numbers in the body bytes as they are
//! forwarded: a byte-level JSON tokenizer that keeps no copy of the body, holds nothing back, and
//! needs no more than a few bytes of state across frames (a key or number split between two
//! frames is still read). Text inside strings (generated content) never matches a key, escaped
//! quotes included. A response without these fields teaches nothing.

/// Prompt tokens of one request and how many of them the engine served from its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheReport {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

impl CacheReport {
    /// Most of the prompt came from the cache (at least half of its tokens).
    pub fn hit(&self) -> bool {
        self.cached_tokens * 2 >= self.prompt_tokens
    }
}

/// The keys the scanner reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    PromptTokens,
    CachedTokens,
    PromptN,
    CacheN,
}

impl Field {
    fn of(key: &[u8]) -> Option<Field> {
        match key {
            b"prompt_tokens" => Some(Field::PromptTokens),
            b"cached_tokens" => Some(Field::CachedTokens),
            b"prompt_n" => Some(Field::PromptN),
            b"cache_n" => Some(Field::CacheN),
            _ => None,
        }
    }
}

/// The longest key the scanner reads (`prompt_tokens`, `cached_tokens`).
const KEY_MAX: usize = 13;

#[derive(Debug, Clone, Copy)]
enum State {
    /// Between tokens.
    Outside,
    /// Inside a string: the first bytes of it (a key candidate), whether they overflowed
    /// [`KEY_MAX`], and whether the previous byte was a backslash.
    InString { len: u8, long: bool, escaped: bool },
    /// After a string that may be a key: waiting for `:`.
    AfterKey(Option<Field>),
    /// After `"key":`: waiting for the value.
    AfterColon(Field),
    /// Reading the digits of a key's value.
    Number(Field, u64),
}

/// Reads an engine's cache report from a response body, frame by frame.
#[derive(Debug, Clone)]
pub struct UsageScanner {
    state: State,
    key: [u8; KEY_MAX],
    /// The last value seen of each [`Field`] (a stream's last usage chunk wins).
    values: [Option<u64>; 4],
}

impl Default for UsageScanner {
    fn default() -> Self {
        UsageScanner {
            state: State::Outside,
            key: [0; KEY_MAX],
            values: [None; 4],
        }
    }
}

impl UsageScanner {
    /// Reads one more piece of the body.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.state = self.step(b);
        }
    }

    #[inline]
    fn step(&mut self, b: u8) -> State {
        match self.state {
            State::InString { len, long, escaped } => {
                if escaped {
                    // an escaped byte makes the string no key we read
                    return State::InString {
                        len,
                        long: true,
                        escaped: false,
                    };
                }
                match b {
                    b'\\' => State::InString {
                        len,
                        long: true,
                        escaped: true,
                    },
                    b'"' => State::AfterKey(if long {
                        None
                    } else {
                        Field::of(&self.key[..len as usize])
                    }),
                    _ if long || len as usize == KEY_MAX => State::InString {
                        len,
                        long: true,
                        escaped: false,
                    },
                    _ => {
                        self.key[len as usize] = b;
                        State::InString {
                            len: len + 1,
                            long: false,
                            escaped: false,
                        }
                    }
                }
            }
            State::AfterKey(field) => match (b, field) {
                (b' ' | b'\t' | b'\r' | b'\n', _) => State::AfterKey(field),
                (b':', Some(f)) => State::AfterColon(f),
                _ => self.outside(b),
            },
            State::AfterColon(f) => match b {
                b' ' | b'\t' | b'\r' | b'\n' => State::AfterColon(f),
                b'0'..=b'9' => State::Number(f, u64::from(b - b'0')),
                _ => self.outside(b),
            },
            State::Number(f, v) => match b {
                b'0'..=b'9' => {
                    State::Number(f, v.saturating_mul(10).saturating_add(u64::from(b - b'0')))
                }
                _ => {
                    self.values[f as usize] = Some(v);
                    self.outside(b)
                }
            },
            State::Outside => self.outside(b),
        }
    }

    #[inline]
    fn outside(&mut self, b: u8) -> State {
        if b == b'"' {
            State::InString {
                len: 0,
                long: false,
                escaped: false,
            }
        } else {
            State::Outside
        }
    }

    /// What the engine reported, once the body has ended: the OpenAI usage fields when both are
    /// there, else llama.cpp's timings; `None` when the body carried neither.
    pub fn report(&self) -> Option<CacheReport> {
        let v = |f: Field| self.values[f as usize];
        let (prompt_tokens, cached_tokens) = match (v(Field::PromptTokens), v(Field::CachedTokens))
        {
            (Some(p), Some(c)) => (p, c),
            _ => {
                let (evaluated, cached) = (v(Field::PromptN)?, v(Field::CacheN)?);
                (evaluated.saturating_add(cached), cached)
            }
        };
        (prompt_tokens > 0).then_some(CacheReport {
            prompt_tokens,
            cached_tokens: cached_tokens.min(prompt_tokens),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan_in_pieces(body: &[u8], piece: usize) -> Option<CacheReport> {
        let mut s = UsageScanner::default();
        for chunk in body.chunks(piece) {
            s.feed(chunk);
        }
        s.report()
    }

    fn report(prompt_tokens: u64, cached_tokens: u64) -> Option<CacheReport> {
        Some(CacheReport {
            prompt_tokens,
            cached_tokens,
        })
    }

    #[test]
    fn openai_usage_in_a_response_split_anywhere() {
        let body = br#"{"id":"x","choices":[{"message":{"role":"assistant","content":"hi"}}],
            "usage": {"prompt_tokens": 1290, "completion_tokens": 24, "total_tokens": 1314,
            "prompt_tokens_details": {"cached_tokens": 1216}}}"#;
        for piece in [1, 2, 3, 7, 64, body.len()] {
            assert_eq!(
                scan_in_pieces(body, piece),
                report(1290, 1216),
                "piece {piece}"
            );
        }
    }

    #[test]
    fn llama_cpp_timings_in_the_last_event_of_a_stream() {
        let body = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"ab\"}}],\"timings\":null}\n\n",
            "data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"length\"}],",
            "\"timings\":{\"cache_n\":1252,\"prompt_n\":78,\"prompt_ms\":31.2,",
            "\"predicted_n\":24}}\n\n",
            "data: [DONE]\n\n"
        );
        for piece in [1, 5, 17, body.len()] {
            assert_eq!(
                scan_in_pieces(body.as_bytes(), piece),
                report(1330, 1252),
                "piece {piece}"
            );
        }
    }

    #[test]
    fn usage_wins_over_timings_and_the_last_value_counts() {
        let body = br#"data: {"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":0}}}

data: {"timings":{"cache_n":5,"prompt_n":7},"usage":{"prompt_tokens":12,"prompt_tokens_details":{"cached_tokens":9}}}

"#;
        assert_eq!(scan_in_pieces(body, 4), report(12, 9));
    }

    #[test]
    fn keys_inside_generated_text_are_not_read() {
        let body =
            br#"{"choices":[{"text":"say \"cached_tokens\": 99 and \"prompt_tokens\": 100"}],
            "note":"prompt_tokens","x":{"cache_n_total":3,"prompt_n":"7"}}"#;
        assert_eq!(scan_in_pieces(body, 3), None);
    }

    #[test]
    fn no_report_without_the_fields_or_for_an_empty_prompt() {
        assert_eq!(scan_in_pieces(br#"{"error":{"message":"x"}}"#, 2), None);
        assert_eq!(
            scan_in_pieces(br#"{"usage":{"prompt_tokens":0,"cached_tokens":0}}"#, 2),
            None
        );
        // a cached count above the prompt is clamped
        assert_eq!(
            scan_in_pieces(br#"{"usage":{"prompt_tokens":8,"cached_tokens":9}}"#, 2),
            report(8, 8)
        );
    }

    #[test]
    fn a_hit_is_at_least_half_of_the_prompt_from_cache() {
        assert!(report(100, 50).unwrap().hit());
        assert!(!report(100, 49).unwrap().hit());
    }
}
