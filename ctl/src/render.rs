//! Tables for people and progress bars.

use super::*;

/// Prints a table: a header line, then aligned columns.
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(headers.iter().map(|h| h.to_uppercase()).collect());
    for r in rows {
        line(r.clone());
    }
}

/// A JSON value as a table cell.
pub(crate) fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().map(cell).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

pub(crate) fn rows_of(list: &Value, columns: &[&str]) -> Vec<Vec<String>> {
    list.as_array()
        .map(|a| {
            a.iter()
                .map(|item| columns.iter().map(|c| cell(&item[*c])).collect())
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn show_list(c: &Client, body: &Value, key: &str, columns: &[&str]) {
    if c.output == Output::Json {
        println!("{body}");
    } else {
        table(columns, &rows_of(&body[key], columns));
    }
}

pub(crate) fn show_one(c: &Client, body: &Value, columns: &[&str]) {
    if c.output == Output::Json {
        println!("{body}");
    } else {
        for col in columns {
            println!("{col:<16} {}", cell(&body[*col]));
        }
    }
}

pub(crate) fn progress_bar(what: &str) -> indicatif::ProgressBar {
    // Drawn on stderr only when it is a terminal, so scripts see clean output.
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}
