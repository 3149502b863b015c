//! Validation of API input into normalized, stored shapes.
//!
//! Every request is checked here before anything is written. An error names the field and the
//! value (`production_variants[1].routing_config.prefix_aware_routing_config.prefix_length: 10 is
//! outside 64..=65536`), and the service maps it to `INVALID_ARGUMENT`.

use std::collections::HashSet;

use proto::{
    KvEventsConfig, PrefixAwareRoutingConfig, ProductionVariant, RequestPriority, RoutingConfig,
    RoutingStrategy,
};

pub use proto::limits::{
    CONCURRENCY_THRESHOLD_RANGE, DEFAULT_CONCURRENCY_THRESHOLD, DEFAULT_PREFIX_LENGTH,
    KV_BLOCK_SIZE_RANGE, PREFIX_LENGTH_RANGE,
};
/// Lease given to a registered instance that asks for none.
pub const DEFAULT_LEASE_TTL_SECONDS: u32 = 30;
pub const MAX_LEASE_TTL_SECONDS: u32 = 3600;
pub const MAX_VARIANTS: usize = 16;
pub const MAX_INSTANCES_PER_VARIANT: usize = 4096;

/// A request field that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field}: {reason}")]
pub struct InvalidField {
    pub field: String,
    pub reason: String,
}

impl InvalidField {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Names of configs, endpoints and variants: 1..=63 characters, letters, digits, `-` and `_`,
/// starting with a letter or digit (SageMaker's rule, plus `_`).
pub fn validate_name(field: &str, value: &str) -> Result<(), InvalidField> {
    let ok_start = value
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric());
    let ok_chars = value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if value.is_empty() {
        return Err(InvalidField::new(field, "must not be empty"));
    }
    if value.len() > 63 || !ok_start || !ok_chars {
        return Err(InvalidField::new(
            field,
            format!("{value:?} is not a valid name (1-63 letters, digits, '-' or '_', starting with a letter or digit)"),
        ));
    }
    Ok(())
}

/// A model-server base URL: `http://host:port` or `https://...`, no path, query or fragment.
/// Returns the normalized form (no trailing slash).
pub fn normalize_instance_url(field: &str, value: &str) -> Result<String, InvalidField> {
    let bad = |why: &str| {
        InvalidField::new(
            field,
            format!("{value:?} is not a valid instance URL: {why}"),
        )
    };
    let uri: http::Uri = value
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(bad("scheme must be http or https")),
    }
    let authority = uri.authority().ok_or_else(|| bad("missing host"))?;
    if authority.host().is_empty() {
        return Err(bad("missing host"));
    }
    if authority.as_str().contains('@') {
        return Err(bad("user info is not allowed"));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() || value.contains('#') {
        return Err(bad("must not have a path, query or fragment"));
    }
    Ok(format!(
        "{}://{}",
        uri.scheme_str().unwrap_or("http"),
        authority.as_str()
    ))
}

/// Validates production variants and returns them normalized: weight set (default 1), strategy
/// explicit (unset = RANDOM), PREFIX_AWARE settings filled with defaults, instance URLs normalized.
pub fn validate_variants(
    variants: &[ProductionVariant],
) -> Result<Vec<ProductionVariant>, InvalidField> {
    if variants.is_empty() {
        return Err(InvalidField::new(
            "production_variants",
            "at least one production variant is required",
        ));
    }
    if variants.len() > MAX_VARIANTS {
        return Err(InvalidField::new(
            "production_variants",
            format!(
                "{} variants given, at most {MAX_VARIANTS} allowed",
                variants.len()
            ),
        ));
    }
    let mut names = HashSet::new();
    let mut out = Vec::with_capacity(variants.len());
    for (i, v) in variants.iter().enumerate() {
        let at = |f: &str| format!("production_variants[{i}].{f}");
        validate_name(&at("variant_name"), &v.variant_name)?;
        if !names.insert(v.variant_name.as_str()) {
            return Err(InvalidField::new(
                at("variant_name"),
                format!("duplicate variant name {:?}", v.variant_name),
            ));
        }
        let weight = v.initial_variant_weight.unwrap_or(1.0);
        if !(weight.is_finite() && weight > 0.0) {
            return Err(InvalidField::new(
                at("initial_variant_weight"),
                format!("{weight} must be greater than 0"),
            ));
        }
        let routing_config =
            validate_routing_config(&at("routing_config"), v.routing_config.as_ref())?;
        if v.instances.len() > MAX_INSTANCES_PER_VARIANT {
            return Err(InvalidField::new(
                at("instances"),
                format!(
                    "{} instances given, at most {MAX_INSTANCES_PER_VARIANT} allowed",
                    v.instances.len()
                ),
            ));
        }
        let mut seen = HashSet::new();
        let mut instances = Vec::with_capacity(v.instances.len());
        for (j, url) in v.instances.iter().enumerate() {
            let field = at(&format!("instances[{j}]"));
            let url = normalize_instance_url(&field, url)?;
            if !seen.insert(url.clone()) {
                return Err(InvalidField::new(
                    field,
                    format!("duplicate instance {url:?}"),
                ));
            }
            instances.push(url);
        }
        out.push(ProductionVariant {
            variant_name: v.variant_name.clone(),
            model_name: v.model_name.clone(),
            initial_variant_weight: Some(weight),
            routing_config: Some(routing_config),
            instances,
        });
    }
    Ok(out)
}

