//! Who sent a request and how urgent it is: the priority classes, tenants, and what an API key's
//! line says of its holder. Read from headers and `--api-key-file`; used by the routing table
//! (a variant's default priority), the access check, flow control and its queues.

use std::sync::Arc;

use http::header::{HeaderMap, HeaderName};

pub const X_TENANT: HeaderName = HeaderName::from_static("x-prefix-router-tenant");
pub const X_PRIORITY: HeaderName = HeaderName::from_static("x-prefix-router-priority");

/// The longest tenant name a header or key file may give.
pub const MAX_TENANT_LEN: usize = 64;

/// How urgent a request is. Ordered: a higher one is served first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    Sheddable = 0,
    #[default]
    Standard = 1,
    Critical = 2,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Standard, Priority::Sheddable];

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Sheddable => "sheddable",
            Priority::Standard => "standard",
            Priority::Critical => "critical",
        }
    }

    /// A request's priority: `x-prefix-router-priority` (default: `default`, its variant's
    /// `default_priority`) capped by its key's (`standard` for a key that names none; `None`: no
    /// keys, the header is trusted).
    pub fn of(
        headers: &HeaderMap,
        key: Option<&KeyPolicy>,
        default: Priority,
    ) -> Result<Priority, String> {
        let asked = match headers.get(X_PRIORITY) {
            None => default,
            Some(v) => v.to_str().ok().and_then(Priority::parse).ok_or_else(|| {
                format!(
                    "invalid {X_PRIORITY} {:?}: expected critical, standard or sheddable",
                    String::from_utf8_lossy(v.as_bytes())
                )
            })?,
        };
        Ok(match key {
            Some(k) => asked.min(k.priority.unwrap_or(Priority::Standard)),
            None => asked,
        })
    }

    pub fn parse(s: &str) -> Option<Priority> {
        match s {
            "sheddable" => Some(Priority::Sheddable),
            "standard" => Some(Priority::Standard),
            "critical" => Some(Priority::Critical),
            _ => None,
        }
    }
}

/// What an API key's line in `--api-key-file` says of its holder: `KEY [tenant=NAME]
/// [priority=P]`. A key without a priority may ask for `standard` at most.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyPolicy {
    pub tenant: Option<Arc<str>>,
    pub priority: Option<Priority>,
    /// `rpm=N tpm=N`: the tenant's rate limits (a line with them must name its tenant).
    pub rates: Rates,
}

/// A tenant's rate limits: requests and prompt tokens per minute.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rates {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u32>,
}

impl Rates {
    pub fn is_limited(&self) -> bool {
        self.requests_per_minute.is_some() || self.tokens_per_minute.is_some()
    }
}

impl KeyPolicy {
    /// Parses the text after a key (`credentials::LabelParser`); errors name the field.
    pub fn parse(label: Option<&str>) -> Result<KeyPolicy, String> {
        let mut policy = KeyPolicy::default();
        for field in label.unwrap_or("").split_whitespace() {
            match field.split_once('=') {
                Some(("tenant", name)) => {
                    check_tenant(name).map_err(|e| format!("tenant={name:?}: {e}"))?;
                    policy.tenant = Some(name.into());
                }
                Some(("priority", p)) => {
                    policy.priority = Some(Priority::parse(p).ok_or_else(|| {
                        format!("priority={p:?}: expected critical, standard or sheddable")
                    })?);
                }
                Some((name @ ("rpm" | "tpm"), n)) => {
                    let n: u32 = n.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                        format!("{name}={n:?}: expected a whole number of at least 1 per minute")
                    })?;
                    match name {
                        "rpm" => policy.rates.requests_per_minute = Some(n),
                        _ => policy.rates.tokens_per_minute = Some(n),
                    }
                }
                _ => {
                    return Err(format!(
                        "unexpected {:?} after the key: expected tenant=NAME, priority=P, rpm=N \
                         or tpm=N",
                        field.chars().take(24).collect::<String>()
                    ))
                }
            }
        }
        if policy.rates.is_limited() && policy.tenant.is_none() {
            return Err("rpm= and tpm= limit a tenant: add tenant=NAME".to_string());
        }
        Ok(policy)
    }
}

fn check_tenant(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > MAX_TENANT_LEN {
        return Err("a tenant name is 1 to 64 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.:@".contains(&b))
    {
        return Err("a tenant name is letters, digits and - _ . : @");
    }
    Ok(())
}

/// The tenant `x-prefix-router-tenant` names, checked (`None`: the key names its tenant, or the
/// header is absent). Called on every request that flow control sees, so that a bad header is
/// refused whether the request would wait or not; nothing is kept.
pub fn tenant_header<'h>(
    headers: &'h HeaderMap,
    key: Option<&KeyPolicy>,
) -> Result<Option<&'h str>, String> {
    if key.is_some_and(|k| k.tenant.is_some()) {
        return Ok(None);
    }
    let Some(v) = headers.get(X_TENANT) else {
        return Ok(None);
    };
    let name = v.to_str().map_err(|_| {
        format!("invalid {X_TENANT}: a tenant name is letters, digits and - _ . : @")
    })?;
    check_tenant(name).map_err(|e| format!("invalid {X_TENANT} {name:?}: {e}"))?;
    Ok(Some(name))
}

