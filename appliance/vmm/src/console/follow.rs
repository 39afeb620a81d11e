//! [`read_log`]: a VM's console as a container log — the retained lines with a
//! [`ValidLogQuery`] applied (`tailLines` by seeking back from the end, `since`, `timestamps`,
//! `limitBytes` through [`LineFilter`]) and, with `follow`, the lines that come after, across
//! rotations, until the VM's files go away.
//!
//! Reads go through [`LogReader::step`], one chunk of at most [`CHUNK`] bytes at a time on a
//! blocking thread; nothing holds more than a chunk and its filtered output. Without `follow`
//! at most the two segments are read (each capped). Following polls every [`POLL`]: a new
//! file at the log's path is a rotation (the old file is read to its end first, then the new
//! one from its start; a segment rotated away unseen in between is read too if it is still the
//! previous one); neither file there means the VM was destroyed, and the stream ends.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use kstream::logs::{Flow, LineFilter, ValidLogQuery};

use super::record::Records;
use super::segments::rotated_path;

/// How often a follower looks for more.
pub const POLL: Duration = Duration::from_millis(150);

/// The most a reader reads at once.
pub const CHUNK: usize = 64 * 1024;

/// What one [`LogReader::step`] came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Progress was made (the output may still be empty: filtered away); step again.
    Data,
    /// Following, and nothing new yet: step again after [`POLL`].
    Idle,
    /// The end: the log was read (no `follow`), the limit reached, or the VM's files are gone.
    End,
}

/// One open segment and the file it is (device, inode).
#[derive(Debug)]
struct Segment {
    file: File,
    id: (u64, u64),
}

