//! The history checker: judges a whole run from what the clients got, what the handler
//! ran and what the store answered. The rules are listed in the crate docs.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;

use crate::history::{Answer, Change, Ending, Event, KeyOf, StoreCall, StoreResult};
use crate::plan::{Behaviour, Settings};

/// A broken rule, with the keys whose history shows it.
#[derive(Clone, Debug)]
pub struct Violation {
    /// The rule, as the crate docs name it.
    pub rule: &'static str,
    /// What happened.
    pub what: String,
    /// The keys involved.
    pub keys: Vec<KeyOf>,
}

struct Request {
    key: KeyOf,
    body: &'static str,
    behaviour: Option<Behaviour>,
    sent: Duration,
    ended: Option<(Duration, Ending)>,
}

struct Exec {
    request: u64,
    key: KeyOf,
    body: &'static str,
    token: i64,
    started: Duration,
    /// Where the start and the end are in the history: events at one instant are
    /// ordered by these.
    started_seq: usize,
    ended_seq: Option<usize>,
    answer: Option<(u16, Bytes)>,
    /// The answer recorded with its change, where its client got another.
    recorded: Option<(u16, Bytes)>,
    unknown: bool,
    /// What became of its change.
    change: Change,
    /// And its record with it.
    stored_with_change: bool,
    ended: Option<Duration>,
}

/// What a history holds, indexed for the rules.
struct Indexed {
    requests: HashMap<u64, Request>,
    execs: HashMap<u64, Exec>,
    calls: Vec<StoreCall>,
    /// When the reservation each token descends from was asked for: the record cannot
    /// have been created earlier, so it cannot expire before this plus the lifetime.
    chain_start: HashMap<i64, Duration>,
    /// When the server dropped client connections.
    dropped: Vec<Duration>,
}

fn index(events: &[(Duration, Event)]) -> Indexed {
    let mut indexed = Indexed {
        requests: HashMap::new(),
        execs: HashMap::new(),
        calls: Vec::new(),
        chain_start: HashMap::new(),
        dropped: Vec::new(),
    };
    for (seq, (at, event)) in events.iter().enumerate() {
        match event {
            Event::Sent {
                request,
                key,
                body,
                behaviour,
            } => {
                indexed.requests.insert(
                    *request,
                    Request {
                        key: key.clone(),
                        body,
                        behaviour: Behaviour::from_name(behaviour),
                        sent: *at,
                        ended: None,
                    },
                );
            }
            Event::Ended { request, ending } => {
                if let Some(sent) = indexed.requests.get_mut(request) {
                    sent.ended = Some((*at, ending.clone()));
                }
            }
            Event::ExecStarted {
                exec,
                request,
                key,
                body,
                token,
            } => {
                indexed.execs.insert(
                    *exec,
                    Exec {
                        request: *request,
                        key: key.clone(),
                        body,
                        token: *token,
                        started: *at,
                        started_seq: seq,
                        ended_seq: None,
                        answer: None,
                        recorded: None,
                        unknown: false,
                        change: Change::None,
                        stored_with_change: false,
                        ended: None,
                    },
                );
            }
            Event::ExecEnded {
                exec,
                answer,
                unknown,
                change,
                recorded,
            } => {
                if let Some(run) = indexed.execs.get_mut(exec) {
                    run.recorded = recorded.clone();
                    run.ended_seq = Some(seq);
                    run.ended = Some(*at);
                    run.answer = answer.clone();
                    run.unknown = *unknown;
                    run.change = *change;
                }
            }
            Event::Store(call) => indexed.calls.push(call.clone()),
            Event::ConnectionsDropped => indexed.dropped.push(*at),
            Event::Quiet => {}
        }
    }
    // Calls are recorded when they end; chains follow that order.
    for call in &indexed.calls {
        match call.result {
            StoreResult::Reserved(token) | StoreResult::ReservedUncommitted(token) => {
                indexed.chain_start.insert(token, call.started);
            }
            StoreResult::TookOver(Some(token)) => {
                let from = call
                    .token
                    .and_then(|lapsed| indexed.chain_start.get(&lapsed).copied())
                    .unwrap_or(Duration::ZERO);
                indexed.chain_start.insert(token, from);
            }
            _ => {}
        }
    }
    indexed
}

impl Indexed {
    fn calls_with(&self, token: i64) -> impl Iterator<Item = &StoreCall> {
        self.calls
            .iter()
            .filter(move |call| call.token == Some(token))
    }

