//! Bearer-token authentication and roles for every gRPC call (`--auth-token-file`).
//!
//! The token file holds `TOKEN ROLE` lines; ROLE is `admin` (everything; the default when a
//! line has none) or `reader` (`Describe*`, `List*`, `WatchRoutingTable` and reflection). A
//! call without a valid `authorization: Bearer TOKEN` gets `UNAUTHENTICATED`; a reader calling
//! anything else gets `PERMISSION_DENIED`, before the service sees the call (so nothing is
//! written). Tokens are compared in constant time ([`credentials::Keyring`]) and the file is
//! re-read when it changes and on SIGHUP; messages never contain a token. A peer address that
//! keeps presenting wrong tokens is refused (`UNAVAILABLE`, `retry-after` seconds in the
//! metadata) for a time that doubles with each further failure ([`credentials::Throttle`]);
//! other peers are never slowed.

use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::{ready, Either, Ready};
use tonic::Status;

use credentials::{SecretFile, Throttle};

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Every RPC.
    Admin,
    /// Reads and the routing-table watch only.
    Reader,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Reader => "reader",
        }
    }
}

/// A token file line's role (no role: admin).
pub fn parse_role(label: Option<&str>) -> Result<Role, String> {
    match label {
        None | Some("admin") => Ok(Role::Admin),
        Some("reader") => Ok(Role::Reader),
        Some(other) => Err(format!("unknown role {other:?} (expected admin or reader)")),
    }
}

/// Opens `--auth-token-file`.
pub fn open_token_file(
    path: &std::path::Path,
) -> Result<Arc<SecretFile<Role>>, credentials::Error> {
    SecretFile::open(path, parse_role).map(Arc::new)
}

/// The role a call to `path` (`/package.Service/Method`) needs.
pub fn required_role(path: &str) -> Role {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let service = parts.next().unwrap_or_default();
    let method = parts.next().unwrap_or_default();
    let read_only = service.ends_with(".RoutingDiscovery")
        || service.starts_with("grpc.reflection.")
        || method.starts_with("Describe")
        || method.starts_with("List");
    if read_only {
        Role::Reader
    } else {
        Role::Admin
    }
}

/// Checks a call's `authorization` header against `tokens`.
pub fn authorize(
    tokens: &SecretFile<Role>,
    path: &str,
    authorization: Option<&http::HeaderValue>,
) -> Result<Role, Status> {
    let Some(value) = authorization else {
        return Err(Status::unauthenticated(
            "missing credentials: send `authorization: Bearer TOKEN` with a token from the control plane's --auth-token-file",
        ));
    };
    let Some(role) = credentials::bearer(value.as_bytes()).and_then(|t| tokens.check(t)) else {
        return Err(Status::unauthenticated(
            "invalid bearer token: it is not one of the control plane's tokens",
        ));
    };
    let needed = required_role(path);
    if role == Role::Reader && needed == Role::Admin {
        let method = path.rsplit('/').next().unwrap_or(path);
        return Err(Status::permission_denied(format!(
            "a {} token may not call {method}: it needs an {} token",
            role.name(),
            needed.name()
        )));
    }
    Ok(role)
}

/// The caller's address, as tonic's server records it (plain TCP or TLS).
fn peer_of<B>(request: &http::Request<B>) -> Option<std::net::IpAddr> {
    use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
    let ext = request.extensions();
    ext.get::<TcpConnectInfo>()
        .and_then(|i| i.remote_addr())
        .or_else(|| {
            ext.get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.get_ref().remote_addr())
        })
        .map(|a| a.ip())
}

/// The answer to a peer refused for its failures: UNAVAILABLE, with when to retry.
fn throttled(wait: std::time::Duration) -> Status {
    let secs = wait.as_millis().div_ceil(1000).max(1);
    let mut status = Status::unavailable(format!(
        "too many failed authentications from this address: retry in {secs} s"
    ));
    if let Ok(v) = secs.to_string().parse() {
        status.metadata_mut().insert("retry-after", v);
    }
    status
}

