//! `--production-variants`: SageMaker-shaped JSON (inline or `file://PATH`) to proto variants,
//! and proto variants back to the same shape (so `describe --output json` pastes back in).
//!
//! A SageMaker ProductionVariants document pastes in as is: unknown fields (InstanceType,
//! InitialInstanceCount, VolumeSizeInGB, ...) are ignored; `Instances` is ours. Either the bare
//! list or an object holding `ProductionVariants` (a `describe-endpoint-config` answer) is accepted.

use proto::{
    KvEventsConfig, PrefixAwareRoutingConfig, ProductionVariant, RequestPriority, RoutingConfig,
    RoutingStrategy,
};
use serde::{Deserialize, Serialize};

use crate::InputError;

/// One production variant as SageMaker spells it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ProductionVariantDoc {
    pub variant_name: String,
    #[serde(default)]
    pub model_name: String,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "weight_in_f32_range"
    )]
    pub initial_variant_weight: Option<f32>,
    #[serde(default)]
    pub instances: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_config: Option<RoutingConfigDoc>,
}

/// The weight as the wire's 32-bit float, refused (with serde's line and column) when a number
/// that large would silently become infinite.
fn weight_in_f32_range<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f32>, D::Error> {
    match Option::<f64>::deserialize(d)? {
        None => Ok(None),
        Some(w) if (w as f32).is_finite() => Ok(Some(w as f32)),
        Some(w) => Err(serde::de::Error::custom(format!(
            "InitialVariantWeight {w:e} is out of range (at most {:e})",
            f32::MAX
        ))),
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RoutingConfigDoc {
    /// RANDOM, LEAST_OUTSTANDING_REQUESTS or PREFIX_AWARE (unset: RANDOM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_strategy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_aware_routing_config: Option<PrefixAwareRoutingConfigDoc>,
    /// CRITICAL, STANDARD or SHEDDABLE: the priority of requests that name none (unset:
    /// STANDARD).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_priority: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct PrefixAwareRoutingConfigDoc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_length: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_threshold: Option<u32>,
    /// Where the engines publish KV-cache events (with `Tokenizer`, the routers index exactly
    /// what each engine holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsDoc>,
    /// The model's `tokenizer.json`, a path on the routers' disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
}

/// `KvEvents`: endpoint templates filled from each instance's URL (`tcp://{host}:5557`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct KvEventsDoc {
    pub endpoint: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct WrappedVariants {
    production_variants: Vec<ProductionVariantDoc>,
}

/// Reads the flag's value: inline JSON, or `file://PATH` (relative or absolute).
pub fn load_production_variants(value: &str) -> Result<Vec<ProductionVariant>, InputError> {
    match value.strip_prefix("file://") {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                InputError(format!(
                    "cannot read --production-variants file {path:?}: {e}"
                ))
            })?;
            parse_production_variants(&text, &format!("in file {path:?}"))
        }
        None => parse_production_variants(value, "(inline JSON)"),
    }
}

/// Parses a document; `source` says where it came from in error messages. JSON errors carry
/// serde_json's line and column.
pub fn parse_production_variants(
    text: &str,
    source: &str,
) -> Result<Vec<ProductionVariant>, InputError> {
    let bad =
        |e: serde_json::Error| InputError(format!("invalid --production-variants {source}: {e}"));
    let docs: Vec<ProductionVariantDoc> = if text.trim_start().starts_with('{') {
        serde_json::from_str::<WrappedVariants>(text)
            .map_err(bad)?
            .production_variants
    } else {
        serde_json::from_str(text).map_err(bad)?
    };
    docs.iter().map(ProductionVariantDoc::to_proto).collect()
}

/// A user-typed strategy name, or the error that names it, the variant and the choices.
pub fn parse_strategy(name: &str, variant: &str) -> Result<RoutingStrategy, InputError> {
    RoutingStrategy::from_user_name(name).ok_or_else(|| {
        InputError(format!(
            "unknown routing strategy {name:?} for variant {variant:?} (expected {})",
            RoutingStrategy::USER_NAMES
        ))
    })
}

