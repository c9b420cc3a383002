//! Gemma 4's tool calls: `<|tool_call>call:NAME{key:value,…}<tool_call|>`.
//!
//! The arguments are not JSON. Gemma 4's template writes them in a
//! notation of its own: keys bare (`city:`), strings between `<|"|>`
//! tokens (`<|"|>Paris<|"|>`, unescaped inside), numbers, `true`,
//! `false` and `null` as in JSON, objects and lists nested with `{}` and
//! `[]`. [`ArgsToJson`] turns that text into JSON text as it streams, so
//! a call's arguments go out as the model writes them, like every other
//! syntax's; a key a template quotes with `<|"|>` (its nested objects,
//! where `escape_keys` is on) and a JSON string the model writes instead
//! read too.

use serde_json::Value;

use crate::Tool;
use crate::tools::{Keywords, keyword_args, lark_literal};

/// Opens a call.
pub(crate) const CALL: &str = "<|tool_call>";
/// Closes it.
pub(crate) const CALL_END: &str = "<tool_call|>";
/// What a call's text opens with after [`CALL`], before the function's name.
pub(crate) const CALL_HEAD: &str = "call:";
/// Gemma 4's string quote (one token in its vocabulary).
pub(crate) const QUOTE: &str = "<|\"|>";
/// Its thinking channel's opening and closing tokens.
pub(crate) const CHANNEL: &str = "<|channel>";
pub(crate) const CHANNEL_END: &str = "<channel|>";

/// Gemma 4's tool-call tokens.
pub(crate) const MARKUP: [&str; 5] = [CALL, CALL_END, QUOTE, CHANNEL, CHANNEL_END];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    Object,
    List,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    /// Where a value, a `,` or a closing bracket may come.
    Value,
    /// Where an object's key (or its closing `}`) may come.
    Key,
    /// A bare key, to its `:`.
    BareKey(String),
    /// After a quoted key: its `:`.
    Colon,
    /// Inside a `<|"|>` string (`key`: it is a key).
    Quoted { key: bool },
    /// Inside a JSON string the model wrote (`esc`: after a backslash).
    Json { key: bool, esc: bool },
    /// A bare value (a number, `true`, …), to the text that ends it.
    Scalar(String),
}

/// Turns Gemma 4's argument notation into JSON text as it streams; see the
/// module's documentation. Feed it the text from the arguments' opening
/// `{` on.
#[derive(Debug, Clone)]
pub(crate) struct ArgsToJson {
    stack: Vec<Frame>,
    mode: Mode,
    /// A key's `:` went out and its value has not begun.
    want_value: bool,
}

/// What a reader of arguments in a notation of their own (this one's,
/// Python's) read of the text it was given.
pub(crate) struct Fed {
    /// Bytes of the input read (the rest may begin a token: held).
    pub read: usize,
    /// JSON text.
    pub json: String,
    /// The arguments closed (their outermost bracket, or the call's end).
    pub done: bool,
    /// What closed them was the call's end (which `read` includes).
    pub ended: bool,
}

/// A JSON string's text for `s`, without its quotes.
fn escaped(s: &str) -> String {
    let q = serde_json::to_string(s).unwrap_or_default();
    q[1..q.len() - 1].to_string()
}

/// Whether `rest` is a proper prefix of `token` (more input may complete it).
fn may_begin(rest: &str, token: &str) -> bool {
    rest.len() < token.len() && token.starts_with(rest)
}

impl ArgsToJson {
    pub(crate) fn new() -> Self {
        ArgsToJson {
            stack: Vec::new(),
            mode: Mode::Value,
            want_value: false,
        }
    }

