//! Bearer-token files: the one rule every surface that reads one applies (sandboxd's root
//! token, and the supervisor's check of the file it hands to sandboxd).

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

/// The shortest token accepted: 32 characters (`openssl rand -hex 32` gives 64).
pub const MIN_TOKEN_LEN: usize = 32;

/// Why a token file is refused. Each message names the fix; the caller adds the path and key.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// The file could not be read.
    #[error("{0}")]
    Read(#[from] std::io::Error),
    /// Group or others may read it.
    #[error("mode {mode:04o} lets group or others read the token; run chmod 600 {path}")]
    Loose {
        /// The file's permission bits.
        mode: u32,
        /// The file, for the fix.
        path: String,
    },
    /// Nothing but whitespace in it.
    #[error("the file is empty; write a random token of at least {MIN_TOKEN_LEN} characters into it")]
    Empty,
    /// Too short to resist guessing.
    #[error(
        "the token has {len} characters, fewer than {MIN_TOKEN_LEN}; write a random one, e.g. \
         `openssl rand -hex 32 > {path}`"
    )]
    Short {
        /// Its length in characters.
        len: usize,
        /// The file, for the fix.
        path: String,
    },
}

/// Reads a bearer token from `path`: readable by its owner only, not empty, at least
/// [`MIN_TOKEN_LEN`] characters. Returns it trimmed.
pub fn read_token_file(path: &Path) -> Result<String, TokenFileError> {
    let mode = std::fs::metadata(path)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(TokenFileError::Loose { mode, path: path.display().to_string() });
    }
    let raw = std::fs::read_to_string(path)?;
    let token = raw.trim();
    match token.chars().count() {
        0 => Err(TokenFileError::Empty),
        len if len < MIN_TOKEN_LEN => Err(TokenFileError::Short { len, path: path.display().to_string() }),
        _ => Ok(token.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loose_empty_short_and_good_tokens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("t");
        assert!(matches!(read_token_file(&p), Err(TokenFileError::Read(_))));
        let good = "0123456789abcdef0123456789abcdef";
        std::fs::write(&p, format!("{good}\n")).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let loose = read_token_file(&p).expect_err("loose").to_string();
        assert!(loose.contains("mode 0644") && loose.contains("chmod 600"), "{loose}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert_eq!(read_token_file(&p).expect("good"), good);
        std::fs::write(&p, " \n").expect("write");
        assert!(matches!(read_token_file(&p), Err(TokenFileError::Empty)));
        std::fs::write(&p, "short").expect("write");
        let short = read_token_file(&p).expect_err("short").to_string();
        assert!(short.contains("5 characters, fewer than 32"), "{short}");
    }
}
