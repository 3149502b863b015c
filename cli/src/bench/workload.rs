//! Benchmark workloads, generated deterministically from a seed.
//!
//! Every workload is a set of closed-loop clients. Each client draws its requests from its own
//! RNG (seeded from the run seed and the client number), so a run is reproducible whatever the
//! scheduling. Sizes are chosen so that the distinct prefixes overflow one engine's KV cache but
//! fit the fleet's: the engines' capacity is part of the workload ([`Workload::kv_capacity_tokens`]).
//!
//! Text is made of pseudo-words; 4 bytes make a token (engine-sim's rule).

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, Zipf};

/// The workloads `prefixctl bench --workload` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum WorkloadKind {
    /// 8,000-token documents of Zipf popularity, each request one document plus a unique question.
    LongContext,
    /// long-context calibrated to the reference's setting: RANDOM hits about a quarter of the
    /// prompt tokens (150 documents of flatter popularity, Zipf 0.5, and 20 documents' worth of
    /// KV cache per engine: the fleet holds 140 of the 150).
    LongContextCalibrated,
    /// ShareGPT-like multi-turn chats behind a short common system prompt.
    Sharegpt,
    /// A few 2,500-token system prompts shared by many multi-turn users.
    SystemPromptChat,
    /// A few popular 3,000-token system prompts, each longer than the variant's `prefix_length`
    /// (so every user of one prompt shares one key), with many multi-turn users each.
    SystemPromptLong,
    /// llm-d's many-tenant shape scaled down: 32 tenants of Zipf popularity, each a 4,000-token
    /// system prompt shared by its users' multi-turn conversations (which resend their history),
    /// and engine caches that hold about a third of the tenants' prompts.
    Tenants,
    /// long-context while an instance joins and later one leaves.
    Autoscale,
    /// Flow control with the fleet full: a sheddable batch tenant at 3x capacity beside a
    /// critical chat tenant at 20%, and two standard tenants of 4:1 demand, with flow control on
    /// and off (see `bench::mixed`; its own phases and report).
    MixedPriority,
    /// Many prompt shapes drawn at random from `--seed` (`--shapes N`; see `bench::shapes`):
    /// documents or tenants, their length against `prefix_length`, the document's role,
    /// popularity, question length and cache size, each shape run with every router.
    Shapes,
}

impl WorkloadKind {
    /// The workloads whose requests each carry one document of a pool (see
    /// [`ClientState::next`]); the others are chats.
    pub const DOCUMENT_WORKLOADS: &'static str = "long-context, long-context-calibrated, autoscale";

    /// Whether each request carries one document of a pool (the others are chats).
    pub fn has_documents(self) -> bool {
        matches!(
            self,
            WorkloadKind::LongContext
                | WorkloadKind::LongContextCalibrated
                | WorkloadKind::Autoscale
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::LongContext => "long-context",
            WorkloadKind::LongContextCalibrated => "long-context-calibrated",
            WorkloadKind::Sharegpt => "sharegpt",
            WorkloadKind::SystemPromptChat => "system-prompt-chat",
            WorkloadKind::SystemPromptLong => "system-prompt-long",
            WorkloadKind::Tenants => "tenants",
            WorkloadKind::Autoscale => "autoscale",
            WorkloadKind::MixedPriority => "mixed-priority",
            WorkloadKind::Shapes => "shapes",
        }
    }
}

/// Where a document workload's request puts its document (`prefixctl bench --document-role`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DocumentRole {
    /// One user message: the document, then the question.
    #[default]
    User,
    /// The document alone as the system message, the question as a user message after it.
    System,
}

impl DocumentRole {
    pub fn name(self) -> &'static str {
        match self {
            DocumentRole::User => "user",
            DocumentRole::System => "system",
        }
    }
}

/// How large the engines' KV caches are against a document workload's documents
/// (`prefixctl bench --cache-regime`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheRegime {
    /// The workload's own sizes: the distinct documents overflow one engine but fit the fleet.
    #[default]
    Ample,
    /// [`SMALL_CACHE_DOCUMENTS`] documents and caches of [`SMALL_CACHE_DOCUMENTS_PER_ENGINE`]
    /// documents each: one engine holds fewer than half of them, four hold each once.
    Small,
}

