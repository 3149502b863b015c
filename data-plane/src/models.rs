//! `GET /v1/models` and `GET /v1/models/{id}`, answered from the routing table with no upstream
//! call: one model per endpoint (the id a client puts in `model` to reach it), then each variant's
//! model name not already listed (with the endpoint that serves it as `parent`, as vLLM names a
//! model's base). OpenAI's list shape, so clients that list models first (`openai`'s
//! `models.list()`, LangChain, LiteLLM, Open WebUI) see what the router serves.

use serde_json::{json, Value};

use crate::table::RoutingTable;

/// `owned_by` of every listed model.
pub const OWNED_BY: &str = "prefix-router";

/// The model objects of `table`, endpoints first, each id once.
fn models(table: &RoutingTable) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for endpoint in table.endpoints() {
        if seen.insert(endpoint.name()) {
            out.push(json!({
                "id": endpoint.name(),
                "object": "model",
                "created": 0,
                "owned_by": OWNED_BY,
            }));
        }
    }
    for endpoint in table.endpoints() {
        for variant in endpoint.variants() {
            let name = variant.model_name();
            if !name.is_empty() && seen.insert(name) {
                out.push(json!({
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": OWNED_BY,
                    "parent": endpoint.name(),
                }));
            }
        }
    }
    out
}

/// The body of `GET /v1/models`: `{"object":"list","data":[...]}`.
pub fn list(table: &RoutingTable) -> Vec<u8> {
    let body = json!({ "object": "list", "data": models(table) });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// The body of `GET /v1/models/{id}`, `None` when no listed model has that id.
pub fn retrieve(table: &RoutingTable, id: &str) -> Option<Vec<u8>> {
    let model = models(table).into_iter().find(|m| m["id"] == id)?;
    serde_json::to_vec(&model).ok()
}
