//! Backend work that must not depend on its caller staying alive (§5: a cancelled
//! Acquire leaves nothing reserved; §12: nothing leaked on any path).
//!
//! Every state-changing backend operation the engine starts (an admission, a report,
//! giving a grant back, abandoning a permit) is a [`Work`], run by the one helper
//! [`Engine::detached`]:
//! - on a **local** backend (`is_remote() == false`, whose futures finish in their
//!   first poll) it runs inline, borrowing the engine: no task, no allocation, its
//!   effects visible on return;
//! - on a **remote** backend it runs in a task of its own, so a caller dropped
//!   mid-round-trip cannot leave it half-done: the task finishes, and an answer
//!   nobody reads any more goes to [`Work::unread`] (an admission gives its grant
//!   back there).
//!
//! [`Engine::detach`] is the same for callers that cannot await (a `Drop`, or the
//! no-await stretch after a grant): it starts the work and forgets it.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Waker};

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

impl<B: Backend> Engine<B> {
    /// Run `work` inline on a local backend, in its own task on a remote one (see
    /// the module docs). `None` when the task failed (it panicked or the runtime
    /// is shutting down). Dropping the returned future never stops the work once it
    /// has been polled.
    pub(super) async fn detached<W: Work<B>>(&self, work: W) -> Option<W::Output> {
        if !self.backend.is_remote() {
            return Some(work.run(self).await);
        }
        let engine = self.arc();
        let task = tokio::spawn(async move {
            let out = work.run(&engine).await;
            Answer {
                work,
                out: Some(out),
                engine,
            }
        });
        task.await
            .ok()
            .map(|mut a| a.out.take().expect("filled once"))
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
