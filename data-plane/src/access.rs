//! Who may use the router and how much at once: client API keys (`--api-key-file`), the
//! credentials sent on to instances (`--forward-authorization`, `--upstream-api-key-file`), and
//! the router-wide cap on requests in flight (`--max-in-flight`).
//!
//! The key check compares a keyed digest of the presented key with every configured key in
//! constant time ([`credentials::Keyring`]); the key file is re-read when it changes. Neither a
//! client's key nor the upstream key is ever logged, traced or put in an error message.

use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Context as _;
use http::header::{self, HeaderMap, HeaderValue};
use http::Response;

use credentials::{SecretFile, SecretValue};

use crate::config::Config;
use crate::priority::KeyPolicy;
use crate::response::{coded_error_response, Admission, ResponseBody};

/// Paths anyone may call: probes and metrics (as vLLM leaves `/health` and `/metrics` open).
pub(crate) fn is_open_path(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/metrics")
}

/// The access settings of a router.
#[derive(Debug, Default)]
pub(crate) struct Access {
    /// Each key with what its line says of its holder (tenant, highest priority).
    api_keys: Option<Arc<SecretFile<KeyPolicy>>>,
    /// Clients whose keys keep failing, refused for a while ([`credentials::Throttle`]).
    throttle: credentials::Throttle,
    forward_authorization: bool,
    /// `Bearer KEY` from `--upstream-api-key-file`, kept current as the file changes.
    upstream_authorization: Option<Arc<SecretValue<HeaderValue>>>,
    max_in_flight: usize,
    in_flight: Arc<AtomicUsize>,
}

/// Why a request is not let in.
pub(crate) enum Refusal {
    /// 401: no key, or not one of ours.
    Unauthorized(&'static str),
    /// 429: this client's keys failed too often; it may try again after this long.
    Throttled(std::time::Duration),
    /// 503: `--max-in-flight` reached.
    Overloaded(usize),
}

impl Refusal {
    pub(crate) fn status(&self) -> u16 {
        match self {
            Refusal::Unauthorized(_) => 401,
            Refusal::Throttled(_) => 429,
            Refusal::Overloaded(_) => 503,
        }
    }
}

impl Access {
    /// Reads `--api-key-file` and `--upstream-api-key-file`; errors name the flag and file.
    pub(crate) fn load(config: &Config) -> anyhow::Result<Self> {
        let api_keys = match &config.api_key_file {
            Some(path) => Some(Arc::new(
                SecretFile::open(path, KeyPolicy::parse).context("--api-key-file")?,
            )),
            None => None,
        };
        let upstream_authorization = match &config.upstream_api_key_file {
            Some(path) => Some(Arc::new(
                SecretValue::open(path, bearer_header).context("--upstream-api-key-file")?,
            )),
            None => None,
        };
        Ok(Access {
            api_keys,
            throttle: Default::default(),
            forward_authorization: config.forward_authorization,
            upstream_authorization,
            max_in_flight: usize::try_from(config.max_in_flight).unwrap_or(usize::MAX),
            in_flight: Arc::default(),
        })
    }

    /// The key file, for its reload task.
    pub(crate) fn api_keys(&self) -> Option<&Arc<SecretFile<KeyPolicy>>> {
        self.api_keys.as_ref()
    }

    /// The upstream key file, for its reload task.
    pub(crate) fn upstream_key(&self) -> Option<&Arc<SecretValue<HeaderValue>>> {
        self.upstream_authorization.as_ref()
    }

    /// Checks the client's key (when keys are configured) and returns what its line says of its
    /// holder (`None`: no keys configured); a client (`peer`) whose keys keep failing is refused
    /// for a while before its key is looked at.
    pub(crate) fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
    ) -> Result<Option<KeyPolicy>, Refusal> {
        let Some(keys) = &self.api_keys else {
            return Ok(None);
        };
        self.throttle.check(peer).map_err(Refusal::Throttled)?;
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            // No key at all is not a guess: not counted.
            return Err(Refusal::Unauthorized(
                "missing API key: send it as `Authorization: Bearer KEY`",
            ));
        };
        match credentials::bearer(value.as_bytes()).and_then(|k| keys.check(k)) {
            Some(policy) => {
                self.throttle.succeeded(peer);
                Ok(Some(policy))
            }
            None => {
                self.throttle.failed(peer);
                Err(Refusal::Unauthorized("incorrect API key provided"))
            }
        }
    }

    /// Takes a place among the requests in flight, held until the response body ends (or the
    /// client goes away).
    pub(crate) fn admit(&self) -> Result<Admission, Refusal> {
        let before = self.in_flight.fetch_add(1, Ordering::AcqRel);
        let admission = Admission(self.in_flight.clone());
        if before >= self.max_in_flight {
            drop(admission);
            return Err(Refusal::Overloaded(self.max_in_flight));
        }
        Ok(admission)
    }

    /// Requests in flight now.
    #[cfg(test)]
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Sets the `authorization` an instance receives: the upstream key if one is configured,
    /// the client's own only with `--forward-authorization`, none otherwise.
    pub(crate) fn upstream_authorization(
        &self,
        client: Option<&HeaderValue>,
    ) -> Option<HeaderValue> {
        match (&self.upstream_authorization, client) {
            (Some(key), _) => Some((**key.get()).clone()),
            (None, Some(c)) if self.forward_authorization => Some(c.clone()),
            _ => None,
        }
    }
}

/// `Bearer KEY`, marked sensitive (kept out of logs and HPACK tables).
fn bearer_header(key: &str) -> Result<HeaderValue, String> {
    let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
        .map_err(|_| "the key has characters a header cannot carry".to_string())?;
    value.set_sensitive(true);
    Ok(value)
}

