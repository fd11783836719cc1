//! Small helpers shared by the commands that print Markdown benchmark reports
//! (`makespan-bench`, `ps-bench`) and by `report`, which embeds them.

use anyhow::Context as _;
use std::path::Path;

/// Prints `md` and, when `out` is given, writes it there (creating the folder).
///
/// # Errors
/// The folder or the file cannot be written.
pub fn emit(md: &str, out: Option<&Path>) -> anyhow::Result<()> {
    println!("{md}");
    if let Some(out) = out {
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(out, md).with_context(|| format!("cannot write {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// A Markdown table built row by row.
#[derive(Debug, Clone)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Self {
            header: header.iter().map(|h| (*h).to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (missing cells render empty, extra cells are dropped).
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table, one line per row, ending with a newline.
    pub fn render(&self) -> String {
        let line = |cells: &[String]| {
            let n = self.header.len();
            let padded: Vec<&str> = (0..n)
                .map(|i| cells.get(i).map_or("", String::as_str))
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        let mut out = line(&self.header);
        out.push_str(&format!("|{}\n", "---|".repeat(self.header.len())));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// A command's arguments at their defaults, as if given no flag.
pub fn defaults<A: clap::Args>() -> A {
    #[derive(clap::Parser)]
    struct Defaults<A: clap::Args> {
        #[command(flatten)]
        args: A,
    }
    <Defaults<A> as clap::Parser>::parse_from(["defaults"]).args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Args)]
    struct Example {
        #[arg(long, default_value_t = 7)]
        count: u32,
    }

    #[test]
    fn tables_render_rows_under_their_header() {
        let mut t = Table::new(&["a", "b"]);
        t.row(vec!["1".into(), "2".into()]);
        t.row(vec!["3".into()]);
        assert_eq!(t.render(), "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 |  |\n");
    }

    #[test]
    fn defaults_are_the_flags_defaults_and_emit_writes_the_file() {
        assert_eq!(defaults::<Example>().count, 7);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("sub/report.md");
        emit("# hi", Some(&out)).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "# hi");
    }
}
