//! Console tables, shared by every printed report of the bench (a leaf: it depends on no
//! other bench module).

/// A console table: the header and the rows, each column padded to its widest cell.
pub fn aligned(header: &[&str], rows: Vec<Vec<String>>) -> Vec<String> {
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: Vec<String>| {
        cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = widths[i]))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    std::iter::once(line(header.iter().map(|s| s.to_string()).collect()))
        .chain(rows.into_iter().map(line))
        .collect()
}
