//! Printing results: a readable table by default, one JSON document with `--output json`.
//! Only results go to stdout; messages go to stderr.

use std::io::Write;

use serde::Serialize;

use crate::args::OutputFormat;

/// A command's result: serializes to its JSON shape and renders as text.
pub trait Report: Serialize {
    /// Plain-text rendering, ending with a newline (empty: print nothing).
    fn table(&self) -> String;
}

/// Prints `report` on stdout in `format`.
pub fn emit<R: Report>(format: OutputFormat, report: &R) -> anyhow::Result<()> {
    let text = match format {
        OutputFormat::Json => {
            let mut s = serde_json::to_string_pretty(report)?;
            s.push('\n');
            s
        }
        OutputFormat::Table => report.table(),
    };
    write_stdout(&text)
}

/// Prints one compact JSON object and a newline (JSON Lines, for streams).
pub fn emit_json_line<T: Serialize>(value: &T) -> anyhow::Result<()> {
    let mut s = serde_json::to_string(value)?;
    s.push('\n');
    write_stdout(&s)
}

/// Writes and flushes stdout. A closed pipe (`prefixctl ... | head`) ends the process quietly.
pub fn write_stdout(text: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(anyhow::anyhow!("cannot write to stdout: {e}")),
    }
}

/// Columns padded to their widest cell, two spaces apart, headers in capitals.
#[derive(Debug, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
    indent: usize,
}

impl Table {
    pub fn new(headers: &[&str]) -> Self {
        Self {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
            indent: 0,
        }
    }

    pub fn indent(mut self, spaces: usize) -> Self {
        self.indent = spaces;
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn render(&self) -> String {
        let cols = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(cols) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for line in std::iter::once(&self.headers).chain(&self.rows) {
            out.push_str(&" ".repeat(self.indent));
            let mut text = String::new();
            for (i, cell) in line.iter().enumerate().take(cols) {
                text.push_str(cell);
                if i + 1 < cols {
                    text.push_str(&" ".repeat(widths[i] - cell.chars().count() + 2));
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `Name  value` lines, names padded to the longest.
pub fn key_values(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| format!("{k:width$}  {v}\n"))
        .collect()
}

/// Unix milliseconds as RFC 3339 UTC (`2025-01-31T12:00:00.000Z`); empty for 0.
pub fn rfc3339(unix_ms: i64) -> String {
    if unix_ms == 0 {
        return String::new();
    }
    let secs = unix_ms.div_euclid(1000);
    let ms = unix_ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps() {
        assert_eq!(rfc3339(0), "");
        assert_eq!(rfc3339(1), "1970-01-01T00:00:00.001Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_735_689_599_999), "2024-12-31T23:59:59.999Z");
    }

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["NAME", "REVISION"]);
        t.row(vec!["default".into(), "3".into()]);
        t.row(vec!["a".into(), "12".into()]);
        assert_eq!(t.render(), "NAME     REVISION\ndefault  3\na        12\n");
    }
}
