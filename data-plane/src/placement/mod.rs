//! Placement: endpoint, variant and instance for one request.
//!
//! # What PREFIX_AWARE minimises
//! The work the fleet does before each first token: prefill of prompt tokens the chosen
//! engine does not hold in its cache, plus the time the request queues behind others, subject
//! to two bounds: no instance over its in-flight bound (bounded load, `--hash-balance-factor`)
//! nor over the variant's `concurrency_threshold`. Every router replica must reach the same
//! choice from the same table without talking to the others. Each mechanism below serves one
//! term, and each that spends cache (puts a prefix where plain hashing would not, so the fleet
//! may hold it twice) acts only while the engines' own reports say the copies pay
//! ([`crate::feedback`]): where revisits miss, it stands down and placement falls back to the
//! plain ranking.
//!
//! - **Affinity** (prefill): the prompt's key ([`crate::prompt`]) ranks the variant's instances
//!   by rendezvous hashing (`rendezvous`): every replica sends the same prefix to the same
//!   instance, and a join or leave of one of n instances moves about 1/(n+1) of the keys.
//! - **Homes** (prefill, `homes`): rendezvous hashing is blind to what else an instance
//!   holds, and with few popular prefixes it leaves one instance crowded and another idle. Once
//!   per half-window the keys this router placed often are counted onto instances in hash order;
//!   a key whose top choice holds clearly more of them than the emptiest of its first three gets
//!   that one as its home and goes there instead. An instance whose cache overflows (revisits
//!   of those keys miss) while it holds more than an even spread of them shows that its cache holds fewer (about
//!   as many as the share of its revisits that hit): from then on no instance gets more (never
//!   less than an even spread; a hot key whose copies would not fit gets none; one that
//!   overflows clearly at an even spread or less, once the set of reused keys has settled,
//!   bounds every instance to the even spread; an instance filled to the bound whose revisits
//!   still miss more than half the limit lowers it to what they show), and the pass
//!   runs again as soon as a router's revisits show an overflow, and once its last pass is 15 s
//!   and 64 requests old. The pass depends only on the set of reused
//!   keys and that bound, so replicas agree.
//! - **Hot-key replicas** (queueing): each router estimates, over its last 2,048-4,096 requests
//!   to the variant ([`crate::load::KeyRates`]), every key's share. A key with share `s` of n
//!   instances is hot when `s * n >= hot_share`; it is served by its first
//!   [`Tuning::replicas`] instances in rendezvous order, each request going to the one this
//!   router sent the fewest recent requests. The copies cost cache, so the rule waits for a
//!   router's second homes pass (its first has no report from the engines, and an overflow it
//!   causes is a bound by the next) and is held to its revisits; until then and while they miss, a
//!   hot key gets only [`Tuning::least_replicas`] (`ceil(s * n)`: a key with more traffic than
//!   one instance's share still cannot stay on one). Nor do copies assume room: with no bound
//!   known, a pass's copies give an instance at most one key over an even spread until an
//!   instance holding more shows that its revisits hit (the probe, see `homes.rs`).
//! - **Deepened heads** (queueing): a hot head-only chat key (a system prompt longer than
//!   `prefix_length`, shared by every conversation on it) is keyed by its conversation instead
//!   ([`crate::prompt::deep_prompt_key`]); a first turn takes the less loaded of its first two
//!   instances and this router remembers it for the later turns. Its premise, that the head is
//!   cached where first turns go, is checked on each first turn's report, and it is false
//!   wherever the homes pass has learnt a bound on what a cache holds: there no head is deepened.
//! - **Warm moves** (queueing): a key near the hot threshold whose instance is over its fair
//!   share of requests goes to the next instance of its ranking while that one has had fewer.
//! - **Re-weighing** (queueing, `reweigh`): instance weights set every half-window from request
//!   shares move whole cold keys among their first three choices until shares even out.
//!   Neither moves a key the last homes pass counted once a bound is known: the caches are
//!   full, and such a key moved evicts one the pass placed where it went. (An
//!   earlier term that also evened each instance's count of distinct keys, a guess at its cache
//!   footprint, is gone: relief below acts on the engines' measured misses instead.)
//! - **Relief** (prefill, [`crate::feedback::InstanceCache`]): an instance whose revisits miss
//!   (a window of them over [`crate::feedback::FeedbackTuning::relief_miss_limit`], a tenth)
//!   holds more prefixes than its cache fits (hash luck can give one instance of a few more
//!   documents than it holds while another idles); each strike sends another eighth of its keys,
//!   picked by key hash, to the first instance of the key's ranking whose revisits hit
//!   (remembered by the prefix index, so a moved key stays where it went). Keys move, nothing
//!   is copied, and the strikes decay once the instance's revisits hit again. Relief acts only
//!   until the homes pass has learnt a bound: then the pass moves keys by it, the same on
//!   every router, where relief's moves were each router's own.
//! - **Spills** (queueing): a key whose instances are all at their in-flight bound walks its
//!   ranking; the local [`PrefixIndex`] remembers where it spilled so it keeps spilling there.
//!   While spill copies miss, only `concurrency_threshold` bounds an instance.
//!
//! The constants live in [`Tuning`]; its `Default` is what users get.