    /// The store call `operation` with `token` that the store answered `Held`.
    fn held(&self, operation: &str, token: i64) -> Option<&StoreCall> {
        self.calls_with(token)
            .find(|call| call.operation == operation && call.result == StoreResult::Held)
    }

    /// Whether another owner took the key over from `token`: its reservation was a record
    /// under a lease, whatever the store's kind.
    fn taken_over(&self, token: i64) -> bool {
        self.calls_with(token)
            .any(|call| matches!(call.result, StoreResult::TookOver(Some(_))))
    }

    /// The end of the last lease the store granted `token` (reserve, takeover, renew,
    /// hold) in a call that had ended by `before`; an uncommitted reservation's lasts
    /// for ever. Calls that were cancelled or failed before the store grant nothing
    /// certain, and count for nothing.
    fn granted_until(&self, token: i64, before: Duration) -> Option<Duration> {
        self.calls
            .iter()
            .filter(|grant| grant.ended <= before)
            .filter_map(|grant| {
                let lease = grant.lease?;
                let granted = match grant.result {
                    StoreResult::ReservedUncommitted(reserved)
                        if reserved == token && !self.taken_over(token) =>
                    {
                        return Some(Duration::MAX);
                    }
                    StoreResult::ReservedUncommitted(reserved) => reserved == token,
                    StoreResult::Reserved(reserved) => reserved == token,
                    StoreResult::TookOver(Some(taken)) => taken == token,
                    StoreResult::Held => {
                        grant.token == Some(token) && matches!(grant.operation, "renew" | "hold")
                    }
                    _ => false,
                };
                granted.then(|| grant.started + lease)
            })
            .max()
    }

    /// Whether a `finalize` of `token` failed while the server dropped connections: the
    /// statement may have run and committed with its answer lost (an autocommit
    /// statement whose connection was cut while it ran).
    fn finalize_may_have_landed(&self, token: i64) -> bool {
        self.calls_with(token).any(|call| {
            call.operation == "finalize"
                && call.result == StoreResult::Error
                && self
                    .dropped
                    .iter()
                    .any(|&at| call.started <= at && at <= call.ended)
        })
    }

    /// The first time after `since` the server dropped client connections.
    fn dropped_after(&self, since: Duration) -> Option<Duration> {
        self.dropped.iter().copied().find(|&at| at >= since)
    }

    /// The earliest the record of `token` can expire.
    fn earliest_expiry(&self, token: i64, lifetime: Duration) -> Duration {
        self.chain_start.get(&token).copied().unwrap_or_default() + lifetime
    }
}

