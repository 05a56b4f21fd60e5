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

/// A table with aligned columns.
pub(super) fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let text: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        text.join("  ").trim_end().to_owned()
    };
    #[allow(clippy::print_stdout)] // the command's output
    {
        println!("{}", line(header.iter().map(|h| (*h).to_owned()).collect()));
        for row in rows {
            println!("{}", line(row.clone()));
        }
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

pub(super) fn time(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)).unwrap_or_else(|| "-".into())
}
