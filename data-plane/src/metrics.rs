//! Prometheus text metrics, kept in atomics (no lock on the request path).
//!
//! Per-route counters (`endpoint`, `variant`, `instance`, `decision`, `status`, `front_door`) are
//! pre-created when a table is built and reused by the next table for routes that are still there.
//! `front_door` (`http` | `ext_proc`) tells the HTTP router's requests from the endpoint picker's;
//! it labels the request counters and the decision histogram (sum over it for the router's total).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use telemetry::exposition::Exposition;

use crate::decision::{Decision, FrontDoor};
use crate::histogram::Histogram;
use crate::route_stats::{slot_label, status_slot, STATUS_SLOTS};
use crate::table::RoutingTable;

/// Router-wide metrics.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Routing-decision latency (body parse, key hash, endpoint/variant/instance choice), by
    /// front door (see [`Metrics::decision`]).
    decision: [Histogram; FrontDoor::ALL.len()],
    /// Requests answered without reaching an instance (no table, unknown endpoint, 413...), by
    /// front door.
    unrouted: [[AtomicU64; STATUS_SLOTS]; FrontDoor::ALL.len()],
    pub table_version: AtomicU64,
    pub tables_applied: AtomicU64,
    pub tables_rejected: AtomicU64,
    pub control_plane_connected: AtomicU64,
    pub retries: AtomicU64,
    /// Requests refused because their client's API keys failed too often.
    pub auth_throttled: AtomicU64,
    /// The endpoint picker's answers (`--ext-proc-listen`) by status: 200 a pick, else the
    /// ImmediateResponse's.
    ext_proc: [AtomicU64; STATUS_SLOTS],
    pub ejections: Arc<AtomicU64>,
    /// Flow control: waiting requests, their waits, refusals (see [`crate::flow`]).
    pub flow: crate::flow::FlowMetrics,
    /// Open client connections per worker thread (`serve` hands a new one to the lowest).
    pub worker_connections: Box<[AtomicU64]>,
}

impl Metrics {
    /// Metrics of a router with `workers` worker threads.
    pub fn with_workers(workers: usize) -> Self {
        Metrics {
            worker_connections: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            ..Metrics::default()
        }
    }

    pub fn record_unrouted(&self, door: FrontDoor, status: u16) {
        self.unrouted[door as usize][status_slot(status)].fetch_add(1, Relaxed);
    }

    /// The routing-decision latency histogram of requests that came in by `door`.
    pub fn decision(&self, door: FrontDoor) -> &Histogram {
        &self.decision[door as usize]
    }

    pub fn record_ext_proc(&self, status: u16) {
        self.ext_proc[status_slot(status)].fetch_add(1, Relaxed);
    }

