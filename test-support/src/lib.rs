//! Every test helper the workspace shares, so no test crate keeps a copy of its own.
//!
//! - [`wait`]: wait on a condition (async or blocking), never a sleep that hopes the state arrived.
//! - [`http_stub`]: a raw HTTP/1.1 server on `127.0.0.1:0` answering from a handler, and the request
//!   reader for servers that break the protocol on purpose.
//! - [`child`]: a workspace binary started on port 0, its address read back from its
//!   `NAME listening on ADDR` line; [`unused_port`] / [`unused_url`] for a port nothing listens on.
//! - [`in_process`]: a server started in this process on `127.0.0.1:0` from the serve call a test
//!   names in a closure ([`InProcessServer`]): its address, its task, its graceful stop.
//! - [`skip`]: the skip policy. A test that cannot run here says why, on stderr and in the one-line
//!   summary `scripts/test.sh` prints; under `CI=true` it fails instead.
//!
//! Invariant: nothing here sleeps for a fixed time to let state settle; every wait names its
//! condition and its limit, and a timeout panics with what was awaited.

pub mod child;
pub mod http_stub;
pub mod in_process;
pub mod skip;
pub mod wait;

pub use child::{bin, unused_port, unused_url, ChildServer};
pub use http_stub::{HttpStub, StubReply, StubRequest};
pub use in_process::{bind_loopback, InProcessServer, Shutdown};
pub use skip::{python_modules, require_tool, skip};
pub use wait::{at_timeout, poll_blocking, wait_for, wait_for_blocking, Condition};
