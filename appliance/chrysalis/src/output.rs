//! Human output: tables of library entries, sizes, times.

use std::time::{Duration, UNIX_EPOCH};

use images::{Entry, Kind};

/// `1.5 GiB`-style size.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// RFC 3339 UTC time of an epoch-seconds value.
pub fn time(secs: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(secs)).to_string()
}

/// `sha256:` + the first 12 hex digits.
pub fn short(d: &images::Digest) -> String {
    format!("{}{}", images::Digest::PREFIX, &d.hex()[..12])
}

/// Prints the entries of one kind as a table or JSON.
pub fn entries(all: Vec<Entry>, kind: Kind, json: bool) -> anyhow::Result<()> {
    let rows: Vec<Entry> = all.into_iter().filter(|e| e.kind == kind).collect();
    if json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let mut table = vec![match kind {
        Kind::Image => {
            vec!["REFERENCE", "DIGEST", "SIZE", "ON DISK", "CREATED"].into_iter().map(String::from).collect()
        }
        Kind::Snapshot => vec!["REFERENCE", "DIGEST", "BASE IMAGE", "NAMESPACE", "SIZE", "ON DISK", "CREATED"]
            .into_iter()
            .map(String::from)
            .collect(),
    }];
    for e in &rows {
        let mut row = vec![e.reference.to_string(), short(&e.digest)];
        if kind == Kind::Snapshot {
            row.push(e.base_image.as_ref().map(short).unwrap_or_default());
            row.push(e.namespace.clone().unwrap_or_else(|| "-".into()));
        }
        row.extend([human_size(e.size), human_size(e.disk), time(e.created)]);
        table.push(row);
    }
    print_table(&table);
    Ok(())
}

/// Prints rows as left-aligned columns two spaces apart.
pub(crate) fn print_table(rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> =
        (0..cols).map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.len()).max().unwrap_or(0)).collect();
    for r in rows {
        let line: Vec<String> = r.iter().enumerate().map(|(i, s)| format!("{s:<w$}", w = widths[i])).collect();
        println!("{}", line.join("  ").trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(1023), "1023 B");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(2 << 30), "2.0 GiB");
        assert_eq!(time(0), "1970-01-01T00:00:00Z");
    }
}
