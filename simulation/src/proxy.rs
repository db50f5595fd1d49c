//! A TCP proxy in front of PostgreSQL or MySQL/MariaDB that loses the answer to a
//! `COMMIT`: it passes the statement on to the server (which commits), then drops the
//! client's connection without a word, as a network failure or a failover right after the
//! `COMMIT` does. Armed for the next `COMMIT` (a test that picks its moment), or for a
//! seeded share of them (the simulation). It can also cut a seeded share of connections
//! at a statement: just before it (the server never sees it), or just after passing it on
//! (the server runs it, with nobody to answer: a cut while the statement runs). And it can
//! restart the server as its clients see a restart: every connection cut at once, new
//! ones refused for a while, then served again; what the server committed survives, and
//! what it had not is rolled back as it sees its clients go (what this does not model is
//! a server that loses commits it acknowledged, which `fsync` rules out).
//!
//! It reads the client's side of each connection by the protocol's framing, to find a
//! simple-query `COMMIT` (PostgreSQL's `Q` message, MySQL's `COM_QUERY`); the server's
//! side is copied through untouched. TLS must be off (both test servers have it off).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

/// Which wire protocol the proxied server speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    /// PostgreSQL's frontend/backend protocol.
    Postgres,
    /// MySQL's and MariaDB's client/server protocol.
    MySql,
}

/// The proxy, listening on a loopback port of its own until dropped.
pub struct CommitProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    accepting: tokio::task::JoinHandle<()>,
}

struct Shared {
    wire: Wire,
    upstream: SocketAddr,
    /// Lose the answer to the next `COMMIT`.
    armed: AtomicBool,
    /// Cut the connections of the next statements so, one each, in order.
    armed_cuts: Mutex<std::collections::VecDeque<Cut>>,
    /// How many `COMMIT` answers were lost.
    lost: AtomicU32,
    /// Lose each `COMMIT`'s answer with this probability, drawn from this generator.
    at_random: Mutex<Option<(f64, StdRng)>>,
    /// Cut the connection before a statement with this probability, drawn from this
    /// generator.
    cut_at_random: Mutex<Option<(f64, StdRng)>>,
    /// How many connections were cut before a statement.
    cuts: AtomicU32,
    /// How many connections were cut after passing a statement on.
    cuts_during: AtomicU32,
    /// Bumped at each restart: every relayed connection is cut.
    restarts: tokio::sync::watch::Sender<u32>,
    /// Until when new connections are refused (the server restarting).
    down_until: Mutex<Option<tokio::time::Instant>>,
    /// Told each time connections are dropped (cut, or by a restart).
    dropped: Mutex<Option<Dropped>>,
}

/// What the proxy tells when it drops connections.
pub type Dropped = Arc<dyn Fn() + Send + Sync>;

/// Where a connection is cut at a statement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Before the statement: the server never sees it.
    Before,
    /// After passing it on: the server runs it, and its answer is lost.
    During,
}

impl Shared {
    /// Whether to lose the answer to the `COMMIT` passing now.
    fn lose(&self) -> bool {
        if self.armed.swap(false, Ordering::SeqCst) {
            return true;
        }
        let mut at_random = self.at_random.lock().expect("the proxy's generator");
        at_random
            .as_mut()
            .is_some_and(|(probability, rng)| rng.random::<f64>() < *probability)
    }

    /// Whether to cut the connection at the statement passing now, and where.
    fn cut(&self) -> Option<Cut> {
        if let Some(armed) = self
            .armed_cuts
            .lock()
            .expect("the proxy's cuts")
            .pop_front()
        {
            return Some(armed);
        }
        let mut at_random = self.cut_at_random.lock().expect("the proxy's generator");
        let (probability, rng) = at_random.as_mut()?;
        if rng.random::<f64>() >= *probability {
            return None;
        }
        Some(if rng.random::<bool>() {
            Cut::Before
        } else {
            Cut::During
        })
    }

    /// Tells whoever listens that connections were dropped.
    fn tell_dropped(&self) {
        let dropped = self.dropped.lock().expect("the proxy's listener").clone();
        if let Some(dropped) = dropped {
            dropped();
        }
    }

    /// Whether new connections are refused now (the server restarting).
    fn down(&self) -> bool {
        let down_until = self.down_until.lock().expect("the proxy's restart");
        down_until.is_some_and(|until| tokio::time::Instant::now() < until)
    }
}

