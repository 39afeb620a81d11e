//! Where a capped log lives: the current segment and the previous one (`<path>.1`), and
//! bounded reads of a segment's end.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Suffix of the previous segment: `console.log` → `console.log.1`.
pub const ROTATED_SUFFIX: &str = ".1";

/// The previous segment of the log at `path`: `<path>.1`.
pub fn rotated_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(ROTATED_SUFFIX);
    PathBuf::from(s)
}

/// The end of one file, as read by [`read_window`].
#[derive(Debug, Default)]
pub struct Window {
    /// The bytes read.
    pub bytes: Vec<u8>,
    /// Whether they start at the file's first byte (a record start).
    pub whole: bool,
}

/// The last `max` bytes of one file (fewer if it is shorter; empty and whole if it is missing).
pub fn read_window(path: &Path, max: usize) -> io::Result<Window> {
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Window { bytes: Vec::new(), whole: true }),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let want = len.min(max as u64);
    f.seek(SeekFrom::Start(len - want))?;
    let mut bytes = Vec::with_capacity(want as usize);
    f.take(want).read_to_end(&mut bytes)?;
    Ok(Window { bytes, whole: want == len })
}