impl CacheRegime {
    pub fn name(self) -> &'static str {
        match self {
            CacheRegime::Ample => "ample",
            CacheRegime::Small => "small",
        }
    }
}

/// Documents in the pool under [`CacheRegime::Small`].
pub const SMALL_CACHE_DOCUMENTS: usize = 8;
/// Documents one engine's KV cache holds under [`CacheRegime::Small`].
pub const SMALL_CACHE_DOCUMENTS_PER_ENGINE: usize = 3;
/// Room for the questions beside the documents under [`CacheRegime::Small`], as a share of the
/// documents' tokens.
pub const SMALL_CACHE_QUESTION_MARGIN: f64 = 0.05;

pub const BYTES_PER_TOKEN: usize = 4;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

/// One request a client sends.
#[derive(Debug, Clone)]
pub struct Request {
    pub messages: Vec<Message>,
    pub max_tokens: u32,
    /// What the placement of this request should follow (document or conversation id); used
    /// to count how many keys moved when the fleet changes.
    pub affinity: u64,
}

impl Request {
    /// The OpenAI chat body, streaming, with usage in the last chunk.
    pub fn body(&self, model: &str) -> Vec<u8> {
        let messages: Vec<serde_json::Value> = self
            .messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        serde_json::to_vec(&serde_json::json!({
            "model": model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        }))
        .expect("a JSON value serializes")
    }

    pub fn prompt_bytes(&self) -> usize {
        self.messages
            .iter()
            .map(|m| m.role.len() + m.content.len() + 2)
            .sum()
    }
}

/// Parameters of a workload, fixed per kind; printed into the bench JSON `config`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Workload {
    pub kind: WorkloadKind,
    pub seed: u64,
    /// KV capacity of each engine, in tokens.
    pub kv_capacity_tokens: u64,
    /// long-context: documents in the pool, their length, and the Zipf exponent of popularity.
    pub documents: usize,
    pub document_tokens: usize,
    pub zipf_exponent: f64,
    /// Chats: system prompts, their length, and turns per conversation (min..=max).
    pub system_prompts: usize,
    pub system_prompt_tokens: usize,
    pub min_turns: u32,
    pub max_turns: u32,
    /// Median user message and assistant reply lengths (log-normal), in tokens.
    pub user_tokens_median: f64,
    pub reply_tokens_median: f64,
    /// Output tokens of a long-context answer.
    pub answer_tokens: u32,
    /// Document workloads: tokens of the question after the document (before its label naming
    /// the client and the request).
    pub question_tokens: usize,
    /// Suggested PREFIX_AWARE `prefix_length` (characters) covering the shared part plus the
    /// start of the unique part, as the reference product's docs advise.
    pub prefix_length: u32,
    /// Mixed into every generated text: two workloads with different salts share no prefix, so
    /// one strategy's run does not inherit another's warm cache on engines that keep running.
    pub text_salt: u64,
    /// Document workloads: the message that carries the document.
    pub document_role: DocumentRole,
    /// Document workloads: the engines' caches against the documents (sets `documents` and
    /// `kv_capacity_tokens`).
    pub cache_regime: CacheRegime,
    #[serde(skip)]
    vocabulary: Vec<String>,
}