    /// A bare value as JSON: itself when it is a JSON number, `true`,
    /// `false` or `null`, else a string of its text.
    fn scalar(text: &str) -> String {
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Number(_) | Value::Bool(_) | Value::Null) => text.to_string(),
            _ => serde_json::to_string(text).unwrap_or_default(),
        }
    }

    /// What ends the arguments early (the call's end inside them): the
    /// brackets still open, closed, so the JSON is whole.
    fn close_all(&mut self, out: &mut String) {
        match std::mem::replace(&mut self.mode, Mode::Value) {
            Mode::Scalar(s) => out.push_str(&Self::scalar(&s)),
            Mode::BareKey(k) => out.push_str(&format!("\"{}\":null", escaped(k.trim()))),
            Mode::Colon => out.push_str(":null"),
            _ if self.want_value => out.push_str("null"),
            _ => {}
        }
        self.want_value = false;
        while let Some(f) = self.stack.pop() {
            out.push(if f == Frame::Object { '}' } else { ']' });
        }
    }

    /// Reads as much of `text` as can be read now.
    pub(crate) fn feed(&mut self, text: &str) -> Fed {
        let mut out = String::new();
        let mut i = 0;
        while i < text.len() {
            let rest = &text[i..];
            let c = rest.chars().next().unwrap_or_default();
            match &mut self.mode {
                Mode::Quoted { key } => {
                    let key = *key;
                    let Some(at) = rest.find(QUOTE) else {
                        // All but what may begin the closing quote.
                        let keep = siliceo_core::held_prefix_len(rest, QUOTE);
                        out.push_str(&escaped(&rest[..rest.len() - keep]));
                        i += rest.len() - keep;
                        break;
                    };
                    out.push_str(&escaped(&rest[..at]));
                    out.push('"');
                    i += at + QUOTE.len();
                    self.mode = if key { Mode::Colon } else { Mode::Value };
                    continue;
                }
                Mode::Json { key, esc } => {
                    out.push(c);
                    i += c.len_utf8();
                    if *esc {
                        *esc = false;
                    } else if c == '\\' {
                        *esc = true;
                    } else if c == '"' {
                        self.mode = if *key { Mode::Colon } else { Mode::Value };
                    }
                    continue;
                }
                _ => {}
            }
            // Outside strings: the call's end and the quote are tokens.
            if rest.starts_with(CALL_END) {
                self.close_all(&mut out);
                return Fed {
                    read: i + CALL_END.len(),
                    json: out,
                    done: true,
                    ended: true,
                };
            }
            let opens_quote = rest.starts_with(QUOTE);
            if may_begin(rest, CALL_END) || may_begin(rest, QUOTE) {
                break;
            }
            match &mut self.mode {
                Mode::Scalar(s) => {
                    if c.is_whitespace() || matches!(c, ',' | '}' | ']') || opens_quote {
                        out.push_str(&Self::scalar(s));
                        self.mode = Mode::Value;
                    } else {
                        s.push(c);
                        i += c.len_utf8();
                    }
                    continue;
                }
                Mode::BareKey(k) => {
                    match c {
                        ':' => {
                            out.push_str(&format!("\"{}\":", escaped(k.trim())));
                            self.mode = Mode::Value;
                            self.want_value = true;
                        }
                        // A key with no value: `null`, and the text goes on.
                        ',' | '}' | ']' => {
                            out.push_str(&format!("\"{}\":null", escaped(k.trim())));
                            self.mode = Mode::Value;
                            continue;
                        }
                        _ => k.push(c),
                    }
                    i += c.len_utf8();
                    continue;
                }
                _ => {}
            }
            if c.is_whitespace() {
                i += c.len_utf8();
                continue;
            }
            let key = self.mode == Mode::Key;
            // A key with no value before a bracket or comma: `null`.
            if self.want_value && matches!(c, '}' | ']' | ',') {
                out.push_str("null");
                self.want_value = false;
                continue;
            }
            if !key && self.mode != Mode::Colon {
                // A value (or what ends one) begins here.
                self.want_value = false;
            }
            match c {
                _ if opens_quote => {
                    out.push('"');
                    i += QUOTE.len();
                    self.mode = Mode::Quoted { key };
                    continue;
                }
                '"' => {
                    out.push('"');
                    self.mode = Mode::Json { key, esc: false };
                }
                ':' if self.mode == Mode::Colon => {
                    out.push(':');
                    self.mode = Mode::Value;
                    self.want_value = true;
                }
                '{' | '[' if !key => {
                    out.push(c);
                    let f = if c == '{' { Frame::Object } else { Frame::List };
                    self.stack.push(f);
                    self.mode = if f == Frame::Object {
                        Mode::Key
                    } else {
                        Mode::Value
                    };
                }
                '}' | ']' => {
                    // Whichever bracket the model wrote, the open one closes.
                    match self.stack.pop() {
                        Some(Frame::Object) => out.push('}'),
                        Some(Frame::List) => out.push(']'),
                        None => {}
                    }
                    self.mode = Mode::Value;
                    if self.stack.is_empty() {
                        return Fed {
                            read: i + 1,
                            json: out,
                            done: true,
                            ended: false,
                        };
                    }
                }
                ',' => {
                    out.push(',');
                    if self.stack.last() == Some(&Frame::Object) {
                        self.mode = Mode::Key;
                    }
                }
                _ if key => {
                    self.mode = Mode::BareKey(c.to_string());
                }
                _ => {
                    self.mode = Mode::Scalar(c.to_string());
                }
            }
            i += c.len_utf8();
        }
        Fed {
            read: i,
            json: out,
            done: false,
            ended: false,
        }
    }

    /// The output ended inside the arguments: the text of a string still
    /// open (`rest`: what [`ArgsToJson::feed`] held back of it).
    pub(crate) fn finish(&self, rest: &str) -> String {
        match self.mode {
            Mode::Quoted { .. } => escaped(rest),
            _ => String::new(),
        }
    }
}

