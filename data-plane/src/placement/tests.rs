//! Placement at the default tuning, on synthetic fleets: every test builds its tables as a
//! control plane would and routes real request bodies.

use super::*;
use crate::load::InFlight;
use crate::prefix_index::{Prediction, BLOCK_BYTES};
use crate::prompt::DEFAULT_SEED;
use crate::table::tests::{table, variant};
use proto::RoutingStrategy;
use rendezvous::fmix64;

fn addrs(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("http://10.0.0.{i}:8000")).collect()
}

fn build(strategy: RoutingStrategy, addresses: &[String], threshold: u32) -> RoutingTable {
    let a: Vec<&str> = addresses.iter().map(|s| s.as_str()).collect();
    let mut v = variant("v1", strategy, &a);
    v.routing_config
        .as_mut()
        .unwrap()
        .prefix_aware_routing_config
        .as_mut()
        .unwrap()
        .concurrency_threshold = threshold;
    RoutingTable::try_from(table(1, "e", vec![v])).unwrap()
}

fn chat_body(user: &str) -> Vec<u8> {
    format!(r#"{{"model":"e","messages":[{{"role":"system","content":"You are helpful."}},{{"role":"user","content":"{user}"}}]}}"#)
        .into_bytes()
}

/// Pseudo-text of `bytes` bytes, its own for each `seed`.
fn text(seed: u64, bytes: usize) -> String {
    let mut out = String::with_capacity(bytes + 16);
    let mut x = seed;
    while out.len() < bytes {
        x = fmix64(x.wrapping_add(0x9E37_79B9_7F4A_7C15));
        out.push_str(&format!("w{:x} ", x & 0xFFFF));
    }
    out.truncate(bytes);
    out
}

/// A document of 8 KiB and a question, in one user message.
fn document(d: u64, question: u64) -> Vec<u8> {
    chat_body(&format!("{} Question {question}?", text(d, 8192)))
}

/// A chat: a system prompt and the turns so far (user, assistant, ..., user).
fn chat(system: &str, turns: &[String]) -> Vec<u8> {
    let mut messages = vec![format!(r#"{{"role":"system","content":"{system}"}}"#)];
    for (i, t) in turns.iter().enumerate() {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        messages.push(format!(r#"{{"role":"{role}","content":"{t}"}}"#));
    }
    format!(r#"{{"model":"e","messages":[{}]}}"#, messages.join(",")).into_bytes()
}

fn req(body: &[u8]) -> RouteRequest<'_> {
    RouteRequest {
        kind: BodyKind::OpenAi,
        body,
        endpoint: None,
        target_variant: None,
        prefix_aware_id: None,
    }
}

fn policy() -> Placement {
    Placement::new(None)
}

fn variant_of(t: &RoutingTable) -> &Variant {
    &t.endpoint("e").unwrap().variants()[0]
}

/// `k` requests in flight on instance `i` (held until dropped).
fn load(v: &Variant, i: usize, k: usize) -> Vec<InFlight> {
    (0..k)
        .map(|_| InFlight::start(v.instances()[i].state(), v.load()))
        .collect()
}

#[test]
fn rendezvous_walk_visits_every_instance_in_score_order() {
    for n in [1usize, 2, 5, 64, 65, 200] {
        let hashes: Vec<u64> = (0..n as u64).map(|i| fmix64(i + 1)).collect();
        for key in [1u64, 42, u64::MAX] {
            let mut expected: Vec<usize> = (0..n).collect();
            expected.sort_by(|&a, &b| {
                rendezvous_score(key, hashes[b])
                    .cmp(&rendezvous_score(key, hashes[a]))
                    .then(a.cmp(&b))
            });
            let (top, score) = rendezvous_top(&hashes, key);
            let mut got = vec![top];
            got.extend(RendezvousWalk::new(&hashes, key, top, score));
            assert_eq!(got, expected, "n={n}");
        }
    }
}

#[test]
fn a_cold_prompt_follows_the_rendezvous_ranking_on_every_replica() {
    // Two routers with their own tables and indexes place every new prompt on its key's
    // rendezvous top, and the prompts spread over the whole variant.
    let t1 = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let t2 = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let (p1, p2) = (policy(), policy());
    let mut used = std::collections::HashSet::new();
    for i in 0..200 {
        let body = chat_body(&format!("question {i} {}", text(i, 600)));
        let a = p1.route(&t1, &req(&body)).unwrap();
        let b = p2.route(&t2, &req(&body)).unwrap();
        let key = a.key.unwrap();
        assert_eq!(
            a.instance,
            rendezvous_top(variant_of(&t1).id_hashes(), key).0
        );
        assert_eq!(
            a.variant.instances()[a.instance].id(),
            b.variant.instances()[b.instance].id()
        );
        assert_eq!(
            (a.decision, b.decision),
            (Decision::PrefixHash, Decision::PrefixHash)
        );
        used.insert(a.instance);
    }
    assert_eq!(used.len(), 7, "keys spread over all instances");
}

#[test]
fn a_prompt_goes_where_it_is_cached_until_that_queue_costs_more_than_the_prefill() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(3), 64);
    let v = variant_of(&t);
    let p = policy();
    let first = p.route(&t, &req(&document(1, 0))).unwrap();
    let home = first.instance;
    assert_eq!(first.decision, Decision::PrefixHash);
    // the same document with another question: where it is cached, not where the question
    // hashes
    for q in 1..20 {
        let r = p.route(&t, &req(&document(1, q))).unwrap();
        assert_eq!((r.instance, r.decision), (home, Decision::PrefixMatch));
        let held = r.prediction.unwrap().cached_bytes as usize;
        assert!(held >= 8192 - BLOCK_BYTES, "{held}");
    }
    // one request in flight there costs less than prefilling 8 KiB elsewhere (the tuning's
    // prior: 4 KiB of prefill a queued request)
    let queue = load(v, home, 1);
    assert_eq!(p.route(&t, &req(&document(1, 50))).unwrap().instance, home);
    // three cost more: a second home, where the prompt is prefilled once
    let more = load(v, home, 2);
    let r = p.route(&t, &req(&document(1, 51))).unwrap();
    assert_ne!(r.instance, home);
    assert_eq!(r.decision, Decision::OverloadBypass);
    let second = r.instance;
    // which now holds it too: the next request goes to the one with the shorter queue
    let r = p.route(&t, &req(&document(1, 52))).unwrap();
    assert_eq!((r.instance, r.decision), (second, Decision::PrefixMatch));
    drop((queue, more));
    // with the queues gone, both homes hold it; equal costs go by the key's ranking
    let a = p.route(&t, &req(&document(1, 53))).unwrap().instance;
    let b = p.route(&t, &req(&document(1, 54))).unwrap().instance;
    assert_eq!(a, b);
    assert!(a == home || a == second);
}

#[test]
fn a_copy_the_cache_cannot_fit_costs_its_eviction() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(2), 64);
    let v = variant_of(&t);
    let p = policy();
    let home = p.route(&t, &req(&document(1, 0))).unwrap().instance;
    let other = 1 - home;
    let tuning = *p.tuning();
    // three requests queued on the holder cost more than prefilling the document on the other
    // instance while its cache has room...
    let queue = load(v, home, 3);
    assert_eq!(p.route(&t, &req(&document(1, 1))).unwrap().instance, other);
    drop(queue);
    // ...but not once the other instance's cache is full: there the copy evicts as much as it
    // adds. Fill it with documents and have its engine report that it held less than that.
    let t = build(RoutingStrategy::PrefixAware, &addrs(2), 64);
    let v = variant_of(&t);
    let p = policy();
    let home = p.route(&t, &req(&document(1, 0))).unwrap().instance;
    let other = 1 - home;
    let ids = v.id_hashes().to_vec();
    let blocks = 8192 / BLOCK_BYTES;
    v.load().index().with(&ids, &tuning, |index| {
        for d in 2..6u64 {
            let mut b = Vec::new();
            prompt_blocks(
                BodyKind::OpenAi,
                &document(d, 0),
                DEFAULT_SEED,
                MAX_PROMPT_BYTES,
                &mut b,
            );
            index.place(other, &b);
        }
    });
    let prompt_bytes = (4 * blocks * BLOCK_BYTES) as u32;
    v.load().index().learn(
        Prediction {
            instance: ids[other],
            cached_bytes: prompt_bytes,
            prompt_bytes,
        },
        0,
        None,
        &tuning,
    );
    let (used, capacity) = v.load().index().with(&ids, &tuning, |i| i.room(other));
    assert!(used as f64 >= capacity.floor() && capacity < (4 * blocks) as f64);
    let queue = load(v, home, 3);
    let r = p.route(&t, &req(&document(1, 1))).unwrap();
    assert_eq!((r.instance, r.decision), (home, Decision::PrefixMatch));
    drop(queue);
}

#[test]
fn a_conversations_later_turns_go_where_its_earlier_turns_are_cached() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(4), 64);
    let v = variant_of(&t);
    let p = policy();
    let system = text(7, 3000);
    let first = |c: u64| vec![format!("conversation {c}: {}", text(100 + c, 300))];
    // conversation 0 starts on the system prompt's instance; while that one is busy,
    // conversation 1 starts elsewhere (the 3 KB head costs less to prefill than the queue)
    let a = p
        .route(&t, &req(&chat(&system, &first(0))))
        .unwrap()
        .instance;
    let busy = load(v, a, 2);
    let b = p
        .route(&t, &req(&chat(&system, &first(1))))
        .unwrap()
        .instance;
    assert_ne!(a, b);
    drop(busy);
    // their later turns resend the history: each goes where its own history is cached, though
    // both instances hold the shared system prompt
    for turn in 1..4 {
        for (c, home) in [(0, a), (1, b)] {
            let mut turns = first(c);
            for k in 1..=turn {
                turns.push(format!("answer {k} {}", text(200 + c * 10 + k, 400)));
                turns.push(format!("follow-up {k}"));
            }
            let r = p.route(&t, &req(&chat(&system, &turns))).unwrap();
            assert_eq!(
                (r.instance, r.decision),
                (home, Decision::PrefixMatch),
                "turn {turn}"
            );
        }
    }
}

