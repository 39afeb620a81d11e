//! Kubernetes resource quantities (`500m`, `1.5`, `10Gi`, `1e9`, `2k`) → exact integers, for
//! Pod resources, the `storage` annotation and the `VK_NODE_*` overrides. Pure.

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

    #[test]
    fn forms() {
        for (s, m) in [
            ("2", 2000u128),
            ("500m", 500),
            ("1.5", 1500),
            ("0.1", 100),
            ("1k", 1_000_000),
            ("1Ki", 1_024_000),
            ("10Gi", 10 * (1u128 << 30) * 1000),
            ("1e3", 1_000_000),
            ("1E3", 1_000_000),
            ("1E", 10u128.pow(18) * 1000),
            ("+3", 3000),
            ("1u", 1),
            ("0", 0),
        ] {
            assert_eq!(milli(s).unwrap(), m, "{s}");
        }
        assert_eq!(units_ceil("1.5Gi").unwrap(), 1_610_612_736);
        assert_eq!(units_ceil("500m").unwrap(), 1);
        assert_eq!(units_ceil("512Mi").unwrap(), 512 << 20);
        for bad in ["", "x", "1.2.3", "-1", "1Zi", "1 Gi", ".", "1e", "Gi"] {
            assert!(matches!(milli(bad), Err(QuantityError::Malformed(_))), "{bad:?}");
        }
        assert!(matches!(milli("99999999999999999999999999999999999999999"), Err(QuantityError::Overflow(_))));
        assert!(matches!(milli("1e99"), Err(QuantityError::Overflow(_))));
        assert_eq!(cpu_string(4000), "4");
        assert_eq!(cpu_string(4500), "4500m");
    }
}