impl Segment {
    fn open(path: &Path) -> io::Result<Option<Segment>> {
        match File::open(path) {
            Ok(file) => {
                let m = file.metadata()?;
                Ok(Some(Segment { file, id: (m.dev(), m.ino()) }))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Which file is at `path` now, if any.
fn file_at(path: &Path) -> io::Result<Option<(u64, u64)>> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some((m.dev(), m.ino()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The synchronous reader behind [`read_log`], a chunk per [`LogReader::step`].
#[derive(Debug)]
pub struct LogReader {
    path: PathBuf,
    follow: bool,
    tail_lines: Option<u64>,
    started: bool,
    /// The segment being read, then those to read after it, oldest first.
    segments: VecDeque<Segment>,
    records: Records,
    filter: LineFilter,
    buf: Vec<u8>,
}

impl LogReader {
    /// A reader of the console log at `path` (nothing is opened before the first step).
    pub fn new(path: &Path, q: &ValidLogQuery) -> Self {
        LogReader {
            path: path.to_path_buf(),
            follow: q.follow,
            tail_lines: q.tail_lines,
            started: false,
            segments: VecDeque::new(),
            records: Records::default(),
            filter: LineFilter::new(q),
            buf: vec![0; CHUNK],
        }
    }

    /// Reads the next chunk, appending what the query keeps of it to `out`.
    pub fn step(&mut self, out: &mut Vec<u8>) -> io::Result<Step> {
        if !self.started {
            self.started = true;
            self.start()?;
        }
        let Some(seg) = self.segments.front_mut() else {
            return Ok(Step::End);
        };
        let n = seg.file.read(&mut self.buf)?;
        let ours = seg.id;
        if n > 0 {
            let (filter, mut done) = (&mut self.filter, false);
            self.records.feed(&self.buf[..n], &mut |at, text| {
                done = done || filter.push(at, text, out) == Flow::Done;
            });
            return Ok(if done { Step::End } else { Step::Data });
        }
        if self.segments.len() > 1 {
            self.segments.pop_front();
            self.records.new_segment();
            return Ok(Step::Data);
        }
        if !self.follow {
            self.finish(out);
            return Ok(Step::End);
        }
        match file_at(&self.path)? {
            Some(id) if id == ours => Ok(Step::Idle),
            // Rotated: the rest of ours (written before the rename) first, then the new files.
            Some(_) => {
                self.queue_rotated(ours)?;
                Ok(Step::Data)
            }
            // Between a rename and the new file, or the VM is gone.
            None if file_at(&rotated_path(&self.path))?.is_some() => Ok(Step::Idle),
            None => {
                self.finish(out);
                Ok(Step::End)
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<u8>) {
        let filter = &mut self.filter;
        self.records.finish(&mut |at, text| {
            filter.push(at, text, out);
        });
    }

    /// Opens the segments and seeks to where the query starts.
    fn start(&mut self) -> io::Result<()> {
        let cur = Segment::open(&self.path)?;
        let old = Segment::open(&rotated_path(&self.path))?;
        let old = old.filter(|o| cur.as_ref().is_none_or(|c| c.id != o.id));
        self.segments.extend(old);
        self.segments.extend(cur);
        if let Some(n) = self.tail_lines {
            self.seek_tail(n)?;
        }
        Ok(())
    }

    /// After a rotation seen from segment `ours`: the previous segment if it is not ours (we
    /// missed one), then the current one.
    fn queue_rotated(&mut self, ours: (u64, u64)) -> io::Result<()> {
        let Some(cur) = Segment::open(&self.path)? else { return Ok(()) };
        let old = Segment::open(&rotated_path(&self.path))?.filter(|o| o.id != ours && o.id != cur.id);
        self.segments.extend(old);
        self.segments.push_back(cur);
        Ok(())
    }

    /// Positions the reader at the start of the `n`th line from the end (a last line without
    /// its newline counts), reading backwards a chunk at a time.
    fn seek_tail(&mut self, n: u64) -> io::Result<()> {
        let mut lens = Vec::with_capacity(self.segments.len());
        for s in &self.segments {
            lens.push(s.file.metadata()?.len());
        }
        let (index, offset) = self.find_tail(n, &lens)?;
        self.segments.drain(..index);
        for (i, s) in self.segments.iter_mut().enumerate() {
            s.file.seek(SeekFrom::Start(if i == 0 { offset } else { 0 }))?;
        }
        Ok(())
    }

    fn find_tail(&mut self, n: u64, lens: &[u64]) -> io::Result<(usize, u64)> {
        let last = lens.len().saturating_sub(1);
        if n == 0 {
            return Ok((last, lens.last().copied().unwrap_or(0)));
        }
        let (mut seen, mut final_byte) = (0u64, true);
        for index in (0..lens.len()).rev() {
            let mut end = lens[index];
            while end > 0 {
                let start = end.saturating_sub(CHUNK as u64);
                let chunk = &mut self.buf[..(end - start) as usize];
                let file = &mut self.segments[index].file;
                file.seek(SeekFrom::Start(start))?;
                file.read_exact(chunk)?;
                for (i, &b) in chunk.iter().enumerate().rev() {
                    if std::mem::take(&mut final_byte) && b == b'\n' {
                        continue;
                    }
                    if b == b'\n' {
                        seen += 1;
                        if seen == n {
                            return Ok((index, start + i as u64 + 1));
                        }
                    }
                }
                end = start;
            }
        }
        // Fewer lines than asked: all of them, from the oldest segment's start.
        Ok((0, 0))
    }
}

/// The console log at `log` as a container log: `q` applied, one chunk of output per item (a
/// chunk read can be filtered away entirely: such reads yield nothing). Ends at the log's end,
/// or with `follow` when the limit is reached or the VM's files are gone; a read failure is
/// the last item. Needs a tokio runtime (reads run on its blocking threads).
pub fn read_log(log: &Path, q: &ValidLogQuery) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
    read_log_while(log, q, || true)
}

/// [`read_log`] of a VM that may die with its files left behind: a follow that has caught up
/// also ends when `alive` says the VM's hypervisor is gone, with an error as its last item (so
/// a `kubectl logs -f` ends with an error instead of waiting for lines that never come).
pub fn read_log_while(
    log: &Path,
    q: &ValidLogQuery,
    alive: impl Fn() -> bool + Send + Sync + 'static,
) -> impl Stream<Item = io::Result<Bytes>> + Send + 'static {
    let alive = std::sync::Arc::new(alive);
    futures::stream::unfold(Some(LogReader::new(log, q)), move |reader| {
        let alive = alive.clone();
        async move {
            let mut reader = reader?;
            loop {
                let joined = tokio::task::spawn_blocking(move || {
                    let mut out = Vec::new();
                    let step = reader.step(&mut out);
                    (reader, step.map(|s| (s, out)))
                })
                .await;
                let result;
                (reader, result) = match joined {
                    Ok(r) => r,
                    Err(e) => return Some((Err(io::Error::other(e)), None)),
                };
                match result {
                    Err(e) => return Some((Err(e), None)),
                    Ok((Step::End, out)) if out.is_empty() => return None,
                    Ok((Step::End, out)) => return Some((Ok(Bytes::from(out)), None)),
                    Ok((_, out)) if !out.is_empty() => return Some((Ok(Bytes::from(out)), Some(reader))),
                    Ok((Step::Idle, _)) if !alive() => {
                        return Some((Err(io::Error::other("the VM stopped while its console was followed")), None))
                    }
                    Ok((Step::Idle, _)) => tokio::time::sleep(POLL).await,
                    Ok((Step::Data, _)) => {}
                }
            }
        }
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::super::capped::CappedLog;
    use super::*;
    use futures::StreamExt as _;
    use std::sync::{Arc, Mutex};
    use std::time::SystemTime;
    use tokio::task::JoinHandle;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(s)
    }

    /// A log of lines `line-1` … `line-<n>`, line `i` stamped at second `i`, over segments of
    /// 100 bytes (so it rotates often).
    fn log_of(dir: &Path, n: u64, cap: u64) -> (PathBuf, CappedLog) {
        let path = dir.join("console.log");
        let mut log = CappedLog::open(&path, cap).unwrap();
        for i in 1..=n {
            log.write_at(t(i), format!("line-{i}\n").as_bytes()).unwrap();
        }
        (path, log)
    }

    async fn read_all(path: &Path, q: ValidLogQuery) -> String {
        let chunks: Vec<_> = read_log(path, &q).collect().await;
        let bytes: Vec<u8> = chunks.into_iter().flat_map(|c| c.unwrap().to_vec()).collect();
        String::from_utf8(bytes).unwrap()
    }

    fn lines(from: u64, to: u64) -> String {
        (from..=to).map(|i| format!("line-{i}\n")).collect()
    }

    #[tokio::test]
    async fn the_whole_log_tail_since_and_limit() {
        let dir = tempfile::tempdir().unwrap();
        // 2 KiB: both segments hold lines 1–26 or so; the oldest have been rotated away.
        let (path, _log) = log_of(dir.path(), 60, 2048);
        let all = read_all(&path, ValidLogQuery::default()).await;
        assert!(all.ends_with(&lines(40, 60)) && all.starts_with("line-"), "{all}");
        let first: u64 = all["line-".len()..all.find('\n').unwrap()].parse().unwrap();
        assert_eq!(all, lines(first, 60), "whole lines, in order, from the oldest kept");

        let tail = |n| ValidLogQuery { tail_lines: Some(n), ..Default::default() };
        assert_eq!(read_all(&path, tail(3)).await, lines(58, 60));
        assert_eq!(read_all(&path, tail(0)).await, "");
        assert_eq!(read_all(&path, tail(10_000)).await, all, "more than there are: all of them");

        let since = ValidLogQuery { since: Some(t(55)), ..Default::default() };
        assert_eq!(read_all(&path, since).await, lines(55, 60));
        let both = ValidLogQuery { since: Some(t(59)), tail_lines: Some(5), ..Default::default() };
        assert_eq!(read_all(&path, both).await, lines(59, 60), "the tail first, then since");

        let limit = ValidLogQuery { limit_bytes: Some(10), tail_lines: Some(2), ..Default::default() };
        assert_eq!(read_all(&path, limit).await, "line-59\nli");
        let stamped = ValidLogQuery { timestamps: true, tail_lines: Some(1), ..Default::default() };
        assert_eq!(read_all(&path, stamped).await, "1970-01-01T00:01:00.000000000Z line-60\n");
    }

    #[tokio::test]
    async fn tail_counts_a_line_split_by_rotation_once_and_an_open_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let mut log = CappedLog::open(&path, 260).unwrap();
        log.write_at(t(1), b"first\n").unwrap();
        log.write_at(t(2), &[b'x'; 80]).unwrap();
        log.write_at(t(3), b"y\nprompt$ ").unwrap();
        assert!(std::fs::metadata(rotated_path(&path)).is_ok(), "rotated inside the long line");
        let q = ValidLogQuery { tail_lines: Some(2), timestamps: true, ..Default::default() };
        let got = read_all(&path, q).await;
        assert_eq!(
            got,
            format!("1970-01-01T00:00:02.000000000Z {}y\n1970-01-01T00:00:03.000000000Z prompt$ ", "x".repeat(80))
        );
    }

    #[tokio::test]
    async fn a_missing_log_is_empty_even_when_following() {
        let dir = tempfile::tempdir().unwrap();
        let q = ValidLogQuery { follow: true, ..Default::default() };
        assert_eq!(read_all(&dir.path().join("console.log"), q).await, "");
    }

    /// Drains `stream` on a task (as an HTTP body is drained) into a shared string.
    fn drain(stream: impl Stream<Item = io::Result<Bytes>> + Send + 'static) -> (Arc<Mutex<String>>, JoinHandle<()>) {
        let got = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&got);
        let task = tokio::spawn(async move {
            let mut stream = Box::pin(stream);
            while let Some(chunk) = stream.next().await {
                sink.lock().unwrap().push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
            }
        });
        (got, task)
    }

    async fn until(got: &Mutex<String>, want: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !got.lock().unwrap().ends_with(want) {
            assert!(tokio::time::Instant::now() < deadline, "{want:?} never came: {:?}", got.lock().unwrap());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn following_sees_new_lines_and_rotations_and_ends_with_the_vm() {
        let dir = tempfile::tempdir().unwrap();
        // Segments of about ten lines; a line every 20 ms rotates every 200 ms or so: a
        // follower looks more often (it misses lines only if more than a segment is written
        // between two looks).
        let (path, mut log) = log_of(dir.path(), 3, 800);
        let q = ValidLogQuery { follow: true, tail_lines: Some(1), ..Default::default() };
        let (got, task) = drain(read_log(&path, &q));
        until(&got, "line-3\n").await;
        assert_eq!(*got.lock().unwrap(), "line-3\n");
        // A line in pieces (sent as they come), then enough lines to rotate several times.
        log.write_at(t(4), b"half").unwrap();
        until(&got, "half").await;
        log.write_at(t(5), b" and half\n").unwrap();
        for i in 6..60 {
            log.write_at(t(i), format!("line-{i}\n").as_bytes()).unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        until(&got, "line-59\n").await;
        assert_eq!(*got.lock().unwrap(), format!("line-3\nhalf and half\n{}", lines(6, 59)));
        // The VM is destroyed: its directory goes, the stream ends.
        drop(log);
        std::fs::remove_dir_all(dir.path()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), task).await.expect("ends in time").unwrap();
    }

    #[tokio::test]
    async fn following_stops_at_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut log) = log_of(dir.path(), 1, 4096);
        let q = ValidLogQuery { follow: true, limit_bytes: Some(12), ..Default::default() };
        let reader = tokio::spawn({
            let path = path.clone();
            async move { read_all(&path, q).await }
        });
        tokio::time::sleep(POLL).await;
        log.write_at(t(2), b"line-2\nline-3\n").unwrap();
        let got = tokio::time::timeout(Duration::from_secs(10), reader).await.expect("ends").unwrap();
        assert_eq!(got, "line-1\nline-");
    }

    #[tokio::test]
    async fn following_a_vm_that_died_ends_with_an_error_once_caught_up() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _log) = log_of(dir.path(), 2, 4096);
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let flag = alive.clone();
        let q = ValidLogQuery { follow: true, ..Default::default() };
        let mut stream = Box::pin(read_log_while(&path, &q, move || flag.load(std::sync::atomic::Ordering::SeqCst)));
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(&first[..], b"line-1\nline-2\n");
        // The hypervisor dies; its files stay.
        alive.store(false, std::sync::atomic::Ordering::SeqCst);
        let end = tokio::time::timeout(Duration::from_secs(5), stream.next()).await.expect("the follow ended");
        assert!(end.unwrap().unwrap_err().to_string().contains("VM stopped"));
        assert!(stream.next().await.is_none());
    }
}