fn validate_routing_config(
    field: &str,
    config: Option<&RoutingConfig>,
) -> Result<RoutingConfig, InvalidField> {
    let config = config.cloned().unwrap_or_default();
    let strategy = RoutingStrategy::try_from(config.routing_strategy).map_err(|_| {
        InvalidField::new(
            format!("{field}.routing_strategy"),
            format!(
                "unknown routing strategy {} (expected {})",
                config.routing_strategy,
                RoutingStrategy::USER_NAMES
            ),
        )
    })?;
    let strategy = match strategy {
        RoutingStrategy::Unspecified => RoutingStrategy::Random,
        s => s,
    };
    let prefix = match (strategy, config.prefix_aware_routing_config) {
        (RoutingStrategy::PrefixAware, None) => Some(PrefixAwareRoutingConfig::default()),
        (_, p) => p,
    };
    let prefix = prefix
        .map(|p| validate_prefix_config(&format!("{field}.prefix_aware_routing_config"), p))
        .transpose()?;
    let priority = match RequestPriority::try_from(config.default_priority) {
        Ok(RequestPriority::Unspecified) => RequestPriority::Standard,
        Ok(p) => p,
        Err(_) => {
            return Err(InvalidField::new(
                format!("{field}.default_priority"),
                format!(
                    "unknown priority {} (expected {})",
                    config.default_priority,
                    RequestPriority::USER_NAMES
                ),
            ))
        }
    };
    Ok(RoutingConfig {
        routing_strategy: strategy as i32,
        prefix_aware_routing_config: prefix,
        default_priority: priority as i32,
    })
}

fn validate_prefix_config(
    field: &str,
    p: PrefixAwareRoutingConfig,
) -> Result<PrefixAwareRoutingConfig, InvalidField> {
    let prefix_length = if p.prefix_length == 0 {
        DEFAULT_PREFIX_LENGTH
    } else {
        p.prefix_length
    };
    if !PREFIX_LENGTH_RANGE.contains(&prefix_length) {
        return Err(InvalidField::new(
            format!("{field}.prefix_length"),
            format!(
                "{prefix_length} is outside {}..={}",
                PREFIX_LENGTH_RANGE.start(),
                PREFIX_LENGTH_RANGE.end()
            ),
        ));
    }
    let concurrency_threshold = if p.concurrency_threshold == 0 {
        DEFAULT_CONCURRENCY_THRESHOLD
    } else {
        p.concurrency_threshold
    };
    if !CONCURRENCY_THRESHOLD_RANGE.contains(&concurrency_threshold) {
        return Err(InvalidField::new(
            format!("{field}.concurrency_threshold"),
            format!(
                "{concurrency_threshold} is outside {}..={}",
                CONCURRENCY_THRESHOLD_RANGE.start(),
                CONCURRENCY_THRESHOLD_RANGE.end()
            ),
        ));
    }
    let kv_events = p
        .kv_events
        .map(|k| validate_kv_events(&format!("{field}.kv_events"), k))
        .transpose()?;
    let tokenizer = p.tokenizer.trim().to_string();
    if kv_events.is_some() && tokenizer.is_empty() {
        return Err(InvalidField::new(
            format!("{field}.tokenizer"),
            "is required with kv_events: the engines' blocks are chains of token ids, so the \
             routers tokenize prompts with the model's tokenizer.json (a path on their disk)",
        ));
    }
    if tokenizer.chars().any(char::is_control) {
        return Err(InvalidField::new(
            format!("{field}.tokenizer"),
            format!("{tokenizer:?} holds a control character"),
        ));
    }
    Ok(PrefixAwareRoutingConfig {
        prefix_length,
        concurrency_threshold,
        kv_events,
        tokenizer,
    })
}

