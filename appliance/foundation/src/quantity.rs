//! Kubernetes resource quantities (`500m`, `1.5`, `10Gi`, `1e9`, `2k`) → exact integers: the
//! workspace's one parser, for Pod resources, vk-cocoon's `storage` annotation and `VK_NODE_*`
//! overrides, and vk-sandbox's `--node-memory`. Pure.
//!
//! A quantity is an optional `+`, decimal digits with an optional fraction, then one suffix:
//! none, a decimal SI one (`n`, `u`, `m`, `k`, `M`, `G`, `T`, `P`, `E`), a binary one (`Ki` …
//! `Ei`) or a decimal exponent (`e3`, `E-2`, within ±30). Negative quantities, spaces inside,
//! and anything else are [`QuantityError::Malformed`]; a value beyond `u128` thousandths is
//! [`QuantityError::Overflow`]. Results round up, so a fraction never becomes zero.

/// A string that is not a non-negative Kubernetes quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("{0:?} is not a quantity (digits with an optional suffix: m, k, M, G, T, P, E, Ki, Mi, Gi, Ti, Pi, Ei or an exponent e<n>)")]
    Malformed(String),
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// `num / den`, rounded up.
fn ceil_div(num: u128, den: u128) -> u128 {
    num.div_ceil(den)
}

/// The quantity in thousandths of its unit, rounded up (`"500m"` → 500, `"2"` → 2000,
/// `"1Ki"` → 1 024 000).
pub fn milli(s: &str) -> Result<u128, QuantityError> {
    let bad = || QuantityError::Malformed(s.to_owned());
    let over = || QuantityError::Overflow(s.to_owned());
    let t = s.trim();
    let t = t.strip_prefix('+').unwrap_or(t);
    let num_len = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, suffix) = t.split_at(num_len);
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if (int.is_empty() && frac.is_empty()) || frac.contains('.') || frac.len() > 30 {
        return Err(bad());
    }
    let digits: u128 = format!("{int}{frac}").parse().map_err(|_| over())?;
    let scale = 10u128.checked_pow(frac.len() as u32).ok_or_else(over)?;
    // value = digits / scale × mul_num / mul_den; result = value × 1000.
    let (mul_num, mul_den): (u128, u128) = match suffix {
        "" => (1000, 1),
        "n" => (1, 1_000_000),
        "u" => (1, 1000),
        "m" => (1, 1),
        "k" => (1000 * 1000, 1),
        "M" => (1000 * 10u128.pow(6), 1),
        "G" => (1000 * 10u128.pow(9), 1),
        "T" => (1000 * 10u128.pow(12), 1),
        "P" => (1000 * 10u128.pow(15), 1),
        "E" => (1000 * 10u128.pow(18), 1),
        "Ki" => (1000 << 10, 1),
        "Mi" => (1000 << 20, 1),
        "Gi" => (1000 << 30, 1),
        "Ti" => (1000 << 40, 1),
        "Pi" => (1000 << 50, 1),
        "Ei" => (1000 << 60, 1),
        e if e.starts_with(['e', 'E']) => {
            let exp: i32 = e[1..].parse().map_err(|_| bad())?;
            if !(-30..=30).contains(&exp) {
                return Err(over());
            }
            if exp >= 0 {
                (1000 * 10u128.pow(exp.unsigned_abs()), 1)
            } else {
                (1000, 10u128.pow(exp.unsigned_abs()))
            }
        }
        _ => return Err(bad()),
    };
    let num = digits.checked_mul(mul_num).ok_or_else(over)?;
    let den = scale.checked_mul(mul_den).ok_or_else(over)?;
    Ok(ceil_div(num, den))
}

/// The quantity as a whole number of units, rounded up (`"1.5Gi"` → 1 610 612 736 bytes,
/// `"500m"` → 1).
pub fn units_ceil(s: &str) -> Result<u128, QuantityError> {
    Ok(ceil_div(milli(s)?, 1000))
}

