//! hyper's timer for one webhook connection, which hyper uses for the header
//! read timeout. hyper asks for a new timer at every request head and drops
//! it once the head is read; a new tokio timer is entered in the runtime's
//! timer wheel under its lock and taken out again when dropped, about 2% of
//! the proxy's instructions per pass-through request. This one hands out the
//! connection's one tokio timer again and again: moving a registered timer's
//! deadline later costs an atomic exchange.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::rt::{Sleep, Timer};

/// The connection's tokio timer while hyper is not using it.
type Spare = Arc<Mutex<Option<Pin<Box<tokio::time::Sleep>>>>>;

/// Made for each connection (a timer shared by many connections would wake
/// whichever used it last).
#[derive(Default)]
pub(super) struct ConnectionTimer {
    spare: Spare,
}

/// A sleep hyper holds; its tokio timer goes back to the connection when
/// hyper drops it. Until the timer is handed out again its deadline may
/// pass, which wakes this connection's task once, to no effect.
struct Lent {
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    home: Spare,
}

impl Timer for ConnectionTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn Sleep>> {
        self.sleep_until(self.now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn Sleep>> {
        let deadline = tokio::time::Instant::from_std(deadline);
        let spare = self
            .spare
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let sleep = match spare {
            Some(mut sleep) => {
                sleep.as_mut().reset(deadline);
                sleep
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        Box::pin(Lent {
            sleep: Some(sleep),
            home: Arc::clone(&self.spare),
        })
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<Lent>() {
            Some(lent) => lent.reset(tokio::time::Instant::from_std(new_deadline)),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }

    fn now(&self) -> Instant {
        // tokio's clock, so that a paused clock in tests pauses this one too.
        tokio::time::Instant::now().into_std()
    }
}

impl Lent {
    fn reset(self: Pin<&mut Self>, deadline: tokio::time::Instant) {
        if let Some(sleep) = self.get_mut().sleep.as_mut() {
            sleep.as_mut().reset(deadline);
        }
    }
}

impl Future for Lent {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.get_mut().sleep.as_mut() {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Sleep for Lent {}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(sleep) = self.sleep.take() {
            *self.home.lock().unwrap_or_else(PoisonError::into_inner) = Some(sleep);
        }
    }
}

#[cfg(test)]
mod tests {
    use futures_util::FutureExt;

    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    /// tokio's timers count whole milliseconds, rounded up.
    fn assert_ended_after(elapsed: Duration, expected: Duration) {
        assert!(
            (expected..=expected + Duration::from_millis(1)).contains(&elapsed),
            "ended {elapsed:?} after the start, not {expected:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_sleep_ends_at_its_deadline_and_not_before() {
        let timer = ConnectionTimer::default();
        let start = timer.now();
        let mut sleep = timer.sleep(SECOND);
        assert!(sleep.as_mut().now_or_never().is_none());
        tokio::time::advance(SECOND / 2).await;
        assert!(sleep.as_mut().now_or_never().is_none());
        sleep.await;
        assert_ended_after(timer.now() - start, SECOND);
    }

    #[tokio::test(start_paused = true)]
    async fn a_returned_timer_is_handed_out_again_with_the_new_deadline() {
        let timer = ConnectionTimer::default();
        let mut first = timer.sleep(SECOND);
        assert!(first.as_mut().now_or_never().is_none());
        drop(first);
        assert!(timer.spare.lock().unwrap().is_some(), "returned on drop");
        // Past the first deadline: the second must not end early.
        tokio::time::advance(SECOND * 2).await;
        let start = timer.now();
        let second = timer.sleep(SECOND * 3);
        assert!(timer.spare.lock().unwrap().is_none(), "handed out again");
        second.await;
        assert_ended_after(timer.now() - start, SECOND * 3);
    }

    #[tokio::test(start_paused = true)]
    async fn resetting_moves_the_deadline_either_way() {
        let timer = ConnectionTimer::default();
        let start = timer.now();
        let mut sleep = timer.sleep(SECOND);
        assert!(sleep.as_mut().now_or_never().is_none());
        timer.reset(&mut sleep, start + SECOND * 5);
        tokio::time::advance(SECOND * 2).await;
        assert!(sleep.as_mut().now_or_never().is_none());
        timer.reset(&mut sleep, start + SECOND * 3);
        sleep.await;
        assert_ended_after(timer.now() - start, SECOND * 3);
    }
}
