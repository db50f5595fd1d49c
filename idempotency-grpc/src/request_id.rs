//! [`RequestIdField`]: the key of a gRPC request carried in its message, as Google's
//! AIP-155 asks (`string request_id = N;`), read without a generated type.

use std::collections::HashSet;

use idempotency_core::{FoundKey, PayloadKey, RequestHead};

use crate::wire::{Fields, Value};

/// The key of a unary call read from a string field of its request message (AIP-155's
/// `request_id`), by the field's number: no `idempotency-key` metadata is needed, and
/// where both are sent the message's field wins (see
/// [`PayloadKey`](idempotency_core::PayloadKey)). The record is bound to the whole
/// message.
///
/// An empty field (proto3's unset string) carries no key. A message the layer cannot
/// read (compressed, cut short, not protobuf), or whose field is not a string, is refused
/// with `INVALID_ARGUMENT`.
///
/// ```
/// # use idempotency_store_memory::MemoryStore;
/// use idempotency_grpc::RequestIdField;
///
/// // message CreateOrderRequest { Order order = 1; string request_id = 2; }
/// let layer = idempotency_grpc::layer(MemoryStore::new()).with_payload_key(
///     RequestIdField::new(2).on_methods(["/orders.v1.Orders/CreateOrder"]),
/// );
/// ```
#[derive(Clone, Debug)]
pub struct RequestIdField {
    number: u32,
    /// The methods' paths (`/package.Service/Method`); `None`: every method.
    methods: Option<HashSet<String>>,
}

impl RequestIdField {
    /// The key in field `number` of every method's request message.
    pub fn new(number: u32) -> Self {
        Self {
            number,
            methods: None,
        }
    }

    /// Only these methods (`/package.Service/Method`) read their key from the message;
    /// the others keep the `idempotency-key` metadata.
    pub fn on_methods<P: Into<String>>(mut self, paths: impl IntoIterator<Item = P>) -> Self {
        self.methods = Some(paths.into_iter().map(Into::into).collect());
        self
    }
}

impl PayloadKey for RequestIdField {
    fn applies(&self, request: &RequestHead<'_>) -> bool {
        self.methods
            .as_ref()
            .is_none_or(|methods| methods.contains(request.uri.path()))
    }

    fn find(&self, body: &[u8]) -> Result<Option<FoundKey>, String> {
        let message = message(body)?;
        let mut key = None;
        for field in Fields(message) {
            let (number, value) = field
                .map_err(|error| format!("the request message is not protobuf ({})", error.0))?;
            if number != u64::from(self.number) {
                continue;
            }
            // The last value of a field is its value.
            key = match value {
                Value::Bytes(bytes) => Some(std::str::from_utf8(bytes).map_err(|_| {
                    format!("the request message's field {} is not UTF-8", self.number)
                })?),
                _ => {
                    return Err(format!(
                        "the request message's field {} must be a string: it is the call's \
                         request_id, its idempotency key",
                        self.number
                    ));
                }
            };
        }
        Ok(key.filter(|key| !key.is_empty()).map(|key| FoundKey {
            key: key.to_owned(),
            fingerprint: None,
        }))
    }
}

/// The one message of a unary call's body: a gRPC frame (a compression flag, a 4-byte
/// length, the message).
fn message(body: &[u8]) -> Result<&[u8], String> {
    let Some((&[compressed, a, b, c, d], rest)) = body.split_first_chunk::<5>() else {
        return Err("the request is not a gRPC message frame".to_owned());
    };
    if compressed != 0 {
        return Err(
            "the request message is compressed, and its request_id cannot be read: send it \
             uncompressed"
                .to_owned(),
        );
    }
    let length = u32::from_be_bytes([a, b, c, d]) as usize;
    rest.get(..length)
        .ok_or_else(|| "the request's gRPC frame is cut short".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gRPC frame of the message `fields` (each already encoded).
    fn frame(fields: &[Vec<u8>]) -> Vec<u8> {
        let message: Vec<u8> = fields.concat();
        let mut frame = vec![0];
        frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
        frame.extend(message);
        frame
    }

    fn string(number: u8, text: &str) -> Vec<u8> {
        let mut field = vec![number << 3 | 2, text.len() as u8];
        field.extend_from_slice(text.as_bytes());
        field
    }

    fn varint(number: u8, value: u8) -> Vec<u8> {
        vec![number << 3, value]
    }

    #[test]
    fn the_key_is_the_string_field() {
        let key = RequestIdField::new(2);
        let body = frame(&[string(1, "order"), varint(3, 7), string(2, "req-1")]);
        let found = key.find(&body).unwrap().unwrap();
        assert_eq!(found.key, "req-1");
        assert_eq!(found.fingerprint, None, "bound to the whole message");
        let last = frame(&[string(2, "a"), string(2, "b")]);
        assert_eq!(
            key.find(&last).unwrap().unwrap().key,
            "b",
            "the last value wins"
        );
    }

    #[test]
    fn an_unset_field_carries_no_key() {
        let key = RequestIdField::new(2);
        assert_eq!(key.find(&frame(&[string(1, "order")])).unwrap(), None);
        assert_eq!(key.find(&frame(&[string(2, "")])).unwrap(), None);
    }

    #[test]
    fn what_cannot_carry_a_key_is_refused_with_why() {
        let key = RequestIdField::new(2);
        let cases: [(Vec<u8>, &str); 4] = [
            (frame(&[varint(2, 1)]), "must be a string"),
            (vec![1, 0, 0, 0, 0], "compressed"),
            (vec![0, 0, 0, 0, 9, 1], "cut short"),
            (vec![0, 0], "not a gRPC message frame"),
        ];
        for (body, says) in cases {
            let error = key.find(&body).unwrap_err();
            assert!(error.contains(says), "{error}");
        }
    }

    #[test]
    fn only_the_named_methods_read_the_message() {
        let key = RequestIdField::new(2).on_methods(["/orders.Orders/Create"]);
        let head = |path: &'static str| http::Request::post(path).body(()).unwrap();
        let create = head("/orders.Orders/Create");
        let other = head("/orders.Orders/Cancel");
        assert!(key.applies(&RequestHead::of(&create)));
        assert!(!key.applies(&RequestHead::of(&other)));
        assert!(RequestIdField::new(2).applies(&RequestHead::of(&other)));
    }
}