/// Millicores as a CPU quantity (`4000` → `"4"`, `4500` → `"4500m"`).
pub fn cpu_string(millis: u64) -> String {
    if millis.is_multiple_of(1000) {
        (millis / 1000).to_string()
    } else {
        format!("{millis}m")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in a test, a panic is the failure report
mod tests {
    use super::*;

    const KI: u128 = 1 << 10;
    const MI: u128 = 1 << 20;
    const GI: u128 = 1 << 30;

    #[test]
    fn plain_numbers_and_fractions() {
        for (s, m) in [("2", 2000u128), ("0", 0), ("+3", 3000), ("1.5", 1500), ("0.1", 100), (" 7 ", 7000)] {
            assert_eq!(milli(s).unwrap(), m, "{s}");
        }
        // Thousandths round up: a fraction never becomes zero.
        assert_eq!(milli("0.0001").unwrap(), 1);
        assert_eq!(units_ceil("0.5").unwrap(), 1);
    }

    #[test]
    fn binary_suffixes() {
        for (s, units) in [("1Ki", KI), ("512Mi", 512 * MI), ("10Gi", 10 * GI), ("1Ti", 1 << 40), ("1Ei", 1 << 60)] {
            assert_eq!(units_ceil(s).unwrap(), units, "{s}");
            assert_eq!(milli(s).unwrap(), units * 1000, "{s}");
        }
        assert_eq!(units_ceil("1.5Gi").unwrap(), 1_610_612_736);
        assert_eq!(units_ceil("0.5Ki").unwrap(), 512);
    }

    #[test]
    fn decimal_suffixes() {
        for (s, units) in [
            ("1k", 1000u128),
            ("2M", 2_000_000),
            ("3G", 3_000_000_000),
            ("1T", 10u128.pow(12)),
            ("1P", 10u128.pow(15)),
            ("1E", 10u128.pow(18)),
            ("1.5k", 1500),
        ] {
            assert_eq!(units_ceil(s).unwrap(), units, "{s}");
        }
    }

    #[test]
    fn milli_and_smaller() {
        assert_eq!(milli("500m").unwrap(), 500);
        assert_eq!(milli("1m").unwrap(), 1);
        assert_eq!(units_ceil("500m").unwrap(), 1, "rounds up to a whole unit");
        assert_eq!(units_ceil("2000m").unwrap(), 2);
        assert_eq!(milli("1u").unwrap(), 1, "a millionth rounds up to a thousandth");
        assert_eq!(milli("1000u").unwrap(), 1);
        assert_eq!(milli("1000000n").unwrap(), 1);
        assert_eq!(milli("0m").unwrap(), 0);
    }

    #[test]
    fn exponents() {
        assert_eq!(milli("1e3").unwrap(), 1_000_000);
        assert_eq!(milli("1E3").unwrap(), 1_000_000, "E followed by digits is an exponent, not exa");
        assert_eq!(units_ceil("1e9").unwrap(), 1_000_000_000);
        assert_eq!(milli("5e-1").unwrap(), 500);
        assert_eq!(milli("1.5e2").unwrap(), 150_000);
        assert_eq!(milli("1e0").unwrap(), 1000);
    }

    #[test]
    fn garbage_is_refused() {
        for bad in [
            "", " ", "x", "1.2.3", "-1", "1Zi", "1 Gi", ".", "1e", "Gi", "1KI", "1ki", "8Tb", "1e1.5", "0x10", "1,5",
            "1Gi2", "++1", "1e+",
        ] {
            assert!(matches!(milli(bad), Err(QuantityError::Malformed(_))), "{bad:?}");
        }
        let e = milli("1Zi").unwrap_err().to_string();
        assert!(e.contains("\"1Zi\"") && e.contains("Ki"), "the message names the input and the forms: {e}");
    }

    #[test]
    fn overflow_is_refused() {
        assert!(matches!(milli("99999999999999999999999999999999999999999"), Err(QuantityError::Overflow(_))));
        assert!(matches!(milli("1e99"), Err(QuantityError::Overflow(_))));
        assert!(matches!(milli("1e-31"), Err(QuantityError::Overflow(_))));
        assert!(matches!(milli("999999999999999999999999999Ei"), Err(QuantityError::Overflow(_))));
    }

    #[test]
    fn cpu_strings() {
        assert_eq!(cpu_string(4000), "4");
        assert_eq!(cpu_string(4500), "4500m");
        assert_eq!(cpu_string(0), "0");
        assert_eq!(cpu_string(1), "1m");
    }
}
