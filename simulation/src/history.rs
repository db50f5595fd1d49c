//! What one run did, as the clients, the handler and the store saw it: the history the
//! checker judges and a failure prints.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

/// The scope and key a request, an execution or a store call is about.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyOf {
    /// The caller the key belongs to.
    pub scope: String,
    /// The `Idempotency-Key`.
    pub key: String,
}

/// An answer as a client (or the handler) saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// Whether it carried `idempotent-replayed`.
    pub replayed: bool,
    /// The `x-exec` header, which names the execution that produced the answer.
    pub exec_header: Option<String>,
    /// The whole body.
    pub body: Bytes,
}

/// How a request ended for its client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// An HTTP answer.
    Answered(Answer),
    /// The service failed or the handler panicked: no answer.
    Failed,
    /// The client stopped waiting (on purpose: a client that goes away mid-request).
    GaveUp,
}

/// What a store call came to, as the store itself answered it (before any injected
/// fault replaced the answer the layer got).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreResult {
    /// `reserve`: the caller owns the key under this token and a lease.
    Reserved(i64),
    /// `reserve`: the caller owns the key under this token, on a store that holds its
    /// reservations unseen, uncommitted (no lease, unless it is taken over: the store
    /// handed the key to a record under a lease).
    ReservedUncommitted(i64),
    /// `reserve`, `load`, `wait`: a live record in flight under this token.
    InFlight(i64),
    /// `reserve`, `load`, `wait`: a completed record.
    Completed,
    /// `reserve`: someone holds the key, record not visible.
    Busy,
    /// `load`, `wait`: no live record.
    Absent,
    /// A fenced call changed the record.
    Held,
    /// A fenced call changed nothing.
    Lost,
    /// `take_over`: the new token, if the takeover happened.
    TookOver(Option<i64>),
    /// The store's own error.
    Error,
    /// Not called: the fault came before the call.
    NotCalled,
}

/// A fault the simulation put between the layer and the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// None.
    None,
    /// The call failed before it reached the store.
    ErrorBefore,
    /// The store did the call, and its answer was lost (the layer got an error).
    AnswerLost,
}

/// One store call, by the wrapper the layer called.
#[derive(Clone, Debug)]
pub struct StoreCall {
    /// `reserve`, `load`, `wait`, `renew`, `hold`, `finalize`, `release`, `take_over`.
    pub operation: &'static str,
    /// The key.
    pub key: KeyOf,
    /// The token the caller passed (fenced calls).
    pub token: Option<i64>,
    /// The lease or hold the call asked for (`reserve`, `renew`, `take_over`, `hold`).
    pub lease: Option<Duration>,
    /// When the call started and ended, from the run's start.
    pub started: Duration,
    /// When the call ended.
    pub ended: Duration,
    /// The fault injected, if any.
    pub fault: Fault,
    /// The delay injected before the call.
    pub delayed: Duration,
    /// What the store answered.
    pub result: StoreResult,
}

/// One event of a run.
#[derive(Clone, Debug)]
pub enum Event {
    /// A client sent request `request`.
    Sent {
        /// The request's number in the run.
        request: u64,
        /// Its key.
        key: KeyOf,
        /// Its body (which makes its binding, with the method and path, which never vary).
        body: &'static str,
        /// What the handler was asked to do.
        behaviour: String,
    },
    /// Its client got an answer, or gave up.
    Ended {
        /// The request.
        request: u64,
        /// How.
        ending: Ending,
    },
    /// The handler started execution `exec` for `request` under `token`.
    ExecStarted {
        /// The execution's number.
        exec: u64,
        /// The request it runs.
        request: u64,
        /// The key (from the request).
        key: KeyOf,
        /// The request's body.
        body: &'static str,
        /// The token of the reservation the layer ran it under.
        token: i64,
    },
    /// The execution ended, with the answer it gave (none: it panicked or failed).
    ExecEnded {
        /// The execution.
        exec: u64,
        /// Its answer: status and body.
        answer: Option<(u16, Bytes)>,
        /// Whether the answer was marked `OutcomeUnknown`.
        unknown: bool,
        /// What became of the handler's change (targets with [`Effects`](crate::Effects)).
        change: Change,
        /// The answer the handler recorded with its change, where that differs from the
        /// one its client got (the client got an error: the `COMMIT` failed, or its
        /// answer was lost, and the record may hold this one).
        recorded: Option<(u16, Bytes)>,
    },
    /// A store call.
    Store(StoreCall),
    /// The server dropped client connections (a restart, or a connection cut at a
    /// statement): the transactions open on them ended.
    ConnectionsDropped,
    /// The quiet phase began: every client has finished.
    Quiet,
}

/// What became of a handler's change, as the handler saw its `COMMIT` end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// The handler wrote none.
    None,
    /// Committed.
    Committed,
    /// Not committed (rolled back, or never begun).
    NotCommitted,
    /// The answer to its `COMMIT` was lost: committed or not, the database knows.
    Unknown,
}

