//! Ops this silkd does not implement yet (`git_*`, `lsp_*`): a typed `unimplemented`
//! error with a message that says what to use instead.

use crate::error::OpError;

/// The error answering `op`.
pub fn refuse(op: &str) -> OpError {
    let hint = if op.starts_with("git_") {
        "git ops are not available in this guest agent; run git through exec (e.g. argv [\"git\", \"status\"]) \
         or push files with fs_push"
    } else if op.starts_with("lsp_") {
        "language servers are not available in this guest agent"
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
        let e = refuse("git_clone");
        assert_eq!(e.kind, wire::ErrorKind::Unimplemented);
        assert!(e.message.starts_with("git_clone: git ops"));
        assert!(refuse("lsp_start").message.contains("language servers"));
    }
}
