//! Backend work that must not depend on its caller staying alive (§5: a cancelled
//! Acquire leaves nothing reserved; §12: nothing leaked on any path).
//!
//! Every state-changing backend operation the engine starts (an admission, a report,
//! giving a grant back, abandoning a permit) is a [`Work`], run by the one helper
//! [`Engine::detached`]:
//! - on a **local** backend (`is_remote() == false`, whose futures finish in their
//!   first poll) it runs inline, borrowing the engine: no task, no allocation, its
//!   effects visible on return;
//! - on a **remote** backend it is polled by its caller too (no task per round
//!   trip: a spawn, a wake-up of another worker and a join cost more than the work's
//!   own CPU), but from a box it owns ([`Finish`]): a caller dropped mid-round-trip
//!   hands the box to a task of its own, so the work is never left half-done; the
//!   task finishes, and an answer nobody reads any more goes to [`Work::unread`] (an
//!   admission gives its grant back there).
//!
//! [`Engine::detach`] is the same for callers that cannot await (a `Drop`, or the
//! no-await stretch after a grant): it starts the work and forgets it.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use super::Engine;
use crate::backend::Backend;

/// One piece of backend work, owning what it needs.
pub(super) trait Work<B: Backend>: Send + Sync + 'static {
    /// What the work answers.
    type Output: Send + 'static;

    /// Do it, against `engine`.
    fn run<'a>(&'a self, engine: &'a Engine<B>) -> impl Future<Output = Self::Output> + Send + 'a;

    /// The caller went away before reading `out` (remote backends only): give back
    /// whatever `out` still holds. Most work holds nothing.
    fn unread(&self, _out: Self::Output, _engine: &Engine<B>) {}
}

/// A remote work's answer in transit from its task to the caller; dropped unread
/// (the caller was cancelled before or after the task finished), it hands the answer
/// to [`Work::unread`].
struct Answer<B: Backend, W: Work<B>> {
    /// The work that produced it.
    work: W,
    /// The answer; taken when read.
    out: Option<W::Output>,
    /// The engine the work ran against.
    engine: Arc<Engine<B>>,
}

impl<B: Backend, W: Work<B>> Drop for Answer<B, W> {
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            self.work.unread(out, &self.engine);
        }
    }
}

/// A remote work's future, polled by whoever awaits it; dropped before it finished
/// (its caller was cancelled), it is moved into a task of its own and runs to the
/// end there. Never polled, it is dropped with nothing started.
struct Finish<F: Future + Send + 'static>
where
    F::Output: Send + 'static,
{
    /// The work's future; `None` once it finished.
    fut: Option<Pin<Box<F>>>,
    /// Whether it was polled (an unpolled work has started nothing: no task for it).
    started: bool,
}

impl<F: Future + Send + 'static> Future for Finish<F>
where
    F::Output: Send + 'static,
{
    /// `None` when the work panicked (as a task's `JoinError` would say).
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(f) = this.fut.as_mut() else {
            return Poll::Ready(None);
        };
        this.started = true;
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| f.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => {
                this.fut = None;
                Poll::Ready(Some(out))
            }
            Err(_) => {
                this.fut = None;
                Poll::Ready(None)
            }
        }
    }
}

impl<F: Future + Send + 'static> Drop for Finish<F>
where
    F::Output: Send + 'static,
{
    fn drop(&mut self) {
        if let Some(f) = self.fut.take() {
            // Outside a runtime (its teardown) nothing could run it any more.
            if self.started {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    drop(rt.spawn(f));
                }
            }
        }
    }
}

impl<B: Backend> Engine<B> {
    /// Run `work` inline on a local backend; on a remote one polled by the caller
    /// but finished in a task of its own if the caller goes away (see the module
    /// docs). `None` when the work panicked. Dropping the returned future never
    /// stops the work once it has been polled.
    ///
    /// A plain `fn` returning an `async move` block, not an `async fn`: an `async
    /// fn`'s future keeps its argument twice (as passed, and moved into the body),
    /// and `work` is a few hundred bytes that every caller's future carries (§16:
    /// each request's future is boxed and moved once).
    #[allow(clippy::manual_async_fn)] // the `async fn` form is the one that stores `work` twice
    pub(super) fn detached<W: Work<B>>(
        &self,
        work: W,
    ) -> impl Future<Output = Option<W::Output>> + Send + '_ {
        async move {
            if !self.backend.is_remote() {
                return Some(work.run(self).await);
            }
            let engine = self.arc();
            let fut = Box::pin(async move {
                let out = work.run(&engine).await;
                Answer {
                    work,
                    out: Some(out),
                    engine,
                }
            });
            let finish = Finish {
                fut: Some(fut),
                started: false,
            };
            finish.await.map(|mut a| a.out.take().expect("filled once"))
        }
    }

    /// Start `work` now, as [`Engine::detached`] would, and forget its answer: a
    /// local backend's work is done on return, a remote one's runs on in its task.
    pub(super) fn detach<W: Work<B>>(&self, work: W) {
        let mut cx = Context::from_waker(Waker::noop());
        let first = pin!(self.detached(work)).poll(&mut cx);
        debug_assert!(
            first.is_ready() || self.backend.is_remote(),
            "a local backend's futures complete in their first poll"
        );
    }
}