use rand::Rng;

use crate::feedback::{Rule, Visit};
use crate::load::now_ms;
use crate::prefix_index::PrefixIndex;
use crate::prompt::{deep_prompt_key, find_model, prompt_key, seed_for, BodyKind};
use crate::table::{Endpoint, RoutingTable, Strategy, Variant};

mod basic;
mod homes;
mod prefix_aware;
mod rendezvous;
mod reweigh;
mod tuning;

pub use basic::{least_loaded, random};
use homes::assign_homes;
pub use prefix_aware::WIDE_REPLICAS;
use prefix_aware::{share, Conversation};
use rendezvous::fmix64;
pub use rendezvous::{ranking, rendezvous_score, rendezvous_top, RendezvousWalk};
use reweigh::reweigh;
pub use reweigh::WEIGHTED_CHOICES;
pub use tuning::{Tuning, DEFAULT_BALANCE_PERCENT, DEFAULT_SPREAD};

pub use crate::decision::Decision;

/// An instance (index into the variant's instances), the header's decision and the rule.
pub type Choice = (usize, Decision, Rule);

/// Why a request could not be placed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RouteError {
    #[error("unknown endpoint {0:?}")]
    UnknownEndpoint(String),
    #[error("no endpoint given: set the x-endpoint-name header or a model field naming an endpoint{}",
        .model.as_ref().map(|m| format!(" (model {m:?} names no endpoint)")).unwrap_or_default())]
    NoEndpoint { model: Option<String> },
    #[error("unknown variant {variant:?} for endpoint {endpoint:?}")]
    UnknownVariant { endpoint: String, variant: String },
    #[error("endpoint {0:?} has no production variants")]
    NoVariant(String),
    #[error("variant {variant:?} of endpoint {endpoint:?} has no instances")]
    NoInstance { endpoint: String, variant: String },
}

impl RouteError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            RouteError::UnknownEndpoint(_)
            | RouteError::NoEndpoint { .. }
            | RouteError::UnknownVariant { .. } => 404,
            RouteError::NoVariant(_) | RouteError::NoInstance { .. } => 503,
        }
    }
}

/// What a placement looks at in a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    pub kind: BodyKind,
    pub body: &'a [u8],
    /// Endpoint named by the path (`/endpoints/{e}/invocations`) or the `x-endpoint-name` header.
    pub endpoint: Option<&'a str>,
    /// `x-target-variant`.
    pub target_variant: Option<&'a str>,
    /// `x-prefix-aware-id`.
    pub prefix_aware_id: Option<&'a [u8]>,
}

