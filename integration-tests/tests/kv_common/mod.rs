//! Helpers shared by the KV-events tests (`kv_events.rs` on engine-sims, `vllm_cpu.rs` on vLLM).

/// The value of `name{...instance="INSTANCE"...}` in a `/metrics` text.
pub fn metric_value(metrics: &str, name: &str, instance: &str) -> Option<f64> {
    let line = metrics.lines().find(|l| {
        l.starts_with(&format!("{name}{{")) && l.contains(&format!("instance=\"{instance}\""))
    })?;
    line.rsplit(' ').next()?.parse().ok()
}

/// The first instance of the key's rendezvous ranking for a chat `body`, as every router
/// computes it (instance ids are their URLs; `prefix_length` 2048, the default seed).
pub fn rendezvous_first(instances: &[String], body: &[u8]) -> usize {
    let hashes: Vec<u64> = instances
        .iter()
        .map(|i| xxhash_rust::xxh3::xxh3_64(i.as_bytes()))
        .collect();
    let key = data_plane::prompt::prompt_key(
        data_plane::prompt::BodyKind::OpenAi,
        body,
        2048,
        data_plane::prompt::DEFAULT_SEED,
    );
    data_plane::placement::rendezvous_top(&hashes, key.hash).0
}

/// A PREFIX_AWARE variant over `urls` whose engines publish KV events at their port + `offset`
/// (replay + `offset + 1`, topic `kv`), matched with the `tokenizer.json` at `tokenizer`.
pub fn events_variant(
    urls: &[String],
    offset: u16,
    block_size: u32,
    tokenizer: String,
) -> proto::ProductionVariant {
    let instances: Vec<&str> = urls.iter().map(String::as_str).collect();
    let mut v = integration_tests::variant("v1", proto::RoutingStrategy::PrefixAware, &instances);
    let pa = v
        .routing_config
        .as_mut()
        .and_then(|rc| rc.prefix_aware_routing_config.as_mut())
        .expect("a PREFIX_AWARE variant has its config");
    pa.kv_events = Some(proto::KvEventsConfig {
        endpoint: format!("tcp://{{host}}:{{port+{offset}}}"),
        replay_endpoint: format!("tcp://{{host}}:{{port+{}}}", offset + 1),
        topic: "kv".into(),
        block_size,
    });
    pa.tokenizer = tokenizer;
    v
}

/// Data planes `dp-a`, `dp-b`, ... (one per `nodes`) watching `control_plane`, with
/// `endpoint` as their default.
pub async fn start_routers(
    control_plane: &str,
    endpoint: &str,
    nodes: &[&str],
) -> Vec<test_support::InProcessServer> {
    let mut routers = Vec::new();
    for node in nodes {
        let config = data_plane::Config {
            control_plane: control_plane.to_string(),
            node_id: Some(node.to_string()),
            default_endpoint: Some(endpoint.into()),
            ..data_plane::Config::default()
        };
        routers.push(
            test_support::InProcessServer::start(|l, stop| data_plane::serve(l, config, stop))
                .await,
        );
    }
    routers
}

/// `method url` with a JSON `body`: the status, the response body, and the instance a router
/// chose (its `x-prefix-router-instance` header; "" from an engine).
pub async fn send(method: &str, url: &str, body: Vec<u8>) -> (u16, bytes::Bytes, String) {
    use http_body_util::BodyExt as _;
    let http: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let instance = resp
        .headers()
        .get("x-prefix-router-instance")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, body, instance)
}
