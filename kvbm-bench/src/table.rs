//! Column-aligned text tables for the terminal.

/// A table: a header row and data rows, every cell a string.
#[derive(Debug, Clone, Default)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column titles.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row (missing cells print empty, extra cells are kept).
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// Renders the table; text columns are left-aligned, columns whose
    /// cells all start with a digit or sign are right-aligned.
    pub fn render(&self) -> String {
        let cols = self
            .rows
            .iter()
            .map(Vec::len)
            .chain([self.header.len()])
            .max()
            .unwrap_or(0);
        let cell = |r: &Vec<String>, c: usize| r.get(c).cloned().unwrap_or_default();
        let mut width = vec![0usize; cols];
        let mut numeric = vec![true; cols];
        for (c, w) in width.iter_mut().enumerate() {
            *w = cell(&self.header, c).chars().count();
            for r in &self.rows {
                let v = cell(r, c);
                *w = (*w).max(v.chars().count());
                if !v.is_empty() && !v.starts_with(|ch: char| ch.is_ascii_digit() || ch == '-') {
                    numeric[c] = false;
                }
            }
        }
        let line = |r: &Vec<String>| {
            let cells: Vec<String> = (0..cols)
                .map(|c| {
                    let v = cell(r, c);
                    if numeric[c] {
                        format!("{v:>w$}", w = width[c])
                    } else {
                        format!("{v:<w$}", w = width[c])
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_string()
        };
        let mut out = line(&self.header);
        out.push('\n');
        let rule: Vec<String> = width.iter().map(|w| "-".repeat(*w)).collect();
        out.push_str(&rule.join("  "));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_line_up() {
        let mut t = Table::new(["path", "GB/s"]);
        t.row(["G2->G3", "1.25"]);
        t.row(["G3->G2 long", "12.5"]);
        let out = t.render();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[2], "G2->G3       1.25");
        assert_eq!(lines[3], "G3->G2 long  12.5");
    }
}
