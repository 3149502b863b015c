//! The router's KV-event subscribers: one per instance of every PREFIX_AWARE variant whose
//! routing config names `kv_events`, each feeding the variant's exact index
//! ([`crate::kv_index`]) off the request path.
//!
//! One task follows the routing table: when a table is applied it starts a subscriber for every
//! instance that has none, restarts one whose address or settings changed, and stops those whose
//! instance left (a stop resets the instance in the index, then its slot is freed). Subscribers
//! start warm: they replay the engine's buffer from its start, so a router started into a warm
//! fleet learns what the engines hold before the live stream goes on. A restart waits for the
//! old subscriber's end, so its final reset never lands after the new one's first events.

use std::collections::HashMap;
use std::sync::Arc;

use kv_events::{Sink, Subscriber, SubscriberConfig};

use crate::kv_index::KvIndex;
use crate::load::VariantLoad;
use crate::proxy::Router;
use crate::table::{KvEvents, RoutingTable};

/// (endpoint, variant, instance id).
type Key = (Arc<str>, Arc<str>, Arc<str>);

struct Running {
    settings: Arc<KvEvents>,
    address: Arc<str>,
    index: Arc<KvIndex>,
    id_hash: u64,
    subscriber: Subscriber,
}

/// The running subscribers (see the module doc).
#[derive(Default)]
pub(crate) struct Subscribers {
    running: HashMap<Key, Running>,
}