    /// The Prometheus text exposition (encoded by the `prometheus` crate, see
    /// [`telemetry::exposition`]).
    pub fn render(&self, table: Option<&RoutingTable>) -> String {
        let mut out = Exposition::new();
        let mut status = String::new();
        let mut requests = out.counter(
            "prefix_router_requests_total",
            "Requests by endpoint, variant, instance, routing decision, response status and front \
             door (http: the HTTP router, ext_proc: the endpoint picker).",
        );
        for door in FrontDoor::ALL {
            for (slot, count) in self.unrouted[door as usize].iter().enumerate() {
                let n = count.load(Relaxed);
                if n > 0 {
                    status.clear();
                    slot_label(slot, &mut status);
                    requests.sample(
                        &[
                            ("endpoint", ""),
                            ("variant", ""),
                            ("instance", ""),
                            ("decision", "none"),
                            ("status", &status),
                            ("front_door", door.as_str()),
                        ],
                        n as f64,
                    );
                }
            }
        }
        let routes = || {
            table.into_iter().flat_map(|t| {
                t.endpoints().flat_map(|e| {
                    e.variants()
                        .iter()
                        .flat_map(move |v| v.instances().iter().map(move |i| (e, v, i)))
                })
            })
        };
        for (endpoint, variant, instance) in routes() {
            for door in FrontDoor::ALL {
                for decision in Decision::ALL {
                    for slot in 0..STATUS_SLOTS {
                        let n = instance.stats().count_at(door, decision, slot);
                        if n > 0 {
                            status.clear();
                            slot_label(slot, &mut status);
                            requests.sample(
                                &[
                                    ("endpoint", endpoint.name()),
                                    ("variant", variant.name()),
                                    ("instance", instance.address()),
                                    ("decision", decision.as_str()),
                                    ("status", &status),
                                    ("front_door", door.as_str()),
                                ],
                                n as f64,
                            );
                        }
                    }
                }
            }
        }
        let mut picks = out.counter(
            "prefix_router_ext_proc_answers_total",
            "Endpoint-picker (ext_proc) answers to Envoy by status: 200 a pick, else the \
             ImmediateResponse's (429 over --max-in-flight, 413, 404, 503).",
        );
        for (slot, count) in self.ext_proc.iter().enumerate() {
            let n = count.load(Relaxed);
            if n > 0 {
                status.clear();
                slot_label(slot, &mut status);
                picks.sample(&[("status", &status)], n as f64);
            }
        }
        for (name, help, cached) in [
            (
                "prefix_router_prompt_tokens_total",
                "Prompt tokens of routed requests as the engines reported them, by instance and \
                 the placement decision that chose it.",
                false,
            ),
            (
                "prefix_router_cached_prompt_tokens_total",
                "Prompt tokens the engines reported served from their prefix cache, by instance \
                 and the placement decision that chose it.",
                true,
            ),
        ] {
            let mut family = out.counter(name, help);
            for (endpoint, variant, instance) in routes() {
                for decision in Decision::ALL {
                    let (prompt, hit) = instance.stats().usage(decision);
                    if prompt > 0 {
                        family.sample(
                            &[
                                ("endpoint", endpoint.name()),
                                ("variant", variant.name()),
                                ("instance", instance.address()),
                                ("decision", decision.as_str()),
                            ],
                            (if cached { hit } else { prompt }) as f64,
                        );
                    }
                }
            }
        }
        let variants = || {
            table.into_iter().flat_map(|t| {
                t.endpoints()
                    .flat_map(|e| e.variants().iter().map(move |v| (e, v)))
            })
        };
        for (name, help, capacity) in [
            (
                "prefix_router_prefix_index_blocks",
                "Prompt blocks (of 256 characters) the PREFIX_AWARE prefix index believes an \
                 instance holds, as this router sent them.",
                false,
            ),
            (
                "prefix_router_prefix_index_capacity_blocks",
                "The prefix index's estimate of an instance's cache, in blocks, learnt from the \
                 engines' reports of cached tokens.",
                true,
            ),
        ] {
            let mut family = out.gauge(name, help);
            for (endpoint, variant, instance) in routes() {
                let Some(index) = variant.load().index_if_any() else {
                    continue;
                };
                if let Some((_, used, cap)) = index
                    .instances()
                    .into_iter()
                    .find(|&(id, _, _)| id == instance.id_hash())
                {
                    family.sample(
                        &[
                            ("endpoint", endpoint.name()),
                            ("variant", variant.name()),
                            ("instance", instance.address()),
                        ],
                        if capacity { cap.floor() } else { used as f64 },
                    );
                }
            }
        }
        let mut request_bytes = out.gauge(
            "prefix_router_request_cost_bytes",
            "PREFIX_AWARE's queue term: what one request in flight on an instance costs a new \
             one there, in prompt bytes of prefill, as learnt from the engines' reports and the \
             requests' times (the tuning's prior until then).",
        );
        for (endpoint, variant) in variants() {
            if let Some(index) = variant.load().index_if_any() {
                request_bytes.sample(
                    &[("endpoint", endpoint.name()), ("variant", variant.name())],
                    index.request_bytes(&crate::placement::Tuning::default()),
                );
            }
        }
        crate::kv::render_metrics(&mut out, table);
        let mut in_flight = out.gauge(
            "prefix_router_instance_in_flight",
            "Requests in flight per instance (until the response body ends).",
        );
        for (endpoint, variant, instance) in routes() {
            in_flight.sample(
                &[
                    ("endpoint", endpoint.name()),
                    ("variant", variant.name()),
                    ("instance", instance.address()),
                ],
                instance.state().outstanding() as f64,
            );
        }
        let now = crate::load::now_ms();
        let mut ejected = out.gauge(
            "prefix_router_instance_ejected",
            "1 while passive health keeps the instance out of placement.",
        );
        for (endpoint, variant, instance) in routes() {
            ejected.sample(
                &[
                    ("endpoint", endpoint.name()),
                    ("variant", variant.name()),
                    ("instance", instance.address()),
                ],
                f64::from(u8::from(instance.state().is_ejected(now))),
            );
        }
        let mut decisions = out.histogram(
            "prefix_router_route_decision_seconds",
            "Routing decision latency: body parse, prefix hash and instance choice, by front door \
             (http: the HTTP router, ext_proc: the endpoint picker; a door with no decision yet \
             is left out, the HTTP router's never).",
        );
        for door in FrontDoor::ALL {
            let h = &self.decision[door as usize];
            if door == FrontDoor::Http || h.count() > 0 {
                h.sample(&mut decisions, &[("front_door", door.as_str())]);
            }
        }
        self.flow.describe(&mut out);
        let gauges: [(&str, bool, &str, u64); 8] = [
            (
                "prefix_router_table_version",
                false,
                "Version of the routing table being served (0 = none).",
                self.table_version.load(Relaxed),
            ),
            (
                "prefix_router_tables_applied_total",
                true,
                "Routing tables applied (ACKed or loaded from the cache).",
                self.tables_applied.load(Relaxed),
            ),
            (
                "prefix_router_tables_rejected_total",
                true,
                "Routing tables rejected (NACKed) as invalid.",
                self.tables_rejected.load(Relaxed),
            ),
            (
                "prefix_router_control_plane_connected",
                false,
                "1 while the routing-table watch stream is up.",
                self.control_plane_connected.load(Relaxed),
            ),
            (
                "prefix_router_retries_total",
                true,
                "Requests retried on another instance after a connect error or 5xx.",
                self.retries.load(Relaxed),
            ),
            (
                "prefix_router_auth_throttled_total",
                true,
                "Requests refused (429) because their client address presented wrong API keys too often.",
                self.auth_throttled.load(Relaxed),
            ),
            (
                "prefix_router_ejections_total",
                true,
                "Instances ejected after repeated failures.",
                self.ejections.load(Relaxed),
            ),
            (
                "prefix_router_prefix_index_entries",
                false,
                "Prompt blocks held in the PREFIX_AWARE prefix indexes of every variant, over \
                 all instances (bounded per variant).",
                table
                    .into_iter()
                    .flat_map(|t| t.endpoints().flat_map(|e| e.variants()))
                    .filter_map(|v| v.load().index_if_any())
                    .map(|i| i.len() as u64)
                    .sum(),
            ),
        ];
        for (name, counter, help, value) in gauges {
            let mut family = if counter {
                out.counter(name, help)
            } else {
                out.gauge(name, help)
            };
            family.sample(&[], value as f64);
        }
        let mut workers = out.gauge(
            "prefix_router_worker_connections",
            "Open client connections per worker thread.",
        );
        for (worker, open) in self.worker_connections.iter().enumerate() {
            workers.sample(
                &[("worker", &worker.to_string())],
                open.load(Relaxed) as f64,
            );
        }
        out.render()
    }
}
