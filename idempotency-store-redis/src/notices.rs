//! Waking duplicates on a single server: finalize, release and evict `PUBLISH` the
//! record's key on the store's channel, and one subscribed connection per store hands
//! what it hears to every waiter of the process.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt as _;
use tokio::sync::{broadcast, oneshot};

/// How often a waiter looks at its record although no notice came: a lapsed lease is
/// not announced, and a notice can be lost while the subscribed connection reconnects.
pub(crate) const SAFETY_POLL: Duration = Duration::from_secs(1);

/// What the listener hands to waiters: a settled record's key, or an empty payload
/// after each (re)subscription, meaning "look again" (notices may have been missed while
/// no connection was subscribed; no record key is empty).
pub(crate) type Notice = Arc<[u8]>;

/// The subscription of one store: its channel's notices, heard on one connection.
#[derive(Debug)]
pub(crate) struct Notices {
    sender: broadcast::Sender<Notice>,
    _listening: AbortOnDrop,
}

#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Notices {
    /// Starts listening on `channel`, and waits up to `patience` for the first
    /// subscription (after which no announcement is missed); the listener keeps trying
    /// in the background if it is not up by then, and waiters poll meanwhile.
    pub(crate) async fn start(client: redis::Client, channel: Vec<u8>, patience: Duration) -> Self {
        let (sender, _) = broadcast::channel(1024);
        let announce = sender.clone();
        let (subscribed, first) = oneshot::channel();
        let listening = tokio::spawn(async move {
            let mut subscribed = Some(subscribed);
            loop {
                match subscribe(&client, &channel).await {
                    Ok(pubsub) => {
                        if let Some(subscribed) = subscribed.take() {
                            let _ = subscribed.send(());
                        }
                        let _ = announce.send(Notice::from(&[][..]));
                        let mut messages = pubsub.into_on_message();
                        while let Some(message) = messages.next().await {
                            let _ = announce.send(Notice::from(message.get_payload_bytes()));
                        }
                        tracing::warn!(
                            "idempotency store: the Redis connection that hears settled records closed; reconnecting (waiters poll meanwhile)"
                        );
                    }
                    Err(error) => tracing::warn!(
                        %error,
                        "idempotency store: cannot subscribe to Redis for settled records; retrying (waiters poll meanwhile)"
                    ),
                }
                tokio::time::sleep(SAFETY_POLL).await;
            }
        });
        let _ = tokio::time::timeout(patience, first).await;
        Self {
            sender,
            _listening: AbortOnDrop(listening),
        }
    }

    /// A receiver of the notices from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<Notice> {
        self.sender.subscribe()
    }
}

/// A connection subscribed to `channel`, or why not (within 5 s).
async fn subscribe(client: &redis::Client, channel: &[u8]) -> Result<redis::aio::PubSub, String> {
    let subscribing = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok::<_, redis::RedisError>(pubsub)
    };
    match tokio::time::timeout(Duration::from_secs(5), subscribing).await {
        Ok(Ok(pubsub)) => Ok(pubsub),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err("no answer within 5 s".to_owned()),
    }
}
