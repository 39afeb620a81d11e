//! How a test that cannot run on this machine says so (feature `testing`, for dev-dependencies
//! only): it calls [`skip`] and returns. `cargo xtask test` sets [`SKIP_LOG`] and counts each
//! line as a skipped test, not a passed one, and lists the reasons at the end.

use std::io::Write as _;

/// The environment variable naming the file skips are appended to.
pub const SKIP_LOG: &str = "CHRYSALIS_SKIP_LOG";

/// Says why the calling test does not run here: `skipped: <why>` on stderr, and one line
/// `<test binary>: <why>` appended to `$CHRYSALIS_SKIP_LOG` when it is set.
pub fn skip(why: &str) {
    eprintln!("skipped: {why}");
    let Some(path) = std::env::var_os(SKIP_LOG) else { return };
    let exe = std::env::current_exe().ok();
    let binary = exe.as_deref().and_then(|p| p.file_name()).and_then(|n| n.to_str()).unwrap_or("a test");
    // Test binaries carry a hash suffix (`vmm-0123abcd`); the reader wants the suite.
    let suite = binary.rsplit_once('-').map_or(binary, |(name, _)| name);
    let line = format!("{suite}: {}\n", why.replace('\n', " "));
    // One short O_APPEND write per skip: lines from tests running at once do not interleave.
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        eprintln!("skipped, but not recorded in {}: {e}", std::path::Path::new(&path).display());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_skip_is_one_line_in_the_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("skips");
        // Only this test sets the variable in this binary.
        std::env::set_var(super::SKIP_LOG, &log);
        super::skip("no widget here");
        super::skip("two\nlines");
        std::env::remove_var(super::SKIP_LOG);
        let text = std::fs::read_to_string(&log).expect("log");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].ends_with(": no widget here") && lines[1].ends_with(": two lines"), "{text}");
    }
}