impl ProductionVariantDoc {
    /// To the wire shape. Only the strategy name is checked here; ranges and names are the
    /// control plane's to validate (its INVALID_ARGUMENT names the field).
    pub fn to_proto(&self) -> Result<ProductionVariant, InputError> {
        let routing_config = match &self.routing_config {
            None => None,
            Some(rc) => {
                let strategy = match &rc.routing_strategy {
                    Some(name) => parse_strategy(name, &self.variant_name)?,
                    None => RoutingStrategy::Unspecified,
                };
                let priority = match &rc.default_priority {
                    Some(name) => RequestPriority::from_user_name(name).ok_or_else(|| {
                        InputError(format!(
                            "unknown DefaultPriority {name:?} for variant {:?} (expected {})",
                            self.variant_name,
                            RequestPriority::USER_NAMES
                        ))
                    })?,
                    None => RequestPriority::Unspecified,
                };
                Some(RoutingConfig {
                    routing_strategy: strategy as i32,
                    default_priority: priority as i32,
                    prefix_aware_routing_config: rc.prefix_aware_routing_config.as_ref().map(|p| {
                        PrefixAwareRoutingConfig {
                            prefix_length: p.prefix_length.unwrap_or(0),
                            concurrency_threshold: p.concurrency_threshold.unwrap_or(0),
                            kv_events: p.kv_events.as_ref().map(|k| KvEventsConfig {
                                endpoint: k.endpoint.clone(),
                                replay_endpoint: k.replay_endpoint.clone().unwrap_or_default(),
                                topic: k.topic.clone().unwrap_or_default(),
                                block_size: k.block_size.unwrap_or(0),
                            }),
                            tokenizer: p.tokenizer.clone().unwrap_or_default(),
                        }
                    }),
                })
            }
        };
        Ok(ProductionVariant {
            variant_name: self.variant_name.clone(),
            model_name: self.model_name.clone(),
            initial_variant_weight: self.initial_variant_weight,
            routing_config,
            instances: self.instances.clone(),
        })
    }
}

impl From<&ProductionVariant> for ProductionVariantDoc {
    fn from(v: &ProductionVariant) -> Self {
        let rc = v.routing_config.clone().unwrap_or_default();
        Self {
            variant_name: v.variant_name.clone(),
            model_name: v.model_name.clone(),
            initial_variant_weight: v.initial_variant_weight,
            instances: v.instances.clone(),
            routing_config: Some(RoutingConfigDoc::from(&rc)),
        }
    }
}

impl From<&RoutingConfig> for RoutingConfigDoc {
    fn from(rc: &RoutingConfig) -> Self {
        Self {
            routing_strategy: Some(strategy_name(rc.routing_strategy).to_string()),
            prefix_aware_routing_config: rc.prefix_aware_routing_config.as_ref().map(|p| {
                PrefixAwareRoutingConfigDoc {
                    prefix_length: Some(p.prefix_length),
                    concurrency_threshold: Some(p.concurrency_threshold),
                    kv_events: p.kv_events.as_ref().map(|k| KvEventsDoc {
                        endpoint: k.endpoint.clone(),
                        replay_endpoint: (!k.replay_endpoint.is_empty())
                            .then(|| k.replay_endpoint.clone()),
                        topic: (!k.topic.is_empty()).then(|| k.topic.clone()),
                        block_size: (k.block_size != 0).then_some(k.block_size),
                    }),
                    tokenizer: (!p.tokenizer.is_empty()).then(|| p.tokenizer.clone()),
                }
            }),
            default_priority: match RequestPriority::try_from(rc.default_priority) {
                Ok(RequestPriority::Unspecified) => None,
                Ok(p) => Some(p.user_name().to_string()),
                Err(_) => Some(format!("UNKNOWN({})", rc.default_priority)),
            },
        }
    }
}

