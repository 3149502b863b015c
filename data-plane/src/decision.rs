//! Why an instance was chosen, as the `x-prefix-router-decision` header and the `decision` label
//! of the request and token counters say it.

use http::HeaderValue;

/// Why an instance was chosen (the `x-prefix-router-decision` header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Decision {
    /// RANDOM.
    Random = 0,
    /// LEAST_OUTSTANDING_REQUESTS.
    LeastOutstanding = 1,
    /// PREFIX_AWARE: the instance the prefix index says holds the longest part of the prompt.
    PrefixMatch = 2,
    /// PREFIX_AWARE: a prompt no instance is known to hold, on its key's rendezvous top choice.
    PrefixHash = 3,
    /// PREFIX_AWARE: not the instance affinity alone would pick (its queue cost more than the
    /// prefill elsewhere, or it was at the concurrency threshold or ejected; a retry).
    OverloadBypass = 4,
}

impl Decision {
    pub const ALL: [Decision; 5] = [
        Decision::Random,
        Decision::LeastOutstanding,
        Decision::PrefixMatch,
        Decision::PrefixHash,
        Decision::OverloadBypass,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Random => "random",
            Decision::LeastOutstanding => "least_outstanding",
            Decision::PrefixMatch => "prefix_match",
            Decision::PrefixHash => "prefix_hash",
            Decision::OverloadBypass => "overload_bypass",
        }
    }

    pub fn header(self) -> HeaderValue {
        HeaderValue::from_static(self.as_str())
    }
}

/// Which front door a request came in by: the `front_door` label of the request counters and
/// of the decision histogram (and the `route` span's field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrontDoor {
    /// The HTTP router (`--listen`).
    Http = 0,
    /// The endpoint picker (`--ext-proc-listen`): Envoy forwards the request.
    ExtProc = 1,
}

impl FrontDoor {
    pub const ALL: [FrontDoor; 2] = [FrontDoor::Http, FrontDoor::ExtProc];

    pub fn as_str(self) -> &'static str {
        match self {
            FrontDoor::Http => "http",
            FrontDoor::ExtProc => "ext_proc",
        }
    }
}
