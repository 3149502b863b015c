//! Placement: endpoint, variant and instance for one request.
//!
//! # What PREFIX_AWARE minimises
//! For each request, one cost per candidate instance, in one unit (prompt bytes of prefill), and
//! the cheapest instance wins:
//!
//! ```text
//! cost(i) = miss(i)                      prompt bytes instance i lacks (its prefix index)
//!         + evict(i)                     bytes its cache must drop to take them
//!         + outstanding(i) * queued      this router's requests in flight there, each what a
//!                                        queued request was measured to cost
//! ```
//!
//! over the healthy instances under `concurrency_threshold` (only when none is: over all the
//! healthy ones, `overload_bypass`). Why each term, and where it comes from:
//! - `miss`: an engine serves from its cache the longest prefix of the prompt it holds; the
//!   rest it must compute before the first token. [`crate::prefix_index`] keeps, per instance,
//!   the blocks of every prompt this router sent there (the chat's whole history included) to a
//!   capacity learnt from the engines' own reports.
//! - `evict`: a prefix copied onto a full cache pushes out others that will be prefilled again
//!   when they come back; each such byte costs one byte of prefill.
//! - the queue: a request shares its instance with the work already sent there. `queued` is what
//!   one request in flight costs a new one, in prefill bytes, learnt from the time requests take
//!   against the prefill they needed and the requests in flight before them
//!   ([`crate::prefix_index::LatencyFit`]): near a whole request on an engine that serves one at
//!   a time, little on one that batches. A hot prefix thus gets a second copy when queueing on
//!   its holder costs more than prefilling (and making room for) a copy, and never because of
//!   its share.
//!
//! The key's rendezvous top (`rendezvous`) is taken to hold at least the affinity key (the first
//! `prefix_length` characters, [`crate::prompt::prompt_key`]): every router replica sends the
//! key there while it is not loaded, so replicas that never talk agree on where a new prefix
//! goes, a key long enough to take in a user's first message spreads users of one system prompt
//! by user, and a join or leave of one of n instances moves about 1/(n+1) of the new keys. Equal
//! costs also go by the rendezvous ranking.
//!
//! The constants live in [`Tuning`]; its `Default` is what users get.

use rand::Rng;

use crate::load::now_ms;
use crate::prefix_index::Prediction;
use crate::prompt::{find_model, prompt_blocks, prompt_key, seed_for, BodyKind};
use crate::table::{Endpoint, RoutingTable, Strategy, Variant};

mod basic;
mod prefix_aware;
mod rendezvous;
mod tuning;

pub use basic::{least_loaded, random};
use prefix_aware::Prompt;
pub use rendezvous::{ranking, rendezvous_score, rendezvous_top, RendezvousWalk};
pub use tuning::Tuning;

pub use crate::decision::Decision;

/// The longest prompt text the prefix index reads (characters): 512 KiB, about 128k tokens.
pub const MAX_PROMPT_BYTES: usize = 512 * 1024;

/// An instance (index into the variant's instances) and the header's decision.
pub type Choice = (usize, Decision);

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
    /// PREFIX_AWARE: what the prefix index predicted the instance holds of the prompt, learnt
    /// from when the engine reports (None once the request moved to another instance).
    pub prediction: Option<Prediction>,
    /// The prompt key hash (PREFIX_AWARE only).
    pub key: Option<u64>,
    /// Blocks of the prompt prefix hashed into the key (PREFIX_AWARE only, else 0): the prefix
    /// that decided the placement.
    pub key_blocks: u32,
}

impl Route<'_> {
    /// The request goes to another instance than the one placement chose (a retry, or flow
    /// control's pick when the chosen one is full): what placement predicted no longer applies.
    pub fn moved(&mut self, instance: usize, decision: Decision) {
        self.instance = instance;
        self.decision = decision;
        self.prediction = None;
    }
}

/// The router's placement policy: its tuning and the default endpoint.
#[derive(Debug, Default)]
pub struct Placement {
    tuning: Tuning,
    default_endpoint: Option<String>,
}

thread_local! {
    /// One decision's scratch: reused, so a decision allocates nothing once they have grown.
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch {
            blocks: Vec::new(),
            depth: Vec::new(),
            tokens: Vec::new(),
            keys: Vec::new(),
            exact: Vec::new(),
        })
    };
}

/// See [`SCRATCH`].
struct Scratch {
    /// The prompt's block hashes (inferred index) and each instance's match.
    blocks: Vec<u64>,
    depth: Vec<u32>,
    /// The prompt's tokens, their block keys (exact index) and each instance's exact match.
    tokens: Vec<u32>,
    keys: Vec<u64>,
    exact: Vec<Option<u32>>,
}

impl Placement {
    pub fn new(default_endpoint: Option<String>) -> Self {
        Placement {
            tuning: Tuning::default(),
            default_endpoint,
        }
    }

