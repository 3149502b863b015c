//! The Rust SDK: a typed client for the control plane's gRPC API.
//!
//! [`Client`] wraps the generated tonic clients ([`ControlPlaneClient`], [`RoutingDiscoveryClient`])
//! over one HTTP/2 connection. It connects eagerly with a timeout (so a control plane that is down
//! is reported once, as [`Error::Unreachable`]), sends an optional bearer token and the caller's
//! W3C trace context with every call ([`CallMetadata`]),
//! gives each RPC a typed method that unwraps the response into the values it carries, and maps
//! every failure into [`Error`], which keeps the gRPC code and the server's message as sent.
//!
//! [`Client::watch_routing_table`] turns `RoutingDiscovery.WatchRoutingTable` into a `Stream` of
//! decoded [`RoutingTable`]s, ACKing each one as it is yielded (and NACKing one that does not
//! decode). It is one stream: it ends when the server closes it and does not reconnect;
//! [`RoutingTableWatch::close`] ends it from the client's side once the last ACK is through.
//!
//! ```no_run
//! use futures_util::StreamExt;
//! use proto::client::{Client, ClientOptions};
//! use proto::{ProductionVariant, RoutingConfig, RoutingStrategy};
//!
//! # async fn example() -> Result<(), proto::client::Error> {
//! let client = Client::connect_with("http://127.0.0.1:7070", ClientOptions::default()).await?;
//! let variant = ProductionVariant {
//!     variant_name: "v1".into(),
//!     model_name: "llama".into(),
//!     initial_variant_weight: Some(1.0),
//!     routing_config: Some(RoutingConfig { routing_strategy: RoutingStrategy::Random as i32, ..Default::default() }),
//!     instances: vec!["http://127.0.0.1:9001".into()],
//! };
//! let config = client.create_endpoint_config("chat", vec![variant]).await?;
//! client.create_endpoint("chat", &config.endpoint_config_name).await?;
//!
//! // Swap the strategy live (describe, change, write with expected_revision, retry on conflict).
//! client.set_variant_routing_strategy("chat", "v1", RoutingStrategy::PrefixAware, None).await?;
//!
//! // Follow the routing tables the data planes receive.
//! let mut tables = client.watch_routing_table("observer-1").await?;
//! while let Some(table) = tables.next().await {
//!     let table = table?;
//!     println!("version {} with {} endpoints", table.version, table.endpoints.len());
//!     if table.version >= 10 {
//!         break;
//!     }
//! }
//! tables.close().await;
//! # Ok(())
//! # }
//! ```

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::InterceptedService;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::{Channel, Endpoint as TonicEndpoint};
use tonic::{Code, Request, Status};

use crate::control_plane_client::ControlPlaneClient;
use crate::routing_discovery_client::RoutingDiscoveryClient;
use crate::*;

/// How many times [`Client::set_variant_routing_strategy`] writes before it gives up on
/// concurrent writers.
pub const STRATEGY_UPDATE_ATTEMPTS: usize = 5;

/// Everything that can go wrong talking to the control plane.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The URL is not a usable `http(s)://host:port`.
    #[error("invalid control plane URL {url:?}: {cause}")]
    InvalidUrl { url: String, cause: String },
    /// No connection could be made (refused, timed out, name not resolved) or it broke.
    #[error("cannot reach control plane at {url}: {cause}")]
    Unreachable { url: String, cause: String },
    /// The control plane answered with a gRPC error; `message` is the server's, unchanged.
    #[error("{}: {message}", code_name(*.code))]
    Api { code: Code, message: String },
    /// The bearer token cannot travel in a header (control characters, non-ASCII).
    #[error("invalid bearer token: {0}")]
    InvalidToken(String),
    /// The control plane answered, but without a field the API promises.
    #[error("malformed response from the control plane: {0}")]
    Malformed(String),
    /// TLS settings that cannot be used (unreadable file, TLS options on an http:// URL).
    #[error("TLS: {0}")]
    Tls(String),
}

