//! The profiles that ship with the crate, set up as layers: [`IdempotencyLayer::iceberg`]
//! and [`IdempotencyLayer::grpc`]. Each is its profile plus a few builder calls, the public
//! builder alone, as a profile of your own is set up with
//! [`with_profile`](IdempotencyLayer::with_profile); the generic layer and request path
//! name no protocol.

#[cfg(feature = "iceberg")]
use http::StatusCode;

#[cfg(feature = "grpc")]
use crate::WrappedBodies;
use crate::{IdempotencyLayer, IdempotencyStore};

impl IdempotencyLayer {
    /// A layer configured for an Iceberg REST catalog: [`IcebergProfile`], 503 while a
    /// duplicate is in flight, 500 for an answer too large to store. See the
    /// [module docs](crate::iceberg). Feature `iceberg` (on by default).
    ///
    /// [`IcebergProfile`]: crate::iceberg::IcebergProfile
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use std::time::Duration;
    /// let layer = IdempotencyLayer::iceberg(MemoryStore::new()).with_lifetime(Duration::from_secs(3600));
    /// ```
    #[cfg(feature = "iceberg")]
    pub fn iceberg(store: impl IdempotencyStore) -> Self {
        Self::new(store)
            .with_profile(crate::iceberg::IcebergProfile::default())
            .with_in_flight_status(StatusCode::SERVICE_UNAVAILABLE)
            .with_not_stored_status(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// A layer for a gRPC server (tonic's `Server::builder().layer(…)`, or around a
    /// `tonic::service::Routes`): [`GrpcProfile`], bodies wrapped so that trailers are
    /// kept, and the gRPC headers stored. See the [module docs](crate::grpc). Feature
    /// `grpc` (on by default).
    ///
    /// [`GrpcProfile`]: crate::grpc::GrpcProfile
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use idempotency_core::grpc::GrpcProfile;
    ///
    /// let layer = IdempotencyLayer::grpc(MemoryStore::new())
    ///     .with_profile(GrpcProfile::new().with_streaming_methods(["/orders.v1.Orders/ListOrders"]));
    /// ```
    #[cfg(feature = "grpc")]
    pub fn grpc(store: impl IdempotencyStore) -> IdempotencyLayer<WrappedBodies> {
        Self::new(store)
            .with_profile(crate::grpc::GrpcProfile::new())
            .with_replayed_headers(crate::grpc::REPLAYED_METADATA)
            .wrap_bodies()
    }
}