#[test]
fn overload_bypass_at_the_concurrency_threshold() {
    let p = policy();
    let t = build(RoutingStrategy::PrefixAware, &addrs(3), 2);
    let v = variant_of(&t);
    let body = chat_body("x");
    let r = p.route(&t, &req(&body)).unwrap();
    assert_eq!(r.decision, Decision::PrefixHash);
    let top = r.instance;
    let _h1 = load(v, top, 1);
    let _h2 = load(v, top, 1);
    let r = p.route(&t, &req(&body)).unwrap();
    assert_ne!(r.instance, top, "at the threshold the instance is skipped");
    assert_eq!(r.decision, Decision::OverloadBypass);
    // every instance at the threshold: the cheapest of them all the same (flow control then
    // waits for a place on it), still a bypass
    let _rest: Vec<_> = (0..3)
        .filter(|&i| i != top)
        .map(|i| load(v, i, 3))
        .collect();
    let r = p.route(&t, &req(&body)).unwrap();
    assert_eq!((r.instance, r.decision), (top, Decision::OverloadBypass));
}

#[test]
fn ejected_instances_are_skipped_and_a_retry_leaves_its_instance() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(5), 64);
    let v = variant_of(&t);
    let p = policy();
    let body = chat_body("y");
    let r = p.route(&t, &req(&body)).unwrap();
    let now = now_ms();
    for _ in 0..3 {
        v.instances()[r.instance].state().record_failure(now);
    }
    let r2 = p.route(&t, &req(&body)).unwrap();
    assert_ne!(r2.instance, r.instance);
    let key = r.key.unwrap();
    // a retry (no prompt at hand) takes the next healthy instance of the key's ranking
    let next = ranking(v.id_hashes(), key)
        .find(|&i| i != r.instance && i != r2.instance)
        .unwrap();
    assert_eq!(
        p.choose(v, Some(key), Some(r2.instance), now),
        Some((next, Decision::OverloadBypass))
    );
}