/// The events of one run, each with its time from the run's start.
pub struct History {
    started: Instant,
    events: Mutex<Vec<(Duration, Event)>>,
}

impl Default for History {
    fn default() -> Self {
        Self::new()
    }
}

impl History {
    /// An empty history starting now.
    pub fn new() -> Self {
        Self {
            started: Instant::now(),
            events: Mutex::new(Vec::new()),
        }
    }

    /// Time since the run started.
    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Records `event` at the current time.
    pub fn push(&self, event: Event) {
        let at = self.now();
        self.push_at(at, event);
    }

    /// Records `event` at `at`.
    pub fn push_at(&self, at: Duration, event: Event) {
        self.events.lock().expect("history lock").push((at, event));
    }

    /// The events so far, in the order they were recorded.
    pub fn events(&self) -> Vec<(Duration, Event)> {
        self.events.lock().expect("history lock").clone()
    }

    /// The history as text, one event a line, tokens named by their order of appearance
    /// (T1, T2, …) so that two runs of one seed compare equal; only events about `keys`
    /// when given.
    pub fn render(&self, keys: Option<&[KeyOf]>) -> String {
        let mut tokens = Tokens::default();
        let mut out = String::new();
        for (at, event) in self.events() {
            if let Some(keys) = keys {
                let about = match &event {
                    Event::Sent { key, .. } | Event::ExecStarted { key, .. } => Some(key),
                    Event::Store(call) => Some(&call.key),
                    _ => None,
                };
                if about.is_some_and(|key| !keys.contains(key)) {
                    continue;
                }
            }
            let line = match event {
                Event::Sent {
                    request,
                    key,
                    body,
                    behaviour,
                } => format!(
                    "request {request} sent: {}/{} body {body:?}, handler {behaviour}",
                    key.scope, key.key
                ),
                Event::Ended { request, ending } => match ending {
                    Ending::Answered(answer) => format!(
                        "request {request} answered {}{} {:?}",
                        answer.status,
                        if answer.replayed { " (replay)" } else { "" },
                        String::from_utf8_lossy(&answer.body)
                    ),
                    Ending::Failed => format!("request {request} failed (no answer)"),
                    Ending::GaveUp => format!("request {request}: its client gave up"),
                },
                Event::ExecStarted {
                    exec,
                    request,
                    key,
                    body,
                    token,
                } => format!(
                    "exec {exec} started for request {request} ({}/{} body {body:?}) under {}",
                    key.scope,
                    key.key,
                    tokens.name(token)
                ),
                Event::ExecEnded {
                    exec,
                    answer,
                    unknown,
                    change,
                    ..
                } => match answer {
                    Some((status, _)) if unknown => {
                        format!("exec {exec} ended {status}, outcome unknown")
                    }
                    Some((status, _)) if change == Change::Committed => {
                        format!("exec {exec} ended {status}, its change committed")
                    }
                    Some((status, _)) if change == Change::Unknown => {
                        format!("exec {exec} ended {status}, its COMMIT's answer lost")
                    }
                    Some((status, _)) => format!("exec {exec} ended {status}"),
                    None => format!("exec {exec} ended without an answer"),
                },
                Event::Store(call) => {
                    let mut line = format!(
                        "  store {} {}/{}",
                        call.operation, call.key.scope, call.key.key
                    );
                    if let Some(token) = call.token {
                        let _ = write!(line, " {}", tokens.name(token));
                    }
                    if let Some(lease) = call.lease {
                        let _ = write!(line, " for {} ms", lease.as_millis());
                    }
                    let result = match call.result {
                        StoreResult::Reserved(token) => format!("reserved {}", tokens.name(token)),
                        StoreResult::ReservedUncommitted(token) => {
                            format!("reserved {} uncommitted", tokens.name(token))
                        }
                        StoreResult::InFlight(token) => format!("in flight {}", tokens.name(token)),
                        StoreResult::TookOver(Some(token)) => {
                            format!("took over as {}", tokens.name(token))
                        }
                        StoreResult::TookOver(None) => "no takeover".to_owned(),
                        other => format!("{other:?}").to_lowercase(),
                    };
                    let _ = write!(line, " -> {result} (until {} ms)", call.ended.as_millis());
                    match call.fault {
                        Fault::None => {}
                        Fault::ErrorBefore => line.push_str(" [fault: failed before the store]"),
                        Fault::AnswerLost => line.push_str(" [fault: answer lost]"),
                    }
                    line
                }
                Event::ConnectionsDropped => "the server dropped connections".to_owned(),
                Event::Quiet => "every client finished; quiet phase".to_owned(),
            };
            let _ = writeln!(out, "{:>6} ms  {line}", at.as_millis());
        }
        out
    }
}

/// Names tokens T1, T2, … in the order they appear.
#[derive(Default)]
struct Tokens(HashMap<i64, usize>);

impl Tokens {
    fn name(&mut self, token: i64) -> String {
        let next = self.0.len() + 1;
        format!("T{}", self.0.entry(token).or_insert(next))
    }
}
