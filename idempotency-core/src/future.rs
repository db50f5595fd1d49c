//! [`ResponseFuture`]: the future the [`Idempotency`](crate::Idempotency) service returns,
//! and the guard that lets a keyed request's owner finish after its caller is gone.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;
use pin_project_lite::pin_project;
use tokio_util::task::TaskTracker;

type Boxed<B, E> = Pin<Box<dyn Future<Output = Result<Response<B>, E>> + Send>>;

pin_project! {
    /// Response future of [`Idempotency`](crate::Idempotency).
    ///
    /// Dropping it does not cancel a keyed request whose inner call has started: the
    /// rest of that request moves to a task of its own, runs to the end and records its
    /// answer for the retry.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        // No key, or not taking part: the inner future, untouched.
        Passthrough { #[pin] future: F },
        // A keyed request (in its span, entered on every poll), or a config answer being
        // rewritten (no span).
        Boxed { future: Boxed<B, E>, span: tracing::Span },
        // Answered by the layer before anything ran.
        Ready { response: Option<Response<B>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(crate) fn boxed(future: Boxed<B, E>) -> Self {
        Self::in_span(future, tracing::Span::none())
    }

    pub(crate) fn in_span(future: Boxed<B, E>, span: tracing::Span) -> Self {
        Self {
            kind: Kind::Boxed { future, span },
        }
    }

    pub(crate) fn ready(response: Response<B>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }
}

/// `F` is the inner service's future; its response body `I` becomes the caller's `B`
/// untouched (`B` is `I`, or a wrapper around it).
impl<F, I, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<I>, E>>,
    B: From<I>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => future
                .poll(cx)
                .map(|answer| answer.map(|response| response.map(B::from))),
            KindProj::Boxed { future, span } => {
                let _entered = span.enter();
                future.as_mut().poll(cx)
            }
            KindProj::Ready { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
        }
    }
}

/// Runs a key owner's work in the caller's task, and moves it to a task of its own if
/// the caller drops it before it is done.
///
/// Running in place saves a task spawn on every first execution; moving on drop keeps the
/// promise that a started mutation finishes and is recorded even when the client
/// disconnects. The work is tracked by the layer's [`TaskTracker`] either way, so a
/// graceful shutdown waits for it.
pub(crate) struct FinishOnDrop<T: Send + 'static> {
    work: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    // The request's span, entered on every poll, and handed to the task the work moves
    // to: the work stays in it without being wrapped (and moved) once more.
    span: tracing::Span,
    // Set while the work is being polled: if a poll panics, the work is left in a
    // state it cannot be resumed from, and must not be moved to a task.
    poisoned: bool,
}

impl<T: Send + 'static> FinishOnDrop<T> {
    pub(crate) fn new(
        tracker: &TaskTracker,
        work: impl Future<Output = T> + Send + 'static,
    ) -> Self {
        Self {
            work: Some(Box::pin(tracker.track_future(work))),
            // Only a subscriber that wants INFO gets the request's span (`keyed::begin`).
            span: if tracing::level_enabled!(tracing::Level::INFO) {
                tracing::Span::current()
            } else {
                tracing::Span::none()
            },
            poisoned: false,
        }
    }
}

impl<T: Send + 'static> Future for FinishOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = &mut *self;
        let work = this
            .work
            .as_mut()
            .expect("FinishOnDrop polled after completion");
        this.poisoned = true;
        let output = this.span.in_scope(|| work.as_mut().poll(cx));
        this.poisoned = false;
        if output.is_ready() {
            this.work = None;
        }
        output
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        let Some(work) = self.work.take() else {
            return;
        };
        if self.poisoned {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let span = std::mem::replace(&mut self.span, tracing::Span::none());
                drop(runtime.spawn(tracing::Instrument::instrument(work, span)));
            }
            // Outside a runtime nothing can finish it: the reservation stays until its
            // lease lapses and a retry takes it over.
            Err(_) => tracing::warn!(
                "idempotency: a running request was dropped outside a tokio runtime; its \
                 key stays reserved until the lease lapses. Drive the Idempotency service's \
                 futures inside a tokio runtime"
            ),
        }
    }
}