/// Where a variant's engines publish KV events: endpoint templates that fill from an instance
/// URL (`tcp://{host}:5557`), an optional replay template, a topic and a block size.
fn validate_kv_events(field: &str, k: KvEventsConfig) -> Result<KvEventsConfig, InvalidField> {
    // any instance URL fills a valid template: check the templates on one
    const SAMPLE: &str = "http://127.0.0.1:8000";
    let template = |name: &str, value: &str| -> Result<String, InvalidField> {
        let value = value.trim();
        let filled = kv_events::fill_template(value, SAMPLE)
            .map_err(|e| InvalidField::new(format!("{field}.{name}"), e.problem.to_string()))?;
        if !(filled.starts_with("tcp://") || filled.starts_with("ipc://")) {
            return Err(InvalidField::new(
                format!("{field}.{name}"),
                format!("{value:?} is not a ZeroMQ endpoint (expected tcp://HOST:PORT, e.g. tcp://{{host}}:5557)"),
            ));
        }
        Ok(value.to_string())
    };
    if k.endpoint.trim().is_empty() {
        return Err(InvalidField::new(
            format!("{field}.endpoint"),
            "is required (e.g. tcp://{host}:5557)",
        ));
    }
    let endpoint = template("endpoint", &k.endpoint)?;
    let replay_endpoint = if k.replay_endpoint.trim().is_empty() {
        String::new()
    } else {
        template("replay_endpoint", &k.replay_endpoint)?
    };
    if k.block_size != 0 && !KV_BLOCK_SIZE_RANGE.contains(&k.block_size) {
        return Err(InvalidField::new(
            format!("{field}.block_size"),
            format!(
                "{} is outside {}..={} (0: taken from the events)",
                k.block_size,
                KV_BLOCK_SIZE_RANGE.start(),
                KV_BLOCK_SIZE_RANGE.end()
            ),
        ));
    }
    Ok(KvEventsConfig {
        endpoint,
        replay_endpoint,
        topic: k.topic,
        block_size: k.block_size,
    })
}

