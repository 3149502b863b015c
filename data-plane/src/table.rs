//! The routing table as the router uses it: validated once from the wire type, immutable, shared
//! behind an `Arc` (requests keep the table they started with).
//!
//! Everything a request needs is precomputed here: instance id hashes for rendezvous hashing,
//! cumulative variant weights, header values, metric counters.

use std::collections::HashMap;
use std::sync::Arc;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::HeaderValue;
use xxhash_rust::xxh3::xxh3_64;

use crate::load::{InstanceState, VariantLoad};
use crate::priority::Priority;
use crate::route_stats::RouteStats;

pub use proto::limits::{
    CONCURRENCY_THRESHOLD_RANGE, DEFAULT_CONCURRENCY_THRESHOLD, DEFAULT_PREFIX_LENGTH,
    PREFIX_LENGTH_RANGE,
};

/// Why a wire routing table was rejected (the NACK's error detail).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TableError {
    #[error("endpoints[{index}].endpoint_name is empty")]
    EmptyEndpointName { index: usize },
    #[error("duplicate endpoint name {0:?}")]
    DuplicateEndpoint(String),
    #[error("endpoint {endpoint:?}: variants[{index}].variant_name is empty")]
    EmptyVariantName { endpoint: String, index: usize },
    #[error("endpoint {endpoint:?}: duplicate variant name {variant:?}")]
    DuplicateVariant { endpoint: String, variant: String },
    #[error("{field} {value:?} contains control characters")]
    ControlCharacters { field: &'static str, value: String },
    #[error(
        "endpoint {endpoint:?} variant {variant:?}: weight {weight} must be a finite number > 0"
    )]
    BadWeight {
        endpoint: String,
        variant: String,
        weight: f32,
    },
    #[error(
        "endpoint {endpoint:?} variant {variant:?}: unknown routing strategy {value} (expected {})",
        proto::RoutingStrategy::USER_NAMES
    )]
    UnknownStrategy {
        endpoint: String,
        variant: String,
        value: i32,
    },
    #[error(
        "endpoint {endpoint:?} variant {variant:?}: unknown default_priority {value} (expected {})",
        proto::RequestPriority::USER_NAMES
    )]
    UnknownPriority {
        endpoint: String,
        variant: String,
        value: i32,
    },
    #[error(
        "endpoint {endpoint:?} variant {variant:?}: prefix_length {value} out of range 64..=65536"
    )]
    BadPrefixLength {
        endpoint: String,
        variant: String,
        value: u32,
    },
    #[error("endpoint {endpoint:?} variant {variant:?}: concurrency_threshold {value} out of range 1..=4096")]
    BadConcurrencyThreshold {
        endpoint: String,
        variant: String,
        value: u32,
    },
    #[error("endpoint {endpoint:?} variant {variant:?}: prefix_aware_routing_config.{field} {value:?}: {reason}")]
    BadKvEvents {
        endpoint: String,
        variant: String,
        field: &'static str,
        value: String,
        reason: String,
    },
    #[error("endpoint {endpoint:?} variant {variant:?}: instances[{index}].instance_id is empty")]
    EmptyInstanceId {
        endpoint: String,
        variant: String,
        index: usize,
    },
    #[error("endpoint {endpoint:?} variant {variant:?}: duplicate instance id {instance:?}")]
    DuplicateInstance {
        endpoint: String,
        variant: String,
        instance: String,
    },
    #[error("endpoint {endpoint:?} variant {variant:?}: bad instance URL {address:?} for instance {instance:?}: {reason}")]
    BadInstanceUrl {
        endpoint: String,
        variant: String,
        instance: String,
        address: String,
        reason: String,
    },
}

/// How a variant picks an instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Random,
    LeastOutstandingRequests,
    PrefixAware(PrefixAware),
}

/// PREFIX_AWARE settings, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixAware {
    /// Characters (OpenAI API) or bytes (`/invocations`) of the prompt that form the key.
    pub prefix_length: u32,
    /// In-flight requests at which an instance is skipped even if it holds the prefix.
    pub concurrency_threshold: u32,
}

impl Strategy {
    pub fn user_name(&self) -> &'static str {
        match self {
            Strategy::Random => "RANDOM",
            Strategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            Strategy::PrefixAware(_) => "PREFIX_AWARE",
        }
    }
}

/// Where a PREFIX_AWARE variant's engines publish their KV-cache events, and the tokenizer its
/// prompts are matched with (`prefix_aware_routing_config.kv_events` and `.tokenizer`), loaded.
#[derive(Debug)]
pub struct KvEvents {
    pub settings: KvSettings,
    /// The tokenizer at `settings.tokenizer`, loaded when the settings last changed.
    pub tokenizer: chat_tokens::ChatTokenizer,
}

