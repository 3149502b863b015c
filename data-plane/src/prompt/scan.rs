//! The tolerant JSON scanner the keys are read with: spans of strings, escapes decoded piece by
//! piece into the key's text, values skipped without being decoded.

use super::*;

/// A JSON string's position in the body: the bytes between its quotes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Span {
    pub(super) start: usize,
    pub(super) end: usize,
}

/// A tolerant forward scanner over JSON bytes. Every method returns `None` on malformed input.
pub(super) struct Scan<'a> {
    pub(super) b: &'a [u8],
    pub(super) pos: usize,
}

impl<'a> Scan<'a> {
    pub(super) fn new(b: &'a [u8]) -> Self {
        Scan { b, pos: 0 }
    }

    pub(super) fn ws(&mut self) {
        while let Some(&c) = self.b.get(self.pos) {
            if matches!(c, b' ' | b'\n' | b'\r' | b'\t') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    pub(super) fn peek(&self) -> Option<u8> {
        self.b.get(self.pos).copied()
    }

    pub(super) fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.peek() == Some(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// A string at the cursor (after whitespace); the cursor moves past its closing quote.
    pub(super) fn string(&mut self) -> Option<Span> {
        self.ws();
        if self.peek() != Some(b'"') {
            return None;
        }
        let start = self.pos + 1;
        let end = string_end(self.b, start)?;
        self.pos = end + 1;
        Some(Span { start, end })
    }

    /// Skips one value of any kind, without validating nested structure beyond bracket balance.
    pub(super) fn skip_value(&mut self) -> Option<()> {
        self.ws();
        match self.peek()? {
            b'"' => self.string().map(|_| ()),
            b'{' | b'[' => {
                let mut depth = 0usize;
                loop {
                    match *self.b.get(self.pos)? {
                        b'"' => {
                            self.string()?;
                            continue;
                        }
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.pos += 1;
                                return Some(());
                            }
                        }
                        _ => {}
                    }
                    self.pos += 1;
                }
            }
            b'}' | b']' | b',' | b':' => None,
            _ => {
                let start = self.pos;
                while let Some(&c) = self.b.get(self.pos) {
                    if matches!(c, b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t') {
                        break;
                    }
                    self.pos += 1;
                }
                (self.pos > start).then_some(())
            }
        }
    }

    /// After a value inside an object or array: `Some(true)` for a comma (more follows),
    /// `Some(false)` for the closing bracket.
    pub(super) fn next_or_close(&mut self, close: u8) -> Option<bool> {
        if self.eat(b',') {
            Some(true)
        } else if self.eat(close) {
            Some(false)
        } else {
            None
        }
    }

    /// An object key and its colon.
    pub(super) fn key(&mut self) -> Option<Span> {
        let k = self.string()?;
        self.eat(b':').then_some(k)
    }

    pub(super) fn is(&self, span: Span, lit: &str) -> bool {
        let raw = &self.b[span.start..span.end];
        if raw == lit.as_bytes() {
            return true;
        }
        // Only an escaped spelling of the literal can still match.
        raw.contains(&b'\\') && decode(self.b, span).is_some_and(|s| s == lit)
    }
}

/// Decodes a string span (allocates only when it holds escapes).
pub(super) fn decode(b: &[u8], span: Span) -> Option<Cow<'_, str>> {
    let raw = &b[span.start..span.end];
    if memchr::memchr(b'\\', raw).is_none() {
        return std::str::from_utf8(raw).ok().map(Cow::Borrowed);
    }
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match memchr::memchr(b'\\', &raw[i..]) {
            Some(off) => {
                out.push_str(std::str::from_utf8(&raw[i..i + off]).ok()?);
                let (c, next) = unescape(raw, i + off)?;
                out.push(c);
                i = next;
            }
            None => {
                out.push_str(std::str::from_utf8(&raw[i..]).ok()?);
                break;
            }
        }
    }
    Some(Cow::Owned(out))
}