/// Gemma 4's keyword notation for forcing grammars: keys sorted (as its
/// template's `dictsort` writes them), `key:value` by `,`, strings between
/// quote tokens; values a schema does not type in its general form.
struct Notation;

impl Keywords for Notation {
    const SEP: &'static str = ",";
    const SORTED: bool = true;

    fn key(&self, key: &str) -> String {
        format!("{key}:")
    }

    fn text(&self, text: &str) -> String {
        format!("{QUOTE}{text}{QUOTE}")
    }

    fn string(&self, g: &mut String, rule: &str, min: Option<u64>, max: Option<u64>) -> String {
        if min.is_none() && max.is_none() {
            return "gstr".into();
        }
        let max = max.map_or(String::new(), |m| m.to_string());
        let q = lark_literal(QUOTE);
        g.push_str(&format!(
            "{rule}_v[lazy]: /(.|\\n){{{},{max}}}/ {q}\n",
            min.unwrap_or(0)
        ));
        format!("{q} {rule}_v")
    }

    fn scalar(&self, ty: &str) -> Option<&'static str> {
        match ty {
            "integer" => Some("gint"),
            "number" => Some("gnum"),
            "boolean" => Some("gbool"),
            _ => None,
        }
    }

    fn other(&self, _: &mut String, _: &str, _: &Value) -> String {
        "gval".into()
    }
}

/// A forced call in Gemma 4's notation to one of `tools`: its arguments
/// in the order its template writes them (sorted by key, as `dictsort`
/// does), the required ones always, each value as its schema types it
/// (strings between quote tokens, of its `minLength` to `maxLength`
/// characters; an `enum`'s texts; numbers; booleans); other values in the
/// notation's general form.
pub(crate) fn grammar(tools: &[&Tool], parallel: bool) -> String {
    let lit = |s: &str| lark_literal(s);
    let repeat = if parallel { "+" } else { "" };
    let fns: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
    let mut g = format!(
        "start: call{repeat}\ncall: {} ({}) {}\n",
        lit(&format!("{CALL}{CALL_HEAD}")),
        fns.join(" | "),
        lit(CALL_END),
    );
    // The notation's general values.
    g.push_str(&format!(
        "gstr: {q} gtext\n\
         gtext[lazy]: /(.|\\n)*/ {q}\n\
         gnum: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/\n\
         gint: /-?(0|[1-9][0-9]*)/\n\
         gbool: \"true\" | \"false\"\n\
         gval: gstr | gnum | gbool | \"null\" | gobj | glist\n\
         gobj: \"{{\" (gkv (\",\" gkv)*)? \"}}\"\n\
         gkv: /[A-Za-z_][A-Za-z0-9_]*/ \":\" gval\n\
         glist: \"[\" (gval (\",\" gval)*)? \"]\"\n",
        q = lit(QUOTE)
    ));
    for (i, t) in tools.iter().enumerate() {
        let body = keyword_args(&mut g, i, t, &Notation);
        g.push_str(&format!(
            "f{i}: {}{body} \"}}\"\n",
            lit(&format!("{}{{", t.name))
        ));
    }
    g
}
