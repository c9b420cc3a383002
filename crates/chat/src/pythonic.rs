//! Calls written as Python: `[get_weather(city="Paris", days=3), now()]`
//! (Liquid AI's LFM2 and LFM2.5, between `<|tool_call_start|>` and
//! `<|tool_call_end|>`).
//!
//! [`ArgsToJson`] turns a call's keyword arguments into a JSON object as
//! they stream: `city="Paris"` becomes `"city": "Paris"`; a string in
//! either quote, its escapes decoded; `True`, `False` and `None` (and
//! JSON's `true`, `false`, `null`, which these models also write);
//! numbers; lists, tuples (as lists) and dicts nested. A bare word that
//! is none of these is kept as a string.

use serde_json::Value;

use crate::Tool;
use crate::gemma4::Fed;
use crate::tools::{Keywords, keyword_args, lark_literal};

/// Opens a list of calls.
pub(crate) const CALL: &str = "<|tool_call_start|>";
/// Closes it.
pub(crate) const CALL_END: &str = "<|tool_call_end|>";
/// Between arguments, and between calls, as forced calls are written.
const SEP: &str = ", ";
/// LFM2's tool-call tokens.
pub(crate) const MARKUP: [&str; 2] = [CALL, CALL_END];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    /// The call's own parentheses: keyword arguments.
    Call,
    /// A dict: `key: value`.
    Dict,
    /// A list or tuple.
    List,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// Where a call's argument may begin (a name, or a positional value).
    Arg,
    /// Where a value may come.
    Value,
    /// After a value: a comma or a closing bracket.
    After,
    /// A keyword argument's name, to its `=`.
    Key(String),
    /// A string in `quote`; `esc` holds an escape read so far (from its
    /// backslash).
    Str { quote: char, esc: Option<String> },
    /// A bare value (a number, `True`, …), to what ends it.
    Scalar(String),
}

/// Turns a call's Python keyword arguments into a JSON object as they
/// stream; feed it the text after the call's `(`.
#[derive(Debug, Clone)]
pub(crate) struct ArgsToJson {
    stack: Vec<Frame>,
    mode: Mode,
    /// Arguments of the call written so far.
    n: usize,
}

/// The character a Python escape stands for, once `esc` (from its
/// backslash) is whole: `Some(None)` when it is whole but no known escape
/// (kept as written), `None` while more is needed.
fn unescape(esc: &str) -> Option<Option<String>> {
    let mut cs = esc.chars().skip(1);
    let c = cs.next()?;
    let simple = match c {
        'n' => Some('\n'),
        't' => Some('\t'),
        'r' => Some('\r'),
        '0' => Some('\0'),
        '\\' | '\'' | '"' => Some(c),
        'x' | 'u' => None,
        _ => return Some(None),
    };
    if let Some(ch) = simple {
        return Some(Some(ch.to_string()));
    }
    let digits = if c == 'x' { 2 } else { 4 };
    let hex: String = cs.collect();
    if hex.len() < digits {
        return if hex.chars().all(|h| h.is_ascii_hexdigit()) {
            None
        } else {
            Some(None)
        };
    }
    Some(
        u32::from_str_radix(&hex, 16)
            .ok()
            .and_then(char::from_u32)
            .map(|ch| ch.to_string()),
    )
}

/// A JSON string's text for `s`, without its quotes.
fn escaped(s: &str) -> String {
    let q = serde_json::to_string(s).unwrap_or_default();
    q[1..q.len() - 1].to_string()
}

impl ArgsToJson {
    pub(crate) fn new() -> Self {
        ArgsToJson {
            stack: vec![Frame::Call],
            mode: Mode::Arg,
            n: 0,
        }
    }

