//! `/v1/responses` bodies: `instructions`, then `input`, in either order.

use super::*;

/// The key of a `/v1/responses` body: `instructions`, a newline, then `input` (its text when a
/// string, its JSON text when an array of items). The two fields may come in either order, so
/// the top-level object is scanned until both are found (values skipped, not decoded).
pub(super) fn responses_key(body: &[u8], limit: usize, seed: u64) -> Option<PromptKey> {
    let mut s = Scan::new(body);
    if !s.eat(b'{') || s.eat(b'}') {
        return None;
    }
    let mut instructions: Option<Span> = None;
    let mut input: Option<Span> = None; // the whole value, quotes or brackets included
    loop {
        let k = s.key()?;
        s.ws();
        if s.is(k, "instructions") && s.peek() == Some(b'"') {
            instructions = Some(s.string()?);
        } else if s.is(k, "input") {
            let start = s.pos;
            s.skip_value()?;
            input = Some(Span { start, end: s.pos });
        } else {
            s.skip_value()?;
        }
        if (instructions.is_some() && input.is_some()) || !s.next_or_close(b'}')? {
            break;
        }
    }
    if instructions.is_none() && input.is_none() {
        return None;
    }
    let mut key = TextKey::new(limit, seed);
    if let Some(span) = instructions {
        emit_span(body, span, &mut key)?;
        key.push(b"\n");
    }
    if let Some(value) = input {
        if body[value.start] == b'"' {
            let text = Span {
                start: value.start + 1,
                end: value.end - 1,
            };
            emit_span(body, text, &mut key)?;
        } else {
            key.push(&body[value.start..value.end]);
        }
    }
    key.finish(KeySource::Completion)
}