impl Workload {
    pub fn new(kind: WorkloadKind, seed: u64) -> Self {
        let mut w = Workload {
            kind,
            seed,
            kv_capacity_tokens: 0,
            documents: 0,
            document_tokens: 0,
            zipf_exponent: 0.0,
            system_prompts: 0,
            system_prompt_tokens: 0,
            min_turns: 1,
            max_turns: 1,
            user_tokens_median: 0.0,
            reply_tokens_median: 0.0,
            answer_tokens: 0,
            question_tokens: 40,
            prefix_length: 4096,
            text_salt: 0,
            document_role: DocumentRole::User,
            cache_regime: CacheRegime::Ample,
            vocabulary: vocabulary(seed),
        };
        match kind {
            WorkloadKind::LongContext | WorkloadKind::Autoscale => {
                // 80 documents x 8,000 tokens = 640k tokens: about 11 documents per engine of 7,
                // against a capacity of 17 per engine (136k) and 119 for the fleet.
                w.documents = 80;
                w.document_tokens = 8000;
                w.zipf_exponent = 0.8;
                w.kv_capacity_tokens = 136_000;
                w.answer_tokens = 24;
                w.prefix_length = 4096;
            }
            WorkloadKind::LongContextCalibrated => {
                w.documents = 150;
                w.document_tokens = 8000;
                w.zipf_exponent = 0.5;
                w.kv_capacity_tokens = 160_000;
                w.answer_tokens = 24;
                w.prefix_length = 4096;
            }
            WorkloadKind::Sharegpt => {
                w.system_prompts = 1;
                w.system_prompt_tokens = 60;
                w.min_turns = 2;
                w.max_turns = 12;
                w.user_tokens_median = 60.0;
                w.reply_tokens_median = 160.0;
                w.kv_capacity_tokens = 48_000;
                w.prefix_length = 4096;
            }
            WorkloadKind::SystemPromptChat => {
                w.system_prompts = 3;
                w.system_prompt_tokens = 2500;
                w.min_turns = 3;
                w.max_turns = 10;
                w.user_tokens_median = 80.0;
                w.reply_tokens_median = 120.0;
                w.kv_capacity_tokens = 48_000;
                w.prefix_length = 16384;
            }
            WorkloadKind::SystemPromptLong => {
                // 4 system prompts of 3,000 tokens (12,000 characters) against a prefix_length
                // of 4,096 characters, so the key never reaches a user's own text. Users paste
                // long messages (median 500 tokens) and get short answers (40), so a turn's
                // prefill is mostly the conversation so far: the history a strategy keeps or
                // loses decides TTFT and throughput, not decode.
                w.system_prompts = 4;
                w.system_prompt_tokens = 3000;
                w.min_turns = 4;
                w.max_turns = 10;
                w.user_tokens_median = 500.0;
                w.reply_tokens_median = 40.0;
                w.kv_capacity_tokens = 96_000;
                w.prefix_length = 4096;
            }
            WorkloadKind::Tenants => {
                // llm-d's published shape (150 tenants, a 6k-token shared prefix each, 5 users per
                // tenant, 8 vLLM pods) at this machine's scale: 32 tenants of 4,000 tokens (128k
                // tokens of prompts), about two users per tenant at 64 clients, more on the
                // popular ones (Zipf 0.6). Each engine holds 44,000 tokens: 11 of the 32 prompts
                // with no conversation beside them, so a router that sends a tenant where its
                // prompt is not pays a 4,000-token prefill. The key (4,096 characters) lies
                // inside the prompt: every user of a tenant shares it.
                w.system_prompts = 32;
                w.system_prompt_tokens = 4000;
                w.zipf_exponent = 0.6;
                w.min_turns = 3;
                w.max_turns = 8;
                w.user_tokens_median = 120.0;
                w.reply_tokens_median = 60.0;
                w.kv_capacity_tokens = 44_000;
                w.prefix_length = 4096;
            }
            // Its requests are made by `bench::mixed`, not from these sizes.
            WorkloadKind::MixedPriority => {}
            // Each shape sets its own sizes ([`Workload::from_shape`]); none here.
            WorkloadKind::Shapes => {}
        }
        w
    }

    /// One shape of the shape suite as a workload: its documents (roles `user` and `system`) or
    /// its tenants' system prompts (`multi-turn`: conversations of
    /// [`shapes::TURNS`](super::shapes::TURNS) turns, a tenant drawn by popularity for each),
    /// their popularity, the question (or the median user message) and the engines' KV
    /// capacity. Its texts are seeded by the suite's seed and the shape's index.
    pub fn from_shape(shape: &super::shapes::Shape) -> Self {
        use super::shapes::{ShapeRole, ANSWER_TOKENS, TURNS};
        let mut w = Workload::new(WorkloadKind::Shapes, shape.text_seed());
        w.zipf_exponent = shape.zipf_exponent;
        w.kv_capacity_tokens = shape.kv_capacity_tokens;
        w.prefix_length = shape.prefix_length;
        w.answer_tokens = ANSWER_TOKENS;
        w.question_tokens = shape.question_tokens();
        match shape.role {
            ShapeRole::User | ShapeRole::System => {
                w.documents = shape.documents_or_tenants;
                w.document_tokens = shape.prefix_tokens();
                w.document_role = match shape.role {
                    ShapeRole::System => DocumentRole::System,
                    _ => DocumentRole::User,
                };
            }
            ShapeRole::MultiTurn => {
                w.system_prompts = shape.documents_or_tenants;
                w.system_prompt_tokens = shape.prefix_tokens();
                (w.min_turns, w.max_turns) = TURNS;
                w.user_tokens_median = shape.question_tokens() as f64;
                w.reply_tokens_median = f64::from(ANSWER_TOKENS);
            }
        }
        w
    }