/// Who sent a request and how urgent it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Who {
    pub tenant: Arc<str>,
    pub priority: Priority,
}

impl Who {
    /// From the key's policy (`None`: no keys configured, the headers are trusted) and the
    /// headers: the key's tenant, else `x-prefix-router-tenant`, else `default`; the priority
    /// header (else the variant's `default_priority`) capped by the key's priority (`standard`
    /// for a key that names none). Errors name the header and its value.
    pub fn of(
        headers: &HeaderMap,
        key: Option<&KeyPolicy>,
        default_priority: Priority,
    ) -> Result<Who, String> {
        let priority = Priority::of(headers, key, default_priority)?;
        let tenant = match (
            key.and_then(|k| k.tenant.clone()),
            tenant_header(headers, key)?,
        ) {
            (Some(t), _) => t,
            (None, Some(name)) => name.into(),
            (None, None) => Arc::from("default"),
        };
        Ok(Who { tenant, priority })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use http::header::HeaderValue;

    /// `tenant`'s request of priority `p`.
    pub(crate) fn who(tenant: &str, p: Priority) -> Who {
        Who {
            tenant: tenant.into(),
            priority: p,
        }
    }

    #[test]
    fn key_lines_name_tenant_and_priority_and_bad_fields_are_named() {
        assert_eq!(KeyPolicy::parse(None).unwrap(), KeyPolicy::default());
        let p = KeyPolicy::parse(Some("tenant=chat priority=critical")).unwrap();
        assert_eq!(p.tenant.as_deref(), Some("chat"));
        assert_eq!(p.priority, Some(Priority::Critical));
        let e = KeyPolicy::parse(Some("priority=urgent")).unwrap_err();
        assert!(e.contains("priority=\"urgent\""), "{e}");
        let e = KeyPolicy::parse(Some("tenant=a/b")).unwrap_err();
        assert!(e.contains("tenant=\"a/b\""), "{e}");
        let e = KeyPolicy::parse(Some("burst")).unwrap_err();
        assert!(e.contains("\"burst\""), "{e}");
    }

    #[test]
    fn a_key_caps_the_priority_its_holder_asks_for() {
        let mut h = HeaderMap::new();
        h.insert(X_PRIORITY, HeaderValue::from_static("critical"));
        h.insert(X_TENANT, HeaderValue::from_static("spoofed"));
        // no keys: the headers are trusted
        assert_eq!(
            Who::of(&h, None, Priority::Standard).unwrap(),
            who("spoofed", Priority::Critical)
        );
        // a key without a priority may ask for standard at most; its tenant wins
        let key = KeyPolicy::parse(Some("tenant=batch")).unwrap();
        assert_eq!(
            Who::of(&h, Some(&key), Priority::Standard).unwrap(),
            who("batch", Priority::Standard)
        );
        let key = KeyPolicy::parse(Some("priority=critical")).unwrap();
        assert_eq!(
            Who::of(&h, Some(&key), Priority::Standard).unwrap(),
            who("spoofed", Priority::Critical)
        );
        h.insert(X_PRIORITY, HeaderValue::from_static("sheddable"));
        assert_eq!(
            Who::of(&h, Some(&key), Priority::Standard)
                .unwrap()
                .priority,
            Priority::Sheddable
        );
        h.insert(X_PRIORITY, HeaderValue::from_static("high"));
        let e = Who::of(&h, None, Priority::Standard).unwrap_err();
        assert!(e.contains("x-prefix-router-priority \"high\""), "{e}");
        assert_eq!(
            Who::of(&HeaderMap::new(), None, Priority::Standard).unwrap(),
            who("default", Priority::Standard)
        );
        // a request that names no priority has its variant's default, capped by its key's
        let none = HeaderMap::new();
        assert_eq!(
            Who::of(&none, None, Priority::Sheddable).unwrap().priority,
            Priority::Sheddable
        );
        let plain = KeyPolicy::parse(Some("tenant=chat")).unwrap();
        assert_eq!(
            Who::of(&none, Some(&plain), Priority::Critical)
                .unwrap()
                .priority,
            Priority::Standard
        );
        assert_eq!(
            Who::of(&none, Some(&key), Priority::Critical)
                .unwrap()
                .priority,
            Priority::Critical
        );
    }
}