impl CommitProxy {
    /// A proxy for the server at `upstream`.
    pub async fn start(wire: Wire, upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let shared = Arc::new(Shared {
            wire,
            upstream,
            armed: AtomicBool::new(false),
            armed_cuts: Mutex::default(),
            lost: AtomicU32::new(0),
            at_random: Mutex::new(None),
            cut_at_random: Mutex::new(None),
            cuts: AtomicU32::new(0),
            cuts_during: AtomicU32::new(0),
            restarts: tokio::sync::watch::Sender::new(0),
            down_until: Mutex::new(None),
            dropped: Mutex::new(None),
        });
        let accepting = tokio::spawn({
            let shared = shared.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    tokio::spawn(relay(shared.clone(), client));
                }
            }
        });
        Self {
            address,
            shared,
            accepting,
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.address.port()
    }

    /// Loses the answer to the next `COMMIT` any connection sends.
    pub fn lose_next_commit_answer(&self) {
        self.shared.armed.store(true, Ordering::SeqCst);
    }

    /// Cuts the connection of the next statement any connection sends (after the ones
    /// armed before), at `cut`.
    pub fn cut_next_statement(&self, cut: Cut) {
        self.shared
            .armed_cuts
            .lock()
            .expect("the proxy's cuts")
            .push_back(cut);
    }

    /// Loses the answer to each `COMMIT` with `probability`, the draws seeded by `seed`.
    pub fn lose_commit_answers(&self, probability: f64, seed: u64) {
        *self.shared.at_random.lock().expect("the proxy's generator") =
            Some((probability, StdRng::seed_from_u64(seed)));
    }

    /// Cuts the connection at each statement with `probability`, the draws seeded by
    /// `seed`: half of them before the statement (the server never sees it), half after
    /// passing it on (the server runs it; its answer is lost). The client sees its
    /// connection closed either way.
    pub fn cut_connections(&self, probability: f64, seed: u64) {
        *self
            .shared
            .cut_at_random
            .lock()
            .expect("the proxy's generator") = Some((probability, StdRng::seed_from_u64(seed)));
    }

    /// Stops losing answers and cutting connections.
    pub fn stop_losing(&self) {
        self.shared
            .armed_cuts
            .lock()
            .expect("the proxy's cuts")
            .clear();
        *self.shared.at_random.lock().expect("the proxy's generator") = None;
        *self
            .shared
            .cut_at_random
            .lock()
            .expect("the proxy's generator") = None;
    }

    /// How many connections were cut before a statement so far.
    pub fn cuts(&self) -> u32 {
        self.shared.cuts.load(Ordering::SeqCst)
    }

    /// How many connections were cut after passing a statement on so far.
    pub fn cuts_during(&self) -> u32 {
        self.shared.cuts_during.load(Ordering::SeqCst)
    }

    /// Restarts the server as its clients see it: cuts every connection now, and refuses
    /// new ones for `down_for`.
    pub fn restart(&self, down_for: Duration) {
        *self.shared.down_until.lock().expect("the proxy's restart") =
            Some(tokio::time::Instant::now() + down_for);
        self.shared.tell_dropped();
        self.shared.restarts.send_modify(|restarts| *restarts += 1);
    }

    /// Calls `dropped` (until `None` replaces it) each time connections are dropped: a
    /// restart, or a connection cut at a statement.
    pub fn on_dropped_connections(&self, dropped: Option<Dropped>) {
        *self.shared.dropped.lock().expect("the proxy's listener") = dropped;
    }

    /// How many restarts so far.
    pub fn restarts(&self) -> u32 {
        *self.shared.restarts.borrow()
    }

    /// How many `COMMIT` answers were lost so far.
    pub fn lost(&self) -> u32 {
        self.shared.lost.load(Ordering::SeqCst)
    }
}