/// The user name of a wire strategy value (`UNKNOWN(n)` for values this build does not know).
pub fn strategy_name(value: i32) -> String {
    match RoutingStrategy::try_from(value) {
        Ok(s) => s.user_name().to_string(),
        Err(_) => format!("UNKNOWN({value})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = r#"[{"VariantName":"v1","ModelName":"llama","InitialVariantWeight":1,
        "Instances":["http://127.0.0.1:9001"],
        "RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE","PrefixAwareRoutingConfig":{"PrefixLength":2048,"ConcurrencyThreshold":64}}}]"#;

    #[test]
    fn contract_example_parses() {
        let v = parse_production_variants(DOC, "(inline JSON)").unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].variant_name, "v1");
        assert_eq!(v[0].initial_variant_weight, Some(1.0));
        let rc = v[0].routing_config.clone().unwrap();
        assert_eq!(rc.routing_strategy, RoutingStrategy::PrefixAware as i32);
        assert_eq!(rc.prefix_aware_routing_config.unwrap().prefix_length, 2048);
    }

    #[test]
    fn sagemaker_documents_paste_in_as_is() {
        let sm = r#"[{"VariantName":"AllTraffic","ModelName":"m","InstanceType":"ml.g5.2xlarge",
            "InitialInstanceCount":1,"VolumeSizeInGB":100,"InitialVariantWeight":1.0,
            "RoutingConfig":{"RoutingStrategy":"LEAST_OUTSTANDING_REQUESTS"}}]"#;
        let v = parse_production_variants(sm, "x").unwrap();
        assert_eq!(
            v[0].routing_config.as_ref().unwrap().routing_strategy,
            RoutingStrategy::LeastOutstandingRequests as i32
        );
        assert!(v[0].instances.is_empty());
        let wrapped = format!(r#"{{"EndpointConfigName":"c","ProductionVariants":{DOC}}}"#);
        assert_eq!(
            parse_production_variants(&wrapped, "x").unwrap(),
            parse_production_variants(DOC, "x").unwrap()
        );
    }

    #[test]
    fn round_trips_through_the_output_shape() {
        let v = parse_production_variants(DOC, "x").unwrap();
        let docs: Vec<ProductionVariantDoc> = v.iter().map(ProductionVariantDoc::from).collect();
        let json = serde_json::to_string(&docs).unwrap();
        assert_eq!(parse_production_variants(&json, "x").unwrap(), v);
    }

    #[test]
    fn kv_events_and_the_tokenizer_parse_and_round_trip() {
        let doc = r#"[{"VariantName":"v1","RoutingConfig":{"RoutingStrategy":"PREFIX_AWARE",
            "PrefixAwareRoutingConfig":{"KvEvents":{"Endpoint":"tcp://{host}:5557",
            "ReplayEndpoint":"tcp://{host}:5558","Topic":"kv","BlockSize":32},
            "Tokenizer":"/models/m/tokenizer.json"}}}]"#;
        let v = parse_production_variants(doc, "x").unwrap();
        let pa = v[0]
            .routing_config
            .as_ref()
            .unwrap()
            .prefix_aware_routing_config
            .clone()
            .unwrap();
        assert_eq!(
            pa.kv_events,
            Some(KvEventsConfig {
                endpoint: "tcp://{host}:5557".into(),
                replay_endpoint: "tcp://{host}:5558".into(),
                topic: "kv".into(),
                block_size: 32,
            })
        );
        assert_eq!(pa.tokenizer, "/models/m/tokenizer.json");
        let out = serde_json::to_string(&ProductionVariantDoc::from(&v[0])).unwrap();
        assert!(
            out.contains(r#""KvEvents":{"Endpoint":"tcp://{host}:5557""#),
            "{out}"
        );
        assert_eq!(
            parse_production_variants(&format!("[{out}]"), "x").unwrap(),
            v
        );
    }

    #[test]
    fn a_variant_names_the_priority_of_requests_that_name_none() {
        let doc = r#"[{"VariantName":"batch","RoutingConfig":{"RoutingStrategy":"RANDOM","DefaultPriority":"sheddable"}}]"#;
        let v = parse_production_variants(doc, "x").unwrap();
        let rc = v[0].routing_config.clone().unwrap();
        assert_eq!(rc.default_priority, RequestPriority::Sheddable as i32);
        let out = serde_json::to_string(&ProductionVariantDoc::from(&v[0])).unwrap();
        assert!(out.contains(r#""DefaultPriority":"SHEDDABLE""#), "{out}");
        let e = parse_production_variants(
            r#"[{"VariantName":"v1","RoutingConfig":{"DefaultPriority":"urgent"}}]"#,
            "x",
        )
        .unwrap_err()
        .0;
        assert_eq!(
            e,
            r#"unknown DefaultPriority "urgent" for variant "v1" (expected CRITICAL, STANDARD, SHEDDABLE)"#
        );
    }

    #[test]
    fn errors_say_where_and_what() {
        let e = parse_production_variants("[{\"VariantName\": \"v1\",,}]", "(inline JSON)")
            .unwrap_err()
            .0;
        assert!(
            e.starts_with("invalid --production-variants (inline JSON): "),
            "{e}"
        );
        assert!(e.contains("line 1 column"), "{e}");
        let e = parse_production_variants(
            r#"[{"VariantName":"v1","RoutingConfig":{"RoutingStrategy":"PREFIX_AWAR"}}]"#,
            "x",
        )
        .unwrap_err()
        .0;
        assert_eq!(
            e,
            r#"unknown routing strategy "PREFIX_AWAR" for variant "v1" (expected RANDOM, LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE)"#
        );
        let e = load_production_variants("file:///nonexistent/variants.json")
            .unwrap_err()
            .0;
        assert!(
            e.starts_with(
                r#"cannot read --production-variants file "/nonexistent/variants.json": "#
            ),
            "{e}"
        );
        // found by tests/variants_props.rs: a weight past f32 became -inf, refused by the
        // control plane as "weight -inf", far from what was typed
        let e = parse_production_variants(
            r#"[{"VariantName":"v1","InitialVariantWeight":-1e300}]"#,
            "x",
        )
        .unwrap_err()
        .0;
        assert!(
            e.starts_with(
                "invalid --production-variants x: InitialVariantWeight -1e300 is out of range"
            ) && e.contains("line 1 column"),
            "{e}"
        );
        let e = parse_production_variants(r#"[{"ModelName":"m"}]"#, "x")
            .unwrap_err()
            .0;
        assert!(e.contains("missing field `VariantName`"), "{e}");
    }
}
