//! The one error body (`docs/sandboxd.md` §4): every refusal of every route is `{"error": "<message>"}`
//! with the status saying which kind.

use serde::{Deserialize, Serialize};

/// `{"error": "<message>"}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a person (internals are logged by sandboxd, not echoed).
    pub error: String,
}

impl ErrorBody {
    /// The body of `message`.
    pub fn new(message: impl Into<String>) -> Self {
        ErrorBody { error: message.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_body_shape() {
        let e = ErrorBody::new("sandbox not found");
        assert_eq!(serde_json::to_string(&e).expect("ser"), r#"{"error":"sandbox not found"}"#);
        assert_eq!(serde_json::from_str::<ErrorBody>(r#"{"error":"x","extra":1}"#).expect("de"), ErrorBody::new("x"));
        assert!(serde_json::from_str::<ErrorBody>("{}").is_err(), "an error body without a message is not one");
    }
}
