use super::*;
use crate::load::InFlight;
use crate::table::tests::{table, variant};
use proto::RoutingStrategy;

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

fn req(body: &[u8]) -> RouteRequest<'_> {
    RouteRequest {
        kind: BodyKind::OpenAi,
        body,
        endpoint: None,
        target_variant: None,
        prefix_aware_id: None,
    }
}

/// A placement with the bounded-load factor at 1.25 (`--hash-balance-factor 125`), for the tests
/// of the in-flight bound itself: at the default (4) a handful of requests never reach it.
fn policy() -> Placement {
    Placement::new(1000, 125, None)
}

fn variant_of(t: &RoutingTable) -> &Variant {
    &t.endpoint("e").unwrap().variants()[0]
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
fn prefix_aware_is_a_pure_function_of_table_and_prompt() {
    // Two independently built tables (two routers) place every prompt identically.
    let t1 = build(RoutingStrategy::PrefixAware, &addrs(7), 8);
    let t2 = build(RoutingStrategy::PrefixAware, &addrs(7), 8);
    let (p1, p2) = (policy(), policy());
    let mut used = std::collections::HashSet::new();
    for i in 0..200 {
        let body = chat_body(&format!("question {i}"));
        let a = p1.route(&t1, &req(&body)).unwrap();
        let b = p2.route(&t2, &req(&body)).unwrap();
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
    // and the choice for a fixed input is fixed: the top rendezvous score
    let body = chat_body("fixed");
    let key = prompt_key(BodyKind::OpenAi, &body, 1024, seed_for(None)).hash;
    let r = p1.route(&t1, &req(&body)).unwrap();
    assert_eq!(r.key, Some(key));
    assert_eq!(
        r.instance,
        rendezvous_top(variant_of(&t1).id_hashes(), key).0
    );
}

#[test]
fn random_and_least_outstanding_choices() {
    let t = build(RoutingStrategy::LeastOutstandingRequests, &addrs(3), 8);
    let v = variant_of(&t);
    let p = policy();
    let _a = InFlight::start(v.instances()[0].state(), v.load());
    let _b = InFlight::start(v.instances()[2].state(), v.load());
    for _ in 0..50 {
        assert_eq!(
            p.choose(v, None, None, 1),
            Some((1, Decision::LeastOutstanding, Rule::LeastOutstanding))
        );
    }
    let _c = InFlight::start(v.instances()[1].state(), v.load());
    let _d = InFlight::start(v.instances()[1].state(), v.load());
    // 0 and 2 tie at one: both get picked
    let picks: std::collections::HashSet<usize> = (0..100)
        .map(|_| p.choose(v, None, None, 1).unwrap().0)
        .collect();
    assert_eq!(picks, [0, 2].into_iter().collect());
    assert_eq!(least_loaded(v, Some(0), 1), Some(2));

    let t = build(RoutingStrategy::Random, &addrs(4), 8);
    let v = variant_of(&t);
    let mut counts = [0; 4];
    for _ in 0..4000 {
        let (i, d, _) = p.choose(v, None, None, 1).unwrap();
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
fn small_counts_leave_headroom_on_the_top_choice() {
    // A replica that carries a fraction of the traffic sees small in-flight counts: one
    // request on the top choice of 7 must not make the next request for the key spill.
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 1000);
    let v = variant_of(&t);
    let p = policy();
    let body = chat_body("a popular document");
    let first = p.route(&t, &req(&body)).unwrap();
    let _held = InFlight::start(v.instances()[first.instance].state(), v.load());
    let second = p.route(&t, &req(&body)).unwrap();
    assert_eq!(
        (second.instance, second.decision),
        (first.instance, Decision::PrefixHash)
    );
}

#[test]
fn a_few_clients_on_one_key_do_not_spill_at_the_default_factor() {
    // Four clients, four instances: three requests for one document in flight at once is
    // ordinary (not a burst) and the fourth waits on the instance that has the document,
    // where a cold prefill elsewhere would cost more. (At a factor of 200 it spilled.)
    let t = build(RoutingStrategy::PrefixAware, &addrs(4), 1000);
    let v = variant_of(&t);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let body = chat_body("a popular document");
    let first = p.route(&t, &req(&body)).unwrap();
    let state = v.instances()[first.instance].state();
    let _held: Vec<InFlight> = (0..3).map(|_| InFlight::start(state, v.load())).collect();
    let next = p.route(&t, &req(&body)).unwrap();
    assert_eq!(
        (next.instance, next.decision),
        (first.instance, Decision::PrefixHash)
    );
    // a lower factor (--hash-balance-factor 200) bounds the same instance sooner
    let tighter = Placement::new(1000, 200, None);
    assert_eq!(
        tighter.route(&t, &req(&body)).unwrap().decision,
        Decision::OverloadBypass
    );
}

#[test]
fn hot_key_spills_to_one_remembered_instance() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 1000);
    let v = variant_of(&t);
    let p = policy();
    let body = chat_body("the hot document");
    let first = p.route(&t, &req(&body)).unwrap();
    assert_eq!(first.decision, Decision::PrefixHash);
    let top = first.instance;
    let mut held = Vec::new();
    let mut decisions = Vec::new();
    // 40 concurrent requests for one key: the cap (1.25 x mean + rounding) forces spills
    for _ in 0..40 {
        let r = p.route(&t, &req(&body)).unwrap();
        held.push(InFlight::start(v.instances()[r.instance].state(), v.load()));
        decisions.push((r.instance, r.decision));
    }
    let on_top = decisions.iter().filter(|d| d.0 == top).count();
    assert!(on_top < 40, "spilled");
    let spilled: Vec<_> = decisions.iter().filter(|d| d.0 != top).collect();
    assert!(
        spilled.iter().any(|d| d.1 == Decision::PrefixMatch),
        "{decisions:?}"
    );
    assert!(spilled
        .iter()
        .all(|d| d.1 == Decision::PrefixMatch || d.1 == Decision::OverloadBypass));
    // the cap holds: no instance above ceil(1.25 * (total + 1) / 7) + 1 at any point
    let max = v
        .instances()
        .iter()
        .map(|i| i.state().outstanding())
        .max()
        .unwrap();
    assert!(max <= (125 * 41u64).div_ceil(700) + 1, "max {max}");
    // the first spill goes where the rendezvous ranking says, and the index remembers it
    let second = RendezvousWalk::new(
        v.id_hashes(),
        first.key.unwrap(),
        top,
        rendezvous_top(v.id_hashes(), first.key.unwrap()).1,
    )
    .next()
    .unwrap();
    let first_spill = spilled[0];
    assert_eq!(
        (first_spill.0, first_spill.1),
        (second, Decision::OverloadBypass)
    );
    assert!(p.index().get(first.key.unwrap() ^ v.salt()).is_some());
}

#[test]
fn remembered_instance_is_preferred_over_the_ranking() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 1);
    let v = variant_of(&t);
    let p = policy();
    let body = chat_body("k");
    let key = p.route(&t, &req(&body)).unwrap().key.unwrap();
    let (top, _) = rendezvous_top(v.id_hashes(), key);
    // the index says this key spilled to instance `far` before
    let far = (0..7).find(|&i| i != top).unwrap();
    p.index().insert(key ^ v.salt(), v.id_hashes()[far]);
    let _busy = InFlight::start(v.instances()[top].state(), v.load()); // threshold 1: top is full
    let r = p.route(&t, &req(&body)).unwrap();
    assert_eq!((r.instance, r.decision), (far, Decision::PrefixMatch));
}

#[test]
fn overload_bypass_at_the_concurrency_threshold() {
    // A generous balance factor so only the threshold matters.
    let p = Placement::new(1000, 1000, None);
    let t = build(RoutingStrategy::PrefixAware, &addrs(3), 2);
    let v = variant_of(&t);
    let body = chat_body("x");
    let r = p.route(&t, &req(&body)).unwrap();
    assert_eq!(r.decision, Decision::PrefixHash);
    let top = r.instance;
    let _h1 = InFlight::start(v.instances()[top].state(), v.load());
    assert_eq!(
        p.route(&t, &req(&body)).unwrap().instance,
        top,
        "1 < threshold 2"
    );
    let _h2 = InFlight::start(v.instances()[top].state(), v.load());
    let r = p.route(&t, &req(&body)).unwrap();
    assert_ne!(r.instance, top, "at the threshold the holder is skipped");
    assert_eq!(r.decision, Decision::OverloadBypass);
    // every instance at the threshold: the least loaded one
    let mut held = Vec::new();
    for (i, inst) in v.instances().iter().enumerate() {
        let extra = if i == top { 0 } else { 3 };
        for _ in 0..extra {
            held.push(InFlight::start(inst.state(), v.load()));
        }
    }
    let r = p.route(&t, &req(&body)).unwrap();
    assert_eq!((r.instance, r.decision), (top, Decision::OverloadBypass));
    // every instance at the threshold, equally: the key's own (a request that waits for a
    // place waits for the one whose cache has its prefix), every time
    let mut even = Vec::new();
    for (i, inst) in v.instances().iter().enumerate() {
        let have = if i == top { 2 } else { 0 };
        for _ in have..2 {
            even.push(InFlight::start(inst.state(), v.load()));
        }
    }
    drop(held);
    for _ in 0..20 {
        assert_eq!(p.route(&t, &req(&body)).unwrap().instance, top);
    }
}

