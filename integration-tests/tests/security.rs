//! Security end to end, on the real binaries over loopback: tokens and roles on every
//! control-plane RPC, token rotation without a restart, TLS and mutual TLS (a CA made here with
//! rcgen), data-plane API keys and what reaches the instance, `--max-in-flight`, request-head
//! limits and slow clients, control-plane limits, and no secret in any process's logs.

mod common;

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use futures_util::StreamExt as _;
use integration_tests::variant;
use proto::client::{Client, ClientOptions, Error, TlsOptions};
use proto::RoutingStrategy;
use test_support::{bin, wait_for, ChildServer};
use tonic::Code;

const ADMIN: &str = "adm-7f3c9e1b5a2d";
const READER: &str = "rd-2b8d4f6a0c1e";
const WRONG: &str = "nope-4e6a8c0b2d3f";
const CLIENT_KEY: &str = "sk-client-5d7f9b1c3e";
const UPSTREAM_KEY: &str = "sk-upstream-8a0c2e4b6d";
/// Every secret above: none may appear in a log.
const SECRETS: [&str; 5] = [ADMIN, READER, WRONG, CLIENT_KEY, UPSTREAM_KEY];
/// Debug logs, so a secret in any event would show.
const DEBUG_LOGS: [(&str, &str); 1] = [("RUST_LOG", "debug")];

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// Replaces a file the way secret managers do: write beside it, rename over it.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

async fn client(url: &str, token: Option<&str>) -> Client {
    client_from(url, token, None).await
}

/// A client connecting from `local` (another loopback address: another peer to the server).
async fn client_from(url: &str, token: Option<&str>, local: Option<&str>) -> Client {
    let options = ClientOptions {
        bearer_token: token.map(str::to_string),
        local_address: local.map(|a| a.parse().unwrap()),
        ..ClientOptions::default()
    };
    Client::connect_with(url, options).await.unwrap()
}

/// Wrong credentials a peer may present before it is throttled (the next is refused).
const FREE_FAILURES: usize = 6;

fn code<T>(r: &Result<T, Error>) -> Code {
    match r {
        Ok(_) => Code::Ok,
        Err(e) => e.code().unwrap_or(Code::Unknown),
    }
}

fn no_secrets(what: &str, logs: &str) {
    for secret in SECRETS {
        assert!(
            !logs.contains(secret),
            "{what} logged a secret ({secret}):\n{logs}"
        );
    }
}

/// Every `ControlPlane` RPC and the watch, as `who` sees them: (name, writes?, code).
async fn call_every_rpc(c: &Client, instance_id: &str) -> Vec<(&'static str, bool, Code)> {
    let vs = || {
        vec![variant(
            "v1",
            RoutingStrategy::Random,
            &["http://127.0.0.1:9"],
        )]
    };
    let watch = async {
        let mut w = c.watch_routing_table("probe").await?;
        match tokio::time::timeout(Duration::from_secs(5), w.next()).await {
            Ok(Some(r)) => r.map(drop),
            _ => Err(Error::Malformed("no first table".into())),
        }
    }
    .await;
    vec![
        (
            "CreateEndpointConfig",
            true,
            code(&c.create_endpoint_config("cfg2", vs()).await),
        ),
        (
            "UpdateEndpointConfig",
            true,
            code(&c.update_endpoint_config("cfg", vs(), None).await),
        ),
        (
            "DescribeEndpointConfig",
            false,
            code(&c.describe_endpoint_config("cfg", None).await),
        ),
        (
            "ListEndpointConfigs",
            false,
            code(&c.list_endpoint_configs().await),
        ),
        (
            "DeleteEndpointConfig",
            true,
            code(&c.delete_endpoint_config("cfg").await),
        ),
        (
            "CreateEndpoint",
            true,
            code(&c.create_endpoint("ep2", "cfg").await),
        ),
        (
            "UpdateEndpoint",
            true,
            code(&c.update_endpoint("ep", "cfg").await),
        ),
        (
            "DescribeEndpoint",
            false,
            code(&c.describe_endpoint("ep").await),
        ),
        ("ListEndpoints", false, code(&c.list_endpoints().await)),
        ("DeleteEndpoint", true, code(&c.delete_endpoint("ep").await)),
        (
            "RegisterInstance",
            true,
            code(
                &c.register_instance("ep", "v1", "http://127.0.0.1:10", 60)
                    .await,
            ),
        ),
        (
            "RenewInstanceLease",
            true,
            code(&c.renew_instance_lease(instance_id).await),
        ),
        (
            "DeregisterInstance",
            true,
            code(&c.deregister_instance(instance_id).await),
        ),
        ("WatchRoutingTable", false, code(&watch)),
    ]
}

