//! Waiting on a condition: check it until it holds or a limit passes, then panic naming what was
//! awaited. The one way a test waits for state; a fixed sleep would only hope the state arrived.

use std::future::Future;
use std::time::Duration;

/// How often a condition is checked.
const POLL: Duration = Duration::from_millis(10);

/// What a check returns: a `bool` (holds or not), or an `Option` (the value once it holds).
pub trait Condition {
    /// What the wait returns once the condition holds.
    type Value;
    /// `Some` once the condition holds.
    fn holds(self) -> Option<Self::Value>;
}

impl Condition for bool {
    type Value = ();
    fn holds(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Condition for Option<T> {
    type Value = T;
    fn holds(self) -> Option<T> {
        self
    }
}

/// Awaits `check` every 10 ms until it holds and returns its value; panics naming `what` once
/// `limit` has passed. A synchronous check is written `|| async { cond() }`.
pub async fn wait_for<C, Fut>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> Fut,
) -> C::Value
where
    C: Condition,
    Fut: Future<Output = C>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().await.holds() {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`wait_for`] for tests without a runtime: checks `check` every 10 ms on this thread.
pub fn wait_for_blocking<C: Condition>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> C,
) -> C::Value {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().holds() {
            return value;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering::SeqCst};

    #[tokio::test]
    async fn returns_the_value_once_the_condition_holds() {
        let calls = AtomicU32::new(0);
        let got = wait_for("the third call", Duration::from_secs(5), || async {
            let n = calls.fetch_add(1, SeqCst) + 1;
            (n == 3).then_some(n)
        })
        .await;
        assert_eq!(got, 3);
        wait_for("a bool", Duration::from_secs(5), || async { true }).await;
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for the impossible")]
    async fn a_timeout_names_what_was_awaited() {
        wait_for("the impossible", Duration::from_millis(30), || async {
            false
        })
        .await;
    }

    #[test]
    fn blocking_waits_on_this_thread() {
        let mut n = 0;
        let got = wait_for_blocking("n to reach 2", Duration::from_secs(5), || {
            n += 1;
            (n == 2).then_some(n)
        });
        assert_eq!(got, 2);
    }
}