#[test]
fn ejected_top_choice_sends_keys_to_their_next_choice() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(5), 8);
    let v = variant_of(&t);
    let p = policy();
    let body = chat_body("y");
    let r = p.route(&t, &req(&body)).unwrap();
    let now = now_ms();
    for _ in 0..3 {
        v.instances()[r.instance].state().record_failure(now);
    }
    let r2 = p.route(&t, &req(&body)).unwrap();
    let key = r.key.unwrap();
    let next = RendezvousWalk::new(
        v.id_hashes(),
        key,
        r.instance,
        rendezvous_top(v.id_hashes(), key).1,
    )
    .next();
    assert_eq!(Some(r2.instance), next);
    // retry exclusion works the same way
    assert_eq!(
        p.choose(v, Some(key), Some(r2.instance), now)
            .map(|c| c.0 == r2.instance),
        Some(false)
    );
}

#[test]
fn joining_or_leaving_instance_moves_about_one_in_n_plus_one_keys() {
    let n = 7;
    let all = addrs(n + 1);
    let small = build(RoutingStrategy::PrefixAware, &all[..n], 8);
    let big = build(RoutingStrategy::PrefixAware, &all, 8);
    let (vs, vb) = (variant_of(&small), variant_of(&big));
    let keys = 10_000;
    let mut moved = 0;
    for k in 0..keys {
        let key = xxhash_rust::xxh3::xxh3_64(format!("key {k}").as_bytes());
        let a = vs.instances()[rendezvous_top(vs.id_hashes(), key).0].id();
        let b = vb.instances()[rendezvous_top(vb.id_hashes(), key).0].id();
        if a != b {
            moved += 1;
            assert_eq!(b, all[n], "a key only ever moves to the new instance");
        }
    }
    let fraction = moved as f64 / keys as f64;
    let ideal = 1.0 / (n as f64 + 1.0);
    assert!(
        (fraction - ideal).abs() < 0.02,
        "moved {fraction}, ideal {ideal}"
    );
    // removing a middle instance moves exactly its keys
    let without: Vec<String> = all
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3)
        .map(|(_, a)| a.clone())
        .collect();
    let gone = build(RoutingStrategy::PrefixAware, &without, 8);
    let vg = variant_of(&gone);
    let mut moved = 0;
    for k in 0..keys {
        let key = xxhash_rust::xxh3::xxh3_64(format!("key {k}").as_bytes());
        let a = vb.instances()[rendezvous_top(vb.id_hashes(), key).0].id();
        let b = vg.instances()[rendezvous_top(vg.id_hashes(), key).0].id();
        if a != b {
            moved += 1;
            assert_eq!(a, all[3]);
        }
    }
    let fraction = moved as f64 / keys as f64;
    assert!((fraction - ideal).abs() < 0.02, "moved {fraction}");
}

#[test]
fn users_sharing_a_system_prompt_spread_and_their_turns_stay() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let p = policy();
    let system = "You are a support agent for ACME. ".repeat(20);
    let mut used = std::collections::HashSet::new();
    for u in 0..50 {
        let turn1 = format!(
            r#"{{"model":"e","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"I am user {u}, help"}}]}}"#
        );
        let turn2 = format!(
            r#"{{"model":"e","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"I am user {u}, help"}},{{"role":"assistant","content":"Sure."}},{{"role":"user","content":"thanks"}}]}}"#
        );
        let a = p.route(&t, &req(turn1.as_bytes())).unwrap();
        let b = p.route(&t, &req(turn2.as_bytes())).unwrap();
        assert_eq!(a.instance, b.instance);
        used.insert(a.instance);
    }
    assert!(used.len() >= 6, "{used:?}");
}

/// A Zipf(0.8) stream over `keys` documents, as the long-context bench draws them.
fn zipf_stream(keys: usize, len: usize, seed: u64) -> Vec<usize> {
    use rand::{Rng, SeedableRng};
    let weights: Vec<f64> = (1..=keys).map(|k| (k as f64).powf(-0.8)).collect();
    let total: f64 = weights.iter().sum();
    let mut cumulative = Vec::with_capacity(keys);
    let mut sum = 0.0;
    for w in &weights {
        sum += w / total;
        cumulative.push(sum);
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    (0..len)
        .map(|_| {
            let x: f64 = rng.random();
            cumulative.partition_point(|&c| c < x).min(keys - 1)
        })
        .collect()
}

fn document(d: usize) -> Vec<u8> {
    chat_body(&format!("document {d} ").repeat(8))
}

/// Routes `stream` (each request done before the next: only the rate balance acts) and
/// returns each instance's share of the requests after `skip`, and the instances each key
/// used after `skip`.
fn route_stream(
    p: &Placement,
    t: &RoutingTable,
    stream: &[usize],
    skip: usize,
) -> (Vec<f64>, Vec<std::collections::BTreeSet<usize>>) {
    let bodies: Vec<Vec<u8>> = (0..=*stream.iter().max().unwrap()).map(document).collect();
    let n = variant_of(t).instances().len();
    let mut counts = vec![0usize; n];
    let mut used = vec![std::collections::BTreeSet::new(); bodies.len()];
    for (i, &d) in stream.iter().enumerate() {
        let r = p.route(t, &req(&bodies[d])).unwrap();
        if i >= skip {
            counts[r.instance] += 1;
            used[d].insert(r.instance);
        }
    }
    let measured = (stream.len() - skip) as f64;
    (counts.iter().map(|&c| c as f64 / measured).collect(), used)
}

#[test]
fn zipf_popular_documents_keep_every_instance_within_one_and_a_half_points() {
    // Rendezvous placement alone leaves 5-12 points between the busiest instance and 1/7 on
    // this stream; hot documents served by their least loaded replicas even it out.
    for seed in [1, 2, 3] {
        let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
        let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
        let stream = zipf_stream(80, 24_000, seed);
        let (shares, used) = route_stream(&p, &t, &stream, 4_000);
        let worst = shares
            .iter()
            .map(|s| (s - 1.0 / 7.0).abs() * 100.0)
            .fold(0.0, f64::max);
        assert!(worst <= 1.5, "seed {seed}: shares {shares:?}");
        // copies are bounded: a key never uses more instances than its share calls for
        // (true share, plus the estimate's slack; a warm key two), and cold keys stay on one
        // instance but for the few that re-weighing moves (once: two instances)
        let mut freq = vec![0usize; 80];
        for &d in &stream[4_000..] {
            freq[d] += 1;
        }
        let mut moved = 0;
        for (d, set) in used.iter().enumerate() {
            let share = freq[d] as f64 / 20_000.0;
            let estimate = share * 1.3 + 0.002;
            let warm = estimate * 7.0 >= Tuning::default().warm_share;
            let bound = Tuning::default()
                .replicas(estimate, 7)
                .max(if warm { 2 } else { 1 });
            if !warm {
                assert!(set.len() <= 2, "cold doc {d} share {share}: {set:?}");
                moved += set.len() - 1;
            } else {
                assert!(set.len() <= bound, "doc {d} share {share}: {set:?}");
            }
        }
        assert!(moved <= 4, "seed {seed}: {moved} cold documents moved");
        assert!(
            used[0].len() >= 4,
            "the hottest document is spread: {:?}",
            used[0]
        );
    }
}

/// Routes a Zipf(`exponent`) stream over `keys` documents; returns the shares after `skip` and
/// the fraction of requests after `skip` whose document was last served elsewhere.
fn shares_and_moves(
    p: &Placement,
    keys: usize,
    exponent: f64,
    len: usize,
    skip: usize,
    seed: u64,
) -> (Vec<f64>, f64) {
    use rand::{Rng, SeedableRng};
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let weights: Vec<f64> = (1..=keys).map(|k| (k as f64).powf(-exponent)).collect();
    let total: f64 = weights.iter().sum();
    let mut cumulative = Vec::new();
    let mut sum = 0.0;
    for w in &weights {
        sum += w / total;
        cumulative.push(sum);
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let bodies: Vec<Vec<u8>> = (0..keys).map(document).collect();
    let mut last = vec![usize::MAX; keys];
    let (mut counts, mut moves) = (vec![0usize; 7], 0usize);
    for i in 0..len {
        let x: f64 = rng.random();
        let d = cumulative.partition_point(|&c| c < x).min(keys - 1);
        let r = p.route(&t, &req(&bodies[d])).unwrap();
        if i >= skip {
            counts[r.instance] += 1;
            if last[d] != usize::MAX && last[d] != r.instance {
                moves += 1;
            }
        }
        last[d] = r.instance;
    }
    let measured = (len - skip) as f64;
    (
        counts.iter().map(|&c| c as f64 / measured).collect(),
        moves as f64 / measured,
    )
}

#[test]
fn flat_popularity_is_balanced_by_weights_moving_whole_keys() {
    // 150 documents of Zipf 0.5: no document is hot enough to spread, and rendezvous alone
    // leaves instances 3-6 points from 1/7. Re-weighing moves whole cold keys among their
    // first three choices until the shares even out, and then leaves them where they are.
    for seed in [1, 2] {
        let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
        let (shares, moved) = shares_and_moves(&p, 150, 0.5, 60_000, 30_000, seed);
        let worst = shares
            .iter()
            .map(|s| (s - 1.0 / 7.0).abs() * 100.0)
            .fold(0.0, f64::max);
        assert!(worst <= 1.5, "seed {seed}: {shares:?}");
        assert!(
            moved < 0.03,
            "seed {seed}: {moved} of requests found their key moved"
        );
    }
}

#[test]
fn a_spread_of_zero_keeps_hot_keys_on_one_instance() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None).with_hot_key_spread(0.0);
    let (_, used) = route_stream(&p, &t, &zipf_stream(80, 12_000, 6), 2_000);
    // (re-weighing may still move a whole key once)
    assert!(used[0].len() <= 2, "{:?}", used[0]);
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let (_, used) = route_stream(&p, &t, &zipf_stream(80, 12_000, 6), 2_000);
    assert!(used[0].len() >= 4, "{:?}", used[0]);
}

