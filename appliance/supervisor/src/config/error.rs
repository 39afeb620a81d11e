//! Why a configuration is refused: [`ConfigError`] (a file, its syntax, a kernel argument, or
//! the rules) and [`Issue`], one broken rule with its key, [`Source`] and fix.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::layers::CMDLINE_PATH;

/// Why the configuration could not be loaded or is not valid.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A layer file exists but cannot be read.
    #[error("reading {}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A layer file is not TOML.
    #[error("{} is not valid TOML: {message}", .path.display())]
    Syntax {
        /// The file.
        path: PathBuf,
        /// The parser's message (with line and column).
        message: String,
    },
    /// A `chrysalis.set=` kernel argument is malformed.
    #[error("kernel command line argument {arg:?}: {problem}; write it as chrysalis.set=<dotted.key>=<TOML value>, e.g. chrysalis.set=sandboxd.listen=\"0.0.0.0:7777\"")]
    Cmdline {
        /// The argument.
        arg: String,
        /// What is wrong.
        problem: String,
    },
    /// The merged configuration breaks one or more rules.
    #[error("{}", Issues(.0))]
    Invalid(Vec<Issue>),
}

impl ConfigError {
    /// The rule violations (empty for read, syntax and command-line errors).
    pub fn issues(&self) -> &[Issue] {
        match self {
            ConfigError::Invalid(v) => v,
            _ => &[],
        }
    }
}

impl ConfigError {
    /// Every problem as an [`Issue`] (read, syntax and command-line errors become one each), for
    /// `GET /v1/status` and `chrysalis config check --json`.
    pub fn to_issues(&self) -> Vec<Issue> {
        match self {
            ConfigError::Invalid(v) => v.clone(),
            ConfigError::Read { path, source } => vec![Issue {
                key: "(file)".into(),
                source: Source::File { path: path.clone() },
                problem: format!("cannot be read: {source}"),
                fix: "make the file readable by root, or remove it".into(),
            }],
            ConfigError::Syntax { path, message } => vec![Issue {
                key: "(syntax)".into(),
                source: Source::File { path: path.clone() },
                problem: message.replace('\n', " "),
                fix: "fix the TOML syntax at the line shown".into(),
            }],
            ConfigError::Cmdline { arg, problem } => vec![Issue {
                key: "(kernel argument)".into(),
                source: Source::Cmdline { path: CMDLINE_PATH.into(), arg: arg.clone() },
                problem: problem.clone(),
                fix: "write it as chrysalis.set=<dotted.key>=<TOML value>".into(),
            }],
        }
    }
}

struct Issues<'a>(&'a [Issue]);

impl fmt::Display for Issues<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            [one] => write!(f, "{one}"),
            many => {
                write!(f, "{} configuration errors:", many.len())?;
                for i in many {
                    write!(f, "\n  {i}")?;
                }
                Ok(())
            }
        }
    }
}

/// One broken rule: the key, where it was set, what is wrong and how to fix it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Issue {
    /// Dotted key with indexes, e.g. `cluster.ca_cert_hashes[0]`.
    pub key: String,
    /// Where the value came from.
    pub source: Source,
    /// What is wrong.
    pub problem: String,
    /// What to do.
    pub fix: String,
}

impl fmt::Display for Issue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} in {}: {}; {}", self.key, self.source, self.problem, self.fix)
    }
}

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// Nobody set it: the built-in default.
    Default,
    /// A layer file.
    File {
        /// The file.
        path: PathBuf,
    },
    /// A `chrysalis.set=` kernel argument.
    Cmdline {
        /// The file the command line was read from (`/proc/cmdline`).
        path: PathBuf,
        /// The whole argument.
        arg: String,
    },
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Default => f.write_str("the built-in defaults"),
            Source::File { path } => write!(f, "{}", path.display()),
            Source::Cmdline { arg, .. } => write!(f, "the kernel command line ({arg})"),
        }
    }
}
