//! The one error-chain formatter.

/// Formats `e` with its whole `source()` chain as `e: cause: cause…` on one line. A cause whose
/// text is empty or already appears in the message so far is skipped, so a wrapper that prints
/// its source (`#[error("{0}")]`, `#[error("…: {source}")]`) is not repeated.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !m.is_empty() && !out.contains(&m) {
            out.push_str(": ");
            out.push_str(&m);
        }
        cur = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug)]
    struct E(&'static str, Option<Box<E>>);
    impl std::fmt::Display for E {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for E {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn causes_are_joined_once_each() {
        let leaf = E("disk on fire", None);
        assert_eq!(error_chain(&leaf), "disk on fire");
        let e = E("saving", Some(Box::new(E("writing /x", Some(Box::new(E("disk on fire", None)))))));
        assert_eq!(error_chain(&e), "saving: writing /x: disk on fire");
        // A wrapper that already prints its cause, and an empty cause, add nothing.
        let e = E("writing /x: disk on fire", Some(Box::new(E("disk on fire", Some(Box::new(E("", None)))))));
        assert_eq!(error_chain(&e), "writing /x: disk on fire");
    }
}