/// The settings of [`KvEvents`] as the table gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSettings {
    /// The engines' PUB endpoint template (`tcp://{host}:5557`).
    pub endpoint: String,
    /// Their replay (ROUTER) endpoint template.
    pub replay_endpoint: Option<String>,
    /// The topic; empty: every topic.
    pub topic: String,
    /// Tokens per KV block; 0: taken from the events.
    pub block_size: u32,
    /// The model's `tokenizer.json` on this router's disk.
    pub tokenizer: std::path::PathBuf,
}

/// One model server behind a variant.
#[derive(Debug)]
pub struct Instance {
    id: Arc<str>,
    address: Arc<str>,
    id_hash: u64,
    authority: Authority,
    /// `Host` header value (the authority).
    host: HeaderValue,
    /// Path prefix of the address ("" for `http://host:port`).
    base_path: Arc<str>,
    /// An `https://` instance.
    tls: bool,
    header: HeaderValue,
    state: Arc<InstanceState>,
    stats: Arc<RouteStats>,
}

impl Instance {
    pub fn id(&self) -> &str {
        &self.id
    }
    pub fn address(&self) -> &str {
        &self.address
    }
    /// xxh3 of the instance id: its identity for rendezvous hashing.
    pub fn id_hash(&self) -> u64 {
        self.id_hash
    }
    pub fn state(&self) -> &Arc<InstanceState> {
        &self.state
    }
    pub fn stats(&self) -> &Arc<RouteStats> {
        &self.stats
    }
    /// Value of the `x-prefix-router-instance` header.
    pub fn header(&self) -> &HeaderValue {
        &self.header
    }

    /// Host and port to connect to.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }
    /// Whether the instance is reached over TLS (`https://`).
    pub fn tls(&self) -> bool {
        self.tls
    }
    /// Value of the `Host` header sent to the instance.
    pub fn host(&self) -> &HeaderValue {
        &self.host
    }

    /// The upstream request target for a request path (with query), in origin form: the
    /// address's base path, then the path.
    pub fn target(&self, path_and_query: &PathAndQuery) -> Result<http::Uri, http::Error> {
        let mut parts = http::uri::Parts::default();
        parts.path_and_query = Some(if self.base_path.is_empty() {
            path_and_query.clone()
        } else {
            PathAndQuery::try_from(format!("{}{}", self.base_path, path_and_query.as_str()))?
        });
        Ok(http::Uri::from_parts(parts)?)
    }
}

/// A production variant: a strategy over a set of instances.
#[derive(Debug)]
pub struct Variant {
    name: Arc<str>,
    model_name: Arc<str>,
    weight: f32,
    strategy: Strategy,
    /// The priority of its requests that name none.
    default_priority: Priority,
    instances: Box<[Instance]>,
    id_hashes: Box<[u64]>,
    /// Mixed into prefix-index keys so variants do not share entries.
    salt: u64,
    header: HeaderValue,
    load: Arc<VariantLoad>,
    kv_events: Option<Arc<KvEvents>>,
}

impl Variant {
    /// Where its engines publish KV events, when it is PREFIX_AWARE and names them.
    pub fn kv_events(&self) -> Option<&Arc<KvEvents>> {
        self.kv_events.as_ref()
    }
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn model_name(&self) -> &str {
        &self.model_name
    }
    pub fn weight(&self) -> f32 {
        self.weight
    }
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }
    /// A PREFIX_AWARE variant (the one whose placement learns from the engines' reports).
    pub fn is_prefix_aware(&self) -> bool {
        matches!(self.strategy(), Strategy::PrefixAware(_))
    }
    /// The priority of the variant's requests that name none (`default_priority` of its
    /// routing config).
    pub fn default_priority(&self) -> Priority {
        self.default_priority
    }
    pub fn instances(&self) -> &[Instance] {
        &self.instances
    }
    /// `instances()[i].id_hash()`, contiguous for the rendezvous scan.
    pub fn id_hashes(&self) -> &[u64] {
        &self.id_hashes
    }
    pub fn salt(&self) -> u64 {
        self.salt
    }
    pub fn header(&self) -> &HeaderValue {
        &self.header
    }
    pub fn load(&self) -> &Arc<VariantLoad> {
        &self.load
    }
}

/// An endpoint: weighted production variants.
#[derive(Debug)]
pub struct Endpoint {
    name: Arc<str>,
    config_name: String,
    config_revision: u64,
    variants: Box<[Variant]>,
    /// Running sum of variant weights, for the weighted pick.
    cumulative_weights: Box<[f64]>,
}