#[test]
fn a_warm_key_leaves_its_instance_while_that_one_is_over_its_share() {
    // Document 0 has 2.5% of the traffic (share x n = 0.175: warm, not hot); cold documents
    // whose first choice is the same instance bring it another 25%, so that instance is at
    // ~28% of 7 before any re-weighing (2,048 requests). The warm document's requests go to
    // the next instance of its ranking while that one has had fewer (here all of them: the
    // busy one stays busy); without the warm rule every one stayed on the busy instance.
    // (each on a table of its own: one that has seen traffic may already spread warm keys)
    let first_choice = |d: usize| {
        let fresh = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
        let r =
            Placement::new(1000, DEFAULT_BALANCE_PERCENT, None).route(&fresh, &req(&document(d)));
        (r.as_ref().unwrap().instance, r.unwrap().key.unwrap())
    };
    let (busy, key) = first_choice(0);
    let (on_busy, elsewhere): (Vec<usize>, Vec<usize>) =
        (1..600).partition(|&d| first_choice(d).0 == busy);
    let bodies: Vec<Vec<u8>> = (0..600).map(document).collect();
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let mut used = std::collections::BTreeMap::new();
    for i in 0..2_000 {
        let d = match i % 40 {
            0 => 0,
            k if k % 4 == 1 => on_busy[(i / 4) % on_busy.len()],
            _ => elsewhere[i % elsewhere.len()],
        };
        let r = p.route(&t, &req(&bodies[d])).unwrap();
        if d == 0 && i >= 1_100 {
            *used.entry(r.instance).or_insert(0) += 1;
        }
    }
    let v = variant_of(&t);
    let key_hashes = v.id_hashes();
    let (top, score) = rendezvous_top(key_hashes, key);
    let next = RendezvousWalk::new(key_hashes, key, top, score)
        .next()
        .unwrap();
    assert_eq!(top, busy);
    // every one of them (once the window held WARM_MIN_WINDOW requests) went to the next
    // instance
    assert_eq!(used.keys().copied().collect::<Vec<_>>(), [next], "{used:?}");
}

#[test]
fn hot_keys_use_the_first_instances_of_their_ranking() {
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let v = variant_of(&t);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let stream = zipf_stream(80, 12_000, 4);
    let (_, used) = route_stream(&p, &t, &stream, 2_000);
    let mut freq = vec![0usize; 80];
    for &d in &stream[2_000..] {
        freq[d] += 1;
    }
    for (d, set) in used.iter().enumerate().take(10) {
        let key = prompt_key(BodyKind::OpenAi, &document(d), 1024, seed_for(None)).hash;
        let (top, score) = rendezvous_top(v.id_hashes(), key);
        let ranking: Vec<usize> = std::iter::once(top)
            .chain(RendezvousWalk::new(v.id_hashes(), key, top, score))
            .collect();
        // the estimate moves with the window: allow for 1.5x the key's true share; a warm
        // key may also use the second instance of its ranking
        let share = freq[d] as f64 / 10_000.0 * 1.5;
        let t = Tuning::default();
        let r = t
            .replicas(share, 7)
            .max(if share * 7.0 >= t.warm_share { 2 } else { 1 });
        let allowed: std::collections::BTreeSet<usize> = ranking[..r].iter().copied().collect();
        assert!(
            set.is_subset(&allowed),
            "doc {d} (r {r}): {set:?} not in {ranking:?}"
        );
    }
}

#[test]
fn routers_that_see_different_halves_of_the_traffic_agree_on_replica_counts() {
    // Two routers, each fed a random half of one stream (as a load balancer in front of
    // them would split it): their estimates of every key's replica count differ by at most
    // one, and since replica sets are prefixes of one rendezvous ranking, they nest.
    let (t1, t2) = (
        build(RoutingStrategy::PrefixAware, &addrs(7), 64),
        build(RoutingStrategy::PrefixAware, &addrs(7), 64),
    );
    let (p1, p2) = (
        Placement::new(1000, DEFAULT_BALANCE_PERCENT, None),
        Placement::new(1000, DEFAULT_BALANCE_PERCENT, None),
    );
    let stream = zipf_stream(80, 20_000, 5);
    let bodies: Vec<Vec<u8>> = (0..80).map(document).collect();
    use rand::{Rng, SeedableRng};
    let mut coin = rand::rngs::SmallRng::seed_from_u64(9);
    for &d in &stream {
        let (p, t) = if coin.random::<bool>() {
            (&p1, &t1)
        } else {
            (&p2, &t2)
        };
        p.route(t, &req(&bodies[d])).unwrap();
    }
    let (v1, v2) = (variant_of(&t1), variant_of(&t2));
    let mut freq = vec![0usize; 80];
    for &d in &stream[stream.len() - 4_000..] {
        freq[d] += 1;
    }
    for (d, body) in bodies.iter().enumerate() {
        let key = prompt_key(BodyKind::OpenAi, body, 1024, seed_for(None)).hash;
        let t = Tuning::default();
        let (r1, r2) = (
            t.replicas(share(v1, key, t.min_window), 7),
            t.replicas(share(v2, key, t.min_window), 7),
        );
        let load = freq[d] as f64 / 4_000.0 * 7.0;
        if load >= 0.5 {
            // clearly hot: both spread it, over nearly the same instances
            assert!(
                r1 > 1 && r2 > 1 && r1.abs_diff(r2) <= 2,
                "doc {d}: {r1} vs {r2}"
            );
        } else if load <= 0.1 {
            assert_eq!((r1, r2), (1, 1), "doc {d} is cold");
        }
    }
}

