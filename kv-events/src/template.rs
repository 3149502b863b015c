//! Endpoint templates: where an instance publishes its KV events, derived from its URL.
//!
//! A routing config names the endpoints once for all instances of a variant, as templates such as
//! `tcp://{host}:5557` (CONTRACT.md, `kv_events.endpoint`). [`fill`] puts in the instance URL's
//! `{host}`, its `{port}`, or `{port+N}` (the port plus N, for several engines on one host:
//! `tcp://{host}:{port+1000}`). An IPv6 host keeps its brackets (`[::1]`), as ZeroMQ's TCP
//! endpoints want. A URL without a port has its scheme's default port (80 for http, 443 for
//! https). Anything else in braces, an unbalanced brace or a port past 65535 is an error naming
//! the template and the URL.

/// A template that could not be filled from an instance URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot fill the KV-events endpoint template {template:?} from the instance URL {url:?}: {problem}")]
pub struct TemplateError {
    /// The template.
    pub template: String,
    /// The instance URL.
    pub url: String,
    /// What went wrong.
    pub problem: TemplateProblem,
}

/// What went wrong filling a template.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateProblem {
    /// A placeholder other than `{host}`, `{port}` and `{port+N}`.
    #[error("unknown placeholder {{{0}}} (expected {{host}}, {{port}} or {{port+N}})")]
    UnknownPlaceholder(String),
    /// A `{` without its `}`, or a `}` without its `{`.
    #[error("unbalanced brace at byte {0}")]
    UnbalancedBrace(usize),
    /// The URL has no host.
    #[error("the URL has no host")]
    NoHost,
    /// The URL's port is not a number from 0 to 65535.
    #[error("the URL's port {0:?} is not a number from 0 to 65535")]
    BadPort(String),
    /// The template needs a port, and the URL has none and no scheme with a default.
    #[error("the URL has no port, and its scheme has no default port")]
    NoPort,
    /// `{port+N}` went past 65535.
    #[error("port {port} + {offset} is past 65535")]
    PortOverflow {
        /// The URL's port.
        port: u16,
        /// N.
        offset: u32,
    },
}

/// Fills `template` from `instance_url` (see the module docs).
pub fn fill(template: &str, instance_url: &str) -> Result<String, TemplateError> {
    let err = |problem| TemplateError {
        template: template.to_owned(),
        url: instance_url.to_owned(),
        problem,
    };
    let (host, port) = host_and_port(instance_url).map_err(err)?;
    let need_port = || port.ok_or_else(|| err(TemplateProblem::NoPort));
    let mut out = String::with_capacity(template.len() + host.len());
    let mut rest = template;
    let mut offset = 0;
    while let Some(i) = rest.find(['{', '}']) {
        if rest.as_bytes()[i] == b'}' {
            return Err(err(TemplateProblem::UnbalancedBrace(offset + i)));
        }
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let close = after
            .find('}')
            .filter(|&j| !after[..j].contains('{'))
            .ok_or_else(|| err(TemplateProblem::UnbalancedBrace(offset + i)))?;
        let name = &after[..close];
        match name {
            "host" => out.push_str(host),
            "port" => out.push_str(&need_port()?.to_string()),
            _ => {
                let n = name
                    .strip_prefix("port+")
                    .and_then(|n| n.parse::<u32>().ok())
                    .ok_or_else(|| err(TemplateProblem::UnknownPlaceholder(name.to_owned())))?;
                let port = need_port()?;
                let sum = u16::try_from(u32::from(port) + n)
                    .map_err(|_| err(TemplateProblem::PortOverflow { port, offset: n }))?;
                out.push_str(&sum.to_string());
            }
        }
        let consumed = i + 1 + close + 1;
        offset += consumed;
        rest = &rest[consumed..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The host (IPv6 in brackets) and port of a URL such as `http://10.0.0.5:8000/v1`; the port is
/// the scheme's default when absent (`None` for a scheme without one).
fn host_and_port(url: &str) -> Result<(&str, Option<u16>), TemplateProblem> {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    let (host, port) = if host_port.starts_with('[') {
        let end = host_port.find(']').ok_or(TemplateProblem::NoHost)?;
        let (host, after) = host_port.split_at(end + 1);
        match after.strip_prefix(':') {
            Some(port) => (host, Some(port)),
            None if after.is_empty() => (host, None),
            None => return Err(TemplateProblem::BadPort(after.to_owned())),
        }
    } else {
        match host_port.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        }
    };
    if host.is_empty() || host == "[]" {
        return Err(TemplateProblem::NoHost);
    }
    let port = match port {
        Some(p) => Some(
            p.parse::<u16>()
                .map_err(|_| TemplateProblem::BadPort(p.to_owned()))?,
        ),
        None => match scheme.map(str::to_ascii_lowercase).as_deref() {
            Some("http") => Some(80),
            Some("https") => Some(443),
            _ => None,
        },
    };
    Ok((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_and_offsets() {
        assert_eq!(
            fill("tcp://{host}:5557", "http://10.0.0.5:8000").as_deref(),
            Ok("tcp://10.0.0.5:5557")
        );
        assert_eq!(
            fill("tcp://{host}:{port+1000}", "http://engine-1:8000/v1").as_deref(),
            Ok("tcp://engine-1:9000")
        );
        assert_eq!(
            fill("tcp://{host}:{port}", "https://user@[::1]:8443?x=1").as_deref(),
            Ok("tcp://[::1]:8443")
        );
        assert_eq!(
            fill("tcp://{host}:{port+1}", "http://engine").as_deref(),
            Ok("tcp://engine:81")
        );
        assert_eq!(
            fill("tcp://127.0.0.1:5557", "anything:1").as_deref(),
            Ok("tcp://127.0.0.1:5557")
        );
    }

    #[test]
    fn errors_name_template_url_and_problem() {
        let e = fill("tcp://{hots}:5557", "http://h:1").unwrap_err();
        assert_eq!(
            e.problem,
            TemplateProblem::UnknownPlaceholder("hots".into())
        );
        assert_eq!(
            e.to_string(),
            "cannot fill the KV-events endpoint template \"tcp://{hots}:5557\" from the instance \
             URL \"http://h:1\": unknown placeholder {hots} (expected {host}, {port} or {port+N})"
        );
        let problem = |t: &str, u: &str| fill(t, u).unwrap_err().problem;
        assert_eq!(
            problem("tcp://{host:5557", "http://h:1"),
            TemplateProblem::UnbalancedBrace(6)
        );
        assert_eq!(
            problem("tcp://host}:5557", "http://h:1"),
            TemplateProblem::UnbalancedBrace(10)
        );
        assert_eq!(problem("tcp://{host}:{port}", "h"), TemplateProblem::NoPort);
        assert_eq!(
            problem("tcp://{host}:{port+1}", "http://h:65535"),
            TemplateProblem::PortOverflow {
                port: 65535,
                offset: 1
            }
        );
        assert_eq!(
            problem("tcp://{host}:1", "http://:80"),
            TemplateProblem::NoHost
        );
        assert_eq!(
            problem("tcp://{host}:1", "http://h:80x"),
            TemplateProblem::BadPort("80x".into())
        );
        assert_eq!(
            problem("tcp://{host}:{port-1}", "http://h:80"),
            TemplateProblem::UnknownPlaceholder("port-1".into())
        );
    }
}