impl Error {
    /// The gRPC code of an [`Error::Api`] (`Unavailable` for an unreachable control plane).
    pub fn code(&self) -> Option<Code> {
        match self {
            Error::Api { code, .. } => Some(*code),
            Error::Unreachable { .. } => Some(Code::Unavailable),
            Error::InvalidUrl { .. }
            | Error::InvalidToken(_)
            | Error::Malformed(_)
            | Error::Tls(_) => None,
        }
    }

    fn api(code: Code, message: impl Into<String>) -> Self {
        Error::Api {
            code,
            message: message.into(),
        }
    }
}

/// `InvalidArgument`, `NotFound`, ...: the code as gRPC names it, in CamelCase.
pub fn code_name(code: Code) -> String {
    format!("{code:?}")
}

/// Connection settings.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Limit on establishing the connection.
    pub connect_timeout: Duration,
    /// Limit on each unary call (not on the routing-table watch).
    pub request_timeout: Duration,
    /// Sent as `authorization: Bearer TOKEN` with every call, when set.
    pub bearer_token: Option<String>,
    /// How to reach an `https://` control plane.
    pub tls: TlsOptions,
    /// The local address to connect from (a host with several; the system picks when `None`).
    pub local_address: Option<std::net::IpAddr>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            bearer_token: None,
            tls: TlsOptions::default(),
            local_address: None,
        }
    }
}

/// TLS towards an `https://` control plane: the CA to trust (the system's roots when none) and,
/// for mutual TLS, this client's certificate and key. All PEM.
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    pub ca_cert_pem: Option<Vec<u8>>,
    /// `(certificate chain, private key)`.
    pub identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl TlsOptions {
    /// Reads the PEM files (`--ca-cert`, `--tls-cert`, `--tls-key`); errors name the file.
    pub fn from_files(
        ca_cert: Option<&std::path::Path>,
        identity: Option<(&std::path::Path, &std::path::Path)>,
    ) -> Result<Self, Error> {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| Error::Tls(format!("cannot read {}: {e}", p.display())))
        };
        Ok(TlsOptions {
            ca_cert_pem: ca_cert.map(read).transpose()?,
            identity_pem: match identity {
                Some((cert, key)) => Some((read(cert)?, read(key)?)),
                None => None,
            },
        })
    }

    /// The channel's TLS settings for `url`: `None` for `http://`.
    pub fn for_url(&self, url: &str) -> Result<Option<tonic::transport::ClientTlsConfig>, Error> {
        if !url.starts_with("https://") {
            if self.ca_cert_pem.is_some() || self.identity_pem.is_some() {
                return Err(Error::Tls(format!(
                    "TLS options were given but {url} is not an https:// URL"
                )));
            }
            return Ok(None);
        }
        let mut tls = tonic::transport::ClientTlsConfig::new();
        tls = match &self.ca_cert_pem {
            Some(ca) => tls.ca_certificate(tonic::transport::Certificate::from_pem(ca)),
            None => tls.with_native_roots(),
        };
        if let Some((cert, key)) = &self.identity_pem {
            tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        Ok(Some(tls))
    }
}

/// A channel endpoint for `url` with `tls` applied (for `https://`).
pub fn endpoint(
    given: &str,
    url: &str,
    tls: &TlsOptions,
    connect_timeout: Duration,
) -> Result<TonicEndpoint, Error> {
    let mut endpoint = TonicEndpoint::from_shared(url.to_string())
        .map_err(|e| Error::InvalidUrl {
            url: given.to_string(),
            cause: error_chain(&e),
        })?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true);
    if let Some(config) = tls.for_url(url)? {
        endpoint = endpoint.tls_config(config).map_err(|e| {
            Error::Tls(format!(
                "cannot use the TLS settings for {url}: {}",
                error_chain(&e)
            ))
        })?;
    }
    Ok(endpoint)
}

