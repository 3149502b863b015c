//! The `model` field of a body, looked for from the end first (clients put it last or first;
//! a long body is not scanned whole for it).

use super::*;

/// The top-level `model` field of a JSON body, if it has one and it is a string.
///
/// Members are read from the front until the first array or object (the `messages`, typically
/// most of the body); the members after it are then read from the END of the body, so a `model`
/// sent after the messages (as the OpenAI Python client does) is found without scanning them.
pub fn find_model(body: &[u8]) -> Option<Cow<'_, str>> {
    let mut s = Scan::new(body);
    if !s.eat(b'{') || s.eat(b'}') {
        return None;
    }
    loop {
        let k = s.key()?;
        if s.is(k, "model") {
            s.ws();
            if s.peek()? != b'"' {
                return None;
            }
            let v = s.string()?;
            return decode(body, v);
        }
        s.ws();
        if matches!(s.peek()?, b'[' | b'{') {
            return find_model_from_the_end(body, s.pos);
        }
        s.skip_value()?;
        if !s.next_or_close(b'}')? {
            return None;
        }
    }
}

/// Reads top-level members backwards from the end of the body down to `floor` (the start of a
/// value the forward pass did not skip). Inside a JSON string every `"` is escaped, i.e. preceded
/// by an odd run of backslashes, so strings are recognised from their end as well as their start.
pub(super) fn find_model_from_the_end(b: &[u8], floor: usize) -> Option<Cow<'_, str>> {
    let mut r = Rev {
        b,
        pos: b.len(),
        floor,
    };
    if !r.eat(b'}') {
        return None;
    }
    loop {
        r.ws();
        let value_end = r.pos;
        let value_start = r.skip_value()?;
        if value_start <= floor {
            return None; // back at the value the forward pass stopped at: no `model` after it
        }
        if !r.eat(b':') {
            return None;
        }
        r.ws();
        if r.pos <= floor || b[r.pos - 1] != b'"' {
            return None;
        }
        let key_end = r.pos - 1;
        let key_start = r.string_start()?;
        let key = Span {
            start: key_start + 1,
            end: key_end,
        };
        if (Scan { b, pos: 0 }).is(key, "model") {
            if b[value_start] != b'"' {
                return None;
            }
            return decode(
                b,
                Span {
                    start: value_start + 1,
                    end: value_end - 1,
                },
            );
        }
        if !r.eat(b',') {
            return None;
        }
    }
}

/// A backward scanner: `pos` is the exclusive end of what is left to read.
pub(super) struct Rev<'a> {
    pub(super) b: &'a [u8],
    pub(super) pos: usize,
    pub(super) floor: usize,
}

impl Rev<'_> {
    pub(super) fn ws(&mut self) {
        while self.pos > self.floor && matches!(self.b[self.pos - 1], b' ' | b'\n' | b'\r' | b'\t')
        {
            self.pos -= 1;
        }
    }

    pub(super) fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.pos > self.floor && self.b[self.pos - 1] == c {
            self.pos -= 1;
            true
        } else {
            false
        }
    }

    /// With `b[pos - 1]` the closing quote of a string: moves `pos` to its opening quote and
    /// returns that index.
    pub(super) fn string_start(&mut self) -> Option<usize> {
        let mut end = self.pos - 1; // the closing quote
        loop {
            let q = self.floor + memchr::memrchr(b'"', &self.b[self.floor..end])?;
            let mut k = q;
            while k > self.floor && self.b[k - 1] == b'\\' {
                k -= 1;
            }
            if (q - k) & 1 == 0 {
                self.pos = q;
                return Some(q);
            }
            end = q;
        }
    }

    /// Skips the value ending at `pos`; returns its start.
    pub(super) fn skip_value(&mut self) -> Option<usize> {
        self.ws();
        if self.pos <= self.floor {
            return None;
        }
        let last = self.b[self.pos - 1];
        match last {
            b'"' => self.string_start(),
            b'}' | b']' => {
                let mut depth = 0usize;
                while self.pos > self.floor {
                    let c = self.b[self.pos - 1];
                    match c {
                        b'"' => {
                            self.string_start()?;
                            continue;
                        }
                        b'}' | b']' => depth += 1,
                        b'{' | b'[' => {
                            depth -= 1;
                            if depth == 0 {
                                self.pos -= 1;
                                return Some(self.pos);
                            }
                        }
                        _ => {}
                    }
                    self.pos -= 1;
                }
                None
            }
            b',' | b':' | b'{' | b'[' => None,
            _ => {
                let end = self.pos;
                while self.pos > self.floor
                    && !matches!(
                        self.b[self.pos - 1],
                        b',' | b':' | b'{' | b'[' | b' ' | b'\n' | b'\r' | b'\t'
                    )
                {
                    self.pos -= 1;
                }
                (self.pos < end).then_some(self.pos)
            }
        }
    }
}
