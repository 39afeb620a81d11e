//! Container-log queries: what the API server asks a kubelet's `GET /containerLogs/…` for, and
//! the filter that applies it to timestamped lines.
//!
//! [`LogQuery`] is the query string as sent (camelCase keys, bools as `true`/`false`);
//! [`LogQuery::validate`] refuses what the API server's own validation refuses and turns the
//! rest into a [`ValidLogQuery`]. [`LineFilter`] then applies `sinceSeconds`/`sinceTime`,
//! `timestamps` and `limitBytes` to the lines a reader finds, in order, and says when the
//! limit is reached. `tailLines` and `follow` are the reader's business: it knows where lines
//! start in its storage and when more can come.
//!
//! The rules are the kubelet's (`k8s.io/cri-client/pkg/logs/logs.go`, `ReadLogs` and
//! `logWriter.write`; `pkg/kubelet/kuberuntime/kuberuntime_logs.go` for `since`;
//! `pkg/apis/core/validation/validation.go`, `ValidatePodLogOptions`): the tail is taken
//! first, then lines stamped before `since` are dropped; a timestamp prefix is the fixed-width
//! RFC 3339 form with nanoseconds and a space; the byte limit counts prefixes too and may cut
//! a line anywhere.

use std::time::{Duration, SystemTime};

use jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// Length of a timestamp written by [`format_timestamp`]: `2006-01-02T15:04:05.000000000Z`.
pub const TIMESTAMP_LEN: usize = 30;

/// `GET /containerLogs` query, as the API server sends it (camelCase keys; bools as
/// `"true"`/`"false"`; unknown keys such as `container` or `stream` are ignored).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct LogQuery {
    /// Keep the stream open and send lines as they come.
    pub follow: bool,
    /// The previous instance's log (the caller decides whether it has one).
    pub previous: bool,
    /// Prefix every line with the time it was logged.
    pub timestamps: bool,
    /// Only the last N lines (0: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tail_lines: Option<i64>,
    /// Only lines logged in the last N seconds (at least 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_seconds: Option<i64>,
    /// Only lines logged at or after this RFC 3339 time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_time: Option<String>,
    /// Stop after this many bytes of output (at least 1).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<i64>,
}

/// Why a [`LogQuery`] was refused. Each message names the key.
#[derive(Debug, thiserror::Error)]
pub enum LogQueryError {
    /// `tailLines` below zero.
    #[error("tailLines must not be negative (got {0})")]
    NegativeTailLines(i64),
    /// `limitBytes` below one.
    #[error("limitBytes must be greater than 0 (got {0})")]
    LimitBytes(i64),
    /// `sinceSeconds` below one.
    #[error("sinceSeconds must be greater than 0 (got {0})")]
    SinceSeconds(i64),
    /// Both `sinceSeconds` and `sinceTime`.
    #[error("at most one of sinceTime or sinceSeconds may be specified")]
    BothSince,
    /// `sinceTime` is not an RFC 3339 time.
    #[error("sinceTime {value:?} is not an RFC 3339 time")]
    SinceTime {
        /// The value sent.
        value: String,
        /// The parser's complaint.
        #[source]
        source: jiff::Error,
    },
}

/// A checked [`LogQuery`]: `since` resolved to an instant, counts unsigned. (`previous` is not
/// here: whoever serves the query answers it before reading any log.)
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ValidLogQuery {
    /// Keep reading as the log grows.
    pub follow: bool,
    /// Prefix lines with their time.
    pub timestamps: bool,
    /// Only the last N lines.
    pub tail_lines: Option<u64>,
    /// Only lines stamped at or after this instant.
    pub since: Option<SystemTime>,
    /// Stop after this many bytes of output.
    pub limit_bytes: Option<u64>,
}

impl From<&ValidLogQuery> for LogQuery {
    /// The query that validates back to `q` (its instant as `sinceTime`): what a provider
    /// forwards to the process that holds the log.
    fn from(q: &ValidLogQuery) -> LogQuery {
        LogQuery {
            follow: q.follow,
            previous: false,
            timestamps: q.timestamps,
            tail_lines: q.tail_lines.map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
            since_seconds: None,
            since_time: q.since.map(format_timestamp),
            limit_bytes: q.limit_bytes.map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        }
    }
}