#[tokio::test]
async fn every_rpc_needs_a_token_and_a_reader_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = write(
        dir.path(),
        "tokens",
        &format!("# ops\n{ADMIN} admin\n{READER} reader\n"),
    );
    let data = dir.path().join("data");
    let cp = ChildServer::start_with_env(
        "control-plane",
        &["--data-dir", s(&data), "--auth-token-file", s(&tokens)],
        &DEBUG_LOGS,
    )
    .unwrap();
    let admin = client(&cp.url(), Some(ADMIN)).await;
    let vs = vec![variant(
        "v1",
        RoutingStrategy::PrefixAware,
        &["http://127.0.0.1:9"],
    )];
    admin.create_endpoint_config("cfg", vs).await.unwrap();
    admin.create_endpoint("ep", "cfg").await.unwrap();
    let instance = admin
        .register_instance("ep", "v1", "http://127.0.0.1:11", 600)
        .await
        .unwrap();

    let mut table = Vec::new();
    for (who, token) in [
        ("no token", None),
        ("wrong token", Some(WRONG)),
        ("reader token", Some(READER)),
    ] {
        // Wrong tokens come from another address: that peer is throttled after a few, and
        // the others are not.
        let from = (token == Some(WRONG)).then_some("127.0.0.2");
        let c = client_from(&cp.url(), token, from).await;
        let answers = call_every_rpc(&c, &instance.instance_id).await;
        let mut refused_as_guesses = 0;
        for (rpc, writes, got) in &answers {
            let expected = match (token, writes) {
                // The first few guesses are answered UNAUTHENTICATED, then the peer is refused.
                (Some(WRONG), _) if *got == Code::Unavailable => {
                    refused_as_guesses += 1;
                    Code::Unavailable
                }
                (None, _) | (Some(WRONG), _) => Code::Unauthenticated,
                (Some(_), true) => Code::PermissionDenied,
                (Some(_), false) => Code::Ok,
            };
            table.push(format!("| {rpc} | {who} | {got:?} |"));
            assert_eq!(*got, expected, "{rpc} with {who}");
        }
        if token == Some(WRONG) {
            assert_eq!(
                answers.len() - refused_as_guesses,
                FREE_FAILURES,
                "wrong tokens answered UNAUTHENTICATED before the peer was throttled"
            );
        }
    }
    eprintln!(
        "| RPC | credential | answer |\n|---|---|---|\n{}",
        table.join("\n")
    );

    // Nothing was written by any refused call.
    let cfg = admin.describe_endpoint_config("cfg", None).await.unwrap();
    assert_eq!(cfg.latest_revision, 1, "the config was not updated");
    let names: Vec<_> = admin
        .list_endpoint_configs()
        .await
        .unwrap()
        .into_iter()
        .map(|c| c.endpoint_config_name)
        .collect();
    assert_eq!(names, ["cfg"]);
    let ep = admin.describe_endpoint("ep").await.unwrap();
    assert_eq!(ep.registered_instances.len(), 1, "no instance came or went");
    assert_eq!(admin.list_endpoints().await.unwrap().len(), 1);
    // And the admin token does write.
    assert!(admin.delete_endpoint("ep").await.is_ok());

    no_secrets("control-plane", &cp.logs());
}