impl Endpoint {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn config_name(&self) -> &str {
        &self.config_name
    }
    pub fn config_revision(&self) -> u64 {
        self.config_revision
    }
    pub fn variants(&self) -> &[Variant] {
        &self.variants
    }
    pub fn variant(&self, name: &str) -> Option<&Variant> {
        self.variants.iter().find(|v| &*v.name == name)
    }

    /// The variant whose weight interval holds `x` in `[0, 1)`.
    pub fn pick_variant(&self, x: f64) -> Option<&Variant> {
        let total = *self.cumulative_weights.last()?;
        let target = x * total;
        let i = self.cumulative_weights.partition_point(|&c| c <= target);
        self.variants.get(i.min(self.variants.len() - 1))
    }
}

/// A validated, versioned routing table.
#[derive(Debug)]
pub struct RoutingTable {
    version: u64,
    version_header: HeaderValue,
    endpoints: HashMap<Box<str>, Endpoint>,
}

impl RoutingTable {
    pub fn version(&self) -> u64 {
        self.version
    }
    pub fn version_header(&self) -> &HeaderValue {
        &self.version_header
    }
    pub fn endpoint(&self, name: &str) -> Option<&Endpoint> {
        self.endpoints.get(name)
    }
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.values()
    }

    /// Validates a wire table and builds it, reusing the load state, health and counters of
    /// instances that `previous` already had.
    pub fn build(
        wire: proto::RoutingTable,
        previous: Option<&RoutingTable>,
    ) -> Result<Self, TableError> {
        // State of every previous instance by id, built only if an instance is not found in its
        // own previous variant (new, or moved between variants).
        let mut old_states: Option<HashMap<&str, &Arc<InstanceState>>> = None;
        let all_old_states = || {
            let mut map = HashMap::new();
            for e in previous.iter().flat_map(|p| p.endpoints.values()) {
                for v in e.variants.iter() {
                    for i in v.instances.iter() {
                        map.insert(&*i.id, &i.state);
                    }
                }
            }
            map
        };
        // One state per instance id in this table, shared by every variant that lists it.
        let mut new_states: HashMap<&str, Arc<InstanceState>> = HashMap::new();
        let mut endpoints = HashMap::with_capacity(wire.endpoints.len());
        for (index, e) in wire.endpoints.iter().enumerate() {
            if e.endpoint_name.is_empty() {
                return Err(TableError::EmptyEndpointName { index });
            }
            no_control_chars("endpoint_name", &e.endpoint_name)?;
            if endpoints.contains_key(e.endpoint_name.as_str()) {
                return Err(TableError::DuplicateEndpoint(e.endpoint_name.clone()));
            }
            let prev_endpoint = previous.and_then(|p| p.endpoint(&e.endpoint_name));
            let mut variants = Vec::with_capacity(e.variants.len());
            let mut cumulative = Vec::with_capacity(e.variants.len());
            let mut sum = 0f64;
            for (vi, v) in e.variants.iter().enumerate() {
                let endpoint = &e.endpoint_name;
                if v.variant_name.is_empty() {
                    return Err(TableError::EmptyVariantName {
                        endpoint: endpoint.clone(),
                        index: vi,
                    });
                }
                no_control_chars("variant_name", &v.variant_name)?;
                if e.variants[..vi]
                    .iter()
                    .any(|o| o.variant_name == v.variant_name)
                {
                    return Err(TableError::DuplicateVariant {
                        endpoint: endpoint.clone(),
                        variant: v.variant_name.clone(),
                    });
                }
                let ctx = || (endpoint.clone(), v.variant_name.clone());
                if !(v.weight.is_finite() && v.weight > 0.0) {
                    let (endpoint, variant) = ctx();
                    return Err(TableError::BadWeight {
                        endpoint,
                        variant,
                        weight: v.weight,
                    });
                }
                let strategy = strategy(v, ctx)?;
                let kv_events = match strategy {
                    Strategy::PrefixAware(_) => kv_events(v, ctx)?,
                    _ => None,
                };
                let default_priority = default_priority(v, ctx)?;
                let prev_variant = prev_endpoint.and_then(|p| p.variant(&v.variant_name));
                // the same settings keep their Arc (and tokenizer): subscribers see no change
                let kv_events = match (prev_variant.and_then(|pv| pv.kv_events.as_ref()), kv_events)
                {
                    (Some(old), Some(new)) if old.settings == new => Some(old.clone()),
                    (_, Some(settings)) => {
                        let tokenizer = chat_tokens::ChatTokenizer::load(&settings.tokenizer)
                            .map_err(|e| {
                                let (endpoint, variant) = ctx();
                                TableError::BadKvEvents {
                                    endpoint,
                                    variant,
                                    field: "tokenizer",
                                    value: settings.tokenizer.display().to_string(),
                                    reason: e.to_string(),
                                }
                            })?;
                        Some(Arc::new(KvEvents {
                            settings,
                            tokenizer,
                        }))
                    }
                    (_, None) => None,
                };
                let prev_instances: HashMap<&str, &Instance> = prev_variant
                    .map(|pv| pv.instances.iter().map(|i| (&*i.id, i)).collect())
                    .unwrap_or_default();
                let mut seen = std::collections::HashSet::with_capacity(v.instances.len());
                let mut instances = Vec::with_capacity(v.instances.len());
                for (ii, inst) in v.instances.iter().enumerate() {
                    let id = inst.instance_id.as_str();
                    if id.is_empty() {
                        let (endpoint, variant) = ctx();
                        return Err(TableError::EmptyInstanceId {
                            endpoint,
                            variant,
                            index: ii,
                        });
                    }
                    if !seen.insert(id) {
                        let (endpoint, variant) = ctx();
                        return Err(TableError::DuplicateInstance {
                            endpoint,
                            variant,
                            instance: id.to_string(),
                        });
                    }
                    let prev = prev_instances.get(id).copied();
                    let state = new_states
                        .entry(id)
                        .or_insert_with(|| match prev {
                            Some(p) => p.state.clone(),
                            None => old_states
                                .get_or_insert_with(all_old_states)
                                .get(id)
                                .map(|s| Arc::clone(s))
                                .unwrap_or_default(),
                        })
                        .clone();
                    let address = inst.address.trim_end_matches('/');
                    let instance = match prev {
                        // Same instance at the same address: reuse the parsed parts and counters.
                        Some(p) if *p.address == *address => Instance {
                            id: p.id.clone(),
                            address: p.address.clone(),
                            id_hash: p.id_hash,
                            authority: p.authority.clone(),
                            host: p.host.clone(),
                            base_path: p.base_path.clone(),
                            tls: p.tls,
                            header: p.header.clone(),
                            state,
                            stats: p.stats.clone(),
                        },
                        _ => {
                            let bad_url = |reason: String| {
                                let (endpoint, variant) = ctx();
                                TableError::BadInstanceUrl {
                                    endpoint,
                                    variant,
                                    instance: id.to_string(),
                                    address: inst.address.clone(),
                                    reason,
                                }
                            };
                            let (authority, base_path, tls) =
                                parse_address(&inst.address).map_err(bad_url)?;
                            Instance {
                                id: id.into(),
                                id_hash: xxh3_64(id.as_bytes()),
                                header: HeaderValue::from_str(address)
                                    .map_err(|e| bad_url(e.to_string()))?,
                                address: address.into(),
                                host: HeaderValue::from_str(authority.as_str())
                                    .map_err(|e| bad_url(e.to_string()))?,
                                authority,
                                base_path,
                                tls,
                                state,
                                stats: prev.map(|p| p.stats.clone()).unwrap_or_default(),
                            }
                        }
                    };
                    instances.push(instance);
                }
                sum += v.weight as f64;
                cumulative.push(sum);
                let name: Arc<str> = v.variant_name.as_str().into();
                let id_hashes: Box<[u64]> = instances.iter().map(|i| i.id_hash).collect();
                variants.push(Variant {
                    header: HeaderValue::from_str(&name).map_err(|_| {
                        TableError::ControlCharacters {
                            field: "variant_name",
                            value: v.variant_name.clone(),
                        }
                    })?,
                    salt: xxh3_64(format!("{}\0{}", e.endpoint_name, v.variant_name).as_bytes()),
                    instances: instances.into_boxed_slice(),
                    name,
                    model_name: v.model_name.as_str().into(),
                    weight: v.weight,
                    strategy,
                    default_priority,
                    load: prev_variant.map(|pv| pv.load.clone()).unwrap_or_default(),
                    kv_events,
                    id_hashes,
                });
            }
            endpoints.insert(
                e.endpoint_name.as_str().into(),
                Endpoint {
                    name: e.endpoint_name.as_str().into(),
                    config_name: e.endpoint_config_name.clone(),
                    config_revision: e.endpoint_config_revision,
                    variants: variants.into_boxed_slice(),
                    cumulative_weights: cumulative.into_boxed_slice(),
                },
            );
        }
        Ok(RoutingTable {
            version: wire.version,
            version_header: HeaderValue::from(wire.version),
            endpoints,
        })
    }
}