/// A hint added to connection errors on `http://` URLs: a TLS server closes a plaintext
/// connection without a word.
pub fn plaintext_hint(url: &str) -> &'static str {
    if url.starts_with("http://") {
        " (if the control plane serves TLS, use an https:// URL)"
    } else {
        " (a control plane with --tls-client-ca also needs this client's --tls-cert and --tls-key)"
    }
}

/// The metadata added to every call: `authorization: Bearer ...` when a token is set, and the
/// caller's trace context (W3C `traceparent`, `tracestate`) when a trace is active, so the control
/// plane's spans join the caller's trace. The context is the current OpenTelemetry context,
/// written by the globally installed propagator (`telemetry::init` installs W3C TraceContext;
/// without one nothing is added).
#[derive(Debug, Clone, Default)]
pub struct CallMetadata {
    header: Option<MetadataValue<Ascii>>,
}

/// The former name of [`CallMetadata`].
pub type BearerAuth = CallMetadata;

impl CallMetadata {
    /// `None` sends no `authorization` header. Fails if the token cannot be a header value.
    pub fn new(token: Option<&str>) -> Result<Self, Error> {
        let header = token
            .map(|t| {
                format!("Bearer {}", t.trim())
                    .parse::<MetadataValue<Ascii>>()
                    .map_err(|_| {
                        Error::InvalidToken(
                            "it contains characters not allowed in a header value".into(),
                        )
                    })
            })
            .transpose()?;
        Ok(Self { header })
    }
}

impl tonic::service::Interceptor for CallMetadata {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(h) = &self.header {
            request.metadata_mut().insert("authorization", h.clone());
        }
        inject_trace_context(request.metadata_mut());
        Ok(request)
    }
}

/// Writes the current OpenTelemetry context into gRPC metadata (no-op when no span is active).
fn inject_trace_context(metadata: &mut tonic::metadata::MetadataMap) {
    use opentelemetry::trace::TraceContextExt as _;
    struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);
    impl opentelemetry::propagation::Injector for MetadataInjector<'_> {
        fn set(&mut self, key: &str, value: String) {
            if let (Ok(key), Ok(value)) = (
                tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
                MetadataValue::try_from(value.as_str()),
            ) {
                self.0.insert(key, value);
            }
        }
    }
    let cx = opentelemetry::Context::current();
    if cx.span().span_context().is_valid() {
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut MetadataInjector(metadata))
        });
    }
}

/// The generated control-plane client with the [`CallMetadata`] interceptor.
pub type ControlPlaneGrpc = ControlPlaneClient<InterceptedService<Channel, CallMetadata>>;
/// The generated routing-discovery client with the [`CallMetadata`] interceptor.
pub type RoutingDiscoveryGrpc = RoutingDiscoveryClient<InterceptedService<Channel, CallMetadata>>;

/// `DescribeEndpointConfig`'s answer.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointConfigDescription {
    /// The requested revision (the latest if none was asked for).
    pub endpoint_config: EndpointConfig,
    pub latest_revision: u64,
    /// Endpoints that route with this config.
    pub endpoint_names: Vec<String>,
}

/// `UpdateEndpointConfig`'s answer.
#[derive(Debug, Clone, PartialEq)]
pub struct UpdatedEndpointConfig {
    pub endpoint_config: EndpointConfig,
    /// The routing-table version the update produced (0 if no endpoint uses the config).
    pub routing_table_version: u64,
}

/// `DescribeEndpoint`'s answer: the endpoint, the config revision it routes with, and rollout
/// status per data-plane node.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointDescription {
    pub endpoint: Endpoint,
    pub endpoint_config: EndpointConfig,
    pub registered_instances: Vec<RegisteredInstance>,
    /// The control plane's current routing-table version (all endpoints).
    pub current_routing_table_version: u64,
    pub data_planes: Vec<DataPlaneStatus>,
}

impl EndpointDescription {
    /// True when every connected data plane has applied this endpoint's latest routes.
    pub fn rolled_out(&self) -> bool {
        self.data_planes
            .iter()
            .filter(|d| d.connected)
            .all(|d| d.up_to_date)
    }
}