#[test]
fn conversations_under_a_long_shared_system_prompt_spread_evenly_and_keep_their_instance() {
    // The system prompt (3,000 characters) is longer than prefix_length (1,024): every
    // conversation has the same shallow key. Once that key is hot, each conversation is
    // keyed by itself: every instance is used, evenly, and a conversation's turns stay.
    let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
    let p = Placement::new(100_000, DEFAULT_BALANCE_PERCENT, None);
    let system = "Follow the policy handbook in every answer. ".repeat(70);
    let body = |user: usize, turns: usize| {
        let mut messages = vec![format!(r#"{{"role":"system","content":"{system}"}}"#)];
        for turn in 0..turns {
            if turn > 0 {
                messages.push(r#"{"role":"assistant","content":"Noted."}"#.to_string());
            }
            messages.push(format!(
                r#"{{"role":"user","content":"user {user} asks question {turn}"}}"#
            ));
        }
        format!(r#"{{"model":"e","messages":[{}]}}"#, messages.join(",")).into_bytes()
    };
    // the shared key becomes hot
    let mut counts = [0usize; 7];
    for u in 0..100 {
        counts[p.route(&t, &req(&body(100_000 + u, 1))).unwrap().instance] += 1;
    }
    // users arrive one after another, each sending a turn every 50 arrivals
    let mut schedule: Vec<(usize, usize)> = (0..700)
        .flat_map(|u| (0..4).map(move |turn| (u, turn)))
        .collect();
    schedule.sort_by_key(|&(u, turn)| (u + 50 * turn, u));
    let mut home = std::collections::HashMap::new();
    for (u, turn) in schedule {
        let r = p.route(&t, &req(&body(u, turn + 1))).unwrap();
        counts[r.instance] += 1;
        let first = *home.entry(u).or_insert(r.instance);
        assert_eq!(first, r.instance, "user {u} turn {turn} moved");
    }
    let total = counts.iter().sum::<usize>() as f64;
    for c in counts {
        let dev = (c as f64 / total - 1.0 / 7.0).abs() * 100.0;
        assert!(dev <= 1.5, "{counts:?}");
    }
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
    let with_default = Placement::new(10, 125, Some("e".into()));
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

// ---- Rules held to the engines' reports (crate::feedback) ----

use crate::feedback::tests::{HIT, MISS};
use crate::feedback::Visit;

/// Reports `window` revisits of `rule` that missed, and nine hits of plain placements for each,
/// so the variant as a whole still hits (only the rule's own gate closes).
fn misses_of(p: &Placement, v: &Variant, rule: Rule) {
    let f = &p.tuning().feedback;
    let n = v.instances().len();
    // spread over the instances: no one cache misses more than a tenth of its revisits
    let cache = |i: usize| v.instances()[i % n].state().cache();
    for w in 0..f.window as usize {
        v.load()
            .feedback()
            .learn(rule, Visit::ReusedRevisit, MISS, now_ms(), f, cache(w));
        for j in 1..10 {
            v.load().feedback().learn(
                Rule::PrefixHash,
                Visit::ReusedRevisit,
                HIT,
                now_ms(),
                f,
                cache(w + j),
            );
        }
    }
}

/// A chat whose system message is a 3,200-character document (longer than prefix_length 1,024:
/// every request on it shares one head-only key) and whose user message is a unique question.
fn system_document(d: usize, question: usize) -> Vec<u8> {
    let document = format!("Document {d} says: ").repeat(200);
    format!(
        r#"{{"model":"e","messages":[{{"role":"system","content":"{document}"}},{{"role":"user","content":"question {question} about it"}}]}}"#
    )
    .into_bytes()
}

/// A chat whose user message is a 3,200-character document followed by a unique question.
fn user_document(d: usize, question: usize) -> Vec<u8> {
    let document = format!("Document {d} says: ").repeat(200);
    format!(
        r#"{{"model":"e","messages":[{{"role":"user","content":"{document} question {question} about it"}}]}}"#
    )
    .into_bytes()
}

fn prefix_aware_table(n: usize) -> RoutingTable {
    prefix_aware_table_at(&addrs(n))
}

/// A PREFIX_AWARE variant over `addresses` (prefix_length 1,024, concurrency_threshold 64).
fn prefix_aware_table_at(addresses: &[String]) -> RoutingTable {
    let a: Vec<&str> = addresses.iter().map(|s| s.as_str()).collect();
    let mut v = variant("v1", RoutingStrategy::PrefixAware, &a);
    let pa = v
        .routing_config
        .as_mut()
        .unwrap()
        .prefix_aware_routing_config
        .as_mut()
        .unwrap();
    pa.prefix_length = 1024;
    pa.concurrency_threshold = 64;
    RoutingTable::try_from(table(1, "e", vec![v])).unwrap()
}

/// What a fleet of engines with small prefix caches reports: each instance holds its
/// `capacity` most recently used documents, and a request whose document it holds is a hit.
/// Every request is reported back to the router as the data plane does when a response ends.
struct Served {
    hit_rate: f64,
    /// Per document: the instances that served it after the warm-up.
    used: Vec<std::collections::BTreeSet<usize>>,
    /// Per instance: the requests it served after the warm-up.
    requests: Vec<usize>,
    /// Per router: the request after which it first had a cache bound.
    bounded_at: Vec<Option<usize>>,
}

fn serve(
    p: &Placement,
    t: &RoutingTable,
    stream: &[usize],
    body: impl Fn(usize, usize) -> Vec<u8>,
    capacity: usize,
    skip: usize,
) -> Served {
    serve_by(&[(p, t)], stream, body, capacity, skip, 0)
}

/// [`serve`] through several routers (each its own placement and table of the same fleet),
/// request `i` through router `i % routers.len()`, in front of the same engines, with the
/// reports' clock advancing `ms_per_request` per request (the gates' strikes escalate by the
/// minute).
fn serve_by(
    routers: &[(&Placement, &RoutingTable)],
    stream: &[usize],
    body: impl Fn(usize, usize) -> Vec<u8>,
    capacity: usize,
    skip: usize,
    ms_per_request: u64,
) -> Served {
    serve_through(
        routers,
        stream,
        body,
        capacity,
        skip,
        ms_per_request,
        Share::Nothing,
    )
}

/// What routers pass each other through the control plane in [`serve_through`].
#[derive(Clone, Copy, PartialEq)]
enum Share {
    Nothing,
    /// Their own cache bounds, after every request (to each router the least of the others',
    /// `control-plane`'s `NodeRegistry::fleet_bounds_for`).
    Bounds,
    /// The bounds, and every [`EVIDENCE_PERIOD`] requests each instance's revisits and misses
    /// as the others reported them a period before (to each router the sum of the others',
    /// `NodeRegistry::fleet_evidence_for`): the control plane sends them once a second, and a
    /// fleet of 4 llama-servers serves about 30 requests a second.
    Evidence,
    /// The evidence, and with it each period the reused keys each router's last pass found
    /// itself (to each router the union of the others', `NodeRegistry::fleet_reused_for`).
    Reused,
}

const EVIDENCE_PERIOD: usize = 32;

/// [`serve_by`], with the routers passing each other what `shared` says.
fn serve_through(
    routers: &[(&Placement, &RoutingTable)],
    stream: &[usize],
    body: impl Fn(usize, usize) -> Vec<u8>,
    capacity: usize,
    skip: usize,
    ms_per_request: u64,
    shared: Share,
) -> Served {
    let mut bounded_at = vec![None; routers.len()];
    // per router and instance, its own (revisits, misses) as it last reported them
    let mut reported = vec![vec![(0u64, 0u64); 0]; routers.len()];
    let n = variant_of(routers[0].1).instances().len();
    let docs = stream.iter().max().unwrap() + 1;
    let mut held: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); n];
    let mut used = vec![std::collections::BTreeSet::new(); docs];
    let (mut hits, mut measured) = (0usize, 0usize);
    let mut requests = vec![0usize; n];
    for (i, &d) in stream.iter().enumerate() {
        let (p, t) = routers[i % routers.len()];
        let v = variant_of(t);
        let r = p.route(t, &req(&body(d, i))).unwrap();
        let cache = &mut held[r.instance];
        let hit = match cache.iter().position(|&x| x == d) {
            Some(at) => {
                cache.remove(at);
                true
            }
            None => false,
        };
        cache.push_front(d);
        cache.truncate(capacity);
        let report = if hit { HIT } else { MISS };
        // the response ends: the router learns, and the prefix counts as served there
        v.load().feedback().learn(
            r.rule,
            r.visit,
            report,
            now_ms() + i as u64 * ms_per_request,
            &p.tuning().feedback,
            v.instances()[r.instance].state().cache(),
        );
        v.load().served().insert(r.placed);
        for (at, (_, t)) in bounded_at.iter_mut().zip(routers) {
            if at.is_none() && variant_of(t).load().homes().capacity().is_some() {
                *at = Some(i);
            }
        }
        if shared == Share::Reused && (i + 1) % EVIDENCE_PERIOD == 0 {
            let own: Vec<_> = routers
                .iter()
                .map(|(_, t)| variant_of(t).load().homes().own_reused())
                .collect();
            for (j, (_, t)) in routers.iter().enumerate() {
                let others = own.iter().enumerate().filter(|&(o, _)| o != j);
                let union: Vec<u64> = others.flat_map(|(_, k)| k.iter().copied()).collect();
                variant_of(t).load().store_fleet_reused(&union);
            }
        }
        if matches!(shared, Share::Evidence | Share::Reused) && (i + 1) % EVIDENCE_PERIOD == 0 {
            for (j, (p, t)) in routers.iter().enumerate() {
                let others = |at: usize, _: &_| {
                    let others = reported.iter().enumerate().filter(|&(o, _)| o != j);
                    others
                        .filter_map(|(_, own)| own.get(at))
                        .fold((0, 0), |a, x| (a.0 + x.0, a.1 + x.1))
                };
                variant_of(t).take_fleet_evidence(others, &p.tuning().feedback);
            }
            for (own, (_, t)) in reported.iter_mut().zip(routers) {
                let instances = variant_of(t).instances().iter();
                *own = instances
                    .map(|x| x.state().cache().own_evidence())
                    .collect();
            }
        }
        if shared != Share::Nothing {
            let own: Vec<Option<u32>> = routers
                .iter()
                .map(|(_, t)| variant_of(t).load().homes().own_capacity())
                .collect();
            for (j, (_, t)) in routers.iter().enumerate() {
                let others = own.iter().enumerate().filter(|&(o, _)| o != j);
                let least = others.filter_map(|(_, &c)| c).min();
                variant_of(t).load().store_fleet_bound(least);
            }
        }
        if i >= skip {
            measured += 1;
            hits += usize::from(hit);
            used[d].insert(r.instance);
            requests[r.instance] += 1;
        }
    }
    Served {
        hit_rate: hits as f64 / measured as f64,
        used,
        requests,
        bounded_at,
    }
}

#[test]
fn documents_stay_on_few_instances_when_caches_hold_fewer_than_half_of_them() {
    // 8 popular documents, 4 instances whose caches hold 3 each: the fleet holds every
    // document once, not twice. Spreading hot documents or deepening their shared head puts
    // every document everywhere and the caches thrash; the engines' reports stop both.
    for (shape, body) in [
        ("system", system_document as fn(usize, usize) -> Vec<u8>),
        ("user", user_document),
    ] {
        for seed in [1, 2, 3] {
            let t = prefix_aware_table(4);
            let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
            let stream = zipf_stream(8, 4_000, seed);
            let served = serve(&p, &t, &stream, body, 3, 2_000);
            let spread = served.used.iter().map(|s| s.len()).max().unwrap();
            assert!(
                spread <= 2,
                "{shape} seed {seed}: a document on {spread} instances ({:?})",
                served.used
            );
            assert!(
                served.hit_rate >= 0.7,
                "{shape} seed {seed}: hit {}",
                served.hit_rate
            );
            // the reports stopped the copies: a gate closed, or the caches' bound is known
            let v = variant_of(&t);
            let feedback = v.load().feedback();
            assert!(
                feedback.variant().closings() >= 1 || v.load().homes().capacity().is_some(),
                "{shape} seed {seed}"
            );
            // RANDOM on the same stream and caches
            let r = build(RoutingStrategy::Random, &addrs(4), 64);
            let random = serve(&p, &r, &stream, body, 3, 2_000);
            assert!(
                served.hit_rate > random.hit_rate + 0.2,
                "{shape} seed {seed}: {} vs RANDOM {}",
                served.hit_rate,
                random.hit_rate
            );
        }
    }
}

#[test]
fn copies_that_hit_keep_their_rules() {
    // The same stream with caches that hold every document: replicas and deepened heads pay,
    // no gate closes, and the hot documents are served by several instances.
    for body in [
        system_document as fn(usize, usize) -> Vec<u8>,
        user_document,
    ] {
        let t = prefix_aware_table(4);
        let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
        let stream = zipf_stream(8, 4_000, 1);
        let served = serve(&p, &t, &stream, body, 8, 2_000);
        let v = variant_of(&t);
        assert_eq!(
            v.load()
                .feedback()
                .gates()
                .map(|(_, g)| g.closings())
                .sum::<u64>(),
            0
        );
        assert!(served.hit_rate >= 0.95, "{}", served.hit_rate);
        assert!(served.used[0].len() >= 3, "{:?}", served.used);
    }
}

#[test]
fn a_deepened_head_whose_first_turns_miss_is_no_longer_deepened() {
    let t = prefix_aware_table(4);
    let v = variant_of(&t);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let rules: Vec<Rule> = (0..200)
        .map(|q| p.route(&t, &req(&system_document(0, q))).unwrap().rule)
        .collect();
    assert!(rules[100..].contains(&Rule::DeepenedHead), "{rules:?}");
    misses_of(&p, v, Rule::DeepenedHead);
    assert!(v.load().feedback().variant().is_open(now_ms()));
    let head = prompt_key(
        BodyKind::OpenAi,
        &system_document(0, 0),
        1024,
        seed_for(None),
    )
    .hash;
    for q in 200..300 {
        let r = p.route(&t, &req(&system_document(0, q))).unwrap();
        assert_ne!(r.rule, Rule::DeepenedHead);
        assert_eq!(r.key, Some(head), "keyed by the shared head again");
    }
}

#[test]
fn hot_keys_whose_replicas_miss_keep_only_the_replicas_their_load_needs() {
    // Document 0 has 45% of the traffic of 4 instances (1.8 instances' worth), document 1 20%
    // (0.8), twenty others share the rest. Both are hot and spread; once the engines report
    // that the replicas' revisits miss, document 1 stays on its first instance and document 0
    // keeps two (one could not serve 1.8 instances' worth).
    let t = prefix_aware_table(4);
    let v = variant_of(&t);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let doc = |i: usize| match i % 20 {
        0..=8 => 0,
        9..=12 => 1,
        _ => 2 + (i * 7) % 20,
    };
    let mut used = vec![std::collections::BTreeSet::new(); 2];
    for q in 0..2_000 {
        let r = p.route(&t, &req(&user_document(doc(q), q))).unwrap();
        if q >= 1_000 && doc(q) < 2 {
            used[doc(q)].insert(r.instance);
        }
    }
    assert!(used[0].len() >= 3 && used[1].len() >= 3, "spread: {used:?}");
    // every revisit of a replica missed: the rule and the variant's copies close
    let f = &p.tuning().feedback;
    for i in 0..f.window as usize {
        let cache = v.instances()[i % 4].state().cache();
        v.load().feedback().learn(
            Rule::HotReplica,
            Visit::ReusedRevisit,
            MISS,
            now_ms(),
            f,
            cache,
        );
    }
    assert!(!v.load().feedback().variant().is_open(now_ms()));
    let mut used = vec![std::collections::BTreeSet::new(); 2];
    for q in 2_000..3_000 {
        let r = p.route(&t, &req(&user_document(doc(q), q))).unwrap();
        // (from the pass at the next half-window on: document 1 may then get a home)
        if q >= 2_100 && doc(q) < 2 {
            used[doc(q)].insert(r.instance);
        }
    }
    assert_eq!((used[0].len(), used[1].len()), (2, 1), "{used:?}");
}

#[test]
fn spills_stop_at_the_bounded_load_cap_while_spill_copies_miss() {
    let t = prefix_aware_table(8);
    let v = variant_of(&t);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None).with_hot_key_spread(0.0);
    let body = user_document(1, 0);
    let top = p.route(&t, &req(&body)).unwrap().instance;
    // 12 concurrent requests for one key: at the default cap (4 x mean, + 1) some spill
    let mut held = Vec::new();
    let mut spilled = 0;
    for _ in 0..12 {
        let r = p.route(&t, &req(&body)).unwrap();
        spilled += usize::from(r.instance != top);
        held.push(InFlight::start(v.instances()[r.instance].state(), v.load()));
    }
    assert!(spilled > 0);
    drop(held);
    misses_of(&p, v, Rule::Spill);
    // now only concurrency_threshold (64) bounds the top instance
    let mut held = Vec::new();
    for _ in 0..12 {
        let r = p.route(&t, &req(&body)).unwrap();
        assert_eq!(r.instance, top);
        held.push(InFlight::start(v.instances()[r.instance].state(), v.load()));
    }
}

#[test]
fn an_instance_given_more_documents_than_its_cache_holds_sheds_some_to_one_with_room() {
    // Eight equally popular documents on four instances whose caches hold three each, chosen so
    // that four of them rank instance 0 first: by hashing alone instance 0 cycles through four
    // documents and misses while the others have room. Its revisits miss, so it sheds some.
    let t = prefix_aware_table(4);
    let v = variant_of(&t);
    let top_of = |d: usize| {
        let key = prompt_key(BodyKind::OpenAi, &user_document(d, 0), 1024, seed_for(None)).hash;
        rendezvous_top(v.id_hashes(), key).0
    };
    let on_zero: Vec<usize> = (0..400).filter(|&d| top_of(d) == 0).take(4).collect();
    let elsewhere: Vec<usize> = (0..400).filter(|&d| top_of(d) != 0).take(4).collect();
    let docs: Vec<usize> = on_zero.iter().chain(&elsewhere).copied().collect();
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let stream: Vec<usize> = zipf_stream(8, 6_000, 1)
        .iter()
        .enumerate()
        .map(|(i, _)| (i * 5 + i / 8) % 8)
        .collect();
    // 20 requests a second: 6,000 take five minutes
    let served = serve_by(
        &[(&p, &t)],
        &stream,
        |d, q| user_document(docs[d], q),
        3,
        4_000,
        50,
    );
    let on_zero_now = served.used.iter().filter(|s| s.contains(&0)).count();
    assert!(
        on_zero_now <= 3,
        "instance 0 still serves {on_zero_now} documents: {:?}",
        served.used
    );
    assert!(served.hit_rate >= 0.8, "hit {}", served.hit_rate);
    // it was struck for its misses, and once it shed keys its revisits hit again
    let cache = v.instances()[0].state().cache();
    assert!(cache.gate().closings() >= 1 && cache.has_room());
}

/// A PREFIX_AWARE variant of `n` instances whose addresses (and so whose rendezvous ranking)
/// differ by `fleet`.
fn fleet_table(fleet: usize, n: usize) -> RoutingTable {
    let a: Vec<String> = (0..n)
        .map(|i| format!("http://10.0.{fleet}.{i}:8000"))
        .collect();
    prefix_aware_table_at(&a)
}

/// `n` fresh routers at the default tuning, each with its own table of fleet `fleet`'s 4
/// instances (pair them up for [`serve_by`]).
fn fresh_routers(n: usize, fleet: usize) -> (Vec<Placement>, Vec<RoutingTable>) {
    let placements = (0..n)
        .map(|_| Placement::new(1000, DEFAULT_BALANCE_PERCENT, None))
        .collect();
    (placements, (0..n).map(|_| fleet_table(fleet, 4)).collect())
}

/// Documents per instance (served there after the warm-up).
fn documents_per_instance(served: &Served, n: usize) -> Vec<usize> {
    let mut per = vec![0usize; n];
    for set in &served.used {
        for &i in set {
            per[i] += 1;
        }
    }
    per
}

/// 8 zipf-popular documents through one router to 4 instances whose caches hold `capacity`
/// documents, on 8 fleets (instance addresses) and both document shapes: each run's shape,
/// fleet, outcome from request `skip` on, and documents per instance.
fn few_documents_on_fleets(
    capacity: usize,
    requests: usize,
    skip: usize,
) -> impl Iterator<Item = (&'static str, usize, Served, Vec<usize>)> {
    [
        ("system", system_document as fn(usize, usize) -> Vec<u8>),
        ("user", user_document),
    ]
    .into_iter()
    .flat_map(move |(shape, body)| {
        (0..8).map(move |fleet| {
            let t = fleet_table(fleet, 4);
            let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
            let stream = zipf_stream(8, requests, 1);
            let served = serve(&p, &t, &stream, body, capacity, skip);
            let per = documents_per_instance(&served, 4);
            (shape, fleet, served, per)
        })
    })
}

#[test]
fn few_documents_get_homes_where_hashing_leaves_an_instance_idle() {
    // 8 popular documents on 4 instances whose caches hold 3 each, on 8 fleets (instance
    // addresses): rendezvous hashing alone leaves some instance with no document on 6 of the
    // 16 (fleet, shape) runs and one with 5 on 4 of them (hit 0.83-0.85 there). Homes by
    // occupancy give every instance documents and keep the hit at 0.9 or more on every fleet.
    for (shape, fleet, served, per) in few_documents_on_fleets(3, 4_000, 2_000) {
        assert!(
            per.iter().all(|&d| d >= 1),
            "{shape} fleet {fleet}: documents per instance {per:?}"
        );
        assert!(
            served.hit_rate >= 0.9,
            "{shape} fleet {fleet}: hit {} ({per:?})",
            served.hit_rate
        );
    }
}

#[test]
fn routers_that_each_see_part_of_the_traffic_agree_on_homes() {
    // Four routers, each placing every fourth request of the same stream, in front of the same
    // small caches (2 documents each: room for each of the 8 once, so every disagreement is an
    // eviction): they reach the hit of one router, and each learns the same bound from the
    // engines' reports and keeps the same homes.
    for fleet in [2, 5, 6] {
        let (placements, tables) = fresh_routers(4, fleet);
        let routers: Vec<(&Placement, &RoutingTable)> = placements.iter().zip(&tables).collect();
        let stream = zipf_stream(8, 8_000, 1);
        let served = serve_by(&routers, &stream, user_document, 2, 4_000, 0);
        assert!(
            served.hit_rate >= 0.9,
            "fleet {fleet}: hit {}",
            served.hit_rate
        );
        // a document on two instances is a copy: only the hottest (1.2 instances' worth) has one
        let copies = served.used.iter().filter(|s| s.len() > 1).count();
        assert!(copies <= 1, "fleet {fleet}: {:?}", served.used);
        let homes: Vec<Vec<(u64, u64)>> = tables
            .iter()
            .map(|t| {
                let mut h: Vec<(u64, u64)> = variant_of(t)
                    .load()
                    .homes()
                    .assignment()
                    .iter()
                    .map(|h| (h.key, h.id_hash))
                    .collect();
                h.sort();
                h
            })
            .collect();
        assert!(
            !homes[0].is_empty(),
            "fleet {fleet}: hashing alone was uneven here"
        );
        for h in &homes[1..] {
            assert_eq!(h, &homes[0], "fleet {fleet}");
        }
    }
}

#[test]
fn no_instance_gets_more_documents_than_the_engines_show_its_cache_holds() {
    // 8 popular documents on 4 instances whose caches hold 2 each: room for each document once
    // and no copy. Counting keys alone leaves an instance with 3 on some fleets (on 4 real
    // llama-servers: 3/1/3/2, and the two with 3 thrashed); once an instance's revisits miss
    // while it holds 3, the passes give none more than 2, and the hottest document no copy.
    for (shape, fleet, served, per) in few_documents_on_fleets(2, 8_000, 6_000) {
        assert!(
            per.iter().all(|&d| d <= 2),
            "{shape} fleet {fleet}: documents per instance {per:?}"
        );
        assert!(
            served.hit_rate >= 0.95,
            "{shape} fleet {fleet}: hit {} ({per:?})",
            served.hit_rate
        );
    }
}

#[test]
fn cold_documents_evicted_by_age_teach_no_bound() {
    // The long-context bench's shape: 80 documents of Zipf 0.8 on 7 instances whose caches hold
    // 15 each (the fleet holds every document once, and the hot ones again). The rarest
    // documents, placed by plain hashing, are evicted by age between their requests: their
    // revisits miss while every reused key's revisits hit. That is no sign that the caches hold
    // fewer reused keys than the passes give them (on engine-sim such misses bounded every
    // instance to an even spread, the hot documents lost their replicas, and one instance took
    // 2.5 points more than 1/7; here, on seed 1, a bound of 9). Only the revisits of keys the
    // passes count are evidence of what they hold. Nor do the first copies' evictions: while no
    // engine has shown room, a pass's copies give an instance at most one key more than an even
    // spread (by share at once, seeds 4, 6, 7, 10 and 12 learnt a bound of 9-10 from them), and
    // an overflow at an even spread or less bounds only once the set of reused keys has settled
    // and its revisits miss clearly (more than 1.5 times the limit).
    let mut bounded = Vec::new();
    for seed in 1..=12 {
        let t = build(RoutingStrategy::PrefixAware, &addrs(7), 64);
        let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
        let stream = zipf_stream(80, 24_000, seed);
        let served = serve(&p, &t, &stream, user_document, 15, 4_000);
        let v = variant_of(&t);
        let spread = served.used[0].len();
        if v.load().homes().capacity().is_some() || spread < 4 {
            bounded.push((seed, v.load().homes().capacity(), spread));
        }
        assert!(
            served.hit_rate >= 0.9,
            "seed {seed}: hit {}",
            served.hit_rate
        );
    }
    // (seed 6: an instance given 11 keys, copies included, missed 3 of 8 revisits, a bound)
    assert!(
        bounded.len() <= 1,
        "bound learnt, hottest spread: {bounded:?}"
    );
}

/// The first instance of `v` held `k` of the reused keys by the last pass (the others
/// `others`), and 8 revisits of reused keys there got `misses` misses.
fn revisits_on_the_first_instance(v: &Variant, k: u32, others: u32, misses: usize) {
    let t = Tuning::default();
    let held: Vec<(u64, u32)> = v
        .id_hashes()
        .iter()
        .enumerate()
        .map(|(i, &h)| (h, if i == 0 { k } else { others }))
        .collect();
    v.load().homes().store_held(held);
    let cache = v.instances()[0].state().cache();
    for j in 0..8 {
        let report = if j < misses { MISS } else { HIT };
        v.load().feedback().learn(
            Rule::PrefixHash,
            Visit::ReusedRevisit,
            report,
            now_ms(),
            &t.feedback,
            cache,
        );
    }
}

#[test]
fn the_fleets_bound_is_taken_unless_the_routers_own_revisits_showed_room_above_it() {
    // Another router learnt that the caches hold 2 of the reused keys. A router with no bound
    // of its own takes it at its next pass (an instance holding 3 whose revisits missed 1 in 8,
    // too few for a bound of its own, says nothing against it), unless an instance of its own
    // held more and hit: 3 keys with no miss in 8 is room above 2. It does not report a bound it
    // took.
    let t = Tuning::default();
    for (k, misses, taken) in [(3u32, 1, true), (3, 0, false), (2, 0, true)] {
        let table = prefix_aware_table(4);
        let v = variant_of(&table);
        revisits_on_the_first_instance(v, k, 2, misses);
        v.load().store_fleet_bound(Some(2));
        let (cap, _) = homes::learn_capacity(v, 8, &t);
        assert_eq!(cap.is_some(), taken, "{k} keys, {misses} misses: {cap:?}");
        assert_eq!(v.load().homes().own_capacity(), None);
    }
    // a bound learnt from its own revisits is its own, reported
    let table = prefix_aware_table(4);
    let v = variant_of(&table);
    revisits_on_the_first_instance(v, 7, 1, 6);
    assert_eq!(homes::learn_capacity(v, 8, &t).0, Some(2));
    assert_eq!(v.load().homes().own_capacity(), Some(2));
}

#[test]
fn a_router_whose_bound_is_above_the_fleets_takes_the_fleets() {
    // This router learnt a bound of 4 (copies that missed), another router saw an instance
    // overflow at 3 keys and learnt 2. The fleet's is taken, even where an instance of this
    // router's held 3 and hit all 8 revisits (room on one cache is no answer to an overflow on
    // another): the routers then place alike. A fleet's bound above this router's own is not.
    let t = Tuning::default();
    for (own, fleet, expected) in [(4u32, 2u32, 2u32), (2, 3, 2)] {
        let table = prefix_aware_table(4);
        let v = variant_of(&table);
        let homes = v.load().homes();
        homes.store_capacity(Some(own), 0);
        revisits_on_the_first_instance(v, 3, 2, 0);
        homes.store_fleet_bound(Some(fleet));
        let (cap, _) = homes::learn_capacity(v, 8, &t);
        assert_eq!(cap, Some(expected), "own {own}, the fleet's {fleet}");
        // a bound taken is not reported back; one's own still is
        let reported = (expected == own).then_some(own);
        assert_eq!(
            homes.own_capacity(),
            reported,
            "own {own}, the fleet's {fleet}"
        );
    }
}

#[test]
fn an_overflow_bounds_an_instance_to_about_what_its_revisits_show_it_holds() {
    // An instance given k of the reused keys whose revisits miss a share m of the time holds
    // about k * (1 - m): 14 keys missing a quarter of their revisits are about 10 (an even
    // spread of 62 keys over 7 would be 9, and took the hot keys' replicas away on engine-sim's
    // long-context fleet); 7 keys missing 70% are 2, and never fewer than an even spread.
    let t = Tuning::default();
    for (k, misses, reused, expected) in [(14u32, 2, 62, 10), (7, 6, 8, 2), (7, 8, 20, 3)] {
        let table = prefix_aware_table(7);
        let v = variant_of(&table);
        revisits_on_the_first_instance(v, k, 1, misses);
        assert_eq!(
            homes::learn_capacity(v, reused, &t).0,
            Some(expected),
            "{k} keys, {misses} of 8 revisits missed, {reused} reused"
        );
    }
}

#[test]
fn the_homes_pass_is_overdue_once_its_time_and_its_requests_have_passed() {
    let t = Tuning::default();
    let (ms, n) = (t.home_interval_ms, t.home_interval_requests);
    let h = crate::load::Homes::default();
    assert!(
        !h.pass_overdue(10_000, 10 * ms, ms, n),
        "no pass yet: none overdue"
    );
    h.mark_pass(100, 1_000);
    assert!(!h.pass_overdue(100 + n, 1_000 + ms - 1, ms, n), "too soon");
    assert!(
        !h.pass_overdue(100 + n - 1, 1_000 + 10 * ms, ms, n),
        "too few requests"
    );
    assert!(h.pass_overdue(100 + n, 1_000 + ms, ms, n));
    assert!(
        !h.pass_overdue(100 + n, 1_000 + ms, ms, n),
        "one caller runs it"
    );
}

#[test]
fn an_overflow_at_an_even_spread_bounds_the_caches_to_it() {
    // Routers that disagree put more on an engine than any one of them counted there: an
    // instance this router gave an even spread of the reused keys (2 of 8 on 4) or fewer, whose
    // revisits miss, shows that the caches have no room for copies, whoever filled it. The
    // bound is the even spread (no fewer: the keys must go somewhere). Before, such an overflow
    // taught nothing, and the router went on spreading hot keys by share over caches that held
    // 2 documents (on 4 llama-servers, one router for 20-40 s, 5-7 documents per instance).
    let t = Tuning::default();
    for k in [0u32, 1, 2] {
        let table = prefix_aware_table(4);
        let v = variant_of(&table);
        v.load().homes().store_reused((1..=8).collect());
        revisits_on_the_first_instance(v, k, 2, 3);
        assert_eq!(homes::learn_capacity(v, 8, &t).0, Some(2), "{k} keys held");
        assert_eq!(v.load().homes().capacity(), Some(2), "{k} keys held");
    }
    // revisits that hit at an even spread teach no bound
    let table = prefix_aware_table(4);
    let v = variant_of(&table);
    revisits_on_the_first_instance(v, 2, 2, 0);
    assert_eq!(homes::learn_capacity(v, 8, &t).0, None);
    // nor do misses while the set of reused keys grows (the last pass counted 4 of the 8): what
    // an instance held of a few keys says nothing of an even spread of many
    let table = prefix_aware_table(4);
    let v = variant_of(&table);
    v.load().homes().store_reused((1..=4).collect());
    revisits_on_the_first_instance(v, 1, 1, 3);
    assert_eq!(homes::learn_capacity(v, 8, &t).0, None);
}

#[test]
fn a_bound_whose_instances_miss_at_it_falls() {
    // A bound of 3 learnt from one overflow, on caches that hold 2 of 8 documents: the
    // instance the pass fills to 3 misses 1 of 8 revisits (12.5%, under the miss limit that
    // first taught the bound, but more than room allows) or 2 (25%). The bound falls to the 2
    // its revisits show; on llama-servers, at 12-15% misses, it stayed at 3 for the whole run
    // (hit 90% against 94.1%).
    let t = Tuning::default();
    for misses in [1usize, 2] {
        let table = prefix_aware_table(4);
        let v = variant_of(&table);
        v.load().homes().store_reused((1..=8).collect());
        v.load().homes().store_capacity(Some(3), 0);
        revisits_on_the_first_instance(v, 3, 2, misses);
        assert_eq!(
            homes::learn_capacity(v, 8, &t).0,
            Some(2),
            "{misses} misses of 8"
        );
    }
    // revisits that hit at the bound keep it
    let table = prefix_aware_table(4);
    let v = variant_of(&table);
    v.load().homes().store_reused((1..=8).collect());
    v.load().homes().store_capacity(Some(3), 0);
    revisits_on_the_first_instance(v, 3, 2, 0);
    assert_eq!(homes::learn_capacity(v, 8, &t).0, Some(3));
    // and with no bound yet, misses under the limit teach none (marginal misses on caches with
    // room, e.g. rare documents evicted by age, are no bound)
    let table = prefix_aware_table(4);
    let v = variant_of(&table);
    v.load().homes().store_reused((1..=8).collect());
    revisits_on_the_first_instance(v, 3, 2, 1);
    assert_eq!(homes::learn_capacity(v, 8, &t).0, None);
}

#[test]
fn the_room_left_once_every_document_has_a_place_spreads_the_hottest() {
    // 8 zipf-popular documents (the hottest 37% of the requests) on 4 instances whose caches
    // hold 5 each: room for every document once and 12 copies. Once the engines' reports have
    // bounded the instances, the copies go to the hottest documents while the room lasts. Copies
    // all-or-nothing (none once all hot documents' copies would not fit) left the instance
    // with the hottest document at 0.38 of the requests (median of the 16 runs) and at up to
    // 0.58; with them, 0.32 and at most 0.45.
    let mut max_shares = Vec::new();
    for (shape, fleet, served, per) in few_documents_on_fleets(5, 8_000, 6_000) {
        let total: usize = served.requests.iter().sum();
        let most = *served.requests.iter().max().unwrap() as f64 / total as f64;
        assert!(
            served.hit_rate >= 0.95,
            "{shape} fleet {fleet}: hit {} ({per:?})",
            served.hit_rate
        );
        assert!(
            most <= 0.5,
            "{shape} fleet {fleet}: an instance took {most:.3} of the requests ({:?}, {per:?})",
            served.requests
        );
        max_shares.push(most);
    }
    max_shares.sort_by(f64::total_cmp);
    let median = (max_shares[7] + max_shares[8]) / 2.0;
    assert!(
        median <= 0.34,
        "busiest instance's share, median {median:.3}: {max_shares:?}"
    );
}

#[test]
fn fresh_routers_give_hot_documents_only_the_places_their_load_needs_until_the_engines_report() {
    // Four fresh routers, each placing every fourth request, in front of caches that hold 2 of
    // the 8 documents. A router's first pass (at its 64th request) has no report from the
    // engines yet; spreading the hot documents by their shares then (the hottest on all 4
    // instances, 6-7 documents each where 2 fit, as 4 routers did on real llama-servers)
    // thrashes every cache until each router has seen its own evidence of it. The first pass
    // gives a hot document only the places its load needs, and the overflow that still causes
    // is a bound by the next: from the first passes on the caches hit (requests 300-3,000 of
    // this stream: 0.920-0.936 with system-message documents when copies came by share at
    // once, 0.952-0.989 so).
    for fleet in [2, 5, 6] {
        for (shape, body) in [
            ("system", system_document as fn(usize, usize) -> Vec<u8>),
            ("user", user_document),
        ] {
            let (placements, tables) = fresh_routers(4, fleet);
            let routers: Vec<(&Placement, &RoutingTable)> =
                placements.iter().zip(&tables).collect();
            let stream = zipf_stream(8, 3_000, 1);
            let served = serve_by(&routers, &stream, body, 2, 300, 0);
            assert!(
                served.hit_rate >= 0.945,
                "{shape} fleet {fleet}: hit {} ({:?})",
                served.hit_rate,
                served.used
            );
        }
    }
}

#[test]
fn under_a_bound_only_the_keys_a_pass_gave_room_are_spread() {
    // A key this router estimates hot is spread over its replicas; once the engines have shown
    // that a cache holds only so many keys, it is spread only if the last pass gave its copies
    // room: another router whose estimate of it differs keeps it in its one place, and a copy
    // would evict a key that router placed.
    let t = prefix_aware_table(4);
    let v = variant_of(&t);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let body = |q: usize| user_document(q % 4, q);
    let mut key = 0;
    for q in 0..400 {
        key = p.route(&t, &req(&body(q * 4))).unwrap().key.unwrap();
        p.route(&t, &req(&body(q * 4 + 1))).unwrap();
    }
    let instances_of_hot = |p: &Placement| {
        let mut seen = std::collections::BTreeSet::new();
        for q in 0..64 {
            seen.insert(p.route(&t, &req(&body(4_000 + q * 4))).unwrap().instance);
        }
        seen
    };
    assert!(instances_of_hot(&p).len() > 1, "hot and spread");
    let homes = v.load().homes();
    homes.store(Vec::new());
    homes.store_capacity(Some(2), 0);
    homes.store_copied(Vec::new());
    assert_eq!(
        instances_of_hot(&p).len(),
        1,
        "under a bound, no room given"
    );
    homes.store_copied(vec![key]);
    assert!(instances_of_hot(&p).len() > 1, "room given");
}

#[test]
fn the_learnt_cache_bound_is_in_the_metrics_once_known() {
    let t = prefix_aware_table(4);
    let metrics = crate::metrics::Metrics::default();
    let line = "prefix_router_cache_bound_keys{endpoint=\"e\",variant=\"v1\"}";
    assert!(!metrics.render(Some(&t), 0).contains(line), "no bound yet");
    variant_of(&t).load().homes().store_capacity(Some(3), 0);
    let out = metrics.render(Some(&t), 0);
    assert!(out.contains(&format!("{line} 3\n")), "{out}");
    // and the fleet's, once the control plane passed one on
    let fleet = "prefix_router_fleet_cache_bound_keys{endpoint=\"e\",variant=\"v1\"}";
    assert!(!out.contains(fleet), "{out}");
    variant_of(&t).load().store_fleet_bound(Some(2));
    let out = metrics.render(Some(&t), 0);
    assert!(out.contains(&format!("{fleet} 2\n")), "{out}");
}

#[test]
fn copies_probe_for_room_until_an_instance_holding_more_than_an_even_spread_hits() {
    // No bound known and the engines report: a pass's copies may give an instance one key more
    // than an even spread (8 keys on 4: 3), not what the keys' shares ask for, until an instance
    // that held more than the even spread shows that its revisits hit; then copies go by share.
    let t = Tuning::default();
    let table = prefix_aware_table(4);
    let v = variant_of(&table);
    let homes = v.load().homes();
    assert_eq!(
        homes::learn_capacity(v, 8, &t),
        (None, None),
        "no report yet: no probe"
    );
    homes.store_reused((1..=8).collect());
    revisits_on_the_first_instance(v, 2, 2, 0);
    assert_eq!(homes::learn_capacity(v, 8, &t), (None, Some(3)));
    assert!(homes.probing() && homes.copies_by_pass());
    // an instance that held 3 and missed 1 of 8 revisits (over half the limit): no verdict yet
    revisits_on_the_first_instance(v, 3, 2, 1);
    assert_eq!(homes::learn_capacity(v, 8, &t), (None, Some(3)));
    // then none of 8: room
    revisits_on_the_first_instance(v, 3, 2, 0);
    assert_eq!(homes::learn_capacity(v, 8, &t), (None, None));
    assert!(!homes.probing() && !homes.copies_by_pass());
}

#[test]
fn under_a_bound_the_keys_a_pass_counted_stay_where_it_counted_them() {
    // Re-weighing moves keys among their first choices to even out request shares. Under a
    // bound the caches are full: a key the last pass counted on its top choice that weights
    // move evicts a key the pass placed there. Keys the pass did not count are still weighed.
    let t = prefix_aware_table(4);
    let v = variant_of(&t);
    let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
    let route = |d: usize| p.route(&t, &req(&user_document(d, 0))).unwrap();
    let tops: Vec<(u64, usize)> = (0..32)
        .map(|d| {
            let key = route(d).key.unwrap();
            (key, rendezvous_top(v.id_hashes(), key).0)
        })
        .collect();
    // every key's top choice weighs least: weights move keys off it
    let weigh = |heavy: usize| {
        for (i, inst) in v.instances().iter().enumerate() {
            inst.state().set_weight(if i == heavy { 0.25 } else { 4.0 });
        }
        v.load().set_weighted();
    };
    let moved: Vec<(usize, u64)> = tops
        .iter()
        .enumerate()
        .filter(|&(d, &(_, top))| {
            weigh(top);
            let r = route(d);
            r.instance != top && r.rule == Rule::Reweighed
        })
        .map(|(d, &(key, _))| (d, key))
        .collect();
    assert!(
        moved.len() >= 4,
        "weights move keys off their top choice: {moved:?}"
    );
    let homes = v.load().homes();
    let counted: Vec<u64> = {
        let mut k: Vec<u64> = moved.iter().map(|&(_, k)| k).take(2).collect();
        k.sort_unstable();
        k
    };
    homes.store_reused(counted.clone());
    homes.store_capacity(Some(2), 0);
    for &(d, key) in &moved {
        let top = tops[d].1;
        weigh(top);
        let r = route(d);
        match counted.contains(&key) {
            true => assert_eq!(
                (r.instance, r.rule),
                (top, Rule::PrefixHash),
                "counted key {d}"
            ),
            false => assert_ne!(
                r.instance, top,
                "a key the pass did not count is still weighed"
            ),
        }
    }
    // with no bound known, a counted key is weighed like any other
    homes.store_capacity(None, 0);
    let (d, _) = moved[0];
    weigh(tops[d].1);
    assert_ne!(route(d).instance, tops[d].1);
}

#[test]
fn three_instances_whose_caches_hold_two_of_six_documents_settle_within_300_requests() {
    // The shape of the real-engine test (`integration-tests/tests/real_engines.rs`, small
    // caches): six documents as system messages over three instances whose caches hold two.
    // After 300 requests every document is on at most two instances and the revisits hit, or
    // the engines' reports closed the copies. (After 150, 3 seeds of 40 failed, hit
    // 0.81-0.91, two of them with a document on all three instances: the probe for room, then
    // the bound, take their passes; the bound came at request 78-186.)
    for seed in 0..40u64 {
        let t = prefix_aware_table(3);
        let p = Placement::new(1000, DEFAULT_BALANCE_PERCENT, None);
        let stream = zipf_stream(6, 450, seed);
        let body = |d: usize, q: usize| system_document(d + 10 * seed as usize, q);
        let served = serve(&p, &t, &stream, body, 2, 300);
        let closed = variant_of(&t).load().feedback().variant().closings() > 0;
        assert!(
            served.used.iter().all(|s| s.len() <= 2),
            "seed {seed}: {:?}",
            served.used
        );
        assert!(
            closed || served.hit_rate >= 0.95,
            "seed {seed}: hit {}",
            served.hit_rate
        );
    }
}

#[test]
fn four_routers_that_share_their_learnt_bounds_agree_as_soon_as_one_has_learnt() {
    // Four routers, each placing every fourth request, before caches that hold 2 of 8
    // documents, on 8 fleets and both shapes. Each learns the caches' bound from its own quarter
    // of the revisits: alone, the last of them learnt it 60-390 requests after the first (or not
    // by request 800), and placed apart until then. With the bounds passed on as the control
    // plane does, the others take the first router's bound at once (one waited 89 requests:
    // its own revisits had shown room above it), and requests 400-800 hit 0.947 on the average
    // of the 16 runs, 0.873 at worst, against 0.888 and 0.785 alone.
    let mut hits = Vec::new();
    for fleet in 0..8 {
        for (shape, body) in [
            ("system", system_document as fn(usize, usize) -> Vec<u8>),
            ("user", user_document),
        ] {
            let (placements, tables) = fresh_routers(4, fleet);
            let routers: Vec<(&Placement, &RoutingTable)> =
                placements.iter().zip(&tables).collect();
            let stream = zipf_stream(8, 800, fleet as u64);
            let served = serve_through(&routers, &stream, body, 2, 400, 0, Share::Bounds);
            let at: Vec<usize> = served.bounded_at.iter().map(|a| a.unwrap_or(800)).collect();
            let (first, last) = (at.iter().min().unwrap(), at.iter().max().unwrap());
            assert!(
                last - first <= 100,
                "fleet {fleet} {shape}: bounds learnt at {:?}",
                served.bounded_at
            );
            assert!(
                served.hit_rate >= 0.85,
                "fleet {fleet} {shape}: hit {}",
                served.hit_rate
            );
            hits.push(served.hit_rate);
        }
    }
    let mean = hits.iter().sum::<f64>() / hits.len() as f64;
    assert!(mean >= 0.93, "mean hit {mean}: {hits:?}");
}

#[test]
fn four_routers_that_share_their_reused_keys_place_each_document_alike() {
    // The long-context bench's shape (80 documents of Zipf 0.8 on 7 instances whose caches hold
    // 17 each) through 4 routers, each placing every fourth request. Each router's pass gives
    // homes to the documents over its bar, and the bar falls among a dozen documents of nearly
    // equal share: one router's set differs from another's by a few documents, and every key
    // counted after them in hash order may then take another instance. And each kept the homes
    // its first passes drew among a few keys. Measured: at the end, the documents that no
    // router copies and that the 4 routers send to different instances (each an eviction
    // somewhere), over seeds 1-6: 73 without the keys shared (mean hit 0.9922), 37 with them
    // and homes kept only from a settled pass (0.9978); with the keys shared but every home
    // kept, 80 (0.9946).
    let (mut apart, mut hits) = ([0usize; 2], [0.0f64; 2]);
    for seed in 1..=6 {
        for (at, share) in [Share::Evidence, Share::Reused].into_iter().enumerate() {
            let placements: Vec<Placement> = (0..4)
                .map(|_| Placement::new(1000, DEFAULT_BALANCE_PERCENT, None))
                .collect();
            let tables: Vec<RoutingTable> = (0..4)
                .map(|_| build(RoutingStrategy::PrefixAware, &addrs(7), 64))
                .collect();
            let routers: Vec<(&Placement, &RoutingTable)> =
                placements.iter().zip(&tables).collect();
            let stream = zipf_stream(80, 24_000, seed);
            let served = serve_through(&routers, &stream, user_document, 17, 8_000, 0, share);
            let copied = |d: usize| {
                let body = user_document(d, 0);
                let key = prompt_key(BodyKind::OpenAi, &body, 1024, seed_for(None)).hash;
                tables
                    .iter()
                    .any(|t| variant_of(t).load().homes().is_copied(key))
            };
            // where each router sends each document at the end (a copied one: to any replica)
            let n = (0..80)
                .filter(|&d| {
                    let body = user_document(d, 1_000_000);
                    let mut to = routers
                        .iter()
                        .map(|(p, t)| p.route(t, &req(&body)).unwrap());
                    let first = to.next().unwrap().instance;
                    !copied(d) && to.any(|r| r.instance != first)
                })
                .count();
            apart[at] += n;
            hits[at] += served.hit_rate / 6.0;
        }
    }
    assert!(
        apart[1] * 3 <= apart[0] * 2,
        "documents placed apart: {} with reused keys shared, {} without",
        apart[1],
        apart[0]
    );
    assert!(
        hits[1] >= hits[0] + 0.002,
        "mean hit {} with reused keys shared, {} without",
        hits[1],
        hits[0]
    );
}

#[test]
fn four_routers_that_share_their_revisits_judge_each_cache_on_the_whole_fleets() {
    // As above, but each router also takes the others' revisits and misses per instance (once a
    // period, as the control plane passes them on). Alone, each of 4 routers sees a quarter of
    // the revisits, so one router learns the bound and the others take it, in 16 runs 1-4 of
    // the 4 (3 or 4 in 6 runs); with the revisits shared each judges on the fleet's, and 3 or 4
    // learnt it themselves in 14 runs. The first bound came at request 362 on average against
    // 383 (every router's first pass is at its own 64th request, request 256 here, and no
    // revisit counts before a pass: that is most of the wait). Requests 200-800 hit 0.882
    // against 0.887: level, within these runs' noise.
    let (mut hits, mut first_learnt, mut learnt_by_most) = (Vec::new(), Vec::new(), [0, 0]);
    for fleet in 0..8 {
        for body in [
            system_document as fn(usize, usize) -> Vec<u8>,
            user_document,
        ] {
            let mut outcome = Vec::new();
            for (at, share) in [Share::Bounds, Share::Evidence].into_iter().enumerate() {
                let (placements, tables) = fresh_routers(4, fleet);
                let routers: Vec<(&Placement, &RoutingTable)> =
                    placements.iter().zip(&tables).collect();
                let stream = zipf_stream(8, 800, fleet as u64);
                let served = serve_through(&routers, &stream, body, 2, 200, 0, share);
                let first = served.bounded_at.iter().map(|a| a.unwrap_or(800)).min();
                let own = tables
                    .iter()
                    .filter(|t| variant_of(t).load().homes().own_capacity().is_some())
                    .count();
                learnt_by_most[at] += usize::from(own >= 3);
                outcome.push((served.hit_rate, first.unwrap() as f64));
            }
            hits.push((outcome[0].0, outcome[1].0));
            first_learnt.push((outcome[0].1, outcome[1].1));
        }
    }
    let mean = |x: &mut dyn Iterator<Item = f64>| {
        let all: Vec<f64> = x.collect();
        all.iter().sum::<f64>() / all.len() as f64
    };
    let (alone, shared) = (
        mean(&mut hits.iter().map(|h| h.0)),
        mean(&mut hits.iter().map(|h| h.1)),
    );
    let (learnt_alone, learnt_shared) = (
        mean(&mut first_learnt.iter().map(|h| h.0)),
        mean(&mut first_learnt.iter().map(|h| h.1)),
    );
    assert!(
        learnt_by_most[1] >= 12 && learnt_by_most[0] <= 8,
        "runs where 3 or 4 routers learnt the bound themselves: {learnt_by_most:?} (alone, shared)"
    );
    assert!(
        learnt_shared + 10.0 <= learnt_alone,
        "first bound at request {learnt_shared} on average with revisits shared, \
         {learnt_alone} without: {first_learnt:?}"
    );
    assert!(
        shared >= alone - 0.01,
        "mean hit {shared} with revisits shared, {alone} without: {hits:?}"
    );
}