/// Judges one run. `final_requests` are the quiet phase's probes, one per key, each of
/// which must run (nothing may be left held or stored once every record expired).
pub(crate) fn check(
    events: &[(Duration, Event)],
    settings: &Settings,
    final_requests: &[u64],
    in_database: Option<(&[u64], bool)>,
) -> Vec<Violation> {
    let mut history = index(events);
    // A change in the database whose record commits with it keeps the key like a stored
    // answer; one whose record is kept elsewhere is kept by the finalize that follows it.
    if let Some((found, true)) = in_database {
        for (id, exec) in history.execs.iter_mut() {
            exec.stored_with_change = found.contains(id);
        }
    }
    let mut violations = Vec::new();
    let tolerance = settings.clock_tolerance;
    let mut violation =
        |rule, what: String, keys: Vec<KeyOf>| violations.push(Violation { rule, what, keys });

    let mut requests: Vec<_> = history.requests.iter().collect();
    requests.sort_by_key(|(id, _)| **id);
    for &(&id, request) in &requests {
        let Some((ended, ending)) = &request.ended else {
            violation(
                "every request ends",
                format!("request {id} never got an answer"),
                vec![request.key.clone()],
            );
            continue;
        };
        let Ending::Answered(answer) = ending else {
            continue;
        };
        match answer_of_exec(answer) {
            Some(exec_id) => {
                let Some(exec) = history.execs.get(&exec_id) else {
                    violation(
                        "own answer or a replay",
                        format!("request {id} was answered by exec {exec_id}, which never ran"),
                        vec![request.key.clone()],
                    );
                    continue;
                };
                if !answer.replayed {
                    if exec.request != id {
                        violation(
                            "own answer or a replay",
                            format!(
                                "request {id} got exec {exec_id}'s answer (request {}) \
                                 without the replay header",
                                exec.request
                            ),
                            vec![request.key.clone(), exec.key.clone()],
                        );
                    }
                    continue;
                }
                if exec.key != request.key || exec.body != request.body {
                    violation(
                        "never another binding's answer",
                        format!(
                            "request {id} ({}/{} body {:?}) was replayed exec {exec_id}'s \
                             answer, which ran {}/{} body {:?}",
                            request.key.scope,
                            request.key.key,
                            request.body,
                            exec.key.scope,
                            exec.key.key,
                            exec.body
                        ),
                        vec![request.key.clone(), exec.key.clone()],
                    );
                }
                let first = exec.answer.as_ref();
                let replayed = (answer.status, answer.body.clone());
                if first != Some(&replayed) && exec.recorded.as_ref() != Some(&replayed) {
                    violation(
                        "replays are byte-identical",
                        format!(
                            "request {id}'s replay ({} {:?}) differs from exec {exec_id}'s \
                             answer ({first:?})",
                            answer.status, answer.body
                        ),
                        vec![request.key.clone()],
                    );
                }
                let stored_kind = history
                    .requests
                    .get(&exec.request)
                    .and_then(|first| first.behaviour)
                    .is_some_and(Behaviour::is_stored);
                if !stored_kind || exec.unknown {
                    violation(
                        "only stored answers replay",
                        format!(
                            "request {id} was replayed exec {exec_id}'s answer {}, which is \
                             never stored (5xx, 401, unknown outcome)",
                            answer.status
                        ),
                        vec![request.key.clone()],
                    );
                }
                if history.held("finalize", exec.token).is_none()
                    && !history.finalize_may_have_landed(exec.token)
                    && !exec.stored_with_change
                {
                    violation(
                        "only stored answers replay",
                        format!(
                            "request {id} was replayed exec {exec_id}'s answer, which the \
                             store never finalized"
                        ),
                        vec![request.key.clone()],
                    );
                }
            }
            None if answer.replayed => violation(
                "replays are byte-identical",
                format!("request {id}'s replay lost the x-exec header the first answer had"),
                vec![request.key.clone()],
            ),
            None => {
                // The layer's own answer: a refusal or "in flight".
                let waited = *ended - request.sent;
                // The wait itself, plus the time the key's other store calls took
                // meanwhile and the delays injected into its waits.
                let store_time: Duration = history
                    .calls
                    .iter()
                    .filter(|call| {
                        call.key == request.key
                            && call.started >= request.sent
                            && call.ended <= *ended
                    })
                    .map(|call| match call.operation {
                        "wait" => call.delayed,
                        _ => call.ended - call.started,
                    })
                    .sum();
                let bound = settings.in_flight_wait
                    + store_time
                    + tolerance * 4
                    + Duration::from_millis(20);
                if matches!(answer.status, 409 | 503) && waited > bound {
                    violation(
                        "a duplicate waits no longer than the in-flight wait",
                        format!(
                            "request {id} was answered {} after {} ms (wait {} ms)",
                            answer.status,
                            waited.as_millis(),
                            settings.in_flight_wait.as_millis()
                        ),
                        vec![request.key.clone()],
                    );
                }
            }
        }
    }

    let mut execs: Vec<_> = history.execs.iter().collect();
    execs.sort_by_key(|(id, _)| **id);
    for &(&id, exec) in &execs {
        let ends = history.earliest_expiry(exec.token, settings.lifetime);
        let kept = [
            ("finalize", "its stored answer"),
            ("hold", "its key, held for an unknown outcome,"),
        ];
        let kept_since = kept
            .into_iter()
            .filter_map(|(operation, what)| {
                history
                    .held(operation, exec.token)
                    .map(|call| (call.ended, what))
            })
            .chain(
                exec.stored_with_change
                    .then(|| {
                        exec.ended
                            .map(|at| (at, "change, committed with its record,"))
                    })
                    .flatten(),
            );
        for (since, what) in kept_since {
            for &(&other_id, other) in &execs {
                if other.key == exec.key
                    && other.started > since
                    && other.started + tolerance < ends
                {
                    violation(
                        "at most one execution per key and lifetime",
                        format!(
                            "exec {other_id} ran at {} ms while exec {id}'s {what} was live \
                             (until at least {} ms)",
                            other.started.as_millis(),
                            ends.as_millis()
                        ),
                        vec![exec.key.clone()],
                    );
                }
            }
        }
        let ended = exec.ended_seq.unwrap_or(usize::MAX);
        for &(&other_id, other) in &execs {
            if other_id == id
                || other.key != exec.key
                || other.started_seq < exec.started_seq
                || other.started_seq >= ended
            {
                continue;
            }
            let mut granted_until = history.granted_until(exec.token, other.started);
            // An uncommitted reservation lasts as long as its transaction, which ends when
            // the server drops its connection; an execution whose change committed kept
            // its transaction to the end.
            if granted_until == Some(Duration::MAX)
                && matches!(exec.change, Change::None | Change::NotCommitted)
                && let Some(reserved) = history.chain_start.get(&exec.token)
                && let Some(dropped) = history.dropped_after(*reserved)
            {
                granted_until = Some(dropped);
            }
            if let Some(until) = granted_until
                && other.started + tolerance < until
            {
                violation(
                    "one execution at a time",
                    format!(
                        "exec {other_id} started at {} ms while exec {id} ran under a lease \
                         granted until {}",
                        other.started.as_millis(),
                        if until == Duration::MAX {
                            "its transaction ends".to_owned()
                        } else {
                            format!("{} ms", until.as_millis())
                        }
                    ),
                    vec![exec.key.clone()],
                );
            }
        }
    }

    for takeover in &history.calls {
        let (StoreResult::TookOver(Some(_)), Some(lapsed)) = (&takeover.result, takeover.token)
        else {
            continue;
        };
        let granted_until = history.granted_until(lapsed, takeover.started);
        if let Some(until) = granted_until
            && takeover.ended + tolerance < until
        {
            violation(
                "a lease is taken over only once it lapsed",
                format!(
                    "a takeover at {} ms took a lease granted until {} ms",
                    takeover.ended.as_millis(),
                    until.as_millis()
                ),
                vec![takeover.key.clone()],
            );
        }
        for late in history.calls_with(lapsed) {
            if late.started > takeover.ended && late.result == StoreResult::Held {
                violation(
                    "a fenced owner changes nothing",
                    format!(
                        "the {} of a token taken over at {} ms was accepted at {} ms",
                        late.operation,
                        takeover.ended.as_millis(),
                        late.started.as_millis()
                    ),
                    vec![takeover.key.clone()],
                );
            }
        }
    }
    for release in history
        .calls
        .iter()
        .filter(|call| call.operation == "release" && call.result == StoreResult::Held)
    {
        let token = release.token.expect("a release names its token");
        for later in &history.calls {
            let shows_it = match later.result {
                StoreResult::InFlight(shown) => shown == token,
                StoreResult::TookOver(Some(_)) => later.token == Some(token),
                _ => false,
            };
            if later.key == release.key && later.started > release.ended && shows_it {
                violation(
                    "a released record is gone",
                    format!(
                        "a {} at {} ms still found the reservation released at {} ms",
                        later.operation,
                        later.started.as_millis(),
                        release.ended.as_millis()
                    ),
                    vec![release.key.clone()],
                );
            }
        }
        for late in history.calls_with(token) {
            if late.started > release.ended && late.result == StoreResult::Held {
                violation(
                    "a fenced owner changes nothing",
                    format!(
                        "the {} of a token released at {} ms was accepted at {} ms",
                        late.operation,
                        release.ended.as_millis(),
                        late.started.as_millis()
                    ),
                    vec![release.key.clone()],
                );
            }
        }
    }

    if let Some((in_database, _)) = in_database {
        for &(&id, exec) in &execs {
            let found = in_database.contains(&id);
            let fits = match exec.change {
                Change::Committed => found,
                Change::Unknown => true,
                Change::None | Change::NotCommitted => !found,
            };
            if !fits {
                violation(
                    "the database holds exactly the committed changes",
                    format!(
                        "exec {id}'s change {} in the database, and its handler saw {:?}",
                        if found { "is" } else { "is not" },
                        exec.change
                    ),
                    vec![exec.key.clone()],
                );
            }
        }
    }

    for id in final_requests {
        let Some(request) = history.requests.get(id) else {
            continue;
        };
        let ran = match &request.ended {
            Some((_, Ending::Answered(answer))) => {
                answer.status == 201
                    && !answer.replayed
                    && answer_of_exec(answer)
                        .and_then(|exec| history.execs.get(&exec))
                        .is_some_and(|exec| exec.request == *id)
            }
            _ => false,
        };
        if !ran {
            violation(
                "every key frees once its records expired",
                format!(
                    "after every record expired, request {id} on {}/{} did not run: {:?}",
                    request.key.scope,
                    request.key.key,
                    request.ended.as_ref().map(|(_, ending)| ending)
                ),
                vec![request.key.clone()],
            );
        }
    }
    violations
}

/// The execution an answer names (`x-exec`), if the handler produced it.
fn answer_of_exec(answer: &Answer) -> Option<u64> {
    answer.exec_header.as_deref()?.parse().ok()
}
