//! Randomized `--production-variants` documents (fixed seed; `PROPTEST_CASES` for more):
//! arbitrary text is parsed or refused with an error that says where, never a panic; documents
//! built from arbitrary fields parse to what they say and round-trip through the output shape.

use cli::variants::{parse_production_variants, ProductionVariantDoc};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use proto::RoutingStrategy;
use serde_json::{json, Value};

fn config() -> Config {
    Config {
        rng_seed: RngSeed::Fixed(0x15),
        failure_persistence: None,
        ..Config::default()
    }
}

fn strategy_name() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(vec!["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"])
            .prop_map(String::from),
        1 => prop::sample::select(vec!["", "random", "PREFIX_AWAR", "ROUTING_STRATEGY_RANDOM", "\u{0}"])
            .prop_map(String::from),
        1 => any::<String>(),
    ]
}

/// A number as a document might hold it: an integer in or out of u32, a fraction, a string.
fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => (0u32..70_000).prop_map(Value::from),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        1 => Just(Value::from("64")),
        1 => Just(Value::Null),
    ]
}

fn variant_doc() -> impl Strategy<Value = Value> {
    (
        prop_oneof![3 => "[a-z0-9-]{1,8}", 1 => any::<String>()],
        any::<String>(),
        prop::option::of(number()),
        prop::collection::vec(any::<String>(), 0..3),
        prop::option::of((
            prop::option::of(strategy_name()),
            prop::option::of((number(), number())),
        )),
        prop::option::of(any::<String>()), // an unknown SageMaker field
    )
        .prop_map(|(name, model, weight, instances, routing, unknown)| {
            let mut v = json!({ "VariantName": name, "ModelName": model, "Instances": instances });
            if let Some(w) = weight {
                v["InitialVariantWeight"] = w;
            }
            if let Some((strategy, pa)) = routing {
                let mut rc = json!({});
                if let Some(s) = strategy {
                    rc["RoutingStrategy"] = Value::from(s);
                }
                if let Some((len, threshold)) = pa {
                    rc["PrefixAwareRoutingConfig"] =
                        json!({ "PrefixLength": len, "ConcurrencyThreshold": threshold });
                }
                v["RoutingConfig"] = rc;
            }
            if let Some(u) = unknown {
                v["InstanceType"] = Value::from(u);
            }
            v
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_text_is_parsed_or_refused_with_where(text in any::<String>(), wrapped in any::<bool>()) {
        let text = if wrapped { format!(r#"{{"ProductionVariants":{text}}}"#) } else { text };
        if let Err(e) = parse_production_variants(&text, "(inline JSON)") {
            prop_assert!(
                e.0.starts_with("invalid --production-variants (inline JSON): ")
                    || e.0.starts_with("unknown routing strategy "),
                "{}", e.0
            );
        }
    }

    #[test]
    fn documents_parse_to_what_they_say_and_round_trip(docs in prop::collection::vec(variant_doc(), 0..4)) {
        let text = serde_json::to_string(&docs).unwrap();
        match parse_production_variants(&text, "x") {
            Ok(variants) => {
                prop_assert_eq!(variants.len(), docs.len());
                for (v, doc) in variants.iter().zip(&docs) {
                    prop_assert_eq!(&v.variant_name, doc["VariantName"].as_str().unwrap());
                    prop_assert_eq!(v.instances.len(), doc["Instances"].as_array().unwrap().len());
                    let want = doc["RoutingConfig"]["RoutingStrategy"].as_str();
                    let got = v.routing_config.as_ref().map(|rc| rc.routing_strategy);
                    match want {
                        Some(name) => prop_assert_eq!(
                            got,
                            RoutingStrategy::from_user_name(name).map(|s| s as i32)
                        ),
                        None if doc.get("RoutingConfig").is_some() => {
                            prop_assert_eq!(got, Some(RoutingStrategy::Unspecified as i32))
                        }
                        None => prop_assert_eq!(got, None),
                    }
                }
                let out: Vec<ProductionVariantDoc> =
                    variants.iter().map(ProductionVariantDoc::from).collect();
                let again = parse_production_variants(&serde_json::to_string(&out).unwrap(), "x");
                // The output shape spells the effective strategy: an unset one comes back as
                // RANDOM, which is what unset means.
                let effective = |vs: Vec<proto::ProductionVariant>| -> Vec<proto::ProductionVariant> {
                    vs.into_iter()
                        .map(|mut v| {
                            let mut rc = v.routing_config.unwrap_or_default();
                            if rc.routing_strategy == RoutingStrategy::Unspecified as i32 {
                                rc.routing_strategy = RoutingStrategy::Random as i32;
                            }
                            v.routing_config = Some(rc);
                            v
                        })
                        .collect()
                };
                prop_assert_eq!(again.ok().map(effective), Some(effective(variants)));
            }
            Err(e) => {
                // refused: a bad strategy name (named, with its variant) or a field of the wrong
                // type or range (named by serde with line and column)
                let named_strategy = docs.iter().find_map(|d| {
                    let s = d["RoutingConfig"]["RoutingStrategy"].as_str()?;
                    RoutingStrategy::from_user_name(s).is_none().then(|| (s, d["VariantName"].as_str()))
                });
                if e.0.starts_with("unknown routing strategy ") {
                    let (s, v) = named_strategy.expect("a bad name was sent");
                    prop_assert!(e.0.contains(&format!("{s:?}")), "{}", e.0);
                    prop_assert!(e.0.contains(&format!("{:?}", v.unwrap())), "{}", e.0);
                } else {
                    prop_assert!(e.0.starts_with("invalid --production-variants x: "), "{}", e.0);
                    prop_assert!(e.0.contains("line 1 column"), "{}", e.0);
                }
            }
        }
    }
}