    pub fn tuning(&self) -> &Tuning {
        &self.tuning
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
        let no_instance = || RouteError::NoInstance {
            endpoint: endpoint.name().to_string(),
            variant: variant.name().to_string(),
        };
        let now = now_ms();
        let Strategy::PrefixAware(pa) = variant.strategy() else {
            let (instance, decision) = self
                .choose(variant, None, None, now)
                .ok_or_else(no_instance)?;
            return Ok(Route {
                endpoint,
                variant,
                instance,
                decision,
                prediction: None,
                key: None,
                key_blocks: 0,
            });
        };
        let seed = seed_for(req.prefix_aware_id);
        let key = prompt_key(req.kind, req.body, pa.prefix_length as usize, seed);
        let (choice, prediction) =
            SCRATCH
                .with_borrow_mut(|scratch| {
                    let Scratch {
                        blocks,
                        depth,
                        tokens,
                        keys,
                        exact,
                    } = scratch;
                    let chars = prompt_blocks(req.kind, req.body, seed, MAX_PROMPT_BYTES, blocks);
                    let exact_block_bytes = exact_matches(variant, req, tokens, keys, exact)
                        .map_or(0.0, |(tokens_per_block, partial)| {
                            // the bytes a block of tokens stands for: of the rendered text the
                            // tokens cover (all of it, or up to where no engine held more)
                            let per_token = if partial.complete {
                                chars as f64 / tokens.len().max(1) as f64
                            } else {
                                partial.text_bytes as f64 / tokens.len().max(1) as f64
                            };
                            tokens_per_block as f64 * per_token
                        });
                    let prompt = Prompt {
                        key: key.hash,
                        key_bytes: key.len,
                        blocks,
                        bytes: chars as u32,
                        exact,
                        exact_block_bytes,
                    };
                    self.prefix_aware(variant, pa, &prompt, depth, now)
                })
                .ok_or_else(no_instance)?;
        Ok(Route {
            endpoint,
            variant,
            instance: choice.0,
            decision: choice.1,
            prediction,
            key: Some(key.hash),
            key_blocks: key.blocks,
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
    /// PREFIX_AWARE without a prompt at hand (a retry): the first healthy instance under the
    /// concurrency threshold in the key's rendezvous ranking, else the least loaded.
    pub fn choose(
        &self,
        variant: &Variant,
        key: Option<u64>,
        exclude: Option<usize>,
        now_ms: u64,
    ) -> Option<Choice> {
        match (variant.strategy(), key) {
            (Strategy::PrefixAware(pa), Some(key)) => {
                let limit = pa.concurrency_threshold as u64;
                let instances = variant.instances();
                ranking(variant.id_hashes(), key)
                    .find(|&i| Some(i) != exclude && instances[i].state().takes(limit, now_ms))
                    .or_else(|| least_loaded(variant, exclude, now_ms))
                    .map(|i| (i, Decision::OverloadBypass))
            }
            (Strategy::LeastOutstandingRequests, _) => {
                least_loaded(variant, exclude, now_ms).map(|i| (i, Decision::LeastOutstanding))
            }
            _ => random(variant, exclude, now_ms).map(|i| (i, Decision::Random)),
        }
    }
}

/// For a variant whose engines publish KV events: the prompt's tokens as the engines compute
/// them (up to the first block no exact instance holds: the rest can only be missed, and its
/// length is the prompt's), and for each instance `Some(leading blocks it holds)` when its index
/// is exact (`None`: inferred) into `exact`; returns the tokens per block and how much of the
/// prompt the tokens cover. `None` (and `exact` empty) when the variant has no events, no block
/// size is known yet, or the body does not tokenize (the engine will say why; placement goes by
/// the inferred index).
fn exact_matches(
    variant: &Variant,
    req: &RouteRequest<'_>,
    tokens: &mut Vec<u32>,
    keys: &mut Vec<u64>,
    exact: &mut Vec<Option<u32>>,
) -> Option<(u32, chat_tokens::Partial)> {
    exact.clear();
    let kv = variant.kv_events()?;
    let index = variant.load().kv_if_any()?;
    let block_size = match kv.settings.block_size {
        0 => index.block_size(),
        n => n,
    };
    if block_size == 0 || req.kind != BodyKind::OpenAi {
        return None;
    }
    let kind = if memchr::memmem::find(req.body, b"\"messages\"").is_some() {
        chat_tokens::RequestKind::Chat
    } else {
        chat_tokens::RequestKind::Completions
    };
    keys.clear();
    let bs = block_size as usize;
    let partial = kv
        .tokenizer
        .tokens_while(req.body, kind, tokens, &mut |so_far| {
            let had = keys.len();
            crate::kv_index::extend_block_keys(so_far, bs, None, keys);
            keys.len() == had || keys.last().is_some_and(|&k| index.held_anywhere(k))
        })
        .ok()?;
    index.matches(variant.id_hashes(), keys, exact);
    Some((block_size, partial))
}

#[cfg(test)]
mod tests;