    /// Whether each request carries one document of a pool: the document workloads, and the
    /// shapes drawn with a document role.
    pub fn has_documents(&self) -> bool {
        match self.kind {
            WorkloadKind::Shapes => self.documents > 0,
            kind => kind.has_documents(),
        }
    }

    /// The same workload with every text changed (see [`Workload::text_salt`]).
    pub fn with_text_salt(mut self, salt: u64) -> Self {
        self.text_salt = salt;
        self.vocabulary = vocabulary(self.seed ^ salt.wrapping_mul(0xA24B_AED4_963E_E407));
        self
    }

    /// The same workload with its documents in `role` messages (document workloads only; the
    /// chats keep their messages).
    pub fn with_document_role(mut self, role: DocumentRole) -> Self {
        if self.kind.has_documents() {
            self.document_role = role;
        }
        self
    }

    /// The same workload under `regime` (document workloads only; the chats keep their sizes).
    /// [`CacheRegime::Small`]: [`SMALL_CACHE_DOCUMENTS`] documents of the same length and Zipf
    /// exponent, and room for [`SMALL_CACHE_DOCUMENTS_PER_ENGINE`] of them (plus
    /// [`SMALL_CACHE_QUESTION_MARGIN`] for the questions) in each engine's KV cache.
    pub fn with_cache_regime(mut self, regime: CacheRegime) -> Self {
        if !self.kind.has_documents() {
            return self;
        }
        self.cache_regime = regime;
        if regime == CacheRegime::Small {
            self.documents = SMALL_CACHE_DOCUMENTS;
            let held = (SMALL_CACHE_DOCUMENTS_PER_ENGINE * self.document_tokens) as f64;
            self.kv_capacity_tokens = (held * (1.0 + SMALL_CACHE_QUESTION_MARGIN)).ceil() as u64;
        }
        self
    }

    /// Deterministic text of about `tokens` tokens, a function of `stream` only.
    pub fn text(&self, stream: u64, tokens: usize) -> String {
        let mut rng = SmallRng::seed_from_u64(
            self.seed ^ self.text_salt ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        self.text_from(&mut rng, tokens)
    }

    fn text_from(&self, rng: &mut SmallRng, tokens: usize) -> String {
        let bytes = tokens * BYTES_PER_TOKEN;
        let mut s = String::with_capacity(bytes + 16);
        while s.len() < bytes {
            let w = &self.vocabulary[rng.random_range(0..self.vocabulary.len())];
            s.push_str(w);
            s.push(' ');
        }
        s.truncate(bytes);
        s
    }

    pub fn document(&self, doc: usize) -> String {
        self.text(1_000_000 + doc as u64, self.document_tokens)
    }

    /// The document pool, built once per run and shared by the clients.
    pub fn documents(&self) -> Vec<std::sync::Arc<str>> {
        (0..self.documents)
            .map(|d| std::sync::Arc::<str>::from(self.document(d)))
            .collect()
    }

    pub fn system_prompt(&self, i: usize) -> String {
        format!(
            "You are assistant #{i}{}. {}",
            if self.text_salt == 0 {
                String::new()
            } else {
                format!(" (run {})", self.text_salt)
            },
            self.text(2_000_000 + i as u64, self.system_prompt_tokens)
        )
    }

    /// The request stream of one client.
    pub fn client(&self, client: usize) -> ClientState {
        let rng =
            SmallRng::seed_from_u64(self.seed.wrapping_mul(31).wrapping_add(client as u64 + 1));
        ClientState {
            client,
            rng,
            conversation: None,
            served: 0,
            conversations_started: 0,
        }
    }
}

/// The vocabulary: 4,096 pseudo-words of 2 to 9 letters.
fn vocabulary(seed: u64) -> Vec<String> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x5EED);
    (0..4096)
        .map(|_| {
            let len = rng.random_range(2..10);
            (0..len)
                .map(|_| (b'a' + rng.random_range(0..26u8)) as char)
                .collect()
        })
        .collect()
}

