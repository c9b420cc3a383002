//! JSON written as Python's `json.dumps(…, ensure_ascii=False)` writes it:
//! what chat templates were written against (`", "` and `": "` between
//! items, non-ASCII kept, no HTML escaping).

use std::fmt::Write;

use serde_json::Value;

/// `json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
pub(crate) fn python_dumps(v: &Value, indent: Option<usize>, sort_keys: bool) -> String {
    let mut out = String::new();
    write_value(&mut out, v, indent, sort_keys, 0);
    out
}

fn newline(out: &mut String, indent: Option<usize>, depth: usize) {
    if let Some(n) = indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn write_value(out: &mut String, v: &Value, indent: Option<usize>, sort: bool, depth: usize) {
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let _ = write!(out, "{n}");
        }
        Value::String(s) => write_str(out, s),
        Value::Array(a) if a.is_empty() => out.push_str("[]"),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, depth + 1);
                write_value(out, x, indent, sort, depth + 1);
            }
            newline(out, indent, depth);
            out.push(']');
        }
        Value::Object(o) if o.is_empty() => out.push_str("{}"),
        Value::Object(o) => {
            let mut entries: Vec<(&String, &Value)> = o.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, indent, depth + 1);
                write_str(out, k);
                out.push_str(": ");
                write_value(out, x, indent, sort, depth + 1);
            }
            newline(out, indent, depth);
            out.push('}');
        }
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_what_python_writes() {
        let v: Value = serde_json::from_str(
            r#"{"name": "get_weather", "parameters": {"type": "object", "required": ["city"]}, "x": [1, 2.5, null, true], "s": "né\n\"<>\""}"#,
        )
        .unwrap();
        // json.dumps(v, ensure_ascii=False)
        assert_eq!(
            python_dumps(&v, None, false),
            r#"{"name": "get_weather", "parameters": {"type": "object", "required": ["city"]}, "x": [1, 2.5, null, true], "s": "né\n\"<>\""}"#
        );
        // json.dumps({"b": [1], "a": {}}, indent=2, sort_keys=True)
        let v: Value = serde_json::from_str(r#"{"b": [1], "a": {}}"#).unwrap();
        assert_eq!(
            python_dumps(&v, Some(2), true),
            "{\n  \"a\": {},\n  \"b\": [\n    1\n  ]\n}"
        );
    }
}