#[tokio::test]
async fn a_peer_guessing_tokens_is_throttled_and_other_peers_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = write(dir.path(), "tokens", &format!("{ADMIN} admin\n"));
    let data = dir.path().join("data");
    let cp = ChildServer::start(
        "control-plane",
        &["--data-dir", s(&data), "--auth-token-file", s(&tokens)],
    )
    .unwrap();
    let guesser = client_from(&cp.url(), Some(WRONG), Some("127.0.0.3")).await;
    for i in 0..FREE_FAILURES {
        let r = guesser.list_endpoints().await;
        assert_eq!(code(&r), Code::Unauthenticated, "guess {i}");
    }
    let refused = guesser.list_endpoints().await.unwrap_err();
    assert_eq!(refused.code(), Some(Code::Unavailable), "{refused}");
    assert!(
        refused
            .to_string()
            .contains("too many failed authentications"),
        "{refused}"
    );
    // The guesser's address is refused even with the right token, for a while...
    let same_peer = client_from(&cp.url(), Some(ADMIN), Some("127.0.0.3")).await;
    assert_eq!(code(&same_peer.list_endpoints().await), Code::Unavailable);
    // ...while the right token from any other address goes through at once.
    let other = client_from(&cp.url(), Some(ADMIN), Some("127.0.0.4")).await;
    assert!(other.list_endpoints().await.is_ok());
    let usual = client(&cp.url(), Some(ADMIN)).await;
    assert!(usual.list_endpoints().await.is_ok());
    // Calls without a token are not guesses: never throttled.
    let bare = client_from(&cp.url(), None, Some("127.0.0.5")).await;
    for _ in 0..3 * FREE_FAILURES {
        assert_eq!(code(&bare.list_endpoints().await), Code::Unauthenticated);
    }
    // The refusal ends: after the wait it names, the guesser's address is let in again.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert!(same_peer.list_endpoints().await.is_ok());
}

#[tokio::test]
async fn tokens_rotate_without_a_restart_and_the_data_plane_keeps_routing() {
    let dir = tempfile::tempdir().unwrap();
    let old = "old-token-1a2b3c4d5e";
    let new = "new-token-6f7a8b9c0d";
    let cp_tokens = write(dir.path(), "tokens", &format!("{old} admin\n"));
    let dp_token = write(dir.path(), "dp-token", &format!("{old}\n"));
    let data = dir.path().join("data");
    let cp = ChildServer::start(
        "control-plane",
        &["--data-dir", s(&data), "--auth-token-file", s(&cp_tokens)],
    )
    .unwrap();
    let engine = ChildServer::start("engine-sim", &["--time-scale", "0.01"]).unwrap();
    let admin = client(&cp.url(), Some(old)).await;
    let engine_url = engine.url();
    admin
        .create_endpoint_config(
            "cfg",
            vec![variant("v1", RoutingStrategy::PrefixAware, &[&engine_url])],
        )
        .await
        .unwrap();
    admin.create_endpoint("ep", "cfg").await.unwrap();
    let dp = ChildServer::start(
        "data-plane",
        &[
            "--control-plane",
            &cp.url(),
            "--auth-token-file",
            s(&dp_token),
            "--default-endpoint",
            "ep",
        ],
    )
    .unwrap();
    let http = Http::new();
    let version = wait_for(
        "the data plane's first table",
        Duration::from_secs(10),
        || http.table_version(&dp),
    )
    .await;
    assert_eq!(http.chat(&dp, None).await.0, 200);

    replace(&cp_tokens, &format!("{new} admin\n"));
    replace(&dp_token, &format!("{new}\n"));
    let rotated = std::time::Instant::now();
    let old_client = client(&cp.url(), Some(old)).await;
    let new_client = client(&cp.url(), Some(new)).await;
    wait_for(
        "the new token to work and the old to fail",
        Duration::from_secs(10),
        || async {
            let o = code(&old_client.list_endpoints().await);
            let n = code(&new_client.list_endpoints().await);
            (o == Code::Unauthenticated && n == Code::Ok).then_some(())
        },
    )
    .await;
    eprintln!("rotation took effect after {:?}", rotated.elapsed());

    // The data plane kept its table and still follows updates made with the new token.
    assert_eq!(http.chat(&dp, None).await.0, 200);
    new_client
        .set_variant_routing_strategy("cfg", "v1", RoutingStrategy::Random, None)
        .await
        .unwrap();
    wait_for(
        "the data plane to apply the update",
        Duration::from_secs(5),
        || async { http.table_version(&dp).await.filter(|&v| v > version) },
    )
    .await;
    // SIGHUP re-reads at once, too.
    replace(&cp_tokens, &format!("{old} admin\n"));
    unsafe { libc::kill(cp.child.id() as i32, libc::SIGHUP) };
    wait_for(
        "SIGHUP to restore the old token",
        Duration::from_secs(10),
        || async { (code(&old_client.list_endpoints().await) == Code::Ok).then_some(()) },
    )
    .await;
    assert!(cp.child.id() > 0, "same process: no restart");
    for (what, server) in [("control-plane", &cp), ("data-plane", &dp)] {
        let l = server.logs();
        assert!(
            !l.contains(old) && !l.contains(new),
            "{what} logged a token:\n{l}"
        );
    }
}

