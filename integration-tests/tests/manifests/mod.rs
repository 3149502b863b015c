//! YAML helpers shared by the tests of deployment files (compose.rs, kubernetes.rs).

use serde_yaml_ng::Value;

/// A list of strings (a lone string counts as a list of one; absent, as none).
pub fn strings(v: &Value) -> Vec<String> {
    match v {
        Value::Sequence(items) => items
            .iter()
            .map(|i| i.as_str().expect("a string").to_string())
            .collect(),
        Value::String(s) => vec![s.clone()],
        Value::Null => Vec::new(),
        other => panic!("expected a list of strings, got {other:?}"),
    }
}