impl Subscribers {
    /// Makes the running subscribers those `table` asks for.
    pub(crate) async fn sync(&mut self, table: &RoutingTable) {
        let mut wanted = Vec::new();
        for e in table.endpoints() {
            for v in e.variants() {
                let Some(settings) = v.kv_events() else {
                    continue;
                };
                let index = v.load().kv();
                for inst in v.instances() {
                    let key: Key = (e.name().into(), v.name().into(), inst.id().into());
                    let current = self.running.get(&key).is_some_and(|r| {
                        Arc::ptr_eq(&r.settings, settings)
                            && *r.address == *inst.address()
                            && Arc::ptr_eq(&r.index, index)
                    });
                    if !current {
                        if let Some(old) = self.running.remove(&key) {
                            old.stop().await;
                        }
                        if let Some(r) = start(settings, inst.address(), v.load(), inst.id_hash()) {
                            self.running.insert(key.clone(), r);
                        }
                    }
                    wanted.push(key);
                }
            }
        }
        let gone: Vec<Key> = self
            .running
            .keys()
            .filter(|k| !wanted.contains(k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(old) = self.running.remove(&key) {
                old.stop().await;
            }
        }
    }
}

impl Running {
    async fn stop(self) {
        self.subscriber.stop().await;
        self.index.remove(self.id_hash);
    }
}

/// What a subscriber feeds: the variant's exact index of one instance; a reset (an engine
/// restart, a gap no replay filled) also makes the inferred index forget the instance, whose
/// cache is then unknown either way.
struct InstanceSink {
    load: Arc<VariantLoad>,
    id: u64,
}

impl Sink for InstanceSink {
    fn apply(&self, _instance: &str, event: &kv_events::Event) {
        self.load.kv().apply(self.id, event);
    }
    fn reset(&self, _instance: &str) {
        self.load.kv().reset(self.id);
        if let Some(inferred) = self.load.index_if_any() {
            inferred.forget(self.id);
        }
    }
}

fn start(
    settings: &Arc<KvEvents>,
    address: &str,
    load: &Arc<VariantLoad>,
    id_hash: u64,
) -> Option<Running> {
    let index = load.kv();
    let s = &settings.settings;
    let config = SubscriberConfig::for_instance(
        address,
        &s.endpoint,
        s.replay_endpoint.as_deref(),
        &s.topic,
    );
    let mut config = match config {
        Ok(c) => c,
        Err(e) => {
            // the table checked the templates; an address they cannot fill stays inferred
            tracing::warn!("{e}; the instance's prefix index stays inferred");
            return None;
        }
    };
    config.warm_start = config.replay_endpoint.is_some();
    index.attach_slot(id_hash);
    let sink = Arc::new(InstanceSink {
        load: load.clone(),
        id: id_hash,
    });
    match Subscriber::spawn(address, config, sink) {
        Ok(subscriber) => {
            index.attach(id_hash, subscriber.counters().clone());
            Some(Running {
                settings: settings.clone(),
                address: address.into(),
                index: index.clone(),
                id_hash,
                subscriber,
            })
        }
        Err(e) => {
            tracing::warn!("{e}; the instance's prefix index stays inferred");
            None
        }
    }
}

/// Follows `router`'s table; aborting the task drops the subscribers, which ends theirs.
pub(crate) async fn run(router: Arc<Router>) {
    let mut subscribers = Subscribers::default();
    loop {
        let applied = router.table_applied.notified();
        let mut applied = std::pin::pin!(applied);
        // registered before the table is read: a table stored meanwhile still wakes the loop
        applied.as_mut().enable();
        if let Some(table) = router.table.load_full() {
            subscribers.sync(&table).await;
        }
        applied.await;
    }
}

/// The subscribers' and exact indexes' metrics: events by type, the blocks each exact instance
/// holds, gaps, replays, resets, undecodable messages and refused stores, per instance.
pub(crate) fn render_metrics(
    out: &mut telemetry::exposition::Exposition,
    table: Option<&RoutingTable>,
) {
    // (endpoint, variant, instance address, exact, blocks, counters) of every subscribed instance
    let mut rows = Vec::new();
    let mut refused = Vec::new();
    for e in table.into_iter().flat_map(|t| t.endpoints()) {
        for v in e.variants() {
            let Some(index) = v.load().kv_if_any().filter(|_| v.kv_events().is_some()) else {
                continue;
            };
            let known = index.instances();
            for inst in v.instances() {
                if let Some((_, live, blocks, Some(counters))) =
                    known.iter().find(|(id, ..)| *id == inst.id_hash())
                {
                    rows.push((
                        e.name(),
                        v.name(),
                        inst.address(),
                        *live,
                        *blocks,
                        counters.snapshot(),
                    ));
                }
            }
            refused.push((e.name(), v.name(), index.clone()));
        }
    }
    let mut events = out.counter(
        "prefix_router_kv_events_total",
        "KV-cache events applied from an instance's engine, by type (BlockStored, BlockRemoved, \
         AllBlocksCleared, unknown).",
    );
    for (endpoint, variant, instance, _, _, c) in &rows {
        for (kind, n) in [
            ("BlockStored", c.stored),
            ("BlockRemoved", c.removed),
            ("AllBlocksCleared", c.cleared),
            ("unknown", c.unknown_events),
        ] {
            events.sample(
                &[
                    ("endpoint", endpoint),
                    ("variant", variant),
                    ("instance", instance),
                    ("type", kind),
                ],
                n as f64,
            );
        }
    }
    let mut blocks = out.gauge(
        "prefix_router_kv_index_blocks",
        "KV blocks an instance's engine reported holding (its events since the last reset); \
         only instances whose index is exact.",
    );
    for (endpoint, variant, instance, live, n, _) in &rows {
        if *live {
            blocks.sample(
                &[
                    ("endpoint", endpoint),
                    ("variant", variant),
                    ("instance", instance),
                ],
                *n as f64,
            );
        }
    }
    for (name, help, pick) in [
        (
            "prefix_router_kv_event_gaps_total",
            "Gaps in an instance's event sequence (each asks the replay socket).",
            (|c| c.gaps) as fn(&kv_events::CountersSnapshot) -> u64,
        ),
        (
            "prefix_router_kv_event_replays_total",
            "Gaps the engine's replay socket filled completely.",
            |c| c.replays_served,
        ),
        (
            "prefix_router_kv_event_resets_total",
            "Times an instance's exact index was reset (a gap no replay filled, an engine restart, \
             a dropped connection, a stop): it is inferred until its next event.",
            |c| c.resets,
        ),
        (
            "prefix_router_kv_event_decode_errors_total",
            "Event messages from an instance that could not be decoded (skipped).",
            |c| c.decode_errors,
        ),
    ] {
        let mut family = out.counter(name, help);
        for (endpoint, variant, instance, _, _, c) in &rows {
            family.sample(
                &[("endpoint", endpoint), ("variant", variant), ("instance", instance)],
                pick(c) as f64,
            );
        }
    }
    let mut refusals = out.counter(
        "prefix_router_kv_index_refused_total",
        "Stored blocks the exact index did not take: full (its bound), unknown_parent (a chain \
         it never saw start), malformed (token ids that do not fill the blocks).",
    );
    for (endpoint, variant, index) in &refused {
        let r = index.refused();
        for (reason, n) in [
            ("full", &r.full),
            ("unknown_parent", &r.unknown_parent),
            ("malformed", &r.malformed),
        ] {
            refusals.sample(
                &[
                    ("endpoint", endpoint),
                    ("variant", variant),
                    ("reason", reason),
                ],
                n.load(std::sync::atomic::Ordering::Relaxed) as f64,
            );
        }
    }
}