/// A test CA and certificates it signed, as PEM files.
struct Pki {
    ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn make_pki(dir: &Path) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "prefix-router test CA");
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
    let (client_cert, client_key) = leaf(vec!["data-plane.test".into()]);
    Pki {
        ca: write(dir, "ca.pem", &ca.pem()),
        server_cert: write(dir, "server.pem", &server_cert),
        server_key: write(dir, "server.key", &server_key),
        client_cert: write(dir, "client.pem", &client_cert),
        client_key: write(dir, "client.key", &client_key),
    }
}

fn prefixctl(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin("prefixctl"))
        .args(args)
        .env_remove("PREFIX_ROUTER_TOKEN")
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[tokio::test]
async fn mutual_tls_from_prefixctl_and_the_data_plane_and_https_on_the_router() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path());
    let data = dir.path().join("data");
    let cp = ChildServer::start(
        "control-plane",
        &[
            "--data-dir",
            s(&data),
            "--tls-cert",
            s(&pki.server_cert),
            "--tls-key",
            s(&pki.server_key),
            "--tls-client-ca",
            s(&pki.ca),
        ],
    )
    .unwrap();
    let https = format!("https://localhost:{}", cp.addr.port());
    let with_cert = [
        "--control-plane",
        &https,
        "--ca-cert",
        s(&pki.ca),
        "--tls-cert",
        s(&pki.client_cert),
        "--tls-key",
        s(&pki.client_key),
    ];
    let (ok, out) = prefixctl(&[&with_cert[..], &["endpoint-config", "list"]].concat());
    assert!(ok, "prefixctl with a client certificate: {out}");

    let (ok, out) = prefixctl(&[
        "--control-plane",
        &https,
        "--ca-cert",
        s(&pki.ca),
        "endpoint-config",
        "list",
    ]);
    assert!(!ok, "no client certificate must be refused: {out}");
    eprintln!("without a client certificate: {out}");
    let (ok, out) = prefixctl(&["--control-plane", &cp.url(), "endpoint-config", "list"]);
    assert!(!ok, "plaintext must be refused: {out}");
    assert!(
        out.contains("https://"),
        "the error says to use https://: {out}"
    );
    let (ok, out) = prefixctl(&[
        "--control-plane",
        &https,
        "--tls-cert",
        s(&pki.client_cert),
        "--tls-key",
        s(&pki.client_key),
        "endpoint-config",
        "list",
    ]);
    assert!(!ok, "an unknown server CA must be refused: {out}");

    // A data plane over mTLS, serving HTTPS itself.
    let engine = ChildServer::start("engine-sim", &["--time-scale", "0.01"]).unwrap();
    let sdk = Client::connect_with(
        https.clone(),
        ClientOptions {
            tls: TlsOptions::from_files(
                Some(&pki.ca),
                Some((pki.client_cert.as_path(), pki.client_key.as_path())),
            )
            .unwrap(),
            ..ClientOptions::default()
        },
    )
    .await
    .unwrap();
    let engine_url = engine.url();
    sdk.create_endpoint_config(
        "cfg",
        vec![variant("v1", RoutingStrategy::PrefixAware, &[&engine_url])],
    )
    .await
    .unwrap();
    sdk.create_endpoint("ep", "cfg").await.unwrap();
    let dp = ChildServer::start(
        "data-plane",
        &[
            "--control-plane",
            &https,
            "--ca-cert",
            s(&pki.ca),
            "--control-plane-tls-cert",
            s(&pki.client_cert),
            "--control-plane-tls-key",
            s(&pki.client_key),
            "--tls-cert",
            s(&pki.server_cert),
            "--tls-key",
            s(&pki.server_key),
            "--default-endpoint",
            "ep",
        ],
    )
    .unwrap();
    let tls = tls_connector(&pki.ca);
    let answer = wait_for(
        "the router to route over HTTPS",
        Duration::from_secs(10),
        || async {
            let (status, body) = https_chat(&tls, dp.addr).await;
            (status == 200).then_some(body)
        },
    )
    .await;
    assert!(answer.contains("chat.completion"), "{answer}");

    // Plain HTTP to the HTTPS port: a readable 400, not a reset.
    let mut plain = TcpStream::connect(dp.addr).unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut reply = String::new();
    plain
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = plain.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 400"), "{reply}");
    assert!(reply.contains("https://"), "{reply}");
}

fn tls_connector(ca: &Path) -> tokio_rustls::TlsConnector {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
}