#[test]
fn joining_or_leaving_instance_moves_about_one_in_n_plus_one_new_keys() {
    let n = 7;
    let all = addrs(n + 1);
    let small = build(RoutingStrategy::PrefixAware, &all[..n], 64);
    let big = build(RoutingStrategy::PrefixAware, &all, 64);
    let (ps, pb) = (policy(), policy());
    let keys = 3_000;
    let mut moved = 0;
    for k in 0..keys {
        let body = chat_body(&format!("key {k}"));
        let a = ps.route(&small, &req(&body)).unwrap();
        let b = pb.route(&big, &req(&body)).unwrap();
        let (a, b) = (
            a.variant.instances()[a.instance].id(),
            b.variant.instances()[b.instance].id(),
        );
        if a != b {
            moved += 1;
            assert_eq!(b, all[n], "a key only ever moves to the new instance");
        }
    }
    let fraction = moved as f64 / keys as f64;
    let ideal = 1.0 / (n as f64 + 1.0);
    assert!(
        (fraction - ideal).abs() < 0.03,
        "moved {fraction}, ideal {ideal}"
    );
}

#[test]
fn a_prompt_the_index_lost_to_a_small_cache_is_cold_again() {
    // The engine reports that it no longer had a document the index listed: the capacity
    // shrinks and the least recently used documents leave the index (not the one just sent,
    // which the engine has computed again).
    let t = build(RoutingStrategy::PrefixAware, &addrs(2), 64);
    let v = variant_of(&t);
    let p = policy();
    let ids = v.id_hashes().to_vec();
    let mut on = std::collections::HashMap::new();
    for d in 0..6u64 {
        let r = p.route(&t, &req(&document(d, 0))).unwrap();
        on.insert(d, r.instance);
    }
    let i = on[&0];
    let r = p.route(&t, &req(&document(0, 1))).unwrap();
    assert_eq!(r.decision, Decision::PrefixMatch);
    let predicted = r.prediction.unwrap();
    // its engine served nothing of it from cache
    v.load().index().learn(predicted, 0, None, p.tuning());
    let (_, capacity) = v.load().index().with(&ids, p.tuning(), |x| x.room(i));
    let held = on.values().filter(|&&j| j == i).count() * 8192 / BLOCK_BYTES;
    assert!(capacity < held as f64, "{capacity} < {held}");
    let depth_on_i = |d: u64| {
        let mut b = Vec::new();
        prompt_blocks(
            BodyKind::OpenAi,
            &document(d, 9),
            DEFAULT_SEED,
            MAX_PROMPT_BYTES,
            &mut b,
        );
        let mut depth = vec![0u32; 2];
        v.load()
            .index()
            .with(&ids, p.tuning(), |x| x.matches(&b, &mut depth));
        depth[i]
    };
    let oldest = (1..6u64)
        .find(|d| on[d] == i)
        .expect("two documents on one of two instances");
    assert_eq!(
        depth_on_i(oldest),
        0,
        "the least recently used document is gone"
    );
    assert!(depth_on_i(0) > 0, "the document just sent stays");
}