/// A connected control-plane client. Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    url: String,
    control_plane: ControlPlaneGrpc,
    discovery: RoutingDiscoveryGrpc,
    request_timeout: Duration,
}

impl Client {
    /// Connects with [`ClientOptions::default`].
    pub async fn connect(url: impl Into<String>) -> Result<Self, Error> {
        Self::connect_with(url, ClientOptions::default()).await
    }

    /// Connects to `url` (`http://host:port`; a bare `host:port` means `http://host:port`).
    /// Several URLs, comma-separated (control-plane replicas), are tried in order; the first that
    /// connects is used.
    pub async fn connect_with(
        url: impl Into<String>,
        options: ClientOptions,
    ) -> Result<Self, Error> {
        let given: String = url.into();
        let urls: Vec<&str> = given
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        if urls.len() > 1 {
            let mut causes = Vec::with_capacity(urls.len());
            for url in urls {
                match Self::connect_one(url.to_string(), options.clone()).await {
                    Ok(c) => return Ok(c),
                    Err(Error::Unreachable { url, cause }) => {
                        causes.push(format!("{url}: {cause}"))
                    }
                    Err(e) => return Err(e),
                }
            }
            return Err(Error::Unreachable {
                url: given.clone(),
                cause: causes.join("; "),
            });
        }
        Self::connect_one(given, options).await
    }

    async fn connect_one(given: String, options: ClientOptions) -> Result<Self, Error> {
        let url = normalize_url(&given);
        let endpoint = endpoint(&given, &url, &options.tls, options.connect_timeout)?
            .local_address(options.local_address);
        let channel = endpoint.connect().await.map_err(|e| Error::Unreachable {
            url: url.clone(),
            cause: format!("{}{}", error_chain(&e), plaintext_hint(&url)),
        })?;
        let auth = CallMetadata::new(options.bearer_token.as_deref())?;
        Ok(Self {
            control_plane: ControlPlaneClient::with_interceptor(channel.clone(), auth.clone()),
            discovery: RoutingDiscoveryClient::with_interceptor(channel, auth),
            url,
            request_timeout: options.request_timeout,
        })
    }

    /// The URL connected to (normalized).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The generated client, for calls this wrapper does not cover.
    pub fn control_plane_grpc(&self) -> ControlPlaneGrpc {
        self.control_plane.clone()
    }

    /// The generated discovery client, e.g. to drive the watch stream by hand.
    pub fn routing_discovery_grpc(&self) -> RoutingDiscoveryGrpc {
        self.discovery.clone()
    }

    // ---- endpoint configs ----

    pub async fn create_endpoint_config(
        &self,
        name: &str,
        production_variants: Vec<ProductionVariant>,
    ) -> Result<EndpointConfig, Error> {
        let req = CreateEndpointConfigRequest {
            endpoint_config_name: name.into(),
            production_variants,
        };
        let resp = self
            .unary(
                req,
                |mut c, r| async move { c.create_endpoint_config(r).await },
            )
            .await?;
        required(resp.endpoint_config, "endpoint_config")
    }

    /// Replaces the config's variants (a new revision). With `expected_revision`, applies only if
    /// the latest revision is that one (`FailedPrecondition` otherwise).
    pub async fn update_endpoint_config(
        &self,
        name: &str,
        production_variants: Vec<ProductionVariant>,
        expected_revision: Option<u64>,
    ) -> Result<UpdatedEndpointConfig, Error> {
        let req = UpdateEndpointConfigRequest {
            endpoint_config_name: name.into(),
            production_variants,
            expected_revision,
        };
        let resp = self
            .unary(
                req,
                |mut c, r| async move { c.update_endpoint_config(r).await },
            )
            .await?;
        Ok(UpdatedEndpointConfig {
            endpoint_config: required(resp.endpoint_config, "endpoint_config")?,
            routing_table_version: resp.routing_table_version,
        })
    }