impl TryFrom<proto::RoutingTable> for RoutingTable {
    type Error = TableError;
    fn try_from(wire: proto::RoutingTable) -> Result<Self, TableError> {
        RoutingTable::build(wire, None)
    }
}

fn no_control_chars(field: &'static str, value: &str) -> Result<(), TableError> {
    if value.chars().any(|c| c.is_control()) {
        return Err(TableError::ControlCharacters {
            field,
            value: value.to_string(),
        });
    }
    Ok(())
}

fn default_priority(
    v: &proto::VariantRoutes,
    ctx: impl Fn() -> (String, String),
) -> Result<Priority, TableError> {
    let raw = v.routing_config.as_ref().map_or(0, |c| c.default_priority);
    match proto::RequestPriority::try_from(raw) {
        Ok(proto::RequestPriority::Critical) => Ok(Priority::Critical),
        Ok(proto::RequestPriority::Unspecified | proto::RequestPriority::Standard) => {
            Ok(Priority::Standard)
        }
        Ok(proto::RequestPriority::Sheddable) => Ok(Priority::Sheddable),
        Err(_) => {
            let (endpoint, variant) = ctx();
            Err(TableError::UnknownPriority {
                endpoint,
                variant,
                value: raw,
            })
        }
    }
}

fn strategy(
    v: &proto::VariantRoutes,
    ctx: impl Fn() -> (String, String),
) -> Result<Strategy, TableError> {
    let config = v.routing_config.as_ref();
    let raw = config.map_or(0, |c| c.routing_strategy);
    let kind = proto::RoutingStrategy::try_from(raw).map_err(|_| {
        let (endpoint, variant) = ctx();
        TableError::UnknownStrategy {
            endpoint,
            variant,
            value: raw,
        }
    })?;
    Ok(match kind {
        proto::RoutingStrategy::Unspecified | proto::RoutingStrategy::Random => Strategy::Random,
        proto::RoutingStrategy::LeastOutstandingRequests => Strategy::LeastOutstandingRequests,
        proto::RoutingStrategy::PrefixAware => {
            let default = proto::PrefixAwareRoutingConfig::default();
            let pa = config
                .and_then(|c| c.prefix_aware_routing_config.as_ref())
                .unwrap_or(&default);
            let prefix_length = setting(
                pa.prefix_length,
                DEFAULT_PREFIX_LENGTH,
                PREFIX_LENGTH_RANGE,
                &ctx,
                |endpoint, variant, value| TableError::BadPrefixLength {
                    endpoint,
                    variant,
                    value,
                },
            )?;
            let concurrency_threshold = setting(
                pa.concurrency_threshold,
                DEFAULT_CONCURRENCY_THRESHOLD,
                CONCURRENCY_THRESHOLD_RANGE,
                &ctx,
                |endpoint, variant, value| TableError::BadConcurrencyThreshold {
                    endpoint,
                    variant,
                    value,
                },
            )?;
            Strategy::PrefixAware(PrefixAware {
                prefix_length,
                concurrency_threshold,
            })
        }
    })
}