/// The escape starting at `raw[at] == b'\\'`: the character and the index after it.
pub(super) fn unescape(raw: &[u8], at: usize) -> Option<(char, usize)> {
    let c = match *raw.get(at + 1)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let hi = hex4(raw.get(at + 2..at + 6)?)?;
            if (0xD800..0xDC00).contains(&hi) {
                if raw.get(at + 6..at + 8)? != b"\\u" {
                    return None;
                }
                let lo = hex4(raw.get(at + 8..at + 12)?)?;
                if !(0xDC00..0xE000).contains(&lo) {
                    return None;
                }
                let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                return Some((char::from_u32(c)?, at + 12));
            }
            return Some((char::from_u32(hi)?, at + 6));
        }
        _ => return None,
    };
    Some((c, at + 2))
}

pub(super) fn hex4(h: &[u8]) -> Option<u32> {
    let mut v = 0u32;
    for &c in h {
        v = v * 16 + (c as char).to_digit(16)?;
    }
    Some(v)
}

/// Feeds the decoded text of a known span.
pub(super) fn emit_span(b: &[u8], span: Span, key: &mut TextKey) -> Option<()> {
    let mut specials = Specials::new(b);
    let mut out = Decoded::new();
    let mut i = span.start;
    while i < span.end && !key.full {
        // As in `stream_string`: look no further than the rest of the key can reach, so a long
        // span is not searched past the key region.
        let wend = key.window_end(b, i, span.end);
        match specials.find(i, wend) {
            Some(j) => {
                out.run(&b[i..j], key);
                let (c, next) = unescape(b, j)?;
                out.char(c, key);
                i = next;
            }
            None => {
                out.run(&b[i..wend], key);
                out.flush(key);
                i = wend;
            }
        }
    }
    out.flush(key);
    Some(())
}

/// Decoded text gathered on the stack so the key sees few large pieces instead of one piece per
/// escape sequence.
pub(super) struct Decoded {
    pub(super) buf: [u8; Decoded::CAP],
    pub(super) len: usize,
}

impl Decoded {
    const CAP: usize = 512;

    pub(super) fn new() -> Self {
        Decoded {
            buf: [0; Decoded::CAP],
            len: 0,
        }
    }

    /// A run of raw bytes (whole characters, or the tail of the key region).
    pub(super) fn run(&mut self, bytes: &[u8], key: &mut TextKey) {
        if self.len + bytes.len() > Self::CAP {
            self.flush(key);
            if bytes.len() > Self::CAP / 2 {
                key.push(bytes);
                return;
            }
        }
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    pub(super) fn char(&mut self, c: char, key: &mut TextKey) {
        if self.len + 4 > Self::CAP {
            self.flush(key);
        }
        self.len += c.encode_utf8(&mut self.buf[self.len..]).len();
    }

    pub(super) fn flush(&mut self, key: &mut TextKey) {
        if self.len > 0 {
            key.push(&self.buf[..self.len]);
            self.len = 0;
        }
    }
}

/// Feeds the decoded text of the string at the cursor while scanning it. Stops early (cursor left
/// inside the string) once the key is full, so a long system prompt is not scanned past the key.
pub(super) fn stream_string(s: &mut Scan<'_>, key: &mut TextKey) -> Option<()> {
    s.ws();
    if s.peek() != Some(b'"') {
        return None;
    }
    let b = s.b;
    let mut i = s.pos + 1;
    let mut specials = Specials::new(b);
    let mut out = Decoded::new();
    loop {
        if key.full {
            return Some(());
        }
        let wend = key.window_end(b, i, b.len());
        match specials.find(i, wend) {
            None => {
                if wend == b.len() {
                    return None; // unterminated string
                }
                out.run(&b[i..wend], key);
                out.flush(key);
                i = wend;
            }
            Some(j) => {
                out.run(&b[i..j], key);
                if b[j] == b'"' {
                    out.flush(key);
                    s.pos = j + 1;
                    return Some(());
                }
                let (c, next) = unescape(b, j)?;
                out.char(c, key);
                i = next;
            }
        }
    }
}

/// Skips the remaining members of the object the cursor is in (after a value), and its `}`.
pub(super) fn skip_rest_of_object(s: &mut Scan<'_>) -> Option<()> {
    while s.next_or_close(b'}')? {
        s.key()?;
        s.skip_value()?;
    }
    Some(())
}
