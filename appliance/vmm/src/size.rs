//! VM size classes (fixed): small 1 vCPU/512 MiB, medium 2/1 GiB, large 4/4 GiB, xlarge 4/8 GiB, 2xlarge 8/16 GiB.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A VM size class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum SizeClass {
    /// 1 vCPU, 512 MiB.
    #[default]
    #[serde(rename = "small")]
    Small,
    /// 2 vCPUs, 1 GiB.
    #[serde(rename = "medium")]
    Medium,
    /// 4 vCPUs, 4 GiB.
    #[serde(rename = "large")]
    Large,
    /// 4 vCPUs, 8 GiB.
    #[serde(rename = "xlarge")]
    XLarge,
    /// 8 vCPUs, 16 GiB.
    #[serde(rename = "2xlarge")]
    X2Large,
}

/// A string that names no size class.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown size class {0:?} (expected small, medium, large, xlarge or 2xlarge)")]
pub struct SizeClassError(pub String);

impl SizeClass {
    /// Every class, smallest first.
    pub const ALL: [SizeClass; 5] =
        [SizeClass::Small, SizeClass::Medium, SizeClass::Large, SizeClass::XLarge, SizeClass::X2Large];

    /// Number of vCPUs.
    pub fn vcpus(self) -> u32 {
        match self {
            SizeClass::Small => 1,
            SizeClass::Medium => 2,
            SizeClass::Large | SizeClass::XLarge => 4,
            SizeClass::X2Large => 8,
        }
    }

    /// Memory in MiB.
    pub fn memory_mib(self) -> u64 {
        match self {
            SizeClass::Small => 512,
            SizeClass::Medium => 1024,
            SizeClass::Large => 4096,
            SizeClass::XLarge => 8192,
            SizeClass::X2Large => 16384,
        }
    }

    /// The class name as used in APIs.
    pub fn as_str(self) -> &'static str {
        match self {
            SizeClass::Small => "small",
            SizeClass::Medium => "medium",
            SizeClass::Large => "large",
            SizeClass::XLarge => "xlarge",
            SizeClass::X2Large => "2xlarge",
        }
    }
}

impl fmt::Display for SizeClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SizeClass {
    type Err = SizeClassError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SizeClass::ALL.into_iter().find(|c| c.as_str() == s).ok_or_else(|| SizeClassError(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_fixed() {
        let got: Vec<(u32, u64)> = SizeClass::ALL.iter().map(|c| (c.vcpus(), c.memory_mib())).collect();
        assert_eq!(got, vec![(1, 512), (2, 1024), (4, 4096), (4, 8192), (8, 16384)]);
    }

    #[test]
    fn parse_and_serde_agree() {
        for c in SizeClass::ALL {
            assert_eq!(c.as_str().parse::<SizeClass>(), Ok(c));
            let j = serde_json::to_string(&c).expect("serialize enum");
            assert_eq!(j, format!("\"{c}\""));
            assert_eq!(serde_json::from_str::<SizeClass>(&j).expect("round trip"), c);
        }
        assert_eq!("huge".parse::<SizeClass>(), Err(SizeClassError("huge".into())));
        assert!("Small".parse::<SizeClass>().is_err());
    }
}