    /// A bare value as JSON: Python's and JSON's constants, a number
    /// (Python's spellings too: `1_000`, `.5`), else a string of its text.
    fn scalar(text: &str) -> String {
        match text {
            "True" | "true" => return "true".into(),
            "False" | "false" => return "false".into(),
            "None" | "null" => return "null".into(),
            _ => {}
        }
        if let Ok(Value::Number(_)) = serde_json::from_str::<Value>(text) {
            return text.to_string();
        }
        let plain = text.replace('_', "");
        if let Ok(i) = plain.parse::<i64>() {
            return i.to_string();
        }
        match plain.parse::<f64>() {
            Ok(f) if f.is_finite() => serde_json::Number::from_f64(f).map_or_else(
                || serde_json::to_string(text).unwrap_or_default(),
                |n| n.to_string(),
            ),
            _ => serde_json::to_string(text).unwrap_or_default(),
        }
    }

    fn top(&self) -> Frame {
        self.stack.last().copied().unwrap_or(Frame::Call)
    }

    /// Reads as much of `text` as can be read now.
    pub(crate) fn feed(&mut self, text: &str) -> Fed {
        let mut out = String::new();
        let mut i = 0;
        while let Some(c) = text[i..].chars().next() {
            match &mut self.mode {
                Mode::Str { quote, esc } => {
                    let quote = *quote;
                    if let Some(e) = esc {
                        e.push(c);
                        if let Some(decoded) = unescape(e) {
                            match decoded {
                                Some(ch) => out.push_str(&escaped(&ch)),
                                None => out.push_str(&escaped(e)),
                            }
                            *esc = None;
                        }
                    } else if c == '\\' {
                        *esc = Some("\\".into());
                    } else if c == quote {
                        out.push('"');
                        self.mode = Mode::After;
                    } else {
                        out.push_str(&escaped(&c.to_string()));
                    }
                    i += c.len_utf8();
                    continue;
                }
                Mode::Key(k) => {
                    if c == '=' {
                        let sep = if self.n == 0 { "" } else { ", " };
                        out.push_str(&format!("{sep}\"{}\": ", escaped(k.trim())));
                        self.n += 1;
                        self.mode = Mode::Value;
                    } else if matches!(c, ',' | ')') {
                        // A name with no value: `null`.
                        let sep = if self.n == 0 { "" } else { ", " };
                        out.push_str(&format!("{sep}\"{}\": null", escaped(k.trim())));
                        self.n += 1;
                        self.mode = Mode::After;
                        continue;
                    } else {
                        k.push(c);
                    }
                    i += c.len_utf8();
                    continue;
                }
                Mode::Scalar(s) => {
                    if c.is_whitespace() || matches!(c, ',' | ')' | ']' | '}' | ':') {
                        out.push_str(&Self::scalar(s));
                        self.mode = Mode::After;
                    } else {
                        s.push(c);
                        i += c.len_utf8();
                    }
                    continue;
                }
                _ => {}
            }
            i += c.len_utf8();
            if c.is_whitespace() {
                continue;
            }
            let (value, arg) = (self.mode == Mode::Value, self.mode == Mode::Arg);
            match c {
                ')' | ']' | '}' => {
                    match self.stack.pop() {
                        Some(Frame::Call) => {
                            if self.n == 0 {
                                out.push('{');
                            }
                            out.push('}');
                            return Fed {
                                read: i,
                                json: out,
                                done: true,
                                ended: false,
                            };
                        }
                        Some(Frame::Dict) => out.push('}'),
                        Some(Frame::List) => out.push(']'),
                        None => {}
                    }
                    self.mode = Mode::After;
                }
                ',' => {
                    self.mode = match self.top() {
                        Frame::Call => Mode::Arg,
                        _ => {
                            out.push_str(", ");
                            Mode::Value
                        }
                    };
                }
                ':' if self.top() == Frame::Dict => {
                    out.push_str(": ");
                    self.mode = Mode::Value;
                }
                // A keyword argument's name.
                _ if arg && (c.is_alphabetic() || c == '_') => {
                    if self.n == 0 {
                        out.push('{');
                    }
                    self.mode = Mode::Key(c.to_string());
                }
                _ if arg => {
                    // A positional argument: named by its place.
                    let sep = if self.n == 0 { "{" } else { ", " };
                    out.push_str(&format!("{sep}\"{}\": ", self.n));
                    self.n += 1;
                    self.open_value(c, &mut out);
                }
                _ if value => self.open_value(c, &mut out),
                _ => {}
            }
        }
        Fed {
            read: i,
            json: out,
            done: false,
            ended: false,
        }
    }