    /// The latest revision, or `revision` when given.
    pub async fn describe_endpoint_config(
        &self,
        name: &str,
        revision: Option<u64>,
    ) -> Result<EndpointConfigDescription, Error> {
        let req = DescribeEndpointConfigRequest {
            endpoint_config_name: name.into(),
            revision,
        };
        let resp = self
            .unary(req, |mut c, r| async move {
                c.describe_endpoint_config(r).await
            })
            .await?;
        Ok(EndpointConfigDescription {
            endpoint_config: required(resp.endpoint_config, "endpoint_config")?,
            latest_revision: resp.latest_revision,
            endpoint_names: resp.endpoint_names,
        })
    }

    pub async fn list_endpoint_configs(&self) -> Result<Vec<EndpointConfig>, Error> {
        let resp = self
            .unary(ListEndpointConfigsRequest {}, |mut c, r| async move {
                c.list_endpoint_configs(r).await
            })
            .await?;
        Ok(resp.endpoint_configs)
    }

    pub async fn delete_endpoint_config(&self, name: &str) -> Result<(), Error> {
        let req = DeleteEndpointConfigRequest {
            endpoint_config_name: name.into(),
        };
        self.unary(
            req,
            |mut c, r| async move { c.delete_endpoint_config(r).await },
        )
        .await?;
        Ok(())
    }

