//! Waking duplicates: finalize, release and evict announce the record's key from inside
//! their scripts, and each store hears the announcements on a connection of its own and
//! hands them to every waiter of the process.
//!
//! - On a single server: `PUBLISH` on the channel `<prefix>settled`, which one
//!   subscribed connection per store hears.
//! - On a cluster: `SPUBLISH` on the shard channel of the record's slot,
//!   `<prefix>settled{<n>}` with `n` the smallest number whose hash slot is the record's
//!   (so the announcement stays on the primary that ran the script). One RESP3 cluster
//!   connection per store `SSUBSCRIBE`s to a slot's channel when the first waiter of that
//!   slot starts, and stays subscribed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use futures_util::StreamExt as _;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{PushInfo, PushKind, Value};
use tokio::sync::{OnceCell, broadcast, oneshot};

/// How often a waiter looks at its record although no notice came: a lapsed lease is
/// not announced, and a notice can be lost while a subscribed connection reconnects.
pub(crate) const SAFETY_POLL: Duration = Duration::from_secs(1);

/// How long the single server's listener may take to subscribe, per attempt.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(5);

/// What waiters hear: a settled record's key, or an empty payload meaning "look again"
/// (after a (re)subscription, notices may have been missed; no record key is empty).
pub(crate) type Notice = Arc<[u8]>;

/// Where a store's settled records are announced and heard.
pub(crate) struct Board {
    /// `<prefix>settled`.
    channel: Vec<u8>,
    sender: broadcast::Sender<Notice>,
    source: Source,
}

/// How a store hears announcements.
pub(crate) enum Source {
    /// A single server: the client to subscribe with, and the listener, started by the
    /// first wait.
    Server {
        client: Box<redis::Client>,
        listening: OnceCell<AbortOnDrop>,
        /// Whether the listener is subscribed right now.
        up: Arc<AtomicBool>,
    },
    /// A cluster: a RESP3 client whose pushes go to the board's sender, its connection
    /// (made by the first wait), and the slots subscribed so far.
    Cluster(Box<ClusterSource>),
}

/// A cluster's side of [`Source`].
pub(crate) struct ClusterSource {
    client: ClusterClient,
    connection: OnceCell<ClusterConnection>,
    slots: Mutex<HashMap<u16, Arc<OnceCell<()>>>>,
}

/// Aborts the listening task with the last store handle.
pub(crate) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Board {
    /// A single server's board.
    pub(crate) fn server(client: redis::Client, prefix: &str) -> Self {
        let (sender, _) = broadcast::channel(1024);
        Self {
            channel: format!("{prefix}settled").into_bytes(),
            sender,
            source: Source::Server {
                client: Box::new(client),
                listening: OnceCell::new(),
                up: Arc::new(AtomicBool::new(false)),
            },
        }
    }

    /// A cluster's board: `build` gets the push sender to configure a RESP3 cluster
    /// client with, and returns that client.
    pub(crate) fn cluster<E>(
        prefix: &str,
        build: impl FnOnce(
            Box<dyn Fn(PushInfo) -> Result<(), redis::aio::SendError> + Send + Sync>,
        ) -> Result<ClusterClient, E>,
    ) -> Result<Self, E> {
        let (sender, _) = broadcast::channel(1024);
        let announce = sender.clone();
        let client = build(Box::new(move |push: PushInfo| {
            let notice = match push.kind {
                PushKind::SMessage => match push.data.last() {
                    Some(Value::BulkString(key)) => Notice::from(&key[..]),
                    _ => return Ok(()),
                },
                // A connection dropped, or a subscription was (re)made: look again.
                PushKind::Disconnection | PushKind::SSubscribe => Notice::from(&[][..]),
                _ => return Ok(()),
            };
            let _ = announce.send(notice);
            Ok(())
        }))?;
        Ok(Self {
            channel: format!("{prefix}settled").into_bytes(),
            sender,
            source: Source::Cluster(Box::new(ClusterSource {
                client,
                connection: OnceCell::new(),
                slots: Mutex::new(HashMap::new()),
            })),
        })
    }

    /// The command and channel the scripts announce the record at `key` with.
    pub(crate) fn announcement(&self, key: &[u8]) -> (&'static str, Vec<u8>) {
        match self.source {
            Source::Server { .. } => ("PUBLISH", self.channel.clone()),
            Source::Cluster(_) => ("SPUBLISH", self.slot_channel(slot_of(key))),
        }
    }

    /// `<prefix>settled{<n>}`, a shard channel in `slot`.
    fn slot_channel(&self, slot: u16) -> Vec<u8> {
        let mut channel = self.channel.clone();
        channel.extend_from_slice(format!("{{{}}}", SLOT_TAGS[usize::from(slot)]).as_bytes());
        channel
    }

    /// A receiver of the notices that concern the record at `key`, from now on, once a
    /// subscription that hears them is up (so that a waiter that loads its record after
    /// this misses no announcement); `None` if none is up within `patience`, and the
    /// waiter then polls.
    pub(crate) async fn listen_for(
        &self,
        key: &[u8],
        patience: Duration,
    ) -> Option<broadcast::Receiver<Notice>> {
        let heard = self.sender.subscribe();
        match &self.source {
            Source::Server {
                client,
                listening,
                up,
            } => {
                listening
                    .get_or_init(|| self.listen_on_server((**client).clone(), up.clone(), patience))
                    .await;
                up.load(Ordering::Acquire).then_some(heard)
            }
            Source::Cluster(cluster) => {
                let ClusterSource {
                    client,
                    connection,
                    slots,
                } = &**cluster;
                let slot = slot_of(key);
                let subscribed = slots
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .entry(slot)
                    .or_default()
                    .clone();
                let subscribing = subscribed.get_or_try_init(|| async {
                    let connection = connection
                        .get_or_try_init(|| client.get_async_connection())
                        .await?;
                    connection.clone().ssubscribe(self.slot_channel(slot)).await
                });
                match tokio::time::timeout(patience, subscribing).await {
                    Ok(Ok(())) => Some(heard),
                    Ok(Err(error)) => {
                        tracing::warn!(
                            %error,
                            "idempotency store: cannot subscribe to a Redis Cluster shard channel for settled records; waiters poll"
                        );
                        None
                    }
                    Err(_) => {
                        tracing::warn!(
                            "idempotency store: subscribing to a Redis Cluster shard channel timed out; waiters poll"
                        );
                        None
                    }
                }
            }
        }
    }

    /// Starts the single server's listener, waiting up to `patience` for its first
    /// attempt to subscribe; it keeps `up` current and keeps trying in the background,
    /// and waiters poll while it is down.
    async fn listen_on_server(
        &self,
        client: redis::Client,
        up: Arc<AtomicBool>,
        patience: Duration,
    ) -> AbortOnDrop {
        let announce = self.sender.clone();
        let channel = self.channel.clone();
        let (tried, first) = oneshot::channel();
        let listening = tokio::spawn(async move {
            let mut tried = Some(tried);
            loop {
                match subscribe(&client, &channel).await {
                    Ok(pubsub) => {
                        up.store(true, Ordering::Release);
                        if let Some(tried) = tried.take() {
                            let _ = tried.send(());
                        }
                        let _ = announce.send(Notice::from(&[][..]));
                        let mut messages = pubsub.into_on_message();
                        while let Some(message) = messages.next().await {
                            let _ = announce.send(Notice::from(message.get_payload_bytes()));
                        }
                        up.store(false, Ordering::Release);
                        // Waiters listening now may miss notices: they look again.
                        let _ = announce.send(Notice::from(&[][..]));
                        tracing::warn!(
                            "idempotency store: the Redis connection that hears settled records closed; reconnecting (waiters look once a second meanwhile)"
                        );
                    }
                    Err(error) => {
                        if let Some(tried) = tried.take() {
                            let _ = tried.send(());
                        }
                        tracing::warn!(
                            %error,
                            "idempotency store: cannot subscribe to Redis for settled records; retrying (waiters poll meanwhile)"
                        );
                    }
                }
                tokio::time::sleep(SAFETY_POLL).await;
            }
        });
        let _ = tokio::time::timeout(patience, first).await;
        AbortOnDrop(listening)
    }
}