#[test]
fn random_and_least_outstanding_choices() {
    let t = build(RoutingStrategy::LeastOutstandingRequests, &addrs(3), 8);
    let v = variant_of(&t);
    let p = policy();
    let _a = load(v, 0, 1);
    let _b = load(v, 2, 1);
    for _ in 0..50 {
        assert_eq!(
            p.choose(v, None, None, 1),
            Some((1, Decision::LeastOutstanding))
        );
    }
    let _c = load(v, 1, 2);
    let picks: std::collections::HashSet<usize> = (0..100)
        .map(|_| p.choose(v, None, None, 1).unwrap().0)
        .collect();
    assert_eq!(picks, [0, 2].into_iter().collect());
    assert_eq!(least_loaded(v, Some(0), 1), Some(2));

    let t = build(RoutingStrategy::Random, &addrs(4), 8);
    let v = variant_of(&t);
    let mut counts = [0; 4];
    for _ in 0..4000 {
        let (i, d) = p.choose(v, None, None, 1).unwrap();
        assert_eq!(d, Decision::Random);
        counts[i] += 1;
    }
    assert!(
        counts.iter().all(|&c| (800..1200).contains(&c)),
        "{counts:?}"
    );
    for _ in 0..100 {
        assert_ne!(random(v, Some(2), 1), Some(2));
    }
    let one = build(RoutingStrategy::Random, &addrs(1), 8);
    assert_eq!(random(variant_of(&one), Some(0), 1), None);
}

#[test]
fn endpoint_and_variant_resolution() {
    let mut a = variant("a", RoutingStrategy::Random, &["http://a:1"]);
    a.weight = 1.0;
    let b = variant("b", RoutingStrategy::Random, &["http://b:1"]);
    let t = RoutingTable::try_from(table(1, "e", vec![a, b])).unwrap();
    let p = policy();
    let body = br#"{"model":"e","prompt":"x"}"#;
    let r = p.route(&t, &req(body)).unwrap();
    assert_eq!(r.endpoint.name(), "e");
    let pinned = RouteRequest {
        target_variant: Some("b"),
        ..req(body)
    };
    assert_eq!(p.route(&t, &pinned).unwrap().variant.name(), "b");
    let bad = RouteRequest {
        target_variant: Some("zz"),
        ..req(body)
    };
    assert_eq!(p.route(&t, &bad).unwrap_err().status(), 404);
    let by_header = RouteRequest {
        endpoint: Some("nope"),
        ..req(body)
    };
    assert_eq!(
        p.route(&t, &by_header).unwrap_err(),
        RouteError::UnknownEndpoint("nope".into())
    );
    let no_model = br#"{"model":"llama","prompt":"x"}"#;
    assert_eq!(
        p.route(&t, &req(no_model)).unwrap_err(),
        RouteError::NoEndpoint {
            model: Some("llama".into())
        }
    );
    let with_default = Placement::new(Some("e".into()));
    assert_eq!(
        with_default
            .route(&t, &req(no_model))
            .unwrap()
            .endpoint
            .name(),
        "e"
    );
    // both variants get traffic by weight
    let names: std::collections::HashSet<&str> = (0..100)
        .map(|_| p.route(&t, &req(body)).unwrap().variant.name())
        .collect();
    assert_eq!(names.len(), 2);
    let empty = RoutingTable::try_from(table(
        1,
        "e",
        vec![variant("a", RoutingStrategy::Random, &[])],
    ))
    .unwrap();
    assert_eq!(p.route(&empty, &req(body)).unwrap_err().status(), 503);
}

