//! The two functions transformers gives chat templates that minijinja
//! lacks or has otherwise: `strftime_now` (today's date, which GPT-OSS's
//! template writes) and `tojson` as Python's `json.dumps` writes it (`", "`
//! and `": "` between items, nothing escaped for HTML, keys in their
//! order), so a rendered prompt is the one the model was trained on.

use std::io;

use minijinja::value::{Kwargs, Value};
use minijinja::{Error, ErrorKind};
use serde::Serialize;

/// Local time now, as Python's `datetime.now().strftime(format)`.
pub fn strftime_now(format: String) -> Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    write!(out, "{}", chrono::Local::now().format(&format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: {format:?} is not a date format"),
        )
    })?;
    Ok(out)
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut buf = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut buf,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut buf, Spaced);
            value.serialize(&mut ser)
        }
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    String::from_utf8(buf).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// Python's default separators: `", "` and `": "`.
struct Spaced;

impl serde_json::ser::Formatter for Spaced {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.add_function("strftime_now", strftime_now);
        env.render_str(template, ctx).unwrap()
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let ctx = minijinja::context! {};
        let v = r#"{"z": 1, "a": [1.5, "<b>&'é", none, true], "m": {}}"#;
        // Python: json.dumps({"z": 1, "a": [1.5, "<b>&'é", None, True], "m": {}},
        // ensure_ascii=False), and with indent=2 for the list.
        assert_eq!(
            render(&format!("{{{{ {v}|tojson }}}}"), ctx.clone()),
            r#"{"z": 1, "a": [1.5, "<b>&'é", null, true], "m": {}}"#
        );
        assert_eq!(
            render(&format!("{{{{ {v}.a|tojson(indent=2) }}}}"), ctx),
            "[\n  1.5,\n  \"<b>&'é\",\n  null,\n  true\n]"
        );
    }

    #[test]
    fn strftime_now_writes_todays_date() {
        let today = chrono::Local::now().format("%Y-%m-%d").to_string();
        assert_eq!(
            render("{{ strftime_now('%Y-%m-%d') }}", Value::UNDEFINED),
            today
        );
    }
}