/// Where one request goes.
#[derive(Debug, Clone, Copy)]
pub struct Route<'t> {
    pub endpoint: &'t Endpoint,
    pub variant: &'t Variant,
    /// Index into `variant.instances()`.
    pub instance: usize,
    pub decision: Decision,
    /// The rule that chose the instance (finer than `decision`: the label of the token counters
    /// and what the engines' reports are held against).
    pub rule: Rule,
    /// PREFIX_AWARE: whether a request with the same prefix finished on the same instance
    /// before, so that the engine should find it cached (see [`crate::feedback`]).
    pub visit: Visit,
    /// PREFIX_AWARE: the hash of (cached prefix, instance), recorded as served when the response
    /// ends ([`crate::load::ServedPrefixes`]); 0 otherwise.
    pub placed: u64,
    /// The prompt key hash (PREFIX_AWARE only).
    pub key: Option<u64>,
    /// Blocks of the prompt prefix hashed into the key (PREFIX_AWARE only, else 0): the prefix
    /// that decided the placement.
    pub key_blocks: u32,
}

/// The router's placement policy: settings plus the local prefix index.
#[derive(Debug)]
pub struct Placement {
    index: PrefixIndex,
    tuning: Tuning,
    default_endpoint: Option<String>,
}

impl Placement {
    pub fn new(
        prefix_index_capacity: usize,
        balance_percent: u32,
        default_endpoint: Option<String>,
    ) -> Self {
        Placement {
            index: PrefixIndex::new(prefix_index_capacity),
            tuning: Tuning {
                balance_percent: balance_percent.clamp(100, 1000),
                ..Tuning::default()
            },
            default_endpoint,
        }
    }

    /// How widely hot keys are spread (see [`Tuning::replicas`]); 0 keeps every key on one
    /// instance and leaves the balance to the weights.
    pub fn with_hot_key_spread(mut self, spread: f64) -> Self {
        self.tuning.spread = spread.clamp(0.0, 64.0);
        self
    }