/// One chat completion over HTTPS to `addr` (as `localhost`): status and body.
async fn https_chat(tls: &tokio_rustls::TlsConnector, addr: std::net::SocketAddr) -> (u16, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
        return (0, String::new());
    };
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let Ok(mut stream) = tls.connect(name, tcp).await else {
        return (0, String::new());
    };
    let body = chat_body();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply).await;
    let reply = String::from_utf8_lossy(&reply).to_string();
    let status = reply
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, reply)
}

fn chat_body() -> String {
    serde_json::json!({
        "model": "m",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello there"}],
    })
    .to_string()
}

/// A plain HTTP client for the router.
struct Http(
    hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        http_body_util::Full<bytes::Bytes>,
    >,
);

impl Http {
    fn new() -> Self {
        Http(
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http(),
        )
    }

    async fn send(
        &self,
        server: &ChildServer,
        method: http::Method,
        path: &str,
        auth: Option<&str>,
        body: String,
    ) -> (u16, http::HeaderMap, String) {
        use http_body_util::BodyExt as _;
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", server.url()))
            .header("content-type", "application/json");
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let req = req.body(http_body_util::Full::new(body.into())).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(30), self.0.request(req))
            .await
            .expect("an answer within 30 s")
            .expect("the router answers");
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.unwrap().to_bytes();
        (
            parts.status.as_u16(),
            parts.headers,
            String::from_utf8_lossy(&bytes).to_string(),
        )
    }

    async fn chat(&self, server: &ChildServer, auth: Option<&str>) -> (u16, String) {
        let (status, _, body) = self
            .send(
                server,
                http::Method::POST,
                "/v1/chat/completions",
                auth,
                chat_body(),
            )
            .await;
        (status, body)
    }

    async fn table_version(&self, server: &ChildServer) -> Option<u64> {
        let (status, _, body) = self
            .send(server, http::Method::GET, "/readyz", None, String::new())
            .await;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (status == 200)
            .then(|| v["table_version"].as_u64())
            .flatten()
    }
}

/// A control plane, an engine-sim requiring `UPSTREAM_KEY`, and the endpoint `ep` over it. Every
/// process logs at debug level (so a secret in any event would show) and, with `otlp`, exports
/// its spans there.
struct KeyedFleet {
    cp: ChildServer,
    engine: ChildServer,
    dir: tempfile::TempDir,
    env: Vec<(&'static str, String)>,
}

impl KeyedFleet {
    async fn start(engine_args: &[&str]) -> Self {
        Self::start_exporting(engine_args, None).await
    }

    async fn start_exporting(engine_args: &[&str], otlp: Option<&str>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let mut env = vec![("RUST_LOG", "debug".to_string())];
        if let Some(url) = otlp {
            env.push(("OTEL_EXPORTER_OTLP_ENDPOINT", url.to_string()));
            env.push(("OTEL_BSP_SCHEDULE_DELAY", "100".to_string()));
        }
        let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let cp = ChildServer::start_with_env("control-plane", &["--data-dir", s(&data)], &pairs)
            .unwrap();
        let engine = ChildServer::start_with_env(
            "engine-sim",
            &[&["--api-key", UPSTREAM_KEY][..], engine_args].concat(),
            &pairs,
        )
        .unwrap();
        let c = client(&cp.url(), None).await;
        let engine_url = engine.url();
        c.create_endpoint_config(
            "cfg",
            vec![variant("v1", RoutingStrategy::PrefixAware, &[&engine_url])],
        )
        .await
        .unwrap();
        c.create_endpoint("ep", "cfg").await.unwrap();
        KeyedFleet {
            cp,
            engine,
            dir,
            env,
        }
    }

