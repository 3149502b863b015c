//! The `prefixrouter.v1` gRPC API: generated prost messages and tonic clients/servers.
//!
//! Wire types stop at crate boundaries: the control plane and the data plane each convert them
//! once into validated domain types.

#![allow(clippy::large_enum_variant)]

/// Generated code for package `prefixrouter.v1`.
pub mod v1 {
    tonic::include_proto!("prefixrouter.v1");

    /// Encoded `FileDescriptorSet` for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("prefixrouter_descriptor");
}

pub use v1::*;

pub mod client;

/// PREFIX_AWARE limits and defaults, part of the API: the control plane validates against them
/// and the data plane re-checks every table it receives.
pub mod limits {
    /// Allowed `prefix_length` (characters or bytes of the prompt that form the affinity key).
    pub const PREFIX_LENGTH_RANGE: std::ops::RangeInclusive<u32> = 64..=65536;
    /// Allowed `concurrency_threshold` (in-flight requests at which affinity is bypassed).
    pub const CONCURRENCY_THRESHOLD_RANGE: std::ops::RangeInclusive<u32> = 1..=4096;
    /// Used when a PREFIX_AWARE variant leaves `prefix_length` unset (0).
    pub const DEFAULT_PREFIX_LENGTH: u32 = 2048;
    /// Used when a PREFIX_AWARE variant leaves `concurrency_threshold` unset (0).
    pub const DEFAULT_CONCURRENCY_THRESHOLD: u32 = 64;
    /// Allowed `kv_events.block_size` (tokens per KV block; 0 = taken from the events).
    pub const KV_BLOCK_SIZE_RANGE: std::ops::RangeInclusive<u32> = 1..=4096;
}

impl RoutingStrategy {
    /// The name users type (`RANDOM`, `LEAST_OUTSTANDING_REQUESTS`, `PREFIX_AWARE`).
    pub fn user_name(self) -> &'static str {
        match self {
            RoutingStrategy::Unspecified | RoutingStrategy::Random => "RANDOM",
            RoutingStrategy::LeastOutstandingRequests => "LEAST_OUTSTANDING_REQUESTS",
            RoutingStrategy::PrefixAware => "PREFIX_AWARE",
        }
    }

    /// Parses a user-typed name; accepts the proto names too.
    pub fn from_user_name(name: &str) -> Option<Self> {
        let name = name.trim();
        let short = name.strip_prefix("ROUTING_STRATEGY_").unwrap_or(name);
        match short.to_ascii_uppercase().as_str() {
            "RANDOM" => Some(RoutingStrategy::Random),
            "LEAST_OUTSTANDING_REQUESTS" => Some(RoutingStrategy::LeastOutstandingRequests),
            "PREFIX_AWARE" => Some(RoutingStrategy::PrefixAware),
            _ => None,
        }
    }

    /// Every user-typed name, for error messages.
    pub const USER_NAMES: &'static str = "RANDOM, LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE";
}

impl RequestPriority {
    /// The name users type (`CRITICAL`, `STANDARD`, `SHEDDABLE`; unset is `STANDARD`).
    pub fn user_name(self) -> &'static str {
        match self {
            RequestPriority::Critical => "CRITICAL",
            RequestPriority::Unspecified | RequestPriority::Standard => "STANDARD",
            RequestPriority::Sheddable => "SHEDDABLE",
        }
    }

    /// Parses a user-typed name, in any case (the header's `critical` too); accepts the proto
    /// names.
    pub fn from_user_name(name: &str) -> Option<Self> {
        let name = name.trim().to_ascii_uppercase();
        match name.strip_prefix("REQUEST_PRIORITY_").unwrap_or(&name) {
            "CRITICAL" => Some(RequestPriority::Critical),
            "STANDARD" => Some(RequestPriority::Standard),
            "SHEDDABLE" => Some(RequestPriority::Sheddable),
            _ => None,
        }
    }

    /// Every user-typed name, for error messages.
    pub const USER_NAMES: &'static str = "CRITICAL, STANDARD, SHEDDABLE";
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn priority_names_round_trip() {
        for p in [
            RequestPriority::Critical,
            RequestPriority::Standard,
            RequestPriority::Sheddable,
        ] {
            assert_eq!(RequestPriority::from_user_name(p.user_name()), Some(p));
        }
        assert_eq!(
            RequestPriority::from_user_name("sheddable"),
            Some(RequestPriority::Sheddable)
        );
        assert_eq!(
            RequestPriority::from_user_name("REQUEST_PRIORITY_CRITICAL"),
            Some(RequestPriority::Critical)
        );
        assert_eq!(RequestPriority::from_user_name("urgent"), None);
    }

    #[test]
    fn strategy_names_round_trip() {
        for s in [
            RoutingStrategy::Random,
            RoutingStrategy::LeastOutstandingRequests,
            RoutingStrategy::PrefixAware,
        ] {
            assert_eq!(RoutingStrategy::from_user_name(s.user_name()), Some(s));
        }
        assert_eq!(
            RoutingStrategy::from_user_name("ROUTING_STRATEGY_PREFIX_AWARE"),
            Some(RoutingStrategy::PrefixAware)
        );
        assert_eq!(RoutingStrategy::from_user_name("PREFIX_AWAR"), None);
    }

    #[test]
    fn encoded_table_decodes_from_watch_response() {
        let table = RoutingTable {
            version: 7,
            endpoints: vec![EndpointRoutes {
                endpoint_name: "e".into(),
                ..Default::default()
            }],
        };
        let resp = WatchRoutingTableResponse {
            version: 7,
            nonce: "n".into(),
            routing_table: table.encode_to_vec().into(),
        };
        let back = RoutingTable::decode(resp.routing_table).unwrap();
        assert_eq!(back, table);
    }
}