/// A connection subscribed to `channel`, or why not.
async fn subscribe(client: &redis::Client, channel: &[u8]) -> Result<redis::aio::PubSub, String> {
    let subscribing = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok::<_, redis::RedisError>(pubsub)
    };
    match tokio::time::timeout(SUBSCRIBE_TIMEOUT, subscribing).await {
        Ok(Ok(pubsub)) => Ok(pubsub),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err(format!("no answer within {SUBSCRIBE_TIMEOUT:?}")),
    }
}

/// The Redis Cluster hash slot of `key`: CRC16 (XMODEM) of its hash tag (what lies
/// between the first `{` and the next `}`, if not empty) or of the whole key, mod 16384.
pub(crate) fn slot_of(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16(hashed) % 16384
}

/// CRC16 as Redis Cluster computes slots with it (XMODEM), from the `crc16` crate the
/// `redis` crate hashes its cluster keys with.
fn crc16(bytes: &[u8]) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(bytes)
}

/// For each slot, the smallest number whose decimal digits hash to it.
static SLOT_TAGS: LazyLock<Vec<u32>> = LazyLock::new(|| {
    let mut tags = vec![u32::MAX; 16384];
    let mut missing = tags.len();
    let mut n: u32 = 0;
    while missing > 0 {
        let slot = usize::from(crc16(n.to_string().as_bytes()) % 16384);
        if tags[slot] == u32::MAX {
            tags[slot] = n;
            missing -= 1;
        }
        n += 1;
    }
    tags
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_the_redis_cluster_rules() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        assert_eq!(slot_of(b"foo{}{bar}"), slot_of(b"foo{}{bar}"));
        assert_ne!(slot_of(b"foo{}{bar}"), slot_of(b"bar"));
        assert_eq!(slot_of(b"foo{{bar}}zap"), slot_of(b"{bar"));
    }

    #[test]
    fn every_slot_has_a_channel_in_it() {
        let board = Board {
            channel: b"p:settled".to_vec(),
            sender: broadcast::channel(1).0,
            source: Source::Server {
                client: Box::new(redis::Client::open("redis://127.0.0.1:1").unwrap()),
                listening: OnceCell::new(),
                up: Arc::new(AtomicBool::new(false)),
            },
        };
        for slot in [0, 1, 5000, 12182, 16383] {
            assert_eq!(slot_of(&board.slot_channel(slot)), slot);
        }
        assert!(SLOT_TAGS.iter().all(|&n| n != u32::MAX));
    }
}
