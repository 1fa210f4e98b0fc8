//! The backend contract suite against the memory backend, on a manual clock.

mod contract;

use std::sync::Arc;
use std::time::Duration;

use contract::{Harness, SOURCES};
use polygate::backend::memory::MemoryBackend;
use polygate::clock::ManualClock;

/// Fresh memory backends sharing one manual clock.
struct Memory {
    /// Advanced by `advance`, read by every backend made here.
    clock: Arc<ManualClock>,
}

impl Harness for Memory {
    type B = MemoryBackend;

    async fn fresh(&self) -> MemoryBackend {
        MemoryBackend::new(self.clock.clone(), SOURCES)
    }

    async fn advance(&self, d: Duration) {
        self.clock.advance(d);
    }

    fn tolerance(&self) -> Duration {
        Duration::ZERO
    }

    async fn lose_state(&self, _b: MemoryBackend) -> MemoryBackend {
        // A restarted process: every breaker fresh at epoch 0.
        self.fresh().await
    }
}

contract_tests!(Memory {
    clock: Arc::new(ManualClock::new())
});