    pub fn tuning(&self) -> &Tuning {
        &self.tuning
    }

    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Endpoint, variant and instance for a request.
    pub fn route<'t>(
        &self,
        table: &'t RoutingTable,
        req: &RouteRequest<'_>,
    ) -> Result<Route<'t>, RouteError> {
        let endpoint = self.endpoint(table, req)?;
        let variant = match req.target_variant {
            Some(name) => endpoint
                .variant(name)
                .ok_or_else(|| RouteError::UnknownVariant {
                    endpoint: endpoint.name().to_string(),
                    variant: name.to_string(),
                })?,
            None if endpoint.variants().len() == 1 => &endpoint.variants()[0],
            None => endpoint
                .pick_variant(rand::rng().random::<f64>())
                .ok_or_else(|| RouteError::NoVariant(endpoint.name().to_string()))?,
        };
        let (key, key_blocks, conversation) = match variant.strategy() {
            Strategy::PrefixAware(pa) => {
                let seed = seed_for(req.prefix_aware_id);
                let limit = pa.prefix_length as usize;
                let k = prompt_key(req.kind, req.body, limit, seed);
                let t = &self.tuning;
                // (Not where the homes pass learnt that the caches hold only so many keys: a
                // conversation's first turn may then land where the head is not cached.)
                let deep = (k.head_only
                    && share(variant, k.hash, t.min_window) * variant.instances().len() as f64
                        >= t.deepen_share
                    && variant
                        .load()
                        .feedback()
                        .allows(Rule::DeepenedHead, now_ms())
                    && variant.load().homes().capacity().is_none())
                .then(|| deep_prompt_key(req.body, limit, seed))
                .flatten();
                match deep {
                    Some(d) => (
                        Some(d.hash),
                        d.blocks,
                        Some(Conversation {
                            head: k.hash,
                            first_turn: d.first_turn,
                        }),
                    ),
                    None => (Some(k.hash), k.blocks, None),
                }
            }
            _ => (None, 0, None),
        };
        let now = now_ms();
        let chosen = match (variant.strategy(), key, conversation) {
            (Strategy::PrefixAware(pa), Some(k), Some(c)) => {
                self.conversation(variant, k, c, pa, now)
            }
            _ => self.choose(variant, key, None, now),
        };
        let (instance, decision, rule) = chosen.ok_or_else(|| RouteError::NoInstance {
            endpoint: endpoint.name().to_string(),
            variant: variant.name().to_string(),
        })?;
        let (mut visit, mut placed) = (Visit::First, 0);
        if let Some(k) = key {
            let state = variant.instances()[instance].state();
            // The prefix the instance's cache must hold for this request: the shared head of a
            // deepened conversation, else the key's own prefix.
            let cached = conversation.map_or(k, |c| c.head);
            placed = fmix64(cached ^ variant.id_hashes()[instance]);
            let recorded = match conversation {
                Some(c) => variant.load().record(state, &[k, c.head], placed),
                None => variant.load().record(state, &[k], placed),
            };
            let homes = variant.load().homes();
            visit = match recorded.revisit {
                false => Visit::First,
                true if homes.is_reused(cached) => Visit::ReusedRevisit,
                true => Visit::Revisit,
            };
            if recorded.new_window {
                reweigh(variant, &self.tuning);
            }
            let t = &self.tuning;
            if recorded.new_window
                || t.home_early.contains(&(recorded.sequence + 1))
                || variant.load().feedback().take_pass_due()
                || homes.pass_overdue(
                    recorded.sequence,
                    now,
                    // while the copies probe for room, a pass every 64 requests: a router that
                    // sees a quarter of a slow fleet's traffic would otherwise wait 15 s a step
                    if homes.probing() {
                        0
                    } else {
                        t.home_interval_ms
                    },
                    t.home_interval_requests,
                )
            {
                homes.mark_pass(recorded.sequence, now);
                assign_homes(variant, t);
            }
        }
        Ok(Route {
            endpoint,
            variant,
            instance,
            decision,
            rule,
            visit,
            placed,
            key,
            key_blocks,
        })
    }

    fn endpoint<'t>(
        &self,
        table: &'t RoutingTable,
        req: &RouteRequest<'_>,
    ) -> Result<&'t Endpoint, RouteError> {
        if let Some(name) = req.endpoint {
            return table
                .endpoint(name)
                .ok_or_else(|| RouteError::UnknownEndpoint(name.to_string()));
        }
        let model = match req.kind {
            BodyKind::OpenAi | BodyKind::Responses => find_model(req.body),
            BodyKind::Raw => None,
        };
        if let Some(e) = model.as_deref().and_then(|m| table.endpoint(m)) {
            return Ok(e);
        }
        match &self.default_endpoint {
            Some(name) => table
                .endpoint(name)
                .ok_or_else(|| RouteError::UnknownEndpoint(name.clone())),
            None => Err(RouteError::NoEndpoint {
                model: model.map(|m| m.into_owned()),
            }),
        }
    }

    /// An instance of `variant` by its strategy, never `exclude` (the instance a retry leaves).
    pub fn choose(
        &self,
        variant: &Variant,
        key: Option<u64>,
        exclude: Option<usize>,
        now_ms: u64,
    ) -> Option<Choice> {
        match (variant.strategy(), key) {
            (Strategy::PrefixAware(pa), Some(key)) => {
                self.prefix_aware(variant, key, pa, exclude, now_ms)
            }
            (Strategy::LeastOutstandingRequests, _) => least_loaded(variant, exclude, now_ms)
                .map(|i| (i, Decision::LeastOutstanding, Rule::LeastOutstanding)),
            _ => random(variant, exclude, now_ms).map(|i| (i, Decision::Random, Rule::Random)),
        }
    }
}

#[cfg(test)]
mod tests;
