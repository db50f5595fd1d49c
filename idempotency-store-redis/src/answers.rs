//! What the server answers, read: records and inspections decoded from the scripts'
//! replies, and failures turned into store errors that say what to do (never showing a
//! value's content, which may be a caller's response).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idempotency_core::{
    Binding, Bytes, FencingToken, IdempotencyRecord, InspectedRecord, InspectedState, RecordState,
    StoreError, StoredResponse,
};
use redis::{RedisError, Value};

use crate::options::ReplicaAcks;
use crate::scripts::Operation;

/// A store operation that did not complete.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OperationError {
    #[error(
        "Redis did not answer {operation} within {timeout:?}: the server is down, overloaded \
         or unreachable; the store reconnects by itself once it answers (raise \
         RedisOptions::operation_timeout if the server is only slow)"
    )]
    TimedOut {
        operation: &'static str,
        timeout: Duration,
    },
    #[error(
        "Redis {operation} was acknowledged by {acknowledged} replica(s) within {timeout:?}, \
         fewer than the {replicas} RedisOptions::replica_acks asks for, so it is not counted \
         as done (a failover could lose it): check that every primary has {replicas} \
         connected replica(s) (`INFO replication`), or raise the timeout"
    )]
    NotAcknowledged {
        operation: &'static str,
        acknowledged: i64,
        replicas: u32,
        timeout: Duration,
    },
    #[error("Redis {operation} failed: {source}{hint}")]
    Failed {
        operation: &'static str,
        hint: &'static str,
        #[source]
        source: RedisError,
    },
}

/// A write that fewer replicas acknowledged in time than the options ask for.
pub(crate) struct Unacknowledged {
    pub(crate) operation: &'static str,
    pub(crate) acknowledged: i64,
    pub(crate) acks: ReplicaAcks,
}

impl Unacknowledged {
    pub(crate) fn into_error(self) -> StoreError {
        StoreError::backend(OperationError::NotAcknowledged {
            operation: self.operation,
            acknowledged: self.acknowledged,
            replicas: self.acks.replicas,
            timeout: self.acks.timeout,
        })
    }
}

/// What to do about a failed operation, where the error alone does not say.
pub(crate) fn hint(error: &RedisError) -> &'static str {
    if error.code() == Some("OOM") {
        "; the server is at its maxmemory: free memory or raise maxmemory (records are never \
         evicted under noeviction, so new reservations wait for records to expire)"
    } else if error.is_io_error() || error.is_connection_dropped() || error.is_timeout() {
        "; the connection to the server was lost; the store reconnects by itself"
    } else if error.code() == Some("CLUSTERDOWN") {
        "; the cluster is down or does not serve this record's slot: check `CLUSTER INFO`"
    } else {
        ""
    }
}

pub(crate) fn unexpected(operation: Operation, answer: &Value) -> StoreError {
    StoreError::Corrupt(format!(
        "the {} script answered {}, which this version of the store does not expect; is \
         another program writing under the same key prefix?",
        operation.name(),
        describe(answer)
    ))
}

/// A short description of a value, never its content (which may be a caller's response).
pub(crate) fn describe(value: &Value) -> String {
    match value {
        Value::Nil => "nil".to_owned(),
        Value::Int(n) => format!("the integer {n}"),
        Value::BulkString(bytes) => format!("a string of {} bytes", bytes.len()),
        Value::Array(items) => format!("an array of {} items", items.len()),
        other => format!("a value of another type ({})", value_kind(other)),
    }
}

pub(crate) fn value_kind(value: &Value) -> &'static str {
    match value {
        Value::SimpleString(_) => "simple string",
        Value::Okay => "OK",
        Value::Map(_) => "map",
        Value::Set(_) => "set",
        Value::Double(_) => "double",
        Value::Boolean(_) => "boolean",
        _ => "other",
    }
}

pub(crate) fn as_bytes(value: &Value) -> Option<&[u8]> {
    match value {
        Value::BulkString(bytes) => Some(bytes),
        Value::SimpleString(text) => Some(text.as_bytes()),
        _ => None,
    }
}

