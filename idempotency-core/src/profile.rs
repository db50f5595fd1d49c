//! [`Profile`]: the decisions a protocol makes (see `decisions`), installed on a layer at
//! once, and [`HttpProfile`], the plain HTTP default.

use crate::decisions::{AllMutations, KeepWhole, ReplayAsStored, StoreAnswers};
use crate::key::OpaqueKey;
use crate::layer::IdempotencyLayer;
use crate::rejection::ProblemJson;

/// The decisions a protocol makes, installed on a layer at once with
/// [`with_profile`](crate::IdempotencyLayer::with_profile): each through the builder
/// method of its own slot, so that a profile can do nothing a user could not do with the
/// builder. The profile crates are written this way; read them as examples.
///
/// ```
/// use http::Method;
/// use idempotency_core::{Disposition, IdempotencyLayer, Profile, RequestHead};
/// use idempotency_store_memory::MemoryStore;
///
/// /// Orders: only `/orders` takes part, and a 409 releases the key.
/// struct Orders;
///
/// impl Profile for Orders {
///     fn apply<M>(self, layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
///         layer
///             .with_routes(|request: &RequestHead<'_>| request.uri.path().starts_with("/orders"))
///             .with_classifier(|answer: &http::response::Parts, _: Option<&http::HeaderMap>| {
///                 if answer.status == 409 { Disposition::Release } else { Disposition::Store }
///             })
///     }
/// }
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_profile(Orders);
/// # drop(layer);
/// ```
pub trait Profile {
    /// Installs the profile's decisions on `layer`.
    fn apply<M>(self, layer: IdempotencyLayer<M>) -> IdempotencyLayer<M>;
}

/// The plain HTTP profile, what a new layer starts with: every mutation takes part, keys
/// are opaque and read from the `Idempotency-Key` header, answers are stored whole, the
/// layer's own answers are problem+json documents, nothing is advertised. Applying it puts those decisions back.
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpProfile;

impl Profile for HttpProfile {
    fn apply<M>(self, layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
        layer
            .with_routes(AllMutations)
            .with_key_format(OpaqueKey)
            .with_classifier(StoreAnswers)
            .with_answer_keeper(KeepWhole)
            .with_answer_replayer(ReplayAsStored)
            .with_error_renderer(ProblemJson)
            .without_advertiser()
            .without_payload_key()
    }
}

impl<M> IdempotencyLayer<M> {
    /// Installs a [`Profile`]'s decisions (see [`profile`](crate::Profile) for the
    /// slots); a profile crate's layer installs its own this way. A
    /// builder call after this one replaces the decision of its slot.
    ///
    /// ```
    /// # use idempotency_core::IdempotencyLayer;
    /// # use idempotency_store_memory::MemoryStore;
    /// use idempotency_core::HttpProfile;
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_profile(HttpProfile);
    /// ```
    pub fn with_profile(self, profile: impl Profile) -> Self {
        profile.apply(self)
    }
}