    /// Changes one variant's routing strategy (and, when given, its PREFIX_AWARE settings), keeping
    /// everything else: describe, change, write with `expected_revision`; on a conflicting write
    /// (`FailedPrecondition`) starts over, up to [`STRATEGY_UPDATE_ATTEMPTS`] times.
    /// An unknown variant is `NotFound`, naming the variants the config has.
    pub async fn set_variant_routing_strategy(
        &self,
        config_name: &str,
        variant_name: &str,
        strategy: RoutingStrategy,
        prefix_aware: Option<PrefixAwareRoutingConfig>,
    ) -> Result<UpdatedEndpointConfig, Error> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let current = self
                .describe_endpoint_config(config_name, None)
                .await?
                .endpoint_config;
            let mut variants = current.production_variants;
            let names = variants
                .iter()
                .map(|v| v.variant_name.clone())
                .collect::<Vec<_>>()
                .join(", ");
            let Some(variant) = variants.iter_mut().find(|v| v.variant_name == variant_name) else {
                return Err(Error::api(
                    Code::NotFound,
                    format!("no variant {variant_name:?} in endpoint config {config_name:?} (it has: {names})"),
                ));
            };
            let routing = variant.routing_config.get_or_insert_with(Default::default);
            routing.routing_strategy = strategy as i32;
            if let Some(p) = &prefix_aware {
                let cur = routing
                    .prefix_aware_routing_config
                    .get_or_insert_with(Default::default);
                if p.prefix_length != 0 {
                    cur.prefix_length = p.prefix_length;
                }
                if p.concurrency_threshold != 0 {
                    cur.concurrency_threshold = p.concurrency_threshold;
                }
                if p.kv_events.is_some() {
                    cur.kv_events.clone_from(&p.kv_events);
                }
                if !p.tokenizer.is_empty() {
                    cur.tokenizer.clone_from(&p.tokenizer);
                }
            }
            match self
                .update_endpoint_config(config_name, variants, Some(current.revision))
                .await
            {
                Err(Error::Api {
                    code: Code::FailedPrecondition,
                    ..
                }) if attempt < STRATEGY_UPDATE_ATTEMPTS => {
                    tokio::time::sleep(Duration::from_millis(20 * attempt as u64)).await;
                }
                other => return other,
            }
        }
    }

    // ---- endpoints ----

    pub async fn create_endpoint(
        &self,
        name: &str,
        endpoint_config_name: &str,
    ) -> Result<Endpoint, Error> {
        let req = CreateEndpointRequest {
            endpoint_name: name.into(),
            endpoint_config_name: endpoint_config_name.into(),
        };
        let resp = self
            .unary(req, |mut c, r| async move { c.create_endpoint(r).await })
            .await?;
        required(resp.endpoint, "endpoint")
    }

    /// Points the endpoint at another config (or at its config's latest revision).
    pub async fn update_endpoint(
        &self,
        name: &str,
        endpoint_config_name: &str,
    ) -> Result<Endpoint, Error> {
        let req = UpdateEndpointRequest {
            endpoint_name: name.into(),
            endpoint_config_name: endpoint_config_name.into(),
        };
        let resp = self
            .unary(req, |mut c, r| async move { c.update_endpoint(r).await })
            .await?;
        required(resp.endpoint, "endpoint")
    }

    pub async fn describe_endpoint(&self, name: &str) -> Result<EndpointDescription, Error> {
        let req = DescribeEndpointRequest {
            endpoint_name: name.into(),
        };
        let resp = self
            .unary(req, |mut c, r| async move { c.describe_endpoint(r).await })
            .await?;
        Ok(EndpointDescription {
            endpoint: required(resp.endpoint, "endpoint")?,
            endpoint_config: required(resp.endpoint_config, "endpoint_config")?,
            registered_instances: resp.registered_instances,
            current_routing_table_version: resp.current_routing_table_version,
            data_planes: resp.data_planes,
        })
    }

    pub async fn list_endpoints(&self) -> Result<Vec<Endpoint>, Error> {
        let resp = self
            .unary(ListEndpointsRequest {}, |mut c, r| async move {
                c.list_endpoints(r).await
            })
            .await?;
        Ok(resp.endpoints)
    }

    pub async fn delete_endpoint(&self, name: &str) -> Result<(), Error> {
        let req = DeleteEndpointRequest {
            endpoint_name: name.into(),
        };
        self.unary(req, |mut c, r| async move { c.delete_endpoint(r).await })
            .await?;
        Ok(())
    }

    // ---- registered instances ----

    /// Adds `address` to a variant under a lease of `lease_ttl_seconds` (0 = the server's default).
    pub async fn register_instance(
        &self,
        endpoint_name: &str,
        variant_name: &str,
        address: &str,
        lease_ttl_seconds: u32,
    ) -> Result<RegisteredInstance, Error> {
        let req = RegisterInstanceRequest {
            endpoint_name: endpoint_name.into(),
            variant_name: variant_name.into(),
            address: address.into(),
            lease_ttl_seconds,
        };
        let resp = self
            .unary(req, |mut c, r| async move { c.register_instance(r).await })
            .await?;
        required(resp.instance, "instance")
    }

    pub async fn renew_instance_lease(
        &self,
        instance_id: &str,
    ) -> Result<RegisteredInstance, Error> {
        let req = RenewInstanceLeaseRequest {
            instance_id: instance_id.into(),
        };
        let resp = self
            .unary(
                req,
                |mut c, r| async move { c.renew_instance_lease(r).await },
            )
            .await?;
        required(resp.instance, "instance")
    }

    pub async fn deregister_instance(&self, instance_id: &str) -> Result<(), Error> {
        let req = DeregisterInstanceRequest {
            instance_id: instance_id.into(),
        };
        self.unary(
            req,
            |mut c, r| async move { c.deregister_instance(r).await },
        )
        .await?;
        Ok(())
    }

    // ---- routing tables ----

    /// Opens `WatchRoutingTable` as node `node_id` (holding no version) and returns the tables as
    /// they arrive. Note that the control plane lists the node in `DescribeEndpoint`'s rollout
    /// status like any data plane.
    pub async fn watch_routing_table(&self, node_id: &str) -> Result<RoutingTableWatch, Error> {
        let (tx, rx) = mpsc::channel(4);
        let hello = WatchRoutingTableRequest {
            node_id: node_id.into(),
            ..Default::default()
        };
        tx.send(hello)
            .await
            .map_err(|_| Error::Malformed("watch request channel closed".into()))?;
        let mut discovery = self.discovery.clone();
        let responses = discovery
            .watch_routing_table(ReceiverStream::new(rx))
            .await
            .map_err(|s| self.status_error(s))?
            .into_inner();
        Ok(RoutingTableWatch {
            node_id: node_id.into(),
            url: self.url.clone(),
            acks: tx,
            responses,
            done: false,
        })
    }

    /// Runs one unary call with the request timeout, mapping its failure into [`Error`].
    async fn unary<Req, Resp, F, Fut>(&self, req: Req, call: F) -> Result<Resp, Error>
    where
        F: FnOnce(ControlPlaneGrpc, Request<Req>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, Status>>,
    {
        let mut request = Request::new(req);
        request.set_timeout(self.request_timeout);
        match tokio::time::timeout(
            self.request_timeout,
            call(self.control_plane.clone(), request),
        )
        .await
        {
            Ok(Ok(resp)) => Ok(resp.into_inner()),
            Ok(Err(status)) => Err(self.status_error(status)),
            Err(_) => Err(Error::api(
                Code::DeadlineExceeded,
                format!(
                    "no answer from the control plane at {} within {:?}",
                    self.url, self.request_timeout
                ),
            )),
        }
    }

    fn status_error(&self, status: Status) -> Error {
        status_to_error(&self.url, status)
    }
}