impl LogQuery {
    /// Checks the query against the clock now ([`LogQuery::validate_at`]).
    pub fn validate(&self) -> Result<ValidLogQuery, LogQueryError> {
        self.validate_at(SystemTime::now())
    }

    /// Checks the query: negative counts and non-positive `limitBytes`/`sinceSeconds` are
    /// refused, `sinceSeconds` and `sinceTime` exclude each other, `sinceTime` must parse;
    /// `sinceSeconds` counts back from `now`.
    pub fn validate_at(&self, now: SystemTime) -> Result<ValidLogQuery, LogQueryError> {
        let tail_lines = match self.tail_lines {
            Some(n) => Some(u64::try_from(n).map_err(|_| LogQueryError::NegativeTailLines(n))?),
            None => None,
        };
        let limit_bytes = match self.limit_bytes {
            Some(n) if n < 1 => return Err(LogQueryError::LimitBytes(n)),
            Some(n) => Some(n.unsigned_abs()),
            None => None,
        };
        let since = match (self.since_seconds, &self.since_time) {
            (Some(_), Some(_)) => return Err(LogQueryError::BothSince),
            (Some(s), None) if s < 1 => return Err(LogQueryError::SinceSeconds(s)),
            // Further back than 1970: every line qualifies.
            (Some(s), None) => Some(
                now.checked_sub(Duration::from_secs(s.unsigned_abs()))
                    .filter(|t| *t >= SystemTime::UNIX_EPOCH)
                    .unwrap_or(SystemTime::UNIX_EPOCH),
            ),
            (None, Some(t)) => Some(parse_rfc3339(t)?),
            (None, None) => None,
        };
        Ok(ValidLogQuery { follow: self.follow, timestamps: self.timestamps, tail_lines, since, limit_bytes })
    }
}

fn parse_rfc3339(value: &str) -> Result<SystemTime, LogQueryError> {
    let ts: Timestamp = value.parse().map_err(|source| LogQueryError::SinceTime { value: value.to_owned(), source })?;
    Ok(SystemTime::from(ts))
}

/// `at` as the kubelet writes a log timestamp: UTC, RFC 3339, always nine fractional digits
/// ([`TIMESTAMP_LEN`] bytes for any year from 1 to 9999).
pub fn format_timestamp(at: SystemTime) -> String {
    let ts = Timestamp::try_from(at).unwrap_or(Timestamp::UNIX_EPOCH);
    format!("{ts:.9}")
}

/// Parses a timestamp written by [`format_timestamp`] (any RFC 3339 time is accepted).
pub fn parse_timestamp(text: &str) -> Option<SystemTime> {
    text.parse::<Timestamp>().ok().map(SystemTime::from)
}

/// Whether a [`LineFilter`] wants more lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Keep feeding lines.
    More,
    /// The byte limit is reached: stop reading.
    Done,
}

/// Applies `since`, `timestamps` and `limit_bytes` to a log's lines, in order.
///
/// A line may come in pieces (a follower sends what it has before the newline arrives): a
/// piece that does not end in `\n` is continued by the next one, and the next piece's `at` is
/// ignored. The line's first piece decides whether it is kept (`at` not before `since`) and
/// carries its prefix.
#[derive(Clone, Debug)]
pub struct LineFilter {
    since: Option<SystemTime>,
    timestamps: bool,
    remaining: Option<u64>,
    at_line_start: bool,
    skipping: bool,
}

impl LineFilter {
    /// A filter for `q`.
    pub fn new(q: &ValidLogQuery) -> Self {
        LineFilter {
            since: q.since,
            timestamps: q.timestamps,
            remaining: q.limit_bytes,
            at_line_start: true,
            skipping: false,
        }
    }

