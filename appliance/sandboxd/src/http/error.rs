//! The one HTTP error type: every failure a handler can answer, mapped to a status by one
//! exhaustive match (a new variant must choose its status to compile). Bodies are
//! [`sandboxd_api::ErrorBody`], `{"error":"<message>"}`, with a `Content-Length`; internals are
//! logged, not echoed.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use sandboxd_api::ErrorBody;

use crate::claims::ClaimError;
use crate::node::PoolsError;
use crate::slots::CapError;

/// Everything a handler can answer besides success.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Malformed body, key, port or argument.
    #[error("{0}")]
    BadRequest(String),
    /// No `Authorization: Bearer` header.
    #[error("missing bearer token")]
    MissingToken,
    /// A node token that is not the root token.
    #[error("invalid api token")]
    InvalidToken,
    /// A root-only route on a node without a root token: no credential can work.
    #[error("{0}")]
    Forbidden(String),
    /// The request body did not arrive within `body_timeout_secs`.
    #[error("{0}")]
    RequestTimeout(String),
    /// Unknown sandbox (or wrong sandbox token), template, route.
    #[error("{0}")]
    NotFound(String),
    /// A lane or state conflict.
    #[error("{0}")]
    Conflict(String),
    /// Output over the cap.
    #[error("{0}")]
    TooLarge(String),
    /// Well-formed but impossible (pool targets over the node budget).
    #[error("{0}")]
    Unprocessable(String),
    /// Missing `Upgrade:` header on a relay route.
    #[error("this route needs Upgrade: {0}")]
    UpgradeRequired(&'static str),
    /// No capacity or draining.
    #[error("{0}")]
    TooManyRequests(String),
    /// An advanced feature this node does not have.
    #[error("{0} is not implemented on this node")]
    NotImplemented(&'static str),
    /// A feature this node has but whose configuration is absent (`501`, naming the key).
    #[error("{0}")]
    Unavailable(String),
    /// The guest could not be reached or failed.
    #[error("{0}")]
    BadGateway(String),
    /// The guest did not finish in time.
    #[error("{0}")]
    GatewayTimeout(String),
    /// Anything else: `<verb> failed`, cause logged.
    #[error("{verb} failed")]
    Internal {
        /// The operation.
        verb: &'static str,
        /// The cause (logged only).
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl ApiError {
    /// The status of each variant.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::MissingToken | ApiError::InvalidToken => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UpgradeRequired(_) => StatusCode::UPGRADE_REQUIRED,
            ApiError::TooManyRequests(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NotImplemented(_) | ApiError::Unavailable(_) => StatusCode::NOT_IMPLEMENTED,
            ApiError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ApiError::GatewayTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// An internal error of `verb`.
    pub fn internal(verb: &'static str, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        ApiError::Internal { verb, source: Box::new(source) }
    }

    /// The sandbox-not-found answer (also for a wrong sandbox token: no existence leak).
    pub fn no_sandbox() -> Self {
        ApiError::NotFound("sandbox not found".into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let ApiError::Internal { source, .. } = &self {
            tracing::error!(status = status.as_u16(), error = %self, cause = %vmm::error_chain(source.as_ref()), "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), error = %self, "request refused");
        }
        (status, Json(ErrorBody::new(self.to_string()))).into_response()
    }
}

impl From<ClaimError> for ApiError {
    fn from(e: ClaimError) -> Self {
        match e {
            ClaimError::Key(k) => ApiError::BadRequest(k.to_string()),
            ClaimError::Ttl(m) => ApiError::BadRequest(m),
            ClaimError::Draining => ApiError::TooManyRequests("node draining".into()),
            e @ (ClaimError::NoCapacity(_) | ClaimError::Full { .. }) => ApiError::TooManyRequests(e.to_string()),
            e @ ClaimError::UnknownTemplate(_) => ApiError::NotFound(e.to_string()),
            ClaimError::AmbiguousTemplate(m) => ApiError::BadRequest(m),
            e @ ClaimError::Egress => ApiError::Conflict(e.to_string()),
            ClaimError::Unsupported(f) => ApiError::NotImplemented(f),
            ClaimError::NotFound => ApiError::no_sandbox(),
            e @ ClaimError::LeaseHorizon { .. } => ApiError::Conflict(e.to_string()),
            e @ ClaimError::Journal(_) => ApiError::internal("claim", e),
            e @ ClaimError::Start(_) => ApiError::internal("claim", e),
        }
    }
}

impl From<PoolsError> for ApiError {
    fn from(e: PoolsError) -> Self {
        match e {
            PoolsError::Invalid(c) => ApiError::BadRequest(vmm::error_chain(&c)),
            PoolsError::OverBudget(b) => ApiError::Unprocessable(b.to_string()),
            e @ PoolsError::Journal(_) => ApiError::internal("put pools", e),
        }
    }
}

impl From<CapError> for ApiError {
    fn from(e: CapError) -> Self {
        ApiError::TooManyRequests(e.to_string())
    }
}