/// A failure of the connection itself (no server behind it) becomes [`Error::Unreachable`];
/// every status the server sent stays an [`Error::Api`] with its message as is.
fn status_to_error(url: &str, status: Status) -> Error {
    use std::error::Error as _;
    // A status with a source was made on this side from a broken connection (refused, reset,
    // a TLS handshake refused, a plaintext client on a TLS port), whatever its code: the cause
    // is in the source chain. Statuses the server sent have none.
    let transport = matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled
    );
    if let Some(source) = status.source().filter(|_| transport) {
        return Error::Unreachable {
            url: url.into(),
            cause: format!("{}{}", error_chain(source), plaintext_hint(url)),
        };
    }
    let hint = if matches!(
        status.code(),
        Code::Cancelled | Code::Unknown | Code::Internal
    ) {
        plaintext_hint(url)
    } else {
        ""
    };
    Error::Api {
        code: status.code(),
        message: format!("{}{hint}", status.message()),
    }
}

/// The decoded routing tables of one `WatchRoutingTable` stream.
///
/// Yields `Ok(table)` per version, after ACKing it; a table that does not decode is NACKed and
/// yielded as `Err(Error::Malformed)`, and the stream goes on. A stream error is yielded once and
/// ends the stream; a clean close by the server just ends it.
pub struct RoutingTableWatch {
    node_id: String,
    url: String,
    acks: mpsc::Sender<WatchRoutingTableRequest>,
    responses: tonic::Streaming<WatchRoutingTableResponse>,
    done: bool,
}

impl RoutingTableWatch {
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Ends the watch cleanly: sends the ACKs still queued, closes the request stream, and waits
    /// (at most 2 s) for the server to close its side, so the last ACK has been recorded.
    /// Dropping the watch instead may lose an ACK that was not sent yet.
    pub async fn close(self) {
        let RoutingTableWatch {
            acks,
            mut responses,
            ..
        } = self;
        drop(acks);
        let _ = tokio::time::timeout(Duration::from_secs(2), async move {
            while let Ok(Some(_)) = responses.message().await {}
        })
        .await;
    }

    fn answer(&self, resp: &WatchRoutingTableResponse, applied_version: u64, error_detail: String) {
        // The channel has room for a few answers; the server reads them as fast as it sends
        // tables, so a full channel only means an answer for an older version is still queued.
        let _ = self.acks.try_send(WatchRoutingTableRequest {
            node_id: self.node_id.clone(),
            applied_version,
            response_nonce: resp.nonce.clone(),
            error_detail,
            status: None,
        });
    }
}

