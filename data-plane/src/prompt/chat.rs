//! Chat bodies: the messages' roles and contents (strings or arrays of text parts, `content`
//! before or after `role`), up to the first user message or, deep, past the head.

use super::*;

/// Where a message's content was found, for messages whose `content` precedes `role`.
pub(super) enum Content {
    None,
    Text(Span),
    Parts(usize),
}

pub(super) fn chat_key(
    s: &mut Scan<'_>,
    limit: usize,
    seed: u64,
    depth: Depth,
) -> Option<PromptKey> {
    if !s.eat(b'[') {
        return None;
    }
    let mut key = TextKey::new(
        match depth {
            Depth::Shallow => limit,
            Depth::Deep => DEEP_HEAD_CHARS,
        },
        seed,
    );
    // The key ends here: `head_only` when no user message has been reached. A deep key also
    // looks past the first user message (the scanner `s` is after it) for more messages.
    let done = |key: &TextKey, user: bool, s: Option<&mut Scan<'_>>| {
        let mut k = key.finish_chat(KeySource::Chat, !user)?;
        if let (Depth::Deep, true, Some(s)) = (depth, user, s) {
            k.first_turn = s.next_or_close(b']') == Some(false);
        }
        Some(k)
    };
    // Before a message's text is fed: the deep key gives the first user message its own budget.
    let start = |key: &mut TextKey, user: bool| {
        if user && depth == Depth::Deep {
            key.restart_budget(limit);
        }
    };
    if s.eat(b']') {
        return key.finish(KeySource::Chat);
    }
    loop {
        if !s.eat(b'{') {
            return None;
        }
        let mut role: Option<Span> = None;
        let mut content = Content::None;
        let mut emitted = false; // role and content already fed (role came first)
        if !s.eat(b'}') {
            loop {
                let k = s.key()?;
                if s.is(k, "role") {
                    role = Some(s.string()?);
                } else if s.is(k, "content") {
                    s.ws();
                    match (s.peek()?, role) {
                        (b'"', Some(r)) => {
                            let user = s.is(r, "user");
                            start(&mut key, user);
                            emit_span(s.b, r, &mut key)?;
                            key.push(b"\n");
                            stream_string(s, &mut key)?;
                            if key.full {
                                if user && depth == Depth::Deep {
                                    // The cursor is still at the content string: skip it and
                                    // the rest of the message to see what follows.
                                    s.ws();
                                    if s.peek() == Some(b'"') {
                                        s.skip_value()?; // else the string ended with the key
                                    }
                                    skip_rest_of_object(s)?;
                                    return done(&key, user, Some(s));
                                }
                                return done(&key, user, None);
                            }
                            emitted = true;
                        }
                        (b'"', None) => content = Content::Text(s.string()?),
                        (b'[', Some(r)) => {
                            let user = s.is(r, "user");
                            start(&mut key, user);
                            emit_span(s.b, r, &mut key)?;
                            key.push(b"\n");
                            let mut parts = Scan { b: s.b, pos: s.pos };
                            emit_parts(&mut parts, &mut key)?;
                            if key.full {
                                if user && depth == Depth::Deep {
                                    // `s` is still at the parts array: skip it and the rest of
                                    // the message to see what follows (as for string content).
                                    s.skip_value()?;
                                    skip_rest_of_object(s)?;
                                    return done(&key, user, Some(s));
                                }
                                return done(&key, user, None);
                            }
                            s.pos = parts.pos;
                            emitted = true;
                        }
                        (b'[', None) => {
                            content = Content::Parts(s.pos);
                            s.skip_value()?;
                        }
                        (b'n', _) => s.skip_value()?, // null: no text
                        _ => return None,
                    }
                } else {
                    s.skip_value()?;
                }
                if !s.next_or_close(b'}')? {
                    break;
                }
            }
        }
        let role = role?;
        let user = s.is(role, "user");
        if !emitted {
            start(&mut key, user);
            emit_span(s.b, role, &mut key)?;
            key.push(b"\n");
            match content {
                Content::None => {}
                Content::Text(span) => emit_span(s.b, span, &mut key)?,
                Content::Parts(at) => emit_parts(&mut Scan { b: s.b, pos: at }, &mut key)?,
            }
        }
        key.push(b"\n");
        if key.full || user {
            return done(&key, user, Some(s));
        }
        if !s.next_or_close(b']')? {
            return done(&key, false, None);
        }
    }
}

/// Feeds the `text` of every `{"type":"text"}` part of the array at the cursor.
pub(super) fn emit_parts(s: &mut Scan<'_>, key: &mut TextKey) -> Option<()> {
    if !s.eat(b'[') {
        return None;
    }
    if s.eat(b']') {
        return Some(());
    }
    loop {
        s.ws();
        if s.peek()? != b'{' {
            s.skip_value()?;
        } else {
            s.pos += 1;
            let mut kind: Option<bool> = None; // Some(true) = type is "text"
            let mut text: Option<Span> = None;
            if !s.eat(b'}') {
                loop {
                    let k = s.key()?;
                    if s.is(k, "type") {
                        let t = s.string()?;
                        kind = Some(s.is(t, "text"));
                    } else if s.is(k, "text") && kind == Some(true) {
                        s.ws();
                        if s.peek()? != b'"' {
                            return None;
                        }
                        stream_string(s, key)?;
                        if key.full {
                            return Some(());
                        }
                        text = None;
                        kind = Some(false); // already fed
                    } else if s.is(k, "text") {
                        s.ws();
                        text = if s.peek()? == b'"' {
                            Some(s.string()?)
                        } else {
                            None
                        };
                        if text.is_none() {
                            s.skip_value()?;
                        }
                    } else {
                        s.skip_value()?;
                    }
                    if !s.next_or_close(b'}')? {
                        break;
                    }
                }
            }
            if let (Some(true), Some(span)) = (kind, text) {
                emit_span(s.b, span, key)?;
                if key.full {
                    return Some(());
                }
            }
        }
        if !s.next_or_close(b']')? {
            return Some(());
        }
    }
}