    async fn router(&self, args: &[&str]) -> ChildServer {
        let base = [
            "--control-plane",
            &self.cp.url(),
            "--default-endpoint",
            "ep",
        ];
        let pairs: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let dp =
            ChildServer::start_with_env("data-plane", &[&base[..], args].concat(), &pairs).unwrap();
        let http = Http::new();
        wait_for("a routing table", Duration::from_secs(10), || {
            http.table_version(&dp)
        })
        .await;
        dp
    }
}

#[tokio::test]
async fn api_keys_guard_the_router_and_only_the_upstream_key_reaches_the_engine() {
    let (otlp, mut exported) = common::otlp::start_collector().await;
    let fleet = KeyedFleet::start_exporting(&["--time-scale", "0.01"], Some(&otlp)).await;
    let keys = write(fleet.dir.path(), "keys", &format!("{CLIENT_KEY}\n"));
    let upstream = write(fleet.dir.path(), "upstream", &format!("{UPSTREAM_KEY}\n"));
    let http = Http::new();
    let mut table = Vec::new();

    let keyed = fleet
        .router(&[
            "--api-key-file",
            s(&keys),
            "--upstream-api-key-file",
            s(&upstream),
        ])
        .await;
    let bearer_client = format!("Bearer {CLIENT_KEY}");
    let bearer_wrong = format!("Bearer {WRONG}");
    let bearer_upstream = format!("Bearer {UPSTREAM_KEY}");
    let bare_client = CLIENT_KEY.to_string();
    for (what, auth, expected) in [
        ("no key", None, 401),
        ("wrong key", Some(bearer_wrong.as_str()), 401),
        ("key without Bearer", Some(bare_client.as_str()), 401),
        ("the engine's key", Some(bearer_upstream.as_str()), 401),
        ("right key", Some(bearer_client.as_str()), 200),
    ] {
        let (status, body) = http.chat(&keyed, auth).await;
        table.push(format!(
            "| router with --api-key-file | {what} | {status} |"
        ));
        assert_eq!(status, expected, "{what}: {body}");
        if status == 401 {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["error"]["code"], "invalid_api_key", "{body}");
            assert!(
                !body.contains(CLIENT_KEY) && !body.contains(WRONG),
                "{body}"
            );
        }
    }
    // Probes and metrics stay open.
    let (status, _, _) = http
        .send(&keyed, http::Method::GET, "/healthz", None, String::new())
        .await;
    assert_eq!(status, 200);

    // Without an upstream key the client's header is dropped: the engine refuses.
    let plain = fleet.router(&[]).await;
    let (status, body) = http.chat(&plain, Some(&bearer_upstream)).await;
    table.push(format!(
        "| router, no flags | the engine's key | {status} (from the engine) |"
    ));
    assert_eq!(
        status, 401,
        "the client's header must not reach the engine: {body}"
    );
    assert!(body.contains("Unauthorized"), "the engine's answer: {body}");
    // ... unless the operator asks for it.
    let forwarding = fleet.router(&["--forward-authorization"]).await;
    let (status, body) = http.chat(&forwarding, Some(&bearer_upstream)).await;
    table.push(format!(
        "| router with --forward-authorization | the engine's key | {status} |"
    ));
    assert_eq!(status, 200, "{body}");
    eprintln!(
        "| router | client sends | answer |\n|---|---|---|\n{}",
        table.join("\n")
    );

    // Every process exported its spans (the routers' `route` spans among them): none carries a
    // key.
    let mut spans = Vec::new();
    wait_for("the routers' spans", Duration::from_secs(20), || {
        while let Ok(s) = exported.try_recv() {
            spans.push(s);
        }
        let routes = spans.iter().filter(|(_, s)| s.name == "route").count();
        std::future::ready((routes >= 3).then_some(()))
    })
    .await;
    let dump = format!("{spans:?}");
    no_secrets("the exported spans", &dump);
    for server in [&keyed, &plain, &forwarding, &fleet.engine] {
        let (_, _, metrics) = http
            .send(server, http::Method::GET, "/metrics", None, String::new())
            .await;
        assert!(metrics.contains("# TYPE"), "{metrics}");
        no_secrets("/metrics", &metrics);
    }
    eprintln!("{} spans exported, none with a key", spans.len());