impl Stream for RoutingTableWatch {
    type Item = Result<RoutingTable, Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.responses).poll_next(cx);
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(status))) => {
                self.done = true;
                Poll::Ready(Some(Err(status_to_error(&self.url, status))))
            }
            Poll::Ready(Some(Ok(resp))) => match RoutingTable::decode(resp.routing_table.clone()) {
                Ok(table) if table.version == resp.version => {
                    self.answer(&resp, resp.version, String::new());
                    Poll::Ready(Some(Ok(table)))
                }
                Ok(table) => {
                    let detail = format!(
                        "table version {} does not match response version {}",
                        table.version, resp.version
                    );
                    self.answer(&resp, 0, detail.clone());
                    Poll::Ready(Some(Err(Error::Malformed(detail))))
                }
                Err(e) => {
                    let detail = format!(
                        "routing table version {} does not decode: {e}",
                        resp.version
                    );
                    self.answer(&resp, 0, detail.clone());
                    Poll::Ready(Some(Err(Error::Malformed(detail))))
                }
            },
        }
    }
}

fn required<T>(value: Option<T>, field: &str) -> Result<T, Error> {
    value.ok_or_else(|| Error::Malformed(format!("the response has no {field}")))
}

/// `host:port` -> `http://host:port`; trailing slashes dropped.
fn normalize_url(url: &str) -> String {
    let url = url.trim().trim_end_matches('/');
    if url.contains("://") {
        url.to_string()
    } else {
        format!("http://{url}")
    }
}

/// An error and its sources as one line, `a: b: c`, skipping tonic's bare "transport error" and
/// repeats.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        let s = err.to_string();
        if s != "transport error" && !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
        cur = err.source();
    }
    if parts.is_empty() {
        "transport error".into()
    } else {
        parts.join(": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_errors_print_code_and_message() {
        let e = Error::api(
            Code::InvalidArgument,
            "invalid production_variants[0].variant_name: must not be empty",
        );
        assert_eq!(
            e.to_string(),
            "InvalidArgument: invalid production_variants[0].variant_name: must not be empty"
        );
        assert_eq!(e.code(), Some(Code::InvalidArgument));
    }

    #[test]
    fn urls_are_normalized() {
        assert_eq!(normalize_url("127.0.0.1:7070"), "http://127.0.0.1:7070");
        assert_eq!(normalize_url("http://cp:7070/"), "http://cp:7070");
    }

    #[test]
    fn bearer_token_is_added() {
        use tonic::service::Interceptor;
        let mut auth = BearerAuth::new(Some("s3cret")).unwrap();
        let req = auth.call(Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("authorization").unwrap(),
            "Bearer s3cret"
        );
        let mut none = BearerAuth::new(None).unwrap();
        assert!(none
            .call(Request::new(()))
            .unwrap()
            .metadata()
            .get("authorization")
            .is_none());
        assert!(BearerAuth::new(Some("bad\ntoken")).is_err());
    }

    #[test]
    fn trace_context_is_carried_when_a_trace_is_active() {
        use opentelemetry::trace::{
            SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
        };
        use tonic::service::Interceptor;
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        let mut metadata = CallMetadata::new(None).unwrap();
        assert!(
            metadata
                .call(Request::new(()))
                .unwrap()
                .metadata()
                .get("traceparent")
                .is_none(),
            "no active trace"
        );

        let trace_id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
        let span_id = SpanId::from_hex("00f067aa0ba902b7").unwrap();
        let cx = opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
            trace_id,
            span_id,
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        ));
        let _active = cx.attach();
        let req = metadata.call(Request::new(())).unwrap();
        assert_eq!(
            req.metadata().get("traceparent").unwrap(),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
    }

    #[tokio::test]
    async fn unreachable_control_plane_is_one_clear_error() {
        let url = test_support::unused_url();
        let e = Client::connect(url.clone()).await.unwrap_err();
        match &e {
            Error::Unreachable { url: u, cause } => {
                assert_eq!(u, &url);
                assert!(!cause.is_empty());
            }
            other => panic!("expected Unreachable, got {other:?}"),
        }
        assert!(
            e.to_string()
                .starts_with(&format!("cannot reach control plane at {url}: ")),
            "{e}"
        );
        assert!(!e.to_string().contains('\n'));
        let bad = Client::connect("http://bad host:1").await.unwrap_err();
        assert!(matches!(bad, Error::InvalidUrl { .. }), "{bad:?}");
    }
}
