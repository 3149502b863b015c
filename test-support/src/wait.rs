//! Waiting on a condition: check it until it holds or a limit passes, then panic naming what was
//! awaited. The one way a test waits for state; a fixed sleep would only hope the state arrived.

use std::fmt;
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

/// A description of what is awaited, written when a timeout shows it: the state at the timeout
/// (a log's end, the last error), not at the start of the wait.
/// `wait_for(&at_timeout(|| format!("the server; its log: {}", log())), ..)`.
pub fn at_timeout<F: Fn() -> String>(describe: F) -> impl fmt::Display {
    struct AtTimeout<F>(F);
    impl<F: Fn() -> String> fmt::Display for AtTimeout<F> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&(self.0)())
        }
    }
    AtTimeout(describe)
}

/// Awaits `check` every 10 ms until it holds and returns its value; panics naming `what` once
/// `limit` has passed. A synchronous check is written `|| async { cond() }`.
pub async fn wait_for<C, Fut>(
    what: &(impl fmt::Display + ?Sized),
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
    what: &(impl fmt::Display + ?Sized),
    limit: Duration,
    check: impl FnMut() -> C,
) -> C::Value {
    match poll_blocking(limit, POLL, check) {
        Some(value) => value,
        None => panic!("timed out after {limit:?} waiting for {what}"),
    }
}

/// Checks `check` every `every` on this thread until it holds (its value) or `limit` has passed
/// (`None`): for a wait whose timeout is an outcome, not a failure (a probe with a timeout), or
/// whose check is too costly to run every 10 ms (a probe that starts a process).
pub fn poll_blocking<C: Condition>(
    limit: Duration,
    every: Duration,
    mut check: impl FnMut() -> C,
) -> Option<C::Value> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().holds() {
            return Some(value);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(every);
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
    #[should_panic(expected = "waiting for the impossible after several checks")]
    fn a_timeout_describes_the_state_at_the_timeout() {
        let checks = AtomicU32::new(0);
        let describe = || {
            let when = match checks.load(SeqCst) {
                0 | 1 => "before the checks",
                _ => "after several checks",
            };
            format!("the impossible {when}")
        };
        wait_for_blocking(&at_timeout(describe), Duration::from_millis(30), || {
            checks.fetch_add(1, SeqCst);
            false
        });
    }

    #[test]
    fn poll_blocking_returns_none_once_the_limit_passed() {
        let mut n = 0;
        let got = poll_blocking(Duration::from_millis(30), POLL, || {
            n += 1;
            (n > 1_000).then_some(n)
        });
        assert_eq!(got, None);
        assert!(n > 1, "checked until the limit, not once");
        assert_eq!(poll_blocking(Duration::ZERO, POLL, || Some(7)), Some(7));
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
