//! Scatter-gather requests: parameters, the gathered answers, and the error when too few came.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// The id the bus gives each [`request`](crate::EventBus::request); responses carry it back
/// through [`Event::response_to`](crate::Event::response_to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(u64);

impl RequestId {
    pub(crate) fn new(raw: u64) -> Self {
        RequestId(raw)
    }

    /// The number inside, unique per bus (for logs and wire formats).
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// How a request gathers its answers.
///
/// The request ends early once it has what it asked for:
/// - with `expected_responders`, when every one of them answered and at least
///   `min_responses` answers came;
/// - without, when `min_responses` (if above 0) answers came.
///
/// Otherwise it ends at `timeout`, and succeeds if at least `min_responses` answers came.
/// Answers from responders that were not expected are kept and count toward the minimum; a
/// second answer from the same responder is ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestParams {
    /// How long to wait for answers, counted from the publication of the request.
    pub timeout: Duration,
    /// The responders that should answer (matched against
    /// [`ResponseTo::responder`](crate::ResponseTo)). Default: none.
    pub expected_responders: Vec<String>,
    /// The fewest answers that make the request succeed. Default: 0.
    pub min_responses: usize,
}

impl RequestParams {
    /// Waits up to `timeout`, expects no particular responder and needs no answer.
    pub fn new(timeout: Duration) -> Self {
        RequestParams {
            timeout,
            expected_responders: Vec::new(),
            min_responses: 0,
        }
    }

    /// Sets the responders that should answer.
    #[must_use]
    pub fn with_expected_responders<S: Into<String>>(
        mut self,
        responders: impl IntoIterator<Item = S>,
    ) -> Self {
        self.expected_responders = responders.into_iter().map(Into::into).collect();
        self
    }

    /// Sets the fewest answers that make the request succeed.
    #[must_use]
    pub fn with_min_responses(mut self, min: usize) -> Self {
        self.min_responses = min;
        self
    }
}

/// One answer to a request.
#[derive(Debug)]
pub struct Response<E> {
    /// Who answered.
    pub responder: String,
    /// The response event, shared with the subscribers of its kind.
    pub event: Arc<E>,
}

/// The answers a request gathered.
#[derive(Debug)]
pub struct Gathered<E> {
    /// The request's id.
    pub id: RequestId,
    /// The answers in the order they were published.
    pub responses: Vec<Response<E>>,
    /// Expected responders that did not answer, in the order they were expected.
    pub missing: Vec<String>,
    /// True when the request ran to its timeout rather than ending early.
    pub timed_out: bool,
}

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The timeout passed with fewer answers than the minimum.
    #[error(
        "request {id} got {received} of the {required} responses it needs within {timeout:?} \
         (missing: {missing:?})"
    )]
    NotEnoughResponses {
        /// The request's id.
        id: RequestId,
        /// Answers that came.
        received: usize,
        /// The minimum it needed.
        required: usize,
        /// How long it waited.
        timeout: Duration,
        /// Expected responders that did not answer.
        missing: Vec<String>,
    },
}

/// The result of a request.
pub type Result<T, E = Error> = std::result::Result<T, E>;