/// A PREFIX_AWARE variant's `kv_events` and `tokenizer`, checked as the control plane does.
fn kv_events(
    v: &proto::VariantRoutes,
    ctx: impl Fn() -> (String, String),
) -> Result<Option<KvSettings>, TableError> {
    let Some(pa) = v
        .routing_config
        .as_ref()
        .and_then(|c| c.prefix_aware_routing_config.as_ref())
    else {
        return Ok(None);
    };
    let Some(k) = &pa.kv_events else {
        return Ok(None);
    };
    let bad = |field: &'static str, value: &str, reason: String| {
        let (endpoint, variant) = ctx();
        TableError::BadKvEvents {
            endpoint,
            variant,
            field,
            value: value.to_string(),
            reason,
        }
    };
    let template = |field: &'static str, value: &str| -> Result<String, TableError> {
        kv_events::fill_template(value, "http://127.0.0.1:8000")
            .map_err(|e| bad(field, value, e.problem.to_string()))?;
        Ok(value.to_string())
    };
    let endpoint = template("kv_events.endpoint", &k.endpoint)?;
    let replay_endpoint = (!k.replay_endpoint.is_empty())
        .then(|| template("kv_events.replay_endpoint", &k.replay_endpoint))
        .transpose()?;
    if k.block_size != 0 && !proto::limits::KV_BLOCK_SIZE_RANGE.contains(&k.block_size) {
        return Err(bad(
            "kv_events.block_size",
            &k.block_size.to_string(),
            "out of range 1..=4096 (0: taken from the events)".into(),
        ));
    }
    if pa.tokenizer.is_empty() {
        return Err(bad(
            "tokenizer",
            "",
            "is required with kv_events (the model's tokenizer.json on this router's disk)".into(),
        ));
    }
    Ok(Some(KvSettings {
        endpoint,
        replay_endpoint,
        topic: k.topic.clone(),
        block_size: k.block_size,
        tokenizer: pa.tokenizer.clone().into(),
    }))
}