impl Drop for CommitProxy {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

/// One client connection, relayed until either side closes, an answer is lost, or the
/// server restarts. While the server is down, a new connection is closed at once.
async fn relay(shared: Arc<Shared>, client: TcpStream) {
    if shared.down() {
        return;
    }
    let mut restarts = shared.restarts.subscribe();
    let Ok(server) = TcpStream::connect(shared.upstream).await else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let cut = Arc::new(AtomicBool::new(false));
    let answers = tokio::spawn(copy_answers(server_read, client_write, cut.clone()));
    let restarted = tokio::select! {
        () = requests(&shared, client_read, server_write, &cut) => false,
        _ = restarts.changed() => true,
    };
    if restarted {
        cut.store(true, Ordering::SeqCst);
    } else if cut.load(Ordering::SeqCst) {
        // Give the server time to commit before its side closes too.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    answers.abort();
}

/// The server's side, copied to the client until the connection is cut.
async fn copy_answers(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, cut: Arc<AtomicBool>) {
    let mut buffer = vec![0_u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if cut.load(Ordering::SeqCst) || to.write_all(&buffer[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The client's side, message by message, passed on to the server; returns once either
/// side closed, or once the connection is cut at a statement (`cut` set).
async fn requests(
    shared: &Shared,
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    cut: &AtomicBool,
) {
    // PostgreSQL's first messages (the startup message, and an SSL or GSS request before
    // it) have no type byte.
    let mut untyped = shared.wire == Wire::Postgres;
    loop {
        let message = match shared.wire {
            Wire::Postgres => read_postgres(&mut from, &mut untyped).await,
            Wire::MySql => read_mysql(&mut from).await,
        };
        let Some(Message {
            bytes: message,
            is_statement,
            is_commit,
        }) = message
        else {
            return;
        };
        let cut_here = if is_statement { shared.cut() } else { None };
        if cut_here.is_some() {
            shared.tell_dropped();
        }
        if cut_here == Some(Cut::Before) {
            cut.store(true, Ordering::SeqCst);
            shared.cuts.fetch_add(1, Ordering::SeqCst);
            return;
        }
        if cut_here == Some(Cut::During) {
            cut.store(true, Ordering::SeqCst);
            let _ = to.write_all(&message).await;
            shared.cuts_during.fetch_add(1, Ordering::SeqCst);
            return;
        }
        let lose = is_commit && shared.lose();
        if lose {
            // Set first: the answer must not slip through.
            cut.store(true, Ordering::SeqCst);
        }
        if to.write_all(&message).await.is_err() {
            return;
        }
        if lose {
            shared.lost.fetch_add(1, Ordering::SeqCst);
            return;
        }
    }
}

/// A client's message, whole, and what it is.
struct Message {
    bytes: Vec<u8>,
    /// A statement for the server to run (PostgreSQL: a simple query or an execute;
    /// MySQL: a text query or a prepared statement's execution).
    is_statement: bool,
    /// The text query `COMMIT`.
    is_commit: bool,
}

/// A PostgreSQL frontend message.
async fn read_postgres(from: &mut OwnedReadHalf, untyped: &mut bool) -> Option<Message> {
    let mut message = Vec::new();
    let mut kind = 0_u8;
    if !*untyped {
        kind = from.read_u8().await.ok()?;
        message.push(kind);
    }
    let length = from.read_u32().await.ok()?;
    message.extend_from_slice(&length.to_be_bytes());
    let mut body = vec![0_u8; (length as usize).checked_sub(4)?];
    from.read_exact(&mut body).await.ok()?;
    if *untyped {
        // SSLRequest (80877103) and GSSENCRequest (80877104) come before the startup message.
        let code = body
            .get(..4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        *untyped = matches!(code, Some(80_877_103 | 80_877_104));
    }
    let is_commit = kind == b'Q' && body.strip_suffix(&[0]).is_some_and(is_commit_text);
    message.extend_from_slice(&body);
    Some(Message {
        bytes: message,
        is_statement: kind == b'Q' || kind == b'E',
        is_commit,
    })
}

/// A MySQL client packet.
async fn read_mysql(from: &mut OwnedReadHalf) -> Option<Message> {
    let mut header = [0_u8; 4];
    from.read_exact(&mut header).await.ok()?;
    let length = u32::from_le_bytes([header[0], header[1], header[2], 0]) as usize;
    let mut payload = vec![0_u8; length];
    from.read_exact(&mut payload).await.ok()?;
    // COM_QUERY (0x03), then the statement (after the query attributes' two counts, when
    // the client sends them).
    let is_commit = payload.first() == Some(&0x03)
        && payload.len() <= 16
        && (is_commit_text(&payload[1..]) || payload.get(3..).is_some_and(is_commit_text));
    // A command starts a new exchange (sequence 0); the handshake's packets do not.
    // COM_QUERY (0x03) and COM_STMT_EXECUTE (0x17) run a statement.
    let is_statement = header[3] == 0 && matches!(payload.first(), Some(0x03 | 0x17));
    let mut message = header.to_vec();
    message.extend_from_slice(&payload);
    Some(Message {
        bytes: message,
        is_statement,
        is_commit,
    })
}

fn is_commit_text(text: &[u8]) -> bool {
    text.trim_ascii().eq_ignore_ascii_case(b"COMMIT")
}