/// A tower layer that authorizes every gRPC call (no-op without a token file).
#[derive(Clone, Default)]
pub struct AuthLayer {
    tokens: Option<Arc<SecretFile<Role>>>,
    throttle: Arc<Throttle>,
}

impl AuthLayer {
    /// Checks calls against `tokens`; `throttle` keeps the failures of each peer address.
    pub fn new(tokens: Option<Arc<SecretFile<Role>>>, throttle: Arc<Throttle>) -> Self {
        Self { tokens, throttle }
    }
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService {
            inner,
            tokens: self.tokens.clone(),
            throttle: self.throttle.clone(),
        }
    }
}

/// The service [`AuthLayer`] wraps around the gRPC routes.
#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    tokens: Option<Arc<SecretFile<Role>>>,
    throttle: Arc<Throttle>,
}

impl<S, B, R> tower_service::Service<http::Request<B>> for AuthService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<S::Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if let Some(tokens) = &self.tokens {
            let peer = peer_of(&request);
            if let Some(wait) = peer.and_then(|p| self.throttle.check(p).err()) {
                return Either::Left(ready(Ok(throttled(wait).into_http())));
            }
            let checked = authorize(
                tokens,
                request.uri().path(),
                request.headers().get(http::header::AUTHORIZATION),
            );
            let presented = request.headers().contains_key(http::header::AUTHORIZATION);
            match (&checked, peer) {
                // A wrong token presented is a guess; none at all, or a reader's token used
                // for a write, is not.
                (Err(s), Some(p)) if presented && s.code() == tonic::Code::Unauthenticated => {
                    self.throttle.failed(p)
                }
                (Ok(_), Some(p)) => self.throttle.succeeded(p),
                _ => {}
            }
            if let Err(status) = checked {
                return Either::Left(ready(Ok(status.into_http())));
            }
        }
        Either::Right(self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_by_method() {
        for read in [
            "/prefixrouter.v1.ControlPlane/DescribeEndpointConfig",
            "/prefixrouter.v1.ControlPlane/ListEndpoints",
            "/prefixrouter.v1.RoutingDiscovery/WatchRoutingTable",
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        ] {
            assert_eq!(required_role(read), Role::Reader, "{read}");
        }
        for write in [
            "/prefixrouter.v1.ControlPlane/UpdateEndpointConfig",
            "/prefixrouter.v1.ControlPlane/RegisterInstance",
            "/prefixrouter.v1.ControlPlane/DeleteEndpoint",
            "/prefixrouter.v1.ControlPlane/Unknown",
            "",
        ] {
            assert_eq!(required_role(write), Role::Admin, "{write}");
        }
    }

    #[test]
    fn authorize_answers_each_case_without_echoing_the_token() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, "adm-XYZ admin\nrd-XYZ reader\n").unwrap();
        let tokens = open_token_file(&path).unwrap();
        let update = "/prefixrouter.v1.ControlPlane/UpdateEndpointConfig";
        let describe = "/prefixrouter.v1.ControlPlane/DescribeEndpoint";
        let h = |s: &str| http::HeaderValue::from_str(s).unwrap();

        let e = authorize(&tokens, update, None).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = authorize(&tokens, update, Some(&h("Bearer wrong-XYZ"))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(!e.message().contains("wrong-XYZ"), "{}", e.message());
        let e = authorize(&tokens, update, Some(&h("Basic adm-XYZ"))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = authorize(&tokens, update, Some(&h("Bearer rd-XYZ"))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("UpdateEndpointConfig"),
            "{}",
            e.message()
        );
        assert!(!e.message().contains("rd-XYZ"));
        assert_eq!(
            authorize(&tokens, describe, Some(&h("Bearer rd-XYZ"))).unwrap(),
            Role::Reader
        );
        assert_eq!(
            authorize(&tokens, update, Some(&h("Bearer adm-XYZ"))).unwrap(),
            Role::Admin
        );
    }

    #[test]
    fn unknown_roles_are_refused_by_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, "t1\nt2 superuser\n").unwrap();
        let e = open_token_file(&path).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("superuser"), "{e}");
        assert!(!e.contains("t2 "), "{e}");
    }
}