/// Decodes what the scripts' `live_record` answers: token, lease lapsed (0/1), method,
/// path, body SHA-256, and the status, headers, body and trailers, nil while in flight
/// (trailers also nil when the answer had none).
pub(crate) fn decode_record(value: Value) -> Result<IdempotencyRecord, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("a stored record {what}"));
    let Value::Array(fields) = value else {
        return Err(corrupt(&format!("came back as {}", describe(&value))));
    };
    let Ok::<[Value; 9], _>(
        [
            token,
            lapsed,
            method,
            path,
            sha,
            status,
            headers,
            body,
            trailers,
        ],
    ) = fields.try_into()
    else {
        return Err(corrupt("does not have the nine fields the scripts return"));
    };
    let text = |value: Value, name: &str| match value {
        Value::BulkString(bytes) => String::from_utf8(bytes)
            .map_err(|_| corrupt(&format!("has a {name} that is not UTF-8"))),
        _ => Err(corrupt(&format!("has no {name}"))),
    };
    let token = text(token, "fencing_token")?
        .parse::<i64>()
        .map_err(|_| corrupt("has a fencing_token that is not a 64-bit integer"))?;
    let body_sha256: [u8; 32] = match sha {
        Value::BulkString(bytes) => bytes
            .try_into()
            .map_err(|_| corrupt("has a body_sha256 that is not 32 bytes"))?,
        _ => return Err(corrupt("has no body_sha256")),
    };
    let binding = Binding {
        method: text(method, "method")?,
        path: text(path, "path")?,
        body_sha256,
    };
    let state = match status {
        Value::Nil => RecordState::InFlight {
            token: FencingToken(token),
            lease_lapsed: matches!(lapsed, Value::Int(1)),
        },
        status => {
            let status = text(status, "response_status")?
                .parse::<u16>()
                .ok()
                .filter(|status| (100..=999).contains(status))
                .ok_or_else(|| corrupt("has a response_status that is not an HTTP status"))?;
            let headers = match headers {
                Value::BulkString(bytes) => StoredResponse::decode_headers(&bytes)?,
                Value::Nil => Vec::new(),
                _ => return Err(corrupt("has response_headers of the wrong type")),
            };
            let body = match body {
                Value::BulkString(bytes) => Bytes::from(bytes),
                _ => return Err(corrupt("is completed but has no response_body")),
            };
            let trailers = match trailers {
                Value::BulkString(bytes) => StoredResponse::decode_trailers(&bytes)?,
                Value::Nil => Vec::new(),
                _ => return Err(corrupt("has response_trailers of the wrong type")),
            };
            RecordState::Completed(StoredResponse {
                status,
                headers,
                body,
                trailers,
            })
        }
    };
    Ok(IdempotencyRecord { binding, state })
}

/// Decodes the scripts' `operator_view`: created, expires, lease end (epoch ms), status
/// (nil in flight), method, path, body SHA-256, and the server's now.
pub(crate) fn decode_view(value: Value) -> Result<InspectedRecord, StoreError> {
    let corrupt = |what: &str| StoreError::Corrupt(format!("a stored record {what}"));
    let Value::Array(fields) = value else {
        return Err(corrupt(&format!("came back as {}", describe(&value))));
    };
    let Ok::<[Value; 8], _>([created, expires, lease, status, method, path, sha, now]) =
        fields.try_into()
    else {
        return Err(corrupt(
            "does not have the eight fields the inspection returns",
        ));
    };
    let text = |value: Value, name: &str| match value {
        Value::BulkString(bytes) => String::from_utf8(bytes)
            .map_err(|_| corrupt(&format!("has a {name} that is not UTF-8"))),
        _ => Err(corrupt(&format!("has no {name}"))),
    };
    let millis = |value: Value, name: &str| -> Result<u64, StoreError> {
        text(value, name)?
            .parse::<u64>()
            .map_err(|_| corrupt(&format!("has a {name} that is not epoch milliseconds")))
    };
    let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(ms);
    let now = millis(now, "clock reading")?;
    let state = match status {
        Value::Nil => {
            let lease_end = millis(lease, "lease_expires_at_ms")?;
            InspectedState::InFlight {
                lease_lapsed: now >= lease_end,
                lease_expires_at: Some(at(lease_end)),
            }
        }
        status => InspectedState::Completed {
            status: text(status, "response_status")?
                .parse::<u16>()
                .map_err(|_| corrupt("has a response_status that is not an HTTP status"))?,
        },
    };
    let body_sha256: [u8; 32] = match sha {
        Value::BulkString(bytes) => bytes
            .try_into()
            .map_err(|_| corrupt("has a body_sha256 that is not 32 bytes"))?,
        _ => return Err(corrupt("has no body_sha256")),
    };
    let created_at: SystemTime = at(millis(created, "created_at_ms")?);
    Ok(InspectedRecord {
        binding: Binding {
            method: text(method, "method")?,
            path: text(path, "path")?,
            body_sha256,
        },
        state,
        created_at: Some(created_at),
        expires_at: Some(at(millis(expires, "expires_at_ms")?)),
        inspected_at: Some(at(now)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_describe_values_without_their_content() {
        let message = unexpected(
            Operation::Load,
            &Value::BulkString(b"secret response".to_vec()),
        )
        .to_string();
        assert!(message.contains("15 bytes"), "{message}");
        assert!(!message.contains("secret"), "{message}");
    }
}