/// A multi-turn conversation in progress.
#[derive(Debug, Clone)]
struct Conversation {
    id: u64,
    history: Vec<Message>,
    turns_left: u32,
}

/// One closed-loop client's position in its request stream.
pub struct ClientState {
    client: usize,
    rng: SmallRng,
    conversation: Option<Conversation>,
    served: u64,
    conversations_started: u64,
}

impl ClientState {
    /// The next request. For chats, `last_reply` is the assistant text the previous turn
    /// returned (the next turn resends it, as a chat UI does).
    pub fn next(
        &mut self,
        w: &Workload,
        documents: &[std::sync::Arc<str>],
        last_reply: Option<String>,
    ) -> Request {
        self.served += 1;
        if w.has_documents() {
            self.next_document(w, documents)
        } else {
            self.next_turn(w, last_reply)
        }
    }

    fn next_document(&mut self, w: &Workload, documents: &[std::sync::Arc<str>]) -> Request {
        let zipf = Zipf::new(w.documents as f64, w.zipf_exponent).expect("valid Zipf parameters");
        let doc = zipf.sample(&mut self.rng) as usize - 1;
        let question = w.text_from(&mut self.rng, w.question_tokens);
        let question = format!(
            "Question from client {} #{}: {question}?",
            self.client, self.served
        );
        let messages = match w.document_role {
            DocumentRole::User => vec![Message {
                role: "user",
                content: format!("{}\n\n{question}", documents[doc]),
            }],
            DocumentRole::System => vec![
                Message {
                    role: "system",
                    content: documents[doc].to_string(),
                },
                Message {
                    role: "user",
                    content: question,
                },
            ],
        };
        Request {
            messages,
            max_tokens: w.answer_tokens,
            affinity: doc as u64,
        }
    }