    for (what, server) in [
        ("control-plane", &fleet.cp),
        ("engine-sim", &fleet.engine),
        ("data-plane (keys)", &keyed),
        ("data-plane", &plain),
        ("data-plane (forwarding)", &forwarding),
    ] {
        no_secrets(what, &server.logs());
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn max_in_flight_refuses_exactly_the_excess_with_retry_after() {
    // Each request takes ~1 s at the engine (40 tokens at 25 ms).
    let fleet = KeyedFleet::start(&["--time-scale", "1"]).await;
    let upstream = write(fleet.dir.path(), "upstream", &format!("{UPSTREAM_KEY}\n"));
    let dp = fleet
        .router(&[
            "--max-in-flight",
            "4",
            "--upstream-api-key-file",
            s(&upstream),
        ])
        .await;
    let slow = serde_json::json!({
        "model": "m", "max_tokens": 40,
        "messages": [{"role": "user", "content": "tell me a long story"}],
    })
    .to_string();
    // Four slow requests in flight...
    let metrics = Http::new();
    let in_flight = fill(&fleet, &dp, &slow).await;
    // ... so three more are refused at once, with Retry-After.
    for _ in 0..3 {
        let (status, headers, body) = metrics
            .send(
                &dp,
                http::Method::POST,
                "/v1/chat/completions",
                None,
                slow.clone(),
            )
            .await;
        assert_eq!(status, 503, "{body}");
        assert_eq!(headers["retry-after"], "1");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "overloaded", "{body}");
    }
    for r in in_flight {
        assert_eq!(r.await.unwrap(), 200, "the admitted requests finish");
    }

    // Refusals hold no memory: many more, then the router's RSS is where it was.
    let blockers = fill(&fleet, &dp, &slow).await;
    let pid = dp.child.id();
    let mut refused = 0;
    let before = rss_kib(pid);
    for _ in 0..2000 {
        let (status, _, _) = metrics
            .send(
                &dp,
                http::Method::POST,
                "/v1/chat/completions",
                None,
                chat_body(),
            )
            .await;
        refused += usize::from(status == 503);
    }
    let after = rss_kib(pid);
    eprintln!("2000 refusals: {refused} answered 503; router RSS {before} KiB -> {after} KiB");
    for b in blockers {
        b.await.unwrap();
    }
    assert!(refused > 1900, "only {refused} of 2000 refused");
    assert!(
        after < before + 16 * 1024,
        "RSS grew by {} KiB over 2000 refusals",
        after - before
    );
}

/// Starts four slow requests through `dp` and waits until the engine runs all four.
async fn fill(
    fleet: &KeyedFleet,
    dp: &ChildServer,
    slow: &str,
) -> Vec<tokio::task::JoinHandle<u16>> {
    let started = (0..4)
        .map(|_| {
            let body = slow.to_string();
            let addr = dp.addr;
            tokio::spawn(async move { raw_post(addr, &body).await })
        })
        .collect();
    let http = Http::new();
    wait_for(
        "four requests running at the engine",
        Duration::from_secs(10),
        || async {
            let (_, _, text) = http
                .send(
                    &fleet.engine,
                    http::Method::GET,
                    "/metrics",
                    None,
                    String::new(),
                )
                .await;
            text.lines()
                .any(|l| l.starts_with("vllm:num_requests_running") && l.ends_with(" 4"))
                .then_some(())
        },
    )
    .await;
    started
}

/// A POST over its own connection; the status once the whole body is read.
async fn raw_post(addr: std::net::SocketAddr, body: &str) -> u16 {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply).await;
    String::from_utf8_lossy(&reply)
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn request_heads_and_slow_clients_are_bounded() {
    let fleet = KeyedFleet::start(&["--time-scale", "0.01"]).await;
    let dp = fleet
        .router(&[
            "--header-read-timeout-ms",
            "500",
            "--body-read-timeout-ms",
            "500",
        ])
        .await;
    let exchange = |request: Vec<u8>| {
        let mut s = TcpStream::connect(dp.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&request).unwrap();
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        String::from_utf8_lossy(&reply).to_string()
    };
    // Too many header fields.
    let mut many = String::from("GET /healthz HTTP/1.1\r\nhost: x\r\n");
    for i in 0..150 {
        many.push_str(&format!("x-h{i}: v\r\n"));
    }
    many.push_str("\r\n");
    let reply = exchange(many.into_bytes());
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
    // A head larger than the limit.
    let big = format!(
        "GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n",
        "a".repeat(100 * 1024)
    );
    let reply = exchange(big.into_bytes());
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
    // A client that never finishes its head is cut off.
    let t = std::time::Instant::now();
    let reply = exchange(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n".to_vec());
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "a slow head was not cut off"
    );
    assert!(!reply.contains(" 200 "), "{reply}");
    // A body that stops coming: 408.
    let reply = exchange(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"model\":"
            .to_vec(),
    );
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
}

#[tokio::test]
async fn control_plane_limits_answer_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cp = ChildServer::start(
        "control-plane",
        &[
            "--data-dir",
            s(&data),
            "--max-message-bytes",
            "4096",
            "--max-watch-streams",
            "1",
        ],
    )
    .unwrap();
    let c = client(&cp.url(), None).await;
    // Too many instances for the message limit.
    let instances: Vec<String> = (0..200)
        .map(|i| format!("http://10.0.0.{}:8000", i % 250))
        .collect();
    let refs: Vec<&str> = instances.iter().map(String::as_str).collect();
    let e = c
        .create_endpoint_config("big", vec![variant("v1", RoutingStrategy::Random, &refs)])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(Code::OutOfRange), "{e}");
    assert!(e.to_string().contains("4096"), "{e}");
    // Too many variants: INVALID_ARGUMENT naming the limit.
    let many: Vec<_> = (0..17)
        .map(|i| {
            variant(
                &format!("v{i}"),
                RoutingStrategy::Random,
                &["http://127.0.0.1:9"],
            )
        })
        .collect();
    let e = c.create_endpoint_config("many", many).await.unwrap_err();
    assert_eq!(e.code(), Some(Code::InvalidArgument), "{e}");
    assert!(e.to_string().contains("at most 16"), "{e}");
    // One watch stream allowed: the second is refused while the first is open.
    let mut first = c.watch_routing_table("n1").await.unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(2), first.next()).await;
    let second = async {
        let mut w = c.watch_routing_table("n2").await?;
        match tokio::time::timeout(Duration::from_secs(5), w.next()).await {
            Ok(Some(r)) => r.map(drop),
            _ => Ok(()),
        }
    }
    .await;
    assert_eq!(code(&second), Code::ResourceExhausted, "{second:?}");
    drop(first);
    wait_for(
        "the stream's place to come back",
        Duration::from_secs(5),
        || async {
            let mut w = c.watch_routing_table("n3").await.ok()?;
            let r = tokio::time::timeout(Duration::from_secs(2), w.next()).await;
            matches!(r, Ok(Some(Ok(_)))).then_some(())
        },
    )
    .await;
}

