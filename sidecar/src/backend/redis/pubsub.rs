//! The admin broadcast (§9): every host hears every host's `force_open`,
//! `force_close` and `reset`, so each can clear its own cooldown memo.
//!
//! The admin scripts publish `"<op> <source>"` on `<prefix>:admin` themselves (in
//! the same atomic step as the change). [`AdminFeed`] keeps one subscription to that
//! channel alive (reconnecting, rotating over the configured nodes, pinging to notice
//! a silent death) and turns each message into an [`AdminEvent`]. Messages published
//! while a host's subscriber is disconnected are lost for that host (pub/sub has no
//! replay).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ::redis::{Client, Value};
use futures_util::StreamExt;
use tokio::sync::broadcast;

use crate::backend::event::AdminEvent;

/// Capacity of the admin event channel (a lagging receiver loses the oldest events).
const ADMIN_CHANNEL_CAPACITY: usize = 256;

/// How often the subscriber pings its connection to detect a silent death.
const SUBSCRIBER_PING: Duration = Duration::from_secs(5);

/// Pause between two subscription attempts.
const RESUBSCRIBE_DELAY: Duration = Duration::from_millis(200);

/// The live subscription to the admin channel and the events it yields; the
/// subscriber task stops when this is dropped.
pub(super) struct AdminFeed {
    /// The channel name (`<prefix>:admin`), also handed to the admin scripts.
    channel: String,
    /// Where events go; [`AdminFeed::events`] hands out receivers.
    tx: broadcast::Sender<AdminEvent>,
    /// `true` while the subscriber holds a live subscription.
    subscribed: Arc<AtomicBool>,
    /// The subscriber task, stopped on drop.
    task: tokio::task::AbortHandle,
}

impl AdminFeed {
    /// Start subscribing to `<prefix>:admin` on `urls` (tried in turn). Must be called
    /// inside a Tokio runtime; never waits for Redis.
    pub(super) fn start(urls: Vec<String>, prefix: &str, timeout: Duration) -> Self {
        let channel = format!("{prefix}:admin");
        let (tx, _) = broadcast::channel(ADMIN_CHANNEL_CAPACITY);
        let subscribed = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(subscriber(
            urls,
            channel.clone(),
            tx.clone(),
            timeout,
            subscribed.clone(),
        ))
        .abort_handle();
        AdminFeed {
            channel,
            tx,
            subscribed,
            task,
        }
    }

    /// The channel name.
    pub(super) fn channel(&self) -> &str {
        &self.channel
    }

    /// Events published by any host (this one included).
    pub(super) fn events(&self) -> broadcast::Receiver<AdminEvent> {
        self.tx.subscribe()
    }

    /// `true` while the subscription is live.
    pub(super) fn subscribed(&self) -> bool {
        self.subscribed.load(Ordering::SeqCst)
    }
}

impl Drop for AdminFeed {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Keep one subscription to the admin channel alive (rotating over `urls` on
/// failure), forwarding every parsable message to `tx`.
async fn subscriber(
    urls: Vec<String>,
    channel: String,
    tx: broadcast::Sender<AdminEvent>,
    timeout: Duration,
    subscribed: Arc<AtomicBool>,
) {
    let mut i = 0usize;
    // Log once per transition, not per reconnect attempt.
    let mut failing = false;
    loop {
        let url = &urls[i % urls.len()];
        i = i.wrapping_add(1);
        let err = match subscribe(url, &channel, &tx, timeout, &subscribed).await {
            Ok(never) => match never {},
            Err(e) => e,
        };
        let was_live = subscribed.swap(false, Ordering::SeqCst);
        if was_live {
            failing = false;
            tracing::warn!(redis = %url, channel = %channel, error = %err,
                "admin subscription lost; reconnecting");
        } else if !failing {
            failing = true;
            tracing::warn!(redis = %url, channel = %channel, error = %err,
                "admin subscription unavailable; retrying");
        }
        tokio::time::sleep(RESUBSCRIBE_DELAY).await;
    }
}

/// One subscription, until it fails (it never ends otherwise). Returns why it ended.
async fn subscribe(
    url: &str,
    channel: &str,
    tx: &broadcast::Sender<AdminEvent>,
    timeout: Duration,
    subscribed: &AtomicBool,
) -> Result<std::convert::Infallible, String> {
    let client = Client::open(url).map_err(|e| e.to_string())?;
    let ps = tokio::time::timeout(timeout, client.get_async_pubsub())
        .await
        .map_err(|_| format!("connect timed out after {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    let (mut sink, mut stream) = ps.split();
    tokio::time::timeout(timeout, sink.subscribe(channel))
        .await
        .map_err(|_| format!("subscribe timed out after {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    subscribed.store(true, Ordering::SeqCst);
    tracing::debug!(redis = %url, channel, "admin subscription established");
    let mut ping = tokio::time::interval(SUBSCRIBER_PING);
    ping.tick().await;
    loop {
        tokio::select! {
            msg = stream.next() => {
                let Some(msg) = msg else {
                    return Err("subscription connection closed".into());
                };
                let payload = String::from_utf8_lossy(msg.get_payload_bytes()).into_owned();
                match AdminEvent::parse(&payload) {
                    Some(ev) => {
                        let _ = tx.send(ev);
                    }
                    None => tracing::debug!(payload, "ignoring unknown admin message"),
                }
            }
            _ = ping.tick() => {
                tokio::time::timeout(timeout, sink.ping::<Value>())
                    .await
                    .map_err(|_| format!("ping timed out after {timeout:?}"))?
                    .map_err(|e| e.to_string())?;
            }
        }
    }
}
