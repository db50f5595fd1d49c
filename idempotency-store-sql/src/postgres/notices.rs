//! How a [`PostgresStore`]'s waiters hear that a record was settled: one `LISTEN`
//! connection per store, its notices handed to every waiter of the process.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::broadcast;

use super::PostgresStore;

/// How often a waiter looks at its record although no notice came: a lapsed lease is
/// not announced, and a notice can be lost while the listening connection reconnects.
pub(super) const SAFETY_POLL: Duration = Duration::from_secs(1);

/// The announcements of settled records (finalized or released), heard on one
/// connection per store and handed to every waiter of this process.
#[derive(Debug)]
pub(super) struct Notices {
    sender: broadcast::Sender<Arc<str>>,
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
    pub(super) async fn start(pool: &PgPool, channel: &str) -> Result<Self, sqlx::Error> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(channel).await?;
        let (sender, _) = broadcast::channel(1024);
        let announce = sender.clone();
        let listening = tokio::spawn(async move {
            loop {
                match listener.recv().await {
                    Ok(notice) => {
                        let _ = announce.send(Arc::from(notice.payload()));
                    }
                    // The listener reconnects on the next `recv`; waiters meanwhile
                    // fall back on their safety poll.
                    Err(error) => {
                        tracing::warn!(%error, "idempotency: listening for settled records failed; retrying");
                        tokio::time::sleep(SAFETY_POLL).await;
                    }
                }
            }
        });
        Ok(Self {
            sender,
            _listening: AbortOnDrop(listening),
        })
    }
}

impl PostgresStore {
    /// Hears the announcements of settled records, starting the listener on first use;
    /// `None` when the database does not let us LISTEN (e.g. behind a pooler in
    /// transaction mode), and waiters then poll.
    pub(super) async fn notices(&self) -> Option<broadcast::Receiver<Arc<str>>> {
        let notices = self
            .notices
            .get_or_init(|| async {
                match Notices::start(&self.pool, &self.sql.channel).await {
                    Ok(notices) => Some(notices),
                    Err(error) => {
                        tracing::warn!(%error, "idempotency: cannot LISTEN for settled records; duplicates will poll instead");
                        None
                    }
                }
            })
            .await;
        notices.as_ref().map(|notices| notices.sender.subscribe())
    }
}
