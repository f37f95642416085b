//! The visor's error envelope (VISOR.md §1): `{"error": {"code",
//! "message"}}` with one status per code. Bad input is never a 500.

use axum::response::{IntoResponse, Response};
use http::StatusCode;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VisorError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    /// Wrong session state.
    #[error("{0}")]
    State(String),
    #[error("{0}")]
    Busy(String),
    #[error("{0}")]
    Protocol(String),
    #[error("{0}")]
    Unsupported(String),
    /// The visor is shutting down.
    #[error("{0}")]
    Closed(String),
    /// Something the visor relies on is out of reach (an executor's
    /// confirmation socket).
    #[error("{0}")]
    Unavailable(String),
    /// A fault of ours (never for bad input).
    #[error("{0}")]
    Internal(String),
}

impl VisorError {
    pub fn code(&self) -> &'static str {
        match self {
            VisorError::Invalid(_) => "invalid",
            VisorError::NotFound(_) => "not_found",
            VisorError::State(_) => "state",
            VisorError::Busy(_) => "busy",
            VisorError::Protocol(_) => "protocol",
            VisorError::Unsupported(_) => "unsupported",
            VisorError::Closed(_) => "closed",
            VisorError::Unavailable(_) => "unavailable",
            VisorError::Internal(_) => "internal",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            VisorError::Invalid(_) => StatusCode::BAD_REQUEST,
            VisorError::NotFound(_) => StatusCode::NOT_FOUND,
            VisorError::State(_) => StatusCode::CONFLICT,
            VisorError::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            VisorError::Protocol(_) => StatusCode::UPGRADE_REQUIRED,
            VisorError::Unsupported(_) => StatusCode::NOT_IMPLEMENTED,
            VisorError::Closed(_) | VisorError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            VisorError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"code": self.code(), "message": self.to_string()}})
    }

    pub fn no_session(id: &str) -> VisorError {
        VisorError::NotFound(format!("no session {id:?}"))
    }
}

impl IntoResponse for VisorError {
    fn into_response(self) -> Response {
        (self.status(), axum::Json(self.body())).into_response()
    }
}