#[test]
fn an_exposed_control_plane_without_credentials_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(bin("control-plane"))
        .args([
            "--listen",
            "0.0.0.0:0",
            "--data-dir",
            s(&dir.path().join("d")),
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("--auth-token-file") && err.contains("--insecure"),
        "{err}"
    );
    assert!(!err.contains("listening"), "{err}");
}

/// An HTTPS "instance" on loopback: TLS with `cert`/`key`, answering every request with a small
/// chat completion that echoes whether an `authorization` header came.
async fn https_instance(pki: &Pki) -> std::net::SocketAddr {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<_> = CertificateDer::pem_file_iter(&pki.server_cert)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(&pki.server_key).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper::service::service_fn(|_req| async {
                    let body = r#"{"object":"chat.completion","choices":[]}"#;
                    Ok::<_, std::convert::Infallible>(
                        http::Response::builder()
                            .header("content-type", "application/json")
                            .body(http_body_util::Full::new(bytes::Bytes::from_static(
                                body.as_bytes(),
                            )))
                            .unwrap(),
                    )
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn https_instances_are_reached_with_the_upstream_ca() {
    let dir = tempfile::tempdir().unwrap();
    let pki = make_pki(dir.path());
    let instance = https_instance(&pki).await;
    let instance_url = format!("https://localhost:{}", instance.port());
    let data = dir.path().join("data");
    let cp = ChildServer::start("control-plane", &["--data-dir", s(&data)]).unwrap();
    let c = client(&cp.url(), None).await;
    c.create_endpoint_config(
        "cfg",
        vec![variant("v1", RoutingStrategy::Random, &[&instance_url])],
    )
    .await
    .unwrap();
    c.create_endpoint("ep", "cfg").await.unwrap();
    let http = Http::new();
    let router = |extra: &[&str]| {
        let base = ["--control-plane", &cp.url(), "--default-endpoint", "ep"];
        ChildServer::start("data-plane", &[&base[..], extra].concat()).unwrap()
    };
    let trusted = router(&["--upstream-ca-cert", s(&pki.ca)]);
    wait_for("a table", Duration::from_secs(10), || {
        http.table_version(&trusted)
    })
    .await;
    let (status, headers, body) = http
        .send(
            &trusted,
            http::Method::POST,
            "/v1/chat/completions",
            None,
            chat_body(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(headers["x-prefix-router-instance"], instance_url.as_str());
    assert!(body.contains("chat.completion"), "{body}");

    // With the system's roots the test CA is unknown: a 502 that says TLS failed.
    let untrusting = router(&[]);
    wait_for("a table", Duration::from_secs(10), || {
        http.table_version(&untrusting)
    })
    .await;
    let (status, _, body) = http
        .send(
            &untrusting,
            http::Method::POST,
            "/v1/chat/completions",
            None,
            chat_body(),
        )
        .await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("TLS"), "{body}");
}
