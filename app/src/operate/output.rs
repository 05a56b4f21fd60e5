//! The terminal output every operator command shares: tables, JSON, messages, progress.

use super::*;

/// Progress of long work: a bar when stderr is a terminal, a plain line every `every` items otherwise.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    label: &'static str,
    done: u64,
    every: u64,
}

impl Progress {
    pub fn new(label: &'static str, total: Option<u64>, every: u64) -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = match total {
                Some(n) => indicatif::ProgressBar::new(n),
                None => indicatif::ProgressBar::new_spinner(),
            };
            let style = indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
            bar.set_style(style.progress_chars("=> "));
            bar.set_message(label);
            bar
        });
        Self { bar, label, done: 0, every: every.max(1) }
    }

    pub fn set(&mut self, done: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(done);
        } else if done / self.every > self.done / self.every {
            eprintln!("{}: {done}", self.label);
        }
        self.done = done;
    }

    pub fn inc(&mut self) {
        self.set(self.done + 1);
    }

    pub fn finish(self) {
        match self.bar {
            Some(bar) => bar.finish_and_clear(),
            None => eprintln!("{}: {} done", self.label, self.done),
        }
    }
}

pub(super) fn print_json(value: &serde_json::Value) {
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{}", serde_json::to_string_pretty(value).unwrap_or_default());
    }
}

/// A table with aligned columns, no borders (comfy-table), lines trimmed on the right.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING).set_header(header.iter().copied());
    for row in rows {
        table.add_row(row.iter().map(String::as_str));
    }
    table.trim_fmt()
}

pub(super) fn print_table(header: &[&str], rows: &[Vec<String>]) {
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{}", table(header, rows));
    }
}

pub(super) fn say(text: &str) {
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{text}");
    }
}

pub(super) fn short(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        format!("{}…", text.chars().take(max).collect::<String>())
    }
}

/// Characters that change how a terminal shows text without being visible themselves: Unicode's format
/// characters (bidirectional overrides and isolates, zero-width ones, the byte-order mark, tags).
fn is_format(c: char) -> bool {
    matches!(c as u32,
        0xAD | 0x600..=0x605 | 0x61C | 0x6DD | 0x70F | 0x180E | 0x200B..=0x200F | 0x202A..=0x202E
        | 0x2060..=0x2064 | 0x2066..=0x206F | 0xFEFF | 0xFFF9..=0xFFFB | 0xE0001 | 0xE0020..=0xE007F)
}

/// Text from a producer (a key, a header, a payload, an error that quotes one) made safe to print to an
/// operator's terminal: C0 and C1 controls, DEL and format characters are shown as `\u{…}` escapes (an
/// escape sequence can set the window title, clear the screen or print a fake result; a bidi override can
/// reorder what is shown), bytes that are not UTF-8 as `\xNN`, and a backslash as `\\` so no escape can
/// be forged. `keep_lines` keeps newlines and tabs (a payload); a table cell escapes them too.
pub(super) fn untrusted(bytes: &[u8], keep_lines: bool) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '\n' | '\t' if keep_lines => out.push(c),
                c if c.is_control() || is_format(c) => {
                    let _ = write!(out, "\\u{{{:x}}}", c as u32);
                }
                c => out.push(c),
            }
        }
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out
}

pub(super) fn time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)).unwrap_or_else(|| "-".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 38.4: what a producer planted (a window title, a screen clear, a bidi override, invalid
    /// UTF-8, a forged escape) reaches the terminal as visible escapes; ordinary text is unchanged.
    #[test]
    fn untrusted_text_cannot_drive_the_terminal() {
        let planted = b"\x1b]0;pwned\x07\x1b[2J\x1b[Hall dead letters re-driven OK\r\n\xc2\x9b31m\xe2\x80\xaegnp.exe\x7f\xff\\u{1b}";
        let shown = untrusted(planted, false);
        assert!(shown.chars().all(|c| !c.is_control() && !is_format(c)), "{shown:?}");
        assert_eq!(
            shown,
            "\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\u{1b}[Hall dead letters re-driven OK\\u{d}\\u{a}\\u{9b}31m\\u{202e}gnp.exe\\u{7f}\\xff\\\\u{1b}"
        );
        assert_eq!(untrusted("Zürich order 42\tok".as_bytes(), true), "Zürich order 42\tok");
        assert_eq!(untrusted(b"a\nb", false), "a\\u{a}b");
    }

    /// Every column starts at the same character offset on every line, wide cells (an ellipsis, a
    /// multi-byte name) included, and no line ends in padding.
    #[test]
    fn table_columns_line_up() {
        let rows = vec![
            vec!["malformed".to_owned(), "12".to_owned(), short("a long error text", 6)],
            vec!["older-than-dedup-window".to_owned(), "1".to_owned(), "Zürich".to_owned()],
        ];
        let text = table(&["REASON", "COUNT", "ERROR"], &rows);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let column = |line: &str, cell: &str| line.find(cell).map(|at| line[..at].chars().count());
        let count_at = column(lines[0], "COUNT");
        assert_eq!(column(lines[1], "12"), count_at, "{text}");
        assert_eq!(column(lines[2], "1"), count_at, "{text}");
        let error_at = column(lines[0], "ERROR");
        assert_eq!(column(lines[1], "a long…"), error_at, "{text}");
        assert_eq!(column(lines[2], "Zürich"), error_at, "{text}");
        assert!(lines.iter().all(|l| !l.ends_with(' ')), "{text}");
    }
}
