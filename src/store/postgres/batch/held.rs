//! Keys whose claim statement waits on a held row, so that a sender's
//! retries of such a key do not take every slot for claims.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::store::ClaimRequest;

/// The keys of claim statements that have been at the database for
/// `stuck_after` or longer: waiting, nearly always, on a row another
/// transaction is inserting (an open transaction, or another replica's
/// statement waiting behind one). A new claim of such a key is answered in
/// flight without a statement: sent, it would wait on the same row, and a
/// sender retrying the key, each retry in a statement of its own, would
/// take every slot for claims, and every other key's claim with them, for
/// as long as the row is held.
#[derive(Default)]
pub(in crate::store::postgres) struct HeldClaims {
    /// How many keys are marked; read without the lock by every batch.
    marked: AtomicUsize,
    keys: Mutex<HashMap<(Arc<str>, String), usize>>,
}

impl HeldClaims {
    /// For each of `requests`, whether its key is marked; `None` when no
    /// key is (the usual case, decided without the lock).
    pub(super) fn held_among(&self, requests: &[ClaimRequest]) -> Option<Vec<bool>> {
        if self.marked.load(Ordering::Acquire) == 0 {
            return None;
        }
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let held: Vec<bool> = requests
            .iter()
            .map(|request| keys.contains_key(&(Arc::clone(&request.source), request.key.clone())))
            .collect();
        held.contains(&true).then_some(held)
    }

    /// Runs `statement`, the claim statement of `requests`; their keys are
    /// marked from `stuck_after` until it returns. Only the statement is
    /// timed: a key it has decided is never marked.
    pub(super) async fn marked_while_stuck<T>(
        &self,
        requests: &[&ClaimRequest],
        stuck_after: Duration,
        statement: impl Future<Output = T>,
    ) -> T {
        let mut statement = std::pin::pin!(statement);
        match tokio::time::timeout(stuck_after, &mut statement).await {
            Ok(done) => done,
            Err(_) => {
                let _marked = self.mark(requests);
                statement.await
            }
        }
    }

    /// Marks the keys of `requests` until the guard is dropped.
    fn mark(&self, requests: &[&ClaimRequest]) -> Marked<'_> {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        let mine: Vec<(Arc<str>, String)> = requests
            .iter()
            .map(|request| (Arc::clone(&request.source), request.key.clone()))
            .collect();
        for key in &mine {
            *keys.entry(key.clone()).or_default() += 1;
        }
        self.marked.store(keys.len(), Ordering::Release);
        Marked { held: self, mine }
    }
}

/// Keys marked held, until dropped.
struct Marked<'a> {
    held: &'a HeldClaims,
    mine: Vec<(Arc<str>, String)>,
}

impl Drop for Marked<'_> {
    fn drop(&mut self) {
        let mut keys = self
            .held
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for key in &self.mine {
            if let Some(count) = keys.get_mut(key) {
                *count -= 1;
                if *count == 0 {
                    keys.remove(key);
                }
            }
        }
        self.held.marked.store(keys.len(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STUCK_AFTER: Duration = Duration::from_millis(250);

    #[tokio::test(start_paused = true)]
    async fn keys_are_held_from_when_their_statement_is_stuck_until_it_returns() {
        let held = HeldClaims::default();
        let (stuck, other) = (
            ClaimRequest::for_test("stuck"),
            ClaimRequest::for_test("other"),
        );
        let asked = [stuck.clone(), other.clone()];
        let (finish, finished) = tokio::sync::oneshot::channel::<()>();
        let sent = [&stuck];
        let statement = held.marked_while_stuck(&sent, STUCK_AFTER, async {
            let _ = finished.await;
        });
        let mut statement = std::pin::pin!(statement);
        let running = tokio::time::timeout(STUCK_AFTER / 2, &mut statement).await;
        assert!(running.is_err(), "the statement waits");
        assert_eq!(held.held_among(&asked), None, "not stuck yet");
        let running = tokio::time::timeout(STUCK_AFTER, &mut statement).await;
        assert!(running.is_err(), "the statement still waits");
        assert_eq!(held.held_among(&asked), Some(vec![true, false]));
        finish.send(()).unwrap();
        statement.await;
        assert_eq!(held.held_among(&asked), None, "let go when it returns");
    }

    #[tokio::test(start_paused = true)]
    async fn a_statement_that_returns_in_time_marks_nothing() {
        let held = HeldClaims::default();
        let decided = ClaimRequest::for_test("decided");
        held.marked_while_stuck(&[&decided], STUCK_AFTER, async {})
            .await;
        assert_eq!(held.held_among(&[decided]), None);
    }

    #[test]
    fn a_key_in_two_stuck_statements_is_held_until_both_return() {
        let held = HeldClaims::default();
        let key = ClaimRequest::for_test("twice");
        let first = held.mark(&[&key]);
        let second = held.mark(&[&key]);
        drop(first);
        assert_eq!(
            held.held_among(std::slice::from_ref(&key)),
            Some(vec![true])
        );
        drop(second);
        assert_eq!(held.held_among(&[key]), None);
    }
}