    fn next_turn(&mut self, w: &Workload, last_reply: Option<String>) -> Request {
        let user_len = LogNormal::new(w.user_tokens_median.ln(), 0.6).expect("valid log-normal");
        let reply_len = LogNormal::new(w.reply_tokens_median.ln(), 0.5).expect("valid log-normal");
        let continuing = match (&mut self.conversation, last_reply) {
            (Some(c), Some(reply)) if c.turns_left > 0 => {
                c.history.push(Message {
                    role: "assistant",
                    content: reply,
                });
                true
            }
            _ => false,
        };
        if !continuing {
            self.conversations_started += 1;
            let id = (self.client as u64) << 32 | self.conversations_started;
            // Uniform unless the workload gives its system prompts a popularity (tenants, the
            // shapes).
            let system = if w.zipf_exponent > 0.0 && w.system_prompts > 1 {
                let zipf = Zipf::new(w.system_prompts as f64, w.zipf_exponent)
                    .expect("valid Zipf parameters");
                zipf.sample(&mut self.rng) as usize - 1
            } else {
                self.rng.random_range(0..w.system_prompts.max(1))
            };
            let turns = self.rng.random_range(w.min_turns..=w.max_turns);
            self.conversation = Some(Conversation {
                id,
                history: vec![Message {
                    role: "system",
                    content: w.system_prompt(system),
                }],
                turns_left: turns,
            });
        }
        let tokens = (user_len.sample(&mut self.rng) as usize).clamp(4, 2000);
        let user = w.text_from(&mut self.rng, tokens);
        let c = self.conversation.as_mut().expect("a conversation is open");
        c.history.push(Message {
            role: "user",
            content: user,
        });
        c.turns_left -= 1;
        let max_tokens = (reply_len.sample(&mut self.rng) as u32).clamp(8, 1000);
        Request {
            messages: c.history.clone(),
            max_tokens,
            affinity: c.id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docs(w: &Workload) -> Vec<std::sync::Arc<str>> {
        w.documents()
    }

    #[test]
    fn same_seed_same_requests() {
        let w = Workload::new(WorkloadKind::LongContext, 7);
        let d = docs(&w);
        let mut a = w.client(3);
        let mut b = Workload::new(WorkloadKind::LongContext, 7).client(3);
        for _ in 0..20 {
            assert_eq!(a.next(&w, &d, None).messages, b.next(&w, &d, None).messages);
        }
        let other = Workload::new(WorkloadKind::LongContext, 8);
        assert_ne!(w.document(0), other.document(0));
    }

    #[test]
    fn long_context_sizes_and_skew() {
        let w = Workload::new(WorkloadKind::LongContext, 1);
        let d = docs(&w);
        assert_eq!(w.document(5).len(), 8000 * BYTES_PER_TOKEN);
        let mut c = w.client(0);
        let mut counts = vec![0u32; w.documents];
        for _ in 0..4000 {
            counts[c.next(&w, &d, None).affinity as usize] += 1;
        }
        assert!(
            counts[0] > counts[40] * 5,
            "popularity is skewed: {counts:?}"
        );
        // Overflows one engine, fits the fleet of 7.
        let pool = (w.documents * w.document_tokens) as u64;
        assert!(pool > w.kv_capacity_tokens && pool < 7 * w.kv_capacity_tokens);
    }

    #[test]
    fn the_system_role_puts_the_document_alone_in_the_system_message() {
        let user = Workload::new(WorkloadKind::LongContext, 3);
        let system =
            Workload::new(WorkloadKind::LongContext, 3).with_document_role(DocumentRole::System);
        assert_eq!(system.document_role, DocumentRole::System);
        let (du, ds) = (docs(&user), docs(&system));
        let (mut cu, mut cs) = (user.client(5), system.client(5));
        for _ in 0..50 {
            let (u, s) = (cu.next(&user, &du, None), cs.next(&system, &ds, None));
            assert_eq!(
                u.affinity, s.affinity,
                "the same document for the same seed"
            );
            assert_eq!(u.max_tokens, s.max_tokens);
            let doc = &*ds[s.affinity as usize];
            assert_eq!(s.messages.len(), 2);
            assert_eq!(s.messages[0].role, "system");
            assert_eq!(s.messages[0].content, doc, "the document alone");
            assert_eq!(s.messages[1].role, "user");
            let question = &s.messages[1].content;
            assert!(
                question.starts_with("Question from client 5 #") && question.ends_with('?'),
                "{question}"
            );
            // the user role: one message, the same document and question
            assert_eq!(u.messages.len(), 1);
            assert_eq!(u.messages[0].role, "user");
            assert_eq!(u.messages[0].content, format!("{doc}\n\n{question}"));
        }
    }

    #[test]
    fn the_small_regime_holds_fewer_than_half_of_the_documents_per_engine() {
        for kind in [
            WorkloadKind::LongContext,
            WorkloadKind::LongContextCalibrated,
            WorkloadKind::Autoscale,
        ] {
            let ample = Workload::new(kind, 1);
            let w = Workload::new(kind, 1).with_cache_regime(CacheRegime::Small);
            assert_eq!(w.cache_regime, CacheRegime::Small);
            assert_eq!(w.documents, 8);
            assert_eq!(w.zipf_exponent, ample.zipf_exponent, "{kind:?}");
            assert_eq!(w.document_tokens, ample.document_tokens, "{kind:?}");
            let (cap, doc) = (w.kv_capacity_tokens, w.document_tokens as u64);
            // each engine: 3 documents with room for questions, not a 4th; fewer than half of 8
            assert!(cap >= 3 * doc + 3 * 60 && cap < 4 * doc, "{kind:?}: {cap}");
            assert!(cap / doc < w.documents as u64 / 2, "{kind:?}");
            // four engines: every document once (8 fit in 12), not twice (16)
            assert!(4 * cap >= 8 * doc && 4 * cap < 16 * doc, "{kind:?}");
        }
        let chat = Workload::new(WorkloadKind::Sharegpt, 1).with_cache_regime(CacheRegime::Small);
        assert_eq!(
            chat.cache_regime,
            CacheRegime::Ample,
            "chats keep their sizes"
        );
        assert_eq!(
            chat.kv_capacity_tokens,
            Workload::new(WorkloadKind::Sharegpt, 1).kv_capacity_tokens
        );
    }

    #[test]
    fn salted_workloads_share_no_text() {
        for kind in [WorkloadKind::LongContext, WorkloadKind::SystemPromptLong] {
            let a = Workload::new(kind, 1);
            let b = Workload::new(kind, 1).with_text_salt(1);
            let (da, db) = (docs(&a), docs(&b));
            let ra = a.client(0).next(&a, &da, None);
            let rb = b.client(0).next(&b, &db, None);
            let (ta, tb) = (&ra.messages[0].content, &rb.messages[0].content);
            let common = ta
                .bytes()
                .zip(tb.bytes())
                .take_while(|(x, y)| x == y)
                .count();
            assert!(common < 64, "{kind:?}: {common} bytes in common");
        }
    }

    #[test]
    fn system_prompt_long_prompts_outgrow_the_key() {
        let w = Workload::new(WorkloadKind::SystemPromptLong, 1);
        assert!(w.system_prompt(0).chars().count() > w.prefix_length as usize);
        let mut c = w.client(0);
        let r = c.next(&w, &[], None);
        assert_eq!(r.messages[0].role, "system");
    }

    #[test]
    fn tenants_share_long_prompts_of_zipf_popularity_that_a_third_of_fit_one_engine() {
        let w = Workload::new(WorkloadKind::Tenants, 1);
        assert_eq!(w.kind.name(), "tenants");
        let prompts = (w.system_prompts * w.system_prompt_tokens) as u64;
        let held = w.kv_capacity_tokens as f64 / prompts as f64;
        assert!(
            (0.3..0.4).contains(&held),
            "one engine holds {held} of the prompts"
        );
        assert!(
            prompts < 7 * w.kv_capacity_tokens,
            "the fleet of 7 holds them all"
        );
        assert!(
            w.system_prompt(0).len() > w.prefix_length as usize,
            "one key per tenant"
        );
        let mut tenants = vec![0u32; w.system_prompts];
        let mut conversations = 0;
        for client in 0..64 {
            let mut c = w.client(client);
            let mut last: Option<Request> = None;
            for _ in 0..40 {
                let r = c.next(&w, &[], Some("a reply".into()));
                match &last {
                    // a turn resends the conversation so far
                    Some(l) if l.affinity == r.affinity => {
                        assert_eq!(r.messages[..l.messages.len()], l.messages[..]);
                    }
                    _ => {
                        conversations += 1;
                        let t = (0..w.system_prompts)
                            .find(|&t| w.system_prompt(t) == r.messages[0].content)
                            .unwrap();
                        tenants[t] += 1;
                    }
                }
                last = Some(r);
            }
        }
        assert!(conversations > 300, "{conversations}");
        assert!(
            tenants[0] > 3 * tenants[31],
            "popularity is skewed: {tenants:?}"
        );
        assert!(
            tenants.iter().filter(|&&n| n > 0).count() > 24,
            "most tenants are visited: {tenants:?}"
        );
    }

    #[test]
    fn chats_resend_their_history() {
        let w = Workload::new(WorkloadKind::SystemPromptChat, 1);
        let mut c = w.client(0);
        let first = c.next(&w, &[], None);
        assert_eq!(first.messages.len(), 2);
        assert!(first.messages[0].content.len() >= 2500 * BYTES_PER_TOKEN);
        let second = c.next(&w, &[], Some("the reply".into()));
        assert_eq!(second.messages[..2], first.messages[..]);
        assert_eq!(
            second.messages[2],
            Message {
                role: "assistant",
                content: "the reply".into()
            }
        );
        assert_eq!(second.affinity, first.affinity);
        // A conversation ends after its turns and the next one starts afresh.
        let mut last = second;
        for _ in 0..20 {
            let next = c.next(&w, &[], Some("r".into()));
            if next.affinity != last.affinity {
                assert_eq!(next.messages.len(), 2);
                return;
            }
            last = next;
        }
        panic!("conversations never ended");
    }
}
