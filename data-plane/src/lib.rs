//! prefix-router data plane (in progress).