/// A PREFIX_AWARE setting: `value`, or `default` when unset (0), checked against `range`; `error`
/// names the field (endpoint, variant, value).
fn setting(
    value: u32,
    default: u32,
    range: std::ops::RangeInclusive<u32>,
    ctx: &impl Fn() -> (String, String),
    error: fn(String, String, u32) -> TableError,
) -> Result<u32, TableError> {
    let value = if value == 0 { default } else { value };
    if range.contains(&value) {
        Ok(value)
    } else {
        let (endpoint, variant) = ctx();
        Err(error(endpoint, variant, value))
    }
}

/// `http(s)://host:port[/base]` -> authority, base path and whether it is `https`.
fn parse_address(address: &str) -> Result<(Authority, Arc<str>, bool), String> {
    let uri: http::Uri = address
        .parse()
        .map_err(|e: http::uri::InvalidUri| e.to_string())?;
    let parts = uri.into_parts();
    let tls = match parts.scheme {
        Some(ref s) if *s == Scheme::HTTP => false,
        Some(ref s) if *s == Scheme::HTTPS => true,
        Some(s) => {
            return Err(format!(
                "scheme {s:?} is not supported (expected http or https)"
            ))
        }
        None => return Err("missing scheme (expected http://host:port)".into()),
    };
    let authority = parts.authority.ok_or("missing host")?;
    if authority.host().is_empty() {
        return Err("missing host".into());
    }
    if authority.as_str().contains('@') {
        return Err("user info is not supported".into());
    }
    let base = match &parts.path_and_query {
        Some(pq) if pq.query().is_some() => return Err("a query string is not allowed".into()),
        Some(pq) => pq.path().trim_end_matches('/'),
        None => "",
    };
    Ok((authority, base.into(), tls))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proto::{
        EndpointRoutes, PrefixAwareRoutingConfig, RoutingConfig, RoutingStrategy, VariantRoutes,
    };

    pub(crate) fn variant(
        name: &str,
        strategy: RoutingStrategy,
        addresses: &[&str],
    ) -> VariantRoutes {
        VariantRoutes {
            variant_name: name.into(),
            model_name: "m".into(),
            weight: 1.0,
            routing_config: Some(RoutingConfig {
                routing_strategy: strategy as i32,
                prefix_aware_routing_config: Some(PrefixAwareRoutingConfig {
                    prefix_length: 1024,
                    concurrency_threshold: 8,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            instances: addresses
                .iter()
                .map(|a| proto::Instance {
                    instance_id: a.to_string(),
                    address: a.to_string(),
                })
                .collect(),
        }
    }

    pub(crate) fn table(
        version: u64,
        endpoint: &str,
        variants: Vec<VariantRoutes>,
    ) -> proto::RoutingTable {
        proto::RoutingTable {
            version,
            endpoints: vec![EndpointRoutes {
                endpoint_name: endpoint.into(),
                endpoint_config_name: "c".into(),
                endpoint_config_revision: 1,
                variants,
            }],
        }
    }

    fn err(mut f: impl FnMut(&mut proto::RoutingTable)) -> String {
        let mut t = table(
            1,
            "e",
            vec![variant(
                "v1",
                RoutingStrategy::PrefixAware,
                &["http://127.0.0.1:1"],
            )],
        );
        f(&mut t);
        RoutingTable::try_from(t).unwrap_err().to_string()
    }

    #[test]
    fn valid_table_builds_with_defaults() {
        let mut wire = table(
            3,
            "e",
            vec![variant(
                "v1",
                RoutingStrategy::Unspecified,
                &["http://a:1/", "http://b:2/base"],
            )],
        );
        wire.endpoints[0].variants[0].routing_config = None;
        let t = RoutingTable::try_from(wire).unwrap();
        assert_eq!(t.version(), 3);
        let v = t.endpoint("e").unwrap().variant("v1").unwrap();
        assert_eq!(v.strategy(), Strategy::Random);
        assert_eq!(v.instances()[0].address(), "http://a:1");
        let pq = PathAndQuery::from_static("/v1/completions?x=1");
        assert_eq!(
            v.instances()[1].target(&pq).unwrap().to_string(),
            "/base/v1/completions?x=1"
        );
        assert_eq!(v.instances()[1].host(), "b:2");
        assert_eq!(
            v.instances()[0].target(&pq).unwrap().to_string(),
            "/v1/completions?x=1"
        );
        assert_eq!(v.instances()[0].authority().as_str(), "a:1");

        let mut wire = table(
            3,
            "e",
            vec![variant("v1", RoutingStrategy::PrefixAware, &["http://a:1"])],
        );
        wire.endpoints[0].variants[0]
            .routing_config
            .as_mut()
            .unwrap()
            .prefix_aware_routing_config = None;
        let t = RoutingTable::try_from(wire).unwrap();
        assert_eq!(
            t.endpoint("e").unwrap().variants()[0].strategy(),
            Strategy::PrefixAware(PrefixAware {
                prefix_length: 2048,
                concurrency_threshold: 64
            })
        );
    }

    #[test]
    fn invalid_tables_name_field_and_value() {
        type Edit = Box<dyn FnMut(&mut proto::RoutingTable)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(|t| t.endpoints[0].endpoint_name.clear()), "endpoints[0].endpoint_name is empty"),
            (Box::new(|t| t.endpoints.push(t.endpoints[0].clone())), "duplicate endpoint name \"e\""),
            (
                Box::new(|t| {
                    let v = t.endpoints[0].variants[0].clone();
                    t.endpoints[0].variants.push(v)
                }),
                "endpoint \"e\": duplicate variant name \"v1\"",
            ),
            (Box::new(|t| t.endpoints[0].variants[0].weight = 0.0), "weight 0 must be a finite number > 0"),
            (Box::new(|t| t.endpoints[0].variants[0].weight = -2.0), "weight -2 must be"),
            (
                Box::new(|t| t.endpoints[0].variants[0].routing_config.as_mut().unwrap().routing_strategy = 9),
                "unknown routing strategy 9 (expected RANDOM, LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE)",
            ),
            (
                Box::new(|t| t.endpoints[0].variants[0].routing_config.as_mut().unwrap().default_priority = 7),
                "variant \"v1\": unknown default_priority 7 (expected CRITICAL, STANDARD, SHEDDABLE)",
            ),
            (
                Box::new(|t| {
                    t.endpoints[0].variants[0]
                        .routing_config
                        .as_mut()
                        .unwrap()
                        .prefix_aware_routing_config
                        .as_mut()
                        .unwrap()
                        .prefix_length = 10
                }),
                "prefix_length 10 out of range 64..=65536",
            ),
            (
                Box::new(|t| {
                    t.endpoints[0].variants[0]
                        .routing_config
                        .as_mut()
                        .unwrap()
                        .prefix_aware_routing_config
                        .as_mut()
                        .unwrap()
                        .concurrency_threshold = 5000
                }),
                "concurrency_threshold 5000 out of range 1..=4096",
            ),
            (
                Box::new(|t| t.endpoints[0].variants[0].instances[0].address = "ftp://x:1".into()),
                "bad instance URL \"ftp://x:1\" for instance \"http://127.0.0.1:1\": scheme \"ftp\" is not supported",
            ),
            (
                Box::new(|t| t.endpoints[0].variants[0].instances[0].address = "127.0.0.1:9000".into()),
                "bad instance URL \"127.0.0.1:9000\"",
            ),
            (
                Box::new(|t| t.endpoints[0].variants[0].instances[0].address = "not a url".into()),
                "bad instance URL \"not a url\"",
            ),
            (
                Box::new(|t| t.endpoints[0].variants[0].instances[0].address = "ws://x:1".into()),
                "scheme \"ws\" is not supported",
            ),
            (
                Box::new(|t| {
                    let i = t.endpoints[0].variants[0].instances[0].clone();
                    t.endpoints[0].variants[0].instances.push(i)
                }),
                "duplicate instance id \"http://127.0.0.1:1\"",
            ),
            (
                Box::new(|t| t.endpoints[0].variants[0].instances[0].instance_id.clear()),
                "instances[0].instance_id is empty",
            ),
            (Box::new(|t| t.endpoints[0].variants[0].variant_name = "a\nb".into()), "control characters"),
        ];
        for (mut f, want) in cases {
            let got = err(&mut f);
            assert!(got.contains(want), "got {got:?}, want {want:?}");
        }
    }

    /// `v` (PREFIX_AWARE) with its engines' KV events and a tokenizer.
    pub(crate) fn with_kv_events(
        v: &mut VariantRoutes,
        kv: proto::KvEventsConfig,
        tokenizer: &str,
    ) {
        let pa = v
            .routing_config
            .as_mut()
            .unwrap()
            .prefix_aware_routing_config
            .as_mut()
            .unwrap();
        pa.kv_events = Some(kv);
        pa.tokenizer = tokenizer.into();
    }

    /// The tiny tokenizer of chat-tokens' tests (a ByteLevel BPE and its chat template).
    pub(crate) fn tiny_tokenizer() -> String {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../chat-tokens/tests/fixtures/tiny/tokenizer.json"
        )
        .to_string()
    }

    #[test]
    fn kv_events_are_read_checked_and_kept_across_rebuilds() {
        let with = |endpoint: &str, block_size: u32, tokenizer: &str| {
            let mut t = table(
                1,
                "e",
                vec![variant(
                    "v1",
                    RoutingStrategy::PrefixAware,
                    &["http://127.0.0.1:1"],
                )],
            );
            with_kv_events(
                &mut t.endpoints[0].variants[0],
                proto::KvEventsConfig {
                    endpoint: endpoint.into(),
                    replay_endpoint: "tcp://{host}:{port+1}".into(),
                    topic: "kv".into(),
                    block_size,
                },
                tokenizer,
            );
            t
        };
        let tiny = tiny_tokenizer();
        let first = RoutingTable::try_from(with("tcp://{host}:5557", 32, &tiny)).unwrap();
        let kv = |t: &RoutingTable| t.endpoint("e").unwrap().variants()[0].kv_events().cloned();
        let got = kv(&first).unwrap();
        assert_eq!(
            got.settings,
            KvSettings {
                endpoint: "tcp://{host}:5557".into(),
                replay_endpoint: Some("tcp://{host}:{port+1}".into()),
                topic: "kv".into(),
                block_size: 32,
                tokenizer: tiny.clone().into(),
            }
        );
        // the same settings keep their Arc and tokenizer (subscribers see no change); new ones do not
        let same = RoutingTable::build(with("tcp://{host}:5557", 32, &tiny), Some(&first));
        assert!(Arc::ptr_eq(&got, &kv(&same.unwrap()).unwrap()));
        let other = RoutingTable::build(with("tcp://{host}:6000", 32, &tiny), Some(&first));
        assert_eq!(
            kv(&other.unwrap()).unwrap().settings.endpoint,
            "tcp://{host}:6000"
        );
        for (wire, says) in [
            (
                with("tcp://{hots}:1", 0, &tiny),
                "kv_events.endpoint \"tcp://{hots}:1\": unknown placeholder {hots}",
            ),
            (
                with("tcp://{host}:1", 9999, &tiny),
                "kv_events.block_size \"9999\": out of range",
            ),
            (
                with("tcp://{host}:1", 0, ""),
                "tokenizer \"\": is required with kv_events",
            ),
            (
                with("tcp://{host}:1", 0, "/nonexistent/tokenizer.json"),
                "tokenizer \"/nonexistent/tokenizer.json\": cannot read /nonexistent/tokenizer.json",
            ),
        ] {
            let e = RoutingTable::try_from(wire).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
        // other strategies have none
        let mut random = with("tcp://{host}:5557", 32, &tiny);
        random.endpoints[0].variants[0]
            .routing_config
            .as_mut()
            .unwrap()
            .routing_strategy = RoutingStrategy::Random as i32;
        assert!(kv(&RoutingTable::try_from(random).unwrap()).is_none());
    }

    #[test]
    fn rebuild_reuses_state_of_instances_still_there() {
        let wire = table(
            1,
            "e",
            vec![variant(
                "v1",
                RoutingStrategy::Random,
                &["http://a:1", "http://b:1"],
            )],
        );
        let t1 = RoutingTable::try_from(wire).unwrap();
        let v1 = &t1.endpoint("e").unwrap().variants()[0];
        let _held = crate::load::InFlight::start(v1.instances()[0].state(), v1.load());
        let wire2 = table(
            2,
            "e",
            vec![variant(
                "v1",
                RoutingStrategy::LeastOutstandingRequests,
                &["http://c:1", "http://a:1"],
            )],
        );
        let t2 = RoutingTable::build(wire2, Some(&t1)).unwrap();
        let v2 = &t2.endpoint("e").unwrap().variants()[0];
        assert!(Arc::ptr_eq(
            v2.instances()[1].state(),
            v1.instances()[0].state()
        ));
        assert_eq!(v2.instances()[1].state().outstanding(), 1);
        assert_eq!(v2.instances()[0].state().outstanding(), 0);
        assert_eq!(v2.load().outstanding(), 1);
    }

    #[test]
    fn weighted_variant_pick() {
        let mut a = variant("a", RoutingStrategy::Random, &["http://a:1"]);
        a.weight = 1.0;
        let mut b = variant("b", RoutingStrategy::Random, &["http://b:1"]);
        b.weight = 3.0;
        let t = RoutingTable::try_from(table(1, "e", vec![a, b])).unwrap();
        let e = t.endpoint("e").unwrap();
        assert_eq!(e.pick_variant(0.0).unwrap().name(), "a");
        assert_eq!(e.pick_variant(0.24).unwrap().name(), "a");
        assert_eq!(e.pick_variant(0.25).unwrap().name(), "b");
        assert_eq!(e.pick_variant(0.999).unwrap().name(), "b");
    }
}
