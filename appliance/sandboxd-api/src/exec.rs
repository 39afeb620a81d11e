//! `POST /v1/sandboxes/{id}/exec` (`docs/sandboxd.md` §7): a buffered exec.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The `…/exec` body, decoded strictly (an unknown field is a `400`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    /// The program and its arguments (empty: `400`).
    #[serde(default)]
    pub argv: Vec<String>,
    /// Working directory in the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Extra environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<BTreeMap<String, String>>,
    /// Seconds before the child is killed and the call answers `504` (absent or 0: the node's
    /// default; negative or over the node's maximum: `400`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<f64>,
}

impl ExecRequest {
    /// `argv`, nothing else.
    pub fn new<S: Into<String>>(argv: impl IntoIterator<Item = S>) -> Self {
        ExecRequest { argv: argv.into_iter().map(Into::into).collect(), ..ExecRequest::default() }
    }
}

/// The `200` of `…/exec`: the child's exit code and its output (lossy UTF-8).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ExecResult {
    /// Exit code.
    pub exit_code: i32,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_request_is_strict_and_omits_what_is_absent() {
        let r = ExecRequest::new(["sh", "-c", "echo hi"]);
        assert_eq!(serde_json::to_string(&r).expect("ser"), r#"{"argv":["sh","-c","echo hi"]}"#);
        let full = ExecRequest {
            cwd: Some("/tmp".into()),
            env: Some(BTreeMap::from([("A".to_string(), "1".to_string())])),
            timeout_seconds: Some(1.5),
            ..r
        };
        let back: ExecRequest = serde_json::from_str(&serde_json::to_string(&full).expect("ser")).expect("round trip");
        assert_eq!(back, full);
        let e = serde_json::from_str::<ExecRequest>(r#"{"argv":["true"],"user":"root"}"#).expect_err("strict");
        assert!(e.to_string().contains("user"), "{e}");
    }

    #[test]
    fn exec_result_round_trips() {
        let r = ExecResult { exit_code: 3, stdout: "out\n".into(), stderr: String::new() };
        let v = serde_json::to_value(&r).expect("ser");
        assert_eq!(v, serde_json::json!({"exit_code": 3, "stdout": "out\n", "stderr": ""}));
        assert_eq!(serde_json::from_value::<ExecResult>(v).expect("de"), r);
    }
}