/// A PREFIX_AWARE table whose engines publish KV events (blocks of 4 tokens), tokenized with
/// chat-tokens' tiny tokenizer.
fn build_with_events(addresses: &[String], block_size: u32) -> RoutingTable {
    let a: Vec<&str> = addresses.iter().map(|s| s.as_str()).collect();
    let mut v = variant("v1", RoutingStrategy::PrefixAware, &a);
    crate::table::tests::with_kv_events(
        &mut v,
        proto::KvEventsConfig {
            endpoint: "tcp://{host}:5557".into(),
            block_size,
            ..Default::default()
        },
        &crate::table::tests::tiny_tokenizer(),
    );
    RoutingTable::try_from(table(1, "e", vec![v])).unwrap()
}

/// What an engine publishes after prefilling `body`: its full blocks, under engine hashes of its
/// own (`first..`).
fn stored_event(v: &Variant, body: &[u8], block_size: usize, first: u64) -> kv_events::Event {
    let mut tokens = Vec::new();
    let kv = v.kv_events().unwrap();
    kv.tokenizer
        .tokens(body, chat_tokens::RequestKind::Chat, &mut tokens)
        .unwrap();
    let blocks = tokens.len() / block_size;
    tokens.truncate(blocks * block_size);
    kv_events::Event::Stored {
        hashes: (first..).take(blocks).collect(),
        parent: None,
        token_ids: tokens,
        block_size: block_size as u32,
        lora_name: None,
        medium: Some("GPU".into()),
        group_idx: None,
    }
}

#[test]
fn a_prompt_an_engine_reports_holding_goes_there_from_every_replica_until_it_resets() {
    let addresses = addrs(4);
    let body = document(7, 1);
    // two router replicas: each has its own table and index, fed the same events
    let replicas = [
        build_with_events(&addresses, 16),
        build_with_events(&addresses, 16),
    ];
    let first = |t: &RoutingTable| {
        let r = policy().route(t, &req(&body)).unwrap();
        (r.instance, r.decision)
    };
    let rendezvous = first(&replicas[0]).0;
    assert_eq!(first(&replicas[1]).0, rendezvous, "cold: the key's ranking");
    let holder = (rendezvous + 1) % 4;
    for t in &replicas {
        let v = variant_of(t);
        let ids = v.id_hashes();
        // every instance publishes; only `holder` prefilled the prompt (before these routers
        // started, say)
        for (i, &id) in ids.iter().enumerate() {
            let event = if i == holder {
                stored_event(v, &body, 16, 1000)
            } else {
                kv_events::Event::Cleared
            };
            v.load().kv().apply(id, &event);
        }
    }
    for t in &replicas {
        assert_eq!(
            first(t),
            (holder, Decision::PrefixMatch),
            "the engine that holds it, not the ranking"
        );
    }
    // the engine restarted and cleared its cache: the exact index forgets it at once (what the
    // inferred index remembers of the placements above counts only for inferred instances)
    for t in &replicas {
        let v = variant_of(t);
        v.load()
            .kv()
            .apply(v.id_hashes()[holder], &kv_events::Event::Cleared);
        assert_eq!(first(t).0, rendezvous);
    }
    // an instance whose stream reset (a gap the replay could not fill) is inferred again: the
    // inferred index's memory of the placements on `holder` counts for it once more, unless
    // forgotten too (as the subscribers' sink does on a reset)
    for t in &replicas {
        let v = variant_of(t);
        let id = v.id_hashes()[holder];
        v.load().kv().reset(id);
        assert_eq!(first(t).0, holder);
        v.load().index().forget(id);
        assert_eq!(first(t).0, rendezvous);
    }
}
