//! A future wrapper that polls its future again at once when the future
//! woke itself during the poll, instead of handing that wake-up to tokio.
//!
//! Why: hyper's HTTP/1 connection task wakes itself in the middle of most
//! requests (the dispatcher feeds the request body into the channel the
//! handler, polled in the same task a moment earlier, is waiting on). A
//! task woken during its own poll is requeued by tokio's multi-threaded
//! scheduler as a yield, and a yield wakes an idle worker thread to steal
//! it: one needless thread wake-up (and often a move of the request to
//! the other CPU) per request. Measured in `bmx bench mcp`
//! (docs/benchmarks.md, "MCP").
//!
//! The re-polls are bounded ([`MAX_REPOLLS`]): past them the wake-up goes
//! to tokio after all, so a future that keeps waking itself still yields
//! to the other tasks.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

/// Immediate re-polls per poll before the wake-up goes to the scheduler.
pub const MAX_REPOLLS: usize = 4;

/// See the module docs.
pub struct RepollSelfWake<F> {
    inner: F,
    state: Arc<State>,
    waker: Waker,
}

struct State {
    /// The wrapper is polling the inner future right now.
    polling: AtomicBool,
    /// A wake-up came since the last poll of the inner future began.
    woken: AtomicBool,
    /// The task's own waker, for wake-ups that come between polls.
    task: futures_util::task::AtomicWaker,
}

impl Wake for State {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Set first, then look: either the poller sees `woken` after it
        // stops polling, or this sees that it stopped and wakes the task.
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

impl<F: Future> RepollSelfWake<F> {
    pub fn new(inner: F) -> Self {
        let state = Arc::new(State {
            polling: AtomicBool::new(false),
            woken: AtomicBool::new(false),
            task: futures_util::task::AtomicWaker::new(),
        });
        let waker = Waker::from(state.clone());
        RepollSelfWake {
            inner,
            state,
            waker,
        }
    }
}

impl<F: Future + Unpin> Future for RepollSelfWake<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = &mut *self;
        this.state.task.register(cx.waker());
        for _ in 0..=MAX_REPOLLS {
            this.state.woken.store(false, Ordering::SeqCst);
            this.state.polling.store(true, Ordering::SeqCst);
            let mut inner_cx = Context::from_waker(&this.waker);
            let r = Pin::new(&mut this.inner).poll(&mut inner_cx);
            this.state.polling.store(false, Ordering::SeqCst);
            if r.is_ready() {
                return r;
            }
            if !this.state.woken.load(Ordering::SeqCst) {
                return Poll::Pending;
            }
        }
        // Still waking itself: let the other tasks run first.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Wakes itself during the first `n` polls, then is ready.
    struct SelfWaking {
        left: usize,
        polls: Arc<AtomicUsize>,
    }

    impl Future for SelfWaking {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.left == 0 {
                return Poll::Ready(());
            }
            self.left -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    /// Counts the wake-ups the wrapper hands to its task.
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll_once<F: Future + Unpin>(
        f: &mut RepollSelfWake<F>,
        count: &Arc<Count>,
    ) -> Poll<F::Output> {
        let waker = Waker::from(count.clone());
        Pin::new(f).poll(&mut Context::from_waker(&waker))
    }

    #[test]
    fn a_self_wake_is_polled_again_without_waking_the_task() {
        let polls = Arc::new(AtomicUsize::new(0));
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let mut f = RepollSelfWake::new(SelfWaking {
            left: 2,
            polls: polls.clone(),
        });
        assert!(poll_once(&mut f, &count).is_ready());
        assert_eq!(polls.load(Ordering::SeqCst), 3);
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn past_the_bound_the_task_is_woken_and_yields() {
        let polls = Arc::new(AtomicUsize::new(0));
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let mut f = RepollSelfWake::new(SelfWaking {
            left: 100,
            polls: polls.clone(),
        });
        assert!(poll_once(&mut f, &count).is_pending());
        assert_eq!(polls.load(Ordering::SeqCst), MAX_REPOLLS + 1);
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the task yields once");
    }

    #[tokio::test]
    async fn a_wake_from_elsewhere_between_polls_reaches_the_task() {
        let (tx, rx) = tokio::sync::oneshot::channel::<u8>();
        let f = RepollSelfWake::new(rx);
        let task = tokio::spawn(f);
        tokio::task::yield_now().await;
        tx.send(7).unwrap();
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("woken")
            .unwrap();
        assert_eq!(got, Ok(7));
    }
}
