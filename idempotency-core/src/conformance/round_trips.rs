//! Round trips: a stored answer comes back exactly as stored.

use super::*;

/// A 6 MiB binary body (real table metadata can be this large) round-trips byte for byte.
pub async fn multi_megabyte_body_round_trips<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let body: Vec<u8> = (0..6 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let stored = StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"application/octet-stream"),
        )],
        body: Bytes::from(body),
        trailers: vec![],
    };
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    let loaded = store.load(&id).await.unwrap().expect("large record lost");
    match loaded.state {
        RecordState::Completed(replayed) => {
            assert_eq!(
                replayed.body.len(),
                stored.body.len(),
                "body length differs"
            );
            assert!(
                replayed == stored,
                "large body differs after the round trip"
            );
        }
        other => panic!("large record not completed: {other:?}"),
    }
}

/// A 204 with no headers and an empty body comes back as exactly that.
pub async fn empty_response_without_headers_round_trips<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let empty = StoredResponse {
        status: 204,
        headers: vec![],
        body: Bytes::new(),
        trailers: vec![],
    };
    assert_eq!(
        store.finalize(&id, token, &empty).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(empty)),
        "an empty 204 without headers must round-trip as such"
    );
}

/// Header values are bytes, not text: values that are not UTF-8, values holding `:`
/// and repeated names come back as they went in, in order.
pub async fn header_values_that_are_not_utf8_round_trip<S: IdempotencyStore + ?Sized>(
    store: &Arc<S>,
) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let stored = StoredResponse {
        status: 201,
        headers: vec![
            (
                "x-latin1".to_owned(),
                Bytes::from_static(b"caf\xe9 \xff\x80"),
            ),
            (
                "link".to_owned(),
                Bytes::from_static(b"<https://a.example:8443/x>; rel=a"),
            ),
            (
                "link".to_owned(),
                Bytes::from_static(b"<https://b.example/y>; rel=b"),
            ),
            ("etag".to_owned(), Bytes::from_static(b"\"\"")),
        ],
        body: Bytes::from_static(b"{}"),
        trailers: vec![],
    };
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(stored)),
        "header values must round-trip byte for byte, in order"
    );
}

/// Trailers (an RPC status can travel in them) come back as they went in, in order, values
/// that are not UTF-8 included, and a response without trailers comes back without any.
pub async fn trailers_round_trip<S: IdempotencyStore + ?Sized>(store: &Arc<S>) {
    let store = store.as_ref();
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let stored = StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"application/x-rpc"),
        )],
        body: Bytes::from_static(b"\0\0\0\0\x02\x08\x01"),
        trailers: vec![
            ("x-status".to_owned(), Bytes::from_static(b"0")),
            ("x-message".to_owned(), Bytes::from_static(b"ok%3A done")),
            (
                "x-status-details-bin".to_owned(),
                Bytes::from_static(b"CAMSBGJhZA"),
            ),
            ("x-raw".to_owned(), Bytes::from_static(b"caf\xe9")),
            ("x-raw".to_owned(), Bytes::from_static(b"second")),
        ],
    };
    assert_eq!(
        store.finalize(&id, token, &stored).await.unwrap(),
        Ownership::Held
    );
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(stored)),
        "trailers must round-trip byte for byte, in order"
    );
    let id = fresh_id();
    let token = reserve_new(store, &id, LONG, LONG).await;
    let without = response(b"{}");
    assert!(without.trailers.is_empty());
    store.finalize(&id, token, &without).await.unwrap();
    assert_eq!(
        store.load(&id).await.unwrap().map(|r| r.state),
        Some(RecordState::Completed(without)),
        "a response without trailers must come back without any"
    );
}
