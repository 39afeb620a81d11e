//! Ops this silkd does not implement (`lsp_*`): a typed `unimplemented` error with a message
//! that says what to use instead.

use crate::error::OpError;

/// The error answering `op`.
pub fn refuse(op: &str) -> OpError {
    let hint = if op.starts_with("lsp_") {
        "language servers are not brokered by this guest agent; run one through exec (stdio) or a session"
    } else {
        "not available in this guest agent"
    };
    OpError::unimplemented(format!("{op}: {hint}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_typed_and_name_the_op() {
        let e = refuse("lsp_start");
        assert_eq!(e.kind, wire::ErrorKind::Unimplemented);
        assert!(e.message.starts_with("lsp_start: language servers"), "{e}");
    }
}