/// Validates a requested lease length; 0 means the default.
pub fn validate_lease_ttl(field: &str, ttl: u32) -> Result<u32, InvalidField> {
    match ttl {
        0 => Ok(DEFAULT_LEASE_TTL_SECONDS),
        t if t <= MAX_LEASE_TTL_SECONDS => Ok(t),
        t => Err(InvalidField::new(
            field,
            format!("{t} is outside 1..={MAX_LEASE_TTL_SECONDS} seconds"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn variant(name: &str) -> ProductionVariant {
        ProductionVariant {
            variant_name: name.into(),
            model_name: "llama".into(),
            initial_variant_weight: None,
            routing_config: None,
            instances: vec!["http://127.0.0.1:9001/".into()],
        }
    }

    #[test]
    fn defaults_are_filled() {
        let mut v = variant("v1");
        v.routing_config = Some(RoutingConfig {
            routing_strategy: RoutingStrategy::PrefixAware as i32,
            ..Default::default()
        });
        let out = validate_variants(&[v, variant("v2")]).unwrap();
        let rc = out[0].routing_config.clone().unwrap();
        assert_eq!(rc.default_priority, RequestPriority::Standard as i32);
        assert_eq!(out[0].initial_variant_weight, Some(1.0));
        assert_eq!(out[0].instances, vec!["http://127.0.0.1:9001".to_string()]);
        let p = out[0]
            .routing_config
            .as_ref()
            .unwrap()
            .prefix_aware_routing_config
            .clone()
            .unwrap();
        assert_eq!(
            (p.prefix_length, p.concurrency_threshold),
            (DEFAULT_PREFIX_LENGTH, DEFAULT_CONCURRENCY_THRESHOLD)
        );
        assert_eq!(
            out[1].routing_config.as_ref().unwrap().routing_strategy,
            RoutingStrategy::Random as i32
        );
    }

    #[test]
    fn kv_events_are_checked_field_by_field() {
        let with = |kv_events: Option<KvEventsConfig>, tokenizer: &str| {
            let mut v = variant("v1");
            v.routing_config = Some(RoutingConfig {
                routing_strategy: RoutingStrategy::PrefixAware as i32,
                prefix_aware_routing_config: Some(PrefixAwareRoutingConfig {
                    kv_events,
                    tokenizer: tokenizer.into(),
                    ..Default::default()
                }),
                ..Default::default()
            });
            validate_variants(&[v])
        };
        let kv = |endpoint: &str, replay: &str, block_size: u32| {
            Some(KvEventsConfig {
                endpoint: endpoint.into(),
                replay_endpoint: replay.into(),
                topic: "kv".into(),
                block_size,
            })
        };
        let field = "production_variants[0].routing_config.prefix_aware_routing_config";
        let ok = with(
            kv(" tcp://{host}:{port+1000} ", "tcp://{host}:5558", 32),
            "/m/tokenizer.json",
        )
        .unwrap();
        let p = ok[0]
            .routing_config
            .clone()
            .unwrap()
            .prefix_aware_routing_config
            .unwrap();
        assert_eq!(p.kv_events.unwrap().endpoint, "tcp://{host}:{port+1000}");
        for (config, tokenizer, at, says) in [
            (kv("", "", 0), "t", "kv_events.endpoint", "is required"),
            (
                kv("tcp://{hots}:5557", "", 0),
                "t",
                "kv_events.endpoint",
                "unknown placeholder {hots}",
            ),
            (
                kv("http://{host}:5557", "", 0),
                "t",
                "kv_events.endpoint",
                "is not a ZeroMQ endpoint",
            ),
            (
                kv("tcp://{host}:5557", "tcp://{host}:{port+70000}", 0),
                "t",
                "kv_events.replay_endpoint",
                "past 65535",
            ),
            (
                kv("tcp://{host}:5557", "", 5000),
                "t",
                "kv_events.block_size",
                "5000 is outside 1..=4096",
            ),
            (
                kv("tcp://{host}:5557", "", 0),
                " ",
                "tokenizer",
                "is required with kv_events",
            ),
        ] {
            let e = with(config, tokenizer).unwrap_err();
            assert_eq!(e.field, format!("{field}.{at}"), "{e}");
            assert!(e.to_string().contains(says), "{e}");
        }
    }

    #[test]
    fn errors_name_field_and_value() {
        let mut v = variant("v1");
        v.routing_config = Some(RoutingConfig {
            routing_strategy: RoutingStrategy::PrefixAware as i32,
            prefix_aware_routing_config: Some(PrefixAwareRoutingConfig {
                prefix_length: 10,
                concurrency_threshold: 1,
                ..Default::default()
            }),
            ..Default::default()
        });
        let e = validate_variants(&[v]).unwrap_err();
        assert_eq!(
            e.field,
            "production_variants[0].routing_config.prefix_aware_routing_config.prefix_length"
        );
        assert!(e.to_string().contains("10 is outside 64..=65536"), "{e}");

        let mut v = variant("v1");
        v.routing_config = Some(RoutingConfig {
            routing_strategy: 42,
            ..Default::default()
        });
        assert!(validate_variants(&[v])
            .unwrap_err()
            .to_string()
            .contains("unknown routing strategy 42"));

        let mut v = variant("v1");
        v.routing_config = Some(RoutingConfig {
            default_priority: 9,
            ..Default::default()
        });
        let e = validate_variants(&[v]).unwrap_err();
        assert_eq!(
            e.field,
            "production_variants[0].routing_config.default_priority"
        );
        assert!(
            e.to_string()
                .contains("unknown priority 9 (expected CRITICAL, STANDARD, SHEDDABLE)"),
            "{e}"
        );

        let mut v = variant("v1");
        v.initial_variant_weight = Some(0.0);
        assert_eq!(
            validate_variants(&[v]).unwrap_err().field,
            "production_variants[0].initial_variant_weight"
        );

        let mut v = variant("v1");
        v.instances = vec!["ftp://x:1".into()];
        assert!(validate_variants(&[v])
            .unwrap_err()
            .to_string()
            .contains("\"ftp://x:1\""));

        let mut v = variant("v1");
        v.instances = vec!["http://a:1".into(), "http://a:1/".into()];
        assert!(validate_variants(&[v])
            .unwrap_err()
            .to_string()
            .contains("duplicate instance"));

        assert!(validate_variants(&[variant("v1"), variant("v1")])
            .unwrap_err()
            .to_string()
            .contains("duplicate variant"));
        assert!(validate_variants(&[]).is_err());
        assert!(validate_variants(&[variant("")])
            .unwrap_err()
            .to_string()
            .contains("must not be empty"));
        assert!(validate_variants(&[variant("bad name")]).is_err());
    }

    #[test]
    fn instance_urls() {
        assert_eq!(
            normalize_instance_url("f", "https://h.example:8443").unwrap(),
            "https://h.example:8443"
        );
        for bad in [
            "",
            "127.0.0.1:9000",
            "http://",
            "http://h:1/v1",
            "http://h:1?x=1",
            "http://u@h:1",
            "http://h:1/#x",
        ] {
            assert!(normalize_instance_url("f", bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn lease_ttl() {
        assert_eq!(validate_lease_ttl("f", 0), Ok(DEFAULT_LEASE_TTL_SECONDS));
        assert_eq!(validate_lease_ttl("f", 5), Ok(5));
        assert!(validate_lease_ttl("f", 3601).is_err());
    }
}