    /// A value opens with `c`.
    fn open_value(&mut self, c: char, out: &mut String) {
        match c {
            '"' | '\'' => {
                out.push('"');
                self.mode = Mode::Str {
                    quote: c,
                    esc: None,
                };
            }
            '[' | '(' => {
                out.push('[');
                self.stack.push(Frame::List);
                self.mode = Mode::Value;
            }
            '{' => {
                out.push('{');
                self.stack.push(Frame::Dict);
                self.mode = Mode::Value;
            }
            _ => self.mode = Mode::Scalar(c.to_string()),
        }
    }

    /// The output ended inside the arguments: nothing more goes out (a
    /// string's text went out as it came).
    pub(crate) fn finish(&self) -> String {
        String::new()
    }
}

/// Python's keyword notation for forcing grammars: `key=value` by `, ` in
/// the schema's order, strings double-quoted, `True`/`False`, other values
/// as JSON (which Python's literals mostly are, and these models write).
struct Notation;

impl Keywords for Notation {
    const SEP: &'static str = SEP;
    const SORTED: bool = false;

    fn key(&self, key: &str) -> String {
        format!("{key}=")
    }

    fn text(&self, text: &str) -> String {
        serde_json::to_string(text).unwrap_or_default()
    }

    fn string(&self, g: &mut String, rule: &str, min: Option<u64>, max: Option<u64>) -> String {
        if min.is_none() && max.is_none() {
            return "pstr".into();
        }
        let max = max.map_or(String::new(), |m| m.to_string());
        g.push_str(&format!(
            "{rule}_v: /\"([^\"\\\\\\n]|\\\\.){{{},{max}}}\"/\n",
            min.unwrap_or(0)
        ));
        format!("{rule}_v")
    }

    fn scalar(&self, ty: &str) -> Option<&'static str> {
        match ty {
            "integer" => Some("pint"),
            "number" => Some("pnum"),
            "boolean" => Some("pbool"),
            _ => None,
        }
    }

    fn other(&self, g: &mut String, rule: &str, schema: &Value) -> String {
        g.push_str(&format!("{rule}_v: %json {schema}\n"));
        format!("{rule}_v")
    }
}

/// A forced list of calls in Python's notation to `tools` (one call, or
/// several when `parallel`): each call's keyword arguments in the schema's
/// order, the required ones always, each value as its schema types it (a
/// double-quoted string of its `minLength` to `maxLength` characters, an
/// `enum`'s texts, integers, numbers, `True`/`False`, other values as JSON).
pub(crate) fn grammar(tools: &[&Tool], parallel: bool) -> String {
    let lit = |s: &str| lark_literal(s);
    let fns: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
    let more = if parallel {
        format!(" ({} call)*", lit(SEP))
    } else {
        String::new()
    };
    let mut g = format!(
        "start: {} call{more} {}\ncall: {}\n",
        lit(&format!("{CALL}[")),
        lit(&format!("]{CALL_END}")),
        fns.join(" | ")
    );
    g.push_str(
        "pstr: /\"([^\"\\\\\\n]|\\\\.)*\"/\n\
         pint: /-?(0|[1-9][0-9]*)/\n\
         pnum: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n\
         pbool: \"True\" | \"False\"\n",
    );
    for (i, t) in tools.iter().enumerate() {
        let body = keyword_args(&mut g, i, t, &Notation);
        g.push_str(&format!(
            "f{i}: {}{body} \")\"\n",
            lit(&format!("{}(", t.name))
        ));
    }
    g
}