/// Whole seconds, rounded up: a client that waits as told is let in.
fn retry_after_secs(wait: std::time::Duration) -> u128 {
    wait.as_millis().div_ceil(1000).max(1)
}

/// The OpenAI-shaped answer to a refusal.
pub(crate) fn refusal_response(refusal: &Refusal) -> Response<ResponseBody> {
    let (status, message, kind, code) = match refusal {
        Refusal::Unauthorized(message) => (
            401,
            (*message).to_string(),
            "invalid_request_error",
            "invalid_api_key",
        ),
        Refusal::Throttled(wait) => (
            429,
            format!(
                "too many failed authentications from this address: retry in {} s",
                retry_after_secs(*wait)
            ),
            "rate_limit_exceeded",
            "too_many_failed_authentications",
        ),
        Refusal::Overloaded(max) => (
            503,
            format!("the router has its limit of {max} requests in flight (--max-in-flight); retry shortly"),
            "service_unavailable",
            "overloaded",
        ),
    };
    let mut r = coded_error_response(status, &message, kind, code);
    match refusal {
        Refusal::Unauthorized(_) => {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        Refusal::Throttled(wait) => {
            if let Ok(v) = HeaderValue::from_str(&retry_after_secs(*wait).to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        Refusal::Overloaded(_) => {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser as _;

    const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn config(args: &[&str]) -> Config {
        Config::parse_from(std::iter::once("data-plane").chain(args.iter().copied()))
    }

    #[test]
    fn keys_are_checked_and_never_echoed() {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys");
        std::fs::write(&keys, "sk-client-1\nsk-client-2\n").unwrap();
        let access = Access::load(&config(&["--api-key-file", keys.to_str().unwrap()])).unwrap();
        let mut h = HeaderMap::new();
        assert!(
            matches!(access.authenticate(&h, PEER), Err(Refusal::Unauthorized(m)) if m.contains("missing"))
        );
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sk-wrong"),
        );
        let Err(refusal) = access.authenticate(&h, PEER) else {
            panic!("a wrong key passed")
        };
        let r = refusal_response(&refusal);
        assert_eq!(r.status(), 401);
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sk-client-2"),
        );
        assert!(access.authenticate(&h, PEER).is_ok());
        // no key file: everyone is let in
        assert!(Access::load(&config(&[]))
            .unwrap()
            .authenticate(&HeaderMap::new(), PEER)
            .is_ok());
    }

    #[test]
    fn a_client_whose_keys_keep_failing_is_throttled_and_others_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let keys = dir.path().join("keys");
        std::fs::write(&keys, "sk-good\n").unwrap();
        let access = Access::load(&config(&["--api-key-file", keys.to_str().unwrap()])).unwrap();
        let header = |k: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_static(k));
            h
        };
        let guesser: IpAddr = "192.0.2.7".parse().unwrap();
        for _ in 0..credentials::throttle::FREE_FAILURES {
            assert!(matches!(
                access.authenticate(&header("Bearer sk-guess"), guesser),
                Err(Refusal::Unauthorized(_))
            ));
        }
        assert!(
            access
                .authenticate(&header("Bearer sk-good"), guesser)
                .is_ok(),
            "not yet throttled"
        );
        for _ in 0..=credentials::throttle::FREE_FAILURES {
            let _ = access.authenticate(&header("Bearer sk-guess"), guesser);
        }
        let Err(refused) = access.authenticate(&header("Bearer sk-good"), guesser) else {
            panic!("throttled, even with the right key")
        };
        let r = refusal_response(&refused);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert!(
            access.authenticate(&header("Bearer sk-good"), PEER).is_ok(),
            "another client's right key is never slowed"
        );
    }

    #[test]
    fn what_instances_receive() {
        let dir = tempfile::tempdir().unwrap();
        let up = dir.path().join("up");
        std::fs::write(&up, "sk-upstream\n").unwrap();
        let client = HeaderValue::from_static("Bearer sk-client");
        let none = Access::load(&config(&[])).unwrap();
        assert_eq!(none.upstream_authorization(Some(&client)), None);
        let fwd = Access::load(&config(&["--forward-authorization"])).unwrap();
        assert_eq!(
            fwd.upstream_authorization(Some(&client)),
            Some(client.clone())
        );
        let keyed =
            Access::load(&config(&["--upstream-api-key-file", up.to_str().unwrap()])).unwrap();
        assert_eq!(
            keyed.upstream_authorization(Some(&client)).unwrap(),
            "Bearer sk-upstream"
        );
        let e = Access::load(&config(&["--upstream-api-key-file", "/nonexistent/k"])).unwrap_err();
        assert!(format!("{e:#}").contains("/nonexistent/k"), "{e:#}");
        // A rotated key is sent from the next re-read on (the reload task calls it).
        std::fs::write(&up, "sk-rotated\n").unwrap();
        assert!(keyed.upstream_key().unwrap().reload().unwrap());
        assert_eq!(
            keyed.upstream_authorization(Some(&client)).unwrap(),
            "Bearer sk-rotated"
        );
    }

    #[test]
    fn admissions_stop_at_the_cap_and_come_back() {
        let access = Access::load(&config(&["--max-in-flight", "2"])).unwrap();
        let a = access.admit().ok().unwrap();
        let b = access.admit().ok().unwrap();
        let refused = access.admit().err().unwrap();
        assert!(matches!(refused, Refusal::Overloaded(2)));
        let r = refusal_response(&refused);
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        assert_eq!(access.in_flight(), 2, "a refusal leaves no count behind");
        drop(a);
        let _c = access.admit().ok().unwrap();
        drop(b);
        assert_eq!(access.in_flight(), 1);
    }
}