    /// Appends what the query keeps of `line` (stamped `at`) to `out`.
    pub fn push(&mut self, at: SystemTime, line: &[u8], out: &mut Vec<u8>) -> Flow {
        if self.remaining == Some(0) {
            return Flow::Done;
        }
        if line.is_empty() {
            return Flow::More;
        }
        let starts = std::mem::replace(&mut self.at_line_start, line.ends_with(b"\n"));
        if starts {
            self.skipping = self.since.is_some_and(|since| at < since);
        }
        if self.skipping {
            return Flow::More;
        }
        if starts && self.timestamps {
            let prefix = format_timestamp(at);
            self.emit(prefix.as_bytes(), out);
            self.emit(b" ", out);
        }
        self.emit(line, out);
        match self.remaining {
            Some(0) => Flow::Done,
            _ => Flow::More,
        }
    }

    /// Whether the byte limit is reached.
    pub fn done(&self) -> bool {
        self.remaining == Some(0)
    }

    fn emit(&mut self, bytes: &[u8], out: &mut Vec<u8>) {
        let take = match &mut self.remaining {
            None => bytes.len(),
            Some(left) => {
                let take = usize::try_from(*left).unwrap_or(usize::MAX).min(bytes.len());
                *left -= take as u64;
                take
            }
        };
        out.extend_from_slice(&bytes[..take]);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn query(s: &str) -> LogQuery {
        serde_json::from_str(s).unwrap()
    }

    #[test]
    fn the_query_decodes_camel_case_keys_and_ignores_others() {
        let q = query(
            r#"{"follow":true,"timestamps":true,"tailLines":3,"sinceSeconds":5,"limitBytes":9,"container":"c","previous":true}"#,
        );
        assert_eq!(
            q,
            LogQuery {
                follow: true,
                previous: true,
                timestamps: true,
                tail_lines: Some(3),
                since_seconds: Some(5),
                since_time: None,
                limit_bytes: Some(9)
            }
        );
        assert_eq!(query("{}"), LogQuery::default());
        assert_eq!(
            serde_json::to_string(&LogQuery::default()).unwrap(),
            r#"{"follow":false,"previous":false,"timestamps":false}"#
        );
    }

    #[test]
    fn validation_refuses_what_the_api_server_refuses() {
        let now = t(1_000);
        let bad = |q: LogQuery| q.validate_at(now).unwrap_err().to_string();
        assert!(bad(LogQuery { tail_lines: Some(-1), ..Default::default() }).contains("tailLines"));
        assert!(bad(LogQuery { limit_bytes: Some(0), ..Default::default() }).contains("limitBytes"));
        assert!(bad(LogQuery { since_seconds: Some(0), ..Default::default() }).contains("sinceSeconds"));
        assert!(bad(LogQuery {
            since_seconds: Some(1),
            since_time: Some("1970-01-01T00:00:00Z".into()),
            ..Default::default()
        })
        .contains("at most one"));
        assert!(bad(LogQuery { since_time: Some("yesterday".into()), ..Default::default() }).contains("yesterday"));

        let ok = |q: LogQuery| q.validate_at(now).unwrap();
        assert_eq!(ok(LogQuery::default()), ValidLogQuery::default());
        let v = ok(LogQuery {
            follow: true,
            timestamps: true,
            tail_lines: Some(0),
            limit_bytes: Some(1),
            ..Default::default()
        });
        assert_eq!((v.follow, v.timestamps, v.tail_lines, v.limit_bytes), (true, true, Some(0), Some(1)));
        assert_eq!(ok(LogQuery { since_seconds: Some(10), ..Default::default() }).since, Some(t(990)));
        assert_eq!(ok(LogQuery { since_seconds: Some(i64::MAX), ..Default::default() }).since, Some(t(0)));
        let at = |s: &str| ok(LogQuery { since_time: Some(s.into()), ..Default::default() }).since;
        assert_eq!(at("1970-01-01T00:16:40Z"), Some(t(1_000)));
        assert_eq!(at("1970-01-01T01:16:40+01:00"), Some(t(1_000)), "an offset is honoured");
        assert_eq!(at("1970-01-01T00:16:40.5Z"), Some(t(1_000) + Duration::from_millis(500)));
    }

    #[test]
    fn timestamps_have_the_kubelets_fixed_width() {
        let at = t(1_700_000_000) + Duration::from_micros(5);
        assert_eq!(format_timestamp(at), "2023-11-14T22:13:20.000005000Z");
        assert_eq!(format_timestamp(t(0)).len(), TIMESTAMP_LEN);
        assert_eq!(parse_timestamp("2023-11-14T22:13:20.000005000Z"), Some(at));
        assert_eq!(parse_timestamp("2023-11-14 nonsense"), None);
    }

    fn run(q: ValidLogQuery, lines: &[(u64, &str)]) -> (String, Flow) {
        let mut f = LineFilter::new(&q);
        let mut out = Vec::new();
        let mut flow = Flow::More;
        for (at, line) in lines {
            flow = f.push(t(*at), line.as_bytes(), &mut out);
            if flow == Flow::Done {
                break;
            }
        }
        (String::from_utf8(out).unwrap(), flow)
    }

    const LOG: &[(u64, &str)] = &[(10, "one\n"), (20, "two\n"), (30, "three\n")];

    #[test]
    fn no_option_passes_lines_unchanged() {
        assert_eq!(run(ValidLogQuery::default(), LOG), ("one\ntwo\nthree\n".into(), Flow::More));
    }

    #[test]
    fn since_keeps_lines_at_or_after_it() {
        let q = ValidLogQuery { since: Some(t(20)), ..Default::default() };
        assert_eq!(run(q, LOG).0, "two\nthree\n");
    }

    #[test]
    fn timestamps_prefix_each_line_once() {
        let q = ValidLogQuery { timestamps: true, ..Default::default() };
        let (out, _) = run(q, &[(10, "on"), (99, "e\n"), (20, "two\n")]);
        assert_eq!(out, "1970-01-01T00:00:10.000000000Z one\n1970-01-01T00:00:20.000000000Z two\n");
    }

    #[test]
    fn a_skipped_line_stays_skipped_across_its_pieces() {
        let q = ValidLogQuery { since: Some(t(15)), ..Default::default() };
        assert_eq!(run(q, &[(10, "o"), (20, "ld\n"), (20, "new\n")]).0, "new\n");
    }

    #[test]
    fn the_limit_may_cut_inside_a_line_and_counts_prefixes() {
        let q = ValidLogQuery { limit_bytes: Some(6), ..Default::default() };
        assert_eq!(run(q, LOG), ("one\ntw".into(), Flow::Done));
        let q = ValidLogQuery { limit_bytes: Some(4), ..Default::default() };
        assert_eq!(run(q, LOG), ("one\n".into(), Flow::Done), "exactly at a line end is done too");
        let q = ValidLogQuery { limit_bytes: Some(12), timestamps: true, ..Default::default() };
        assert_eq!(run(q, LOG), ("1970-01-01T0".into(), Flow::Done));
        let mut f = LineFilter::new(&ValidLogQuery { limit_bytes: Some(1), ..Default::default() });
        let mut out = Vec::new();
        assert_eq!(f.push(t(0), b"xy\n", &mut out), Flow::Done);
        assert!(f.done());
        assert_eq!(f.push(t(0), b"more\n", &mut out), Flow::Done);
        assert_eq!(out, b"x");
    }

    #[test]
    fn a_valid_query_round_trips_through_the_wire_form() {
        let now = SystemTime::UNIX_EPOCH + std::time::Duration::from_nanos(1_700_000_000_123_456_789);
        let q = LogQuery {
            follow: true,
            timestamps: true,
            tail_lines: Some(5),
            since_seconds: Some(60),
            limit_bytes: Some(9),
            ..Default::default()
        };
        let valid = q.validate_at(now).expect("valid");
        assert_eq!(LogQuery::from(&valid).validate_at(now).expect("valid again"), valid);
    }
}
