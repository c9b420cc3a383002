//! Tool calls read as the model writes them, so that a stream can send a
//! call's name as soon as it is written and its arguments as they grow.
//!
//! A call opens with one of the syntax's start markers (or, for a syntax
//! without one, is the answer's opening `{`). When the block then
//! reads `{"name": "…", "arguments": ` (or `"parameters"`, or a list of such
//! objects), the call is taken at once: its name goes out, then its
//! arguments' JSON text as it arrives, exactly as the model wrote it. A
//! block that opens otherwise (another key order, not JSON) is held to its
//! close and read whole; if it is not a call, it is text. A later item of a
//! list of calls in another key order is held to its object's close and
//! read whole; an item that is no call ends the list.
//!
//! Qwen3-Coder's XML calls (`<function=NAME>` and one `<parameter=KEY>`
//! tag per argument) are read the same way: the name goes out once its tag
//! is read, then the arguments as JSON text, one parameter at a time, each
//! value typed by the tool's schema ([`CallParser::with_tools`]). A string
//! value streams as it is written.
//!
//! The answer's text is what comes before the first call. From the first
//! call on the output is calls: text between and after blocks is dropped.
//! [`ToolSyntax::parse`] runs this same reader over a whole text, so a whole
//! answer and a streamed one agree by construction.
//!
//! Harmony's calls are messages of their own: for [`ToolSyntax::Harmony`]
//! this reader hands the text to a [`HarmonyReader`] and keeps its answer
//! and calls (its thinking is left out).

use siliceo_core::held_prefix_len;

use crate::Tool;
use crate::gemma4::{self, ArgsToJson};
use crate::harmony::HarmonyReader;
use crate::pythonic;
use crate::tools::{ToolSyntax, call_of_text, calls_of, find_first, held_tail_len, param_type};

/// A piece of a model's answer, read for tool calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallPiece {
    /// Answer text (all of it comes before the first call).
    Text(String),
    /// A call begins: its function's name.
    Call(String),
    /// More of the last call's arguments (JSON text).
    Args(String),
}

/// Reads generated text for tool calls as it streams; see the module's
/// documentation for the rules.
#[derive(Debug)]
pub struct CallParser {
    syntax: ToolSyntax,
    /// Text not read yet.
    buf: String,
    state: State,
    /// Calls taken so far.
    calls: usize,
    out: Vec<CallPiece>,
    /// The output ended inside a call's arguments.
    cut: bool,
    /// Text other than whitespace went out (a marker-less syntax's call
    /// can no longer begin).
    spoke: bool,
    /// Calls read at most; later ones are dropped.
    max_calls: usize,
    /// Each tool's parameters and their types (XML calls' values).
    types: Vec<(String, Vec<(String, String)>)>,
    /// Harmony's reader, which reads that syntax instead.
    harmony: Option<Box<HarmonyReader>>,
    /// The XML call being read: its function, and the parameter whose
    /// value is being read.
    func: String,
    param: String,
    /// Gemma 4's call being read: its arguments, turned into JSON.
    gemma: ArgsToJson,
    /// A Python call's arguments being read, turned into JSON.
    python: pythonic::ArgsToJson,
}

/// Where the reader is. `marker`: the start marker of the block it is in.
#[derive(Debug, Clone, Copy)]
enum State {
    /// Before the first call: text goes out; a marker opens a block.
    Prose,
    /// After a call: text outside blocks is dropped.
    After,
    /// In a block, reading a call's head (`first`: at the block's start,
    /// where a list may open; `list`: in a list of calls).
    Head {
        marker: &'static str,
        first: bool,
        list: bool,
    },
    /// A block whose head was not a call's: held to its close, read whole.
    Hold { marker: &'static str },
    /// A later list item whose head was not a call's (another key order):
    /// held to its object's close, read whole.
    Item { marker: &'static str },
    /// A call's arguments (`kind` once their first character is seen).
    Value {
        marker: &'static str,
        list: bool,
        kind: Option<ValueKind>,
        scan: Scan,
        /// No object encloses them (`NAME[ARGS]{…}`): the call ends with
        /// them.
        bare: bool,
    },
    /// The rest of the call's object after its arguments.
    Rest {
        marker: &'static str,
        list: bool,
        scan: Scan,
    },
    /// After a call's object: the list goes on, or the block ends.
    Between { marker: &'static str, list: bool },
    /// Skipping to the block's close.
    Close { marker: &'static str },
    /// An XML call's function name, to its `>`.
    XmlName { marker: &'static str },
    /// Between an XML call's parameters (`n` written so far).
    XmlParams { marker: &'static str, n: usize },
    /// A parameter's value, to its closing tag (`text`: a string, streamed;
    /// `lead`: its leading newline is still to be dropped).
    XmlValue {
        marker: &'static str,
        n: usize,
        text: bool,
        lead: bool,
    },
    /// Gemma 4's call after its marker: `call:NAME{`.
    GemmaHead { marker: &'static str },
    /// Gemma 4's arguments (in [`CallParser::gemma`]).
    GemmaArgs { marker: &'static str },
    /// A Python call's name, to its `(` (`first`: at the block's start,
    /// where the list's `[` may open).
    PyName { marker: &'static str, first: bool },
    /// A Python call's arguments (in [`CallParser::python`]).
    PyArgs { marker: &'static str },
    /// After a Python call: `,` and another, or the list's end.
    PyBetween { marker: &'static str },
}

const XML_FUNCTION: &str = "<function=";

/// The tags of an XML call's arguments: Qwen3-Coder's `<parameter=KEY>\n
/// VALUE\n</parameter>` in `<function=NAME>…</function>`, GLM's
/// `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` after the name.
pub(crate) struct XmlTags {
    /// Opens a parameter's key.
    pub key: &'static str,
    /// Ends the key.
    pub key_end: &'static str,
    /// Opens the value after the key (and whitespace); empty: the key's
    /// end does.
    pub value: &'static str,
    /// Ends the value.
    pub value_end: &'static str,
    /// Ends the call's parameters (the block's close when it is that).
    pub call_end: &'static str,
    /// A value's leading and trailing newline are the layout's, not the
    /// value's.
    pub newlines: bool,
}

pub(crate) const QWEN_XML: XmlTags = XmlTags {
    key: "<parameter=",
    key_end: ">",
    value: "",
    value_end: "</parameter>",
    call_end: "</function>",
    newlines: true,
};

pub(crate) const GLM_XML: XmlTags = XmlTags {
    key: "<arg_key>",
    key_end: "</arg_key>",
    value: "<arg_value>",
    value_end: "</arg_value>",
    call_end: "</tool_call>",
    newlines: false,
};

/// A JSON string's text without its quotes.
fn escaped(s: &str) -> String {
    let q = serde_json::to_string(s).unwrap_or_default();
    q[1..q.len() - 1].to_string()
}

/// An XML parameter's value as JSON text, as its schema types it: the
/// model's own text when it is a value of that type, else a string.
fn typed(value: &str, ty: &str) -> String {
    let v = value.trim();
    let as_string = || serde_json::to_string(value).unwrap_or_default();
    match ty {
        "boolean" if v.eq_ignore_ascii_case("true") || v.eq_ignore_ascii_case("false") => {
            v.to_ascii_lowercase()
        }
        "integer" | "number" => match serde_json::from_str::<serde_json::Value>(v) {
            Ok(serde_json::Value::Number(_)) => v.to_string(),
            _ => as_string(),
        },
        "boolean" | "string" => as_string(),
        _ => match serde_json::from_str::<serde_json::Value>(v) {
            Ok(_) => v.to_string(),
            Err(_) => as_string(),
        },
    }
}

/// How a call's arguments are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueKind {
    /// An object or a list: streamed as written.
    Nested,
    /// A string holding JSON (some models write that): held to its end.
    Str,
    /// Anything else (a number, `null`): held to its end.
    Scalar,
}

/// Bracket depth through JSON text, strings skipped.
#[derive(Debug, Clone, Copy, Default)]
struct Scan {
    depth: u32,
    in_str: bool,
    esc: bool,
}

impl Scan {
    /// Reads one byte; true when it closes the outermost bracket.
    fn step(&mut self, c: u8) -> bool {
        if self.in_str {
            if self.esc {
                self.esc = false;
            } else if c == b'\\' {
                self.esc = true;
            } else if c == b'"' {
                self.in_str = false;
            }
            return false;
        }
        match c {
            b'"' => self.in_str = true,
            b'{' | b'[' => self.depth += 1,
            b'}' | b']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }

    /// The index of the byte in `b` that closes the outermost bracket.
    fn until_closed(&mut self, b: &[u8]) -> Option<usize> {
        b.iter().position(|&c| self.step(c))
    }
}

/// The text that closes a block opened by `marker` (none: to the end).
fn close_of(marker: &str) -> &'static str {
    match marker {
        "<tool_call>" => "</tool_call>",
        "```json" => "```",
        crate::tools::COMMAND_R_CALL => crate::tools::COMMAND_R_END,
        gemma4::CALL => gemma4::CALL_END,
        pythonic::CALL => pythonic::CALL_END,
        _ => "",
    }
}

/// Why a call's head was not read.
enum NoHead {
    /// The text so far may still become one.
    Partial,
    /// It cannot.
    Fail,
}

/// A cursor over a block's text, for [`head`].
struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn ws(&mut self) {
        while self.b.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn peek(&self) -> Result<u8, NoHead> {
        self.b.get(self.i).copied().ok_or(NoHead::Partial)
    }

    fn eat(&mut self, lit: &str) -> Result<(), NoHead> {
        let (lit, rest) = (lit.as_bytes(), &self.b[self.i..]);
        let n = lit.len().min(rest.len());
        if rest[..n] != lit[..n] {
            return Err(NoHead::Fail);
        }
        if n < lit.len() {
            return Err(NoHead::Partial);
        }
        self.i += n;
        Ok(())
    }

    /// A JSON string literal: where it starts and ends.
    fn string(&mut self) -> Result<(usize, usize), NoHead> {
        let start = self.i;
        self.eat("\"")?;
        let mut scan = Scan {
            in_str: true,
            ..Scan::default()
        };
        while let Some(&c) = self.b.get(self.i) {
            self.i += 1;
            scan.step(c);
            if !scan.in_str {
                return Ok((start, self.i));
            }
        }
        Err(NoHead::Partial)
    }
}

/// A call's head, `{"name": "…", "arguments": ` (`[` first when `first`
/// allows a list): the name, where the arguments start, and whether a list
/// opened.
fn head(s: &str, first: bool) -> Result<(String, usize, bool), NoHead> {
    let mut c = Cursor {
        b: s.as_bytes(),
        i: 0,
    };
    c.ws();
    let list = first && c.peek()? == b'[';
    if list {
        c.i += 1;
        c.ws();
    }
    c.eat("{")?;
    c.ws();
    // Command R's calls lead with their id (`"tool_call_id": "0", `),
    // skipped, and name the function `tool_name`.
    match c.eat("\"tool_call_id\"") {
        Ok(()) => {
            c.ws();
            c.eat(":")?;
            c.ws();
            c.string()?;
            c.ws();
            c.eat(",")?;
            c.ws();
        }
        Err(NoHead::Partial) => return Err(NoHead::Partial),
        Err(NoHead::Fail) => {}
    }
    match c.eat("\"name\"") {
        Err(NoHead::Fail) => c.eat("\"tool_name\"")?,
        r => r?,
    }
    c.ws();
    c.eat(":")?;
    c.ws();
    let (a, z) = c.string()?;
    let name: String = serde_json::from_str(&s[a..z]).map_err(|_| NoHead::Fail)?;
    c.ws();
    c.eat(",")?;
    c.ws();
    match c.eat("\"arguments\"") {
        Err(NoHead::Fail) => c.eat("\"parameters\"")?,
        r => r?,
    }
    c.ws();
    c.eat(":")?;
    Ok((name, c.i, list))
}

/// A harmony reading's answer and calls, as this reader's pieces.
fn pieces_of(r: crate::Routed) -> Vec<CallPiece> {
    let text = (!r.answer.is_empty()).then_some(CallPiece::Text(r.answer));
    text.into_iter().chain(r.calls).collect()
}

/// Whether `s` (trimmed) may be a function's name.
fn is_name(s: &str) -> bool {
    s.trim()
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// A function's name at the front of a call's text, before what ends it.
enum NameAt {
    /// The name, and where the first of the ends begins.
    Name(String, usize),
    /// A name so far: more text decides.
    Wait,
    /// Not a name.
    No,
}

/// The name at the front of `text`, up to the first of `ends` (the tail
/// that may begin one of them held).
fn name_before(text: &str, ends: &[&str]) -> NameAt {
    let Some((at, _)) = find_first(text, ends) else {
        let keep = held_tail_len(text, ends);
        return if is_name(&text[..text.len() - keep]) {
            NameAt::Wait
        } else {
            NameAt::No
        };
    };
    let name = text[..at].trim();
    if name.is_empty() || !is_name(name) {
        return NameAt::No;
    }
    NameAt::Name(name.to_string(), at)
}

/// Whether [`CallParser::step`] read on or needs more text.
enum Step {
    On,
    Wait,
}

impl CallParser {
    /// A reader for `syntax`'s calls.
    pub fn new(syntax: ToolSyntax) -> Self {
        CallParser {
            syntax,
            buf: String::new(),
            state: State::Prose,
            calls: 0,
            out: Vec::new(),
            cut: false,
            spoke: false,
            max_calls: usize::MAX,
            types: Vec::new(),
            harmony: (syntax == ToolSyntax::Harmony).then(|| Box::new(HarmonyReader::new(true))),
            func: String::new(),
            param: String::new(),
            gemma: ArgsToJson::new(),
            python: pythonic::ArgsToJson::new(),
        }
    }

    /// This reader, typing XML calls' values by `tools`' schemas (a
    /// parameter the schema does not type is a string).
    pub fn with_tools(mut self, tools: &[Tool]) -> Self {
        // Only XML values are typed: other syntaxes' arguments are JSON.
        if self.syntax.xml_tags().is_none() {
            return self;
        }
        self.types = tools
            .iter()
            .map(|t| {
                let schema = t.parameters_value();
                let props = schema.get("properties").and_then(|p| p.as_object());
                let params = props
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), param_type(v).to_string()))
                    .collect();
                (t.name.clone(), params)
            })
            .collect();
        self
    }

    /// The type of the current XML call's parameter.
    fn param_type(&self) -> &str {
        self.types
            .iter()
            .find(|(f, _)| *f == self.func)
            .and_then(|(_, ps)| ps.iter().find(|(p, _)| *p == self.param))
            .map_or("string", |(_, t)| t.as_str())
    }

    /// The JSON text that opens the current XML parameter's value, the
    /// `n`-th: `{"key": ` or `, "key": `.
    fn arg_head(&self, n: usize) -> String {
        let open = if n == 0 { "{" } else { ", " };
        let key = serde_json::to_string(&self.param).unwrap_or_default();
        format!("{open}{key}: ")
    }

    /// This reader, taking only the first call (`parallel_tool_calls:
    /// false`): later ones are dropped.
    pub fn single(mut self) -> Self {
        self.max_calls = 1;
        self.harmony = self.harmony.map(|h| Box::new(h.single()));
        self
    }

    /// Takes the model's next text; returns what can go out now.
    pub fn push(&mut self, text: &str) -> Vec<CallPiece> {
        if let Some(h) = self.harmony.as_mut() {
            return pieces_of(h.push(text));
        }
        self.buf.push_str(text);
        while let Step::On = self.step() {}
        std::mem::take(&mut self.out)
    }

    /// The output is over: returns all that was held back.
    pub fn finish(&mut self) -> Vec<CallPiece> {
        if let Some(h) = self.harmony.as_mut() {
            let r = h.finish();
            self.cut = r.cut;
            return pieces_of(r);
        }
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Prose => self.emit(CallPiece::Text(rest)),
            // A marker-less syntax's answer that never became a call.
            State::Head { marker: "", .. } if self.calls == 0 => {
                self.emit(CallPiece::Text(rest));
            }
            State::Head {
                marker,
                first: true,
                ..
            }
            | State::Hold { marker }
            | State::GemmaHead { marker }
            | State::PyName {
                marker,
                first: true,
            } => self.whole_block(marker, &rest, ""),
            State::Value { kind, .. } => {
                self.cut = true;
                if kind != Some(ValueKind::Nested) {
                    self.emit(CallPiece::Args(rest.trim_end().to_string()));
                }
            }
            // An XML call cut short: its arguments so far, a string value's
            // text included.
            State::XmlValue { text, .. } => {
                self.cut = true;
                if text {
                    self.emit(CallPiece::Args(escaped(&rest)));
                }
            }
            State::XmlParams { .. } => self.cut = true,
            State::PyArgs { .. } => {
                self.cut = true;
                let tail = self.python.finish();
                self.emit(CallPiece::Args(tail));
            }
            State::GemmaArgs { .. } => {
                self.cut = true;
                let tail = self.gemma.finish(&rest);
                self.emit(CallPiece::Args(tail));
            }
            State::XmlName { marker } if self.calls == 0 => {
                self.emit(CallPiece::Text(format!("{marker}{rest}")));
            }
            // Inside a call's object, after its arguments, or after the
            // calls: nothing more to say.
            _ => {}
        }
        self.state = State::After;
        std::mem::take(&mut self.out)
    }

    /// The output ended inside a call's arguments (they are cut short).
    pub fn cut_short(&self) -> bool {
        self.cut
    }

    fn emit(&mut self, piece: CallPiece) {
        if let CallPiece::Text(t) = &piece {
            self.spoke |= !t.trim().is_empty();
        }
        match (self.out.last_mut(), piece) {
            (_, CallPiece::Text(t) | CallPiece::Args(t)) if t.is_empty() => {}
            (Some(CallPiece::Text(a)), CallPiece::Text(b))
            | (Some(CallPiece::Args(a)), CallPiece::Args(b)) => a.push_str(&b),
            (_, p) => self.out.push(p),
        }
    }

    /// A held block read whole (its text after `marker`, and the `close`
    /// that ended it): its calls, or, before any call, text.
    fn whole_block(&mut self, marker: &'static str, inner: &str, close: &str) {
        match calls_of(inner.trim()) {
            Some(calls) => {
                let room = self.max_calls - self.calls;
                for (name, args) in calls.into_iter().take(room) {
                    self.calls += 1;
                    self.emit(CallPiece::Call(name));
                    self.emit(CallPiece::Args(args));
                }
                self.state = State::After;
            }
            None if self.calls == 0 => {
                self.emit(CallPiece::Text(format!("{marker}{inner}{close}")));
                self.state = State::Prose;
            }
            None => self.state = State::After,
        }
    }

    /// A call named `name` begins, its head read: its name goes out and
    /// the reader goes on to `next` (its arguments); false when the calls
    /// taken are all there may be (then it and all after it go).
    fn take_call(&mut self, name: String, next: State) -> bool {
        if self.calls >= self.max_calls {
            self.buf.clear();
            self.state = State::After;
            return false;
        }
        self.calls += 1;
        self.emit(CallPiece::Call(name));
        self.state = next;
        true
    }

    /// [`CallParser::take_call`] for an XML call: its function is kept
    /// (its values' types), and its parameters come next.
    fn take_xml_call(&mut self, name: String, marker: &'static str) -> Step {
        self.func.clone_from(&name);
        if self.take_call(name, State::XmlParams { marker, n: 0 }) {
            Step::On
        } else {
            Step::Wait
        }
    }

    /// What a reader of arguments in a notation of their own read: it
    /// leaves `buf` and its JSON goes out. `Some(ended)` once the arguments
    /// closed (`ended`: by the call's end).
    fn took_args(&mut self, fed: gemma4::Fed) -> Option<bool> {
        self.buf.drain(..fed.read);
        self.emit(CallPiece::Args(fed.json));
        fed.done.then_some(fed.ended)
    }

    /// Skips whitespace at the front of `buf`; false when none is left.
    fn skip_ws(&mut self) -> bool {
        let n = self.buf.len() - self.buf.trim_start().len();
        self.buf.drain(..n);
        !self.buf.is_empty()
    }

    fn step(&mut self) -> Step {
        match self.state {
            // A marker-less syntax: a call is the answer's opening `{`.
            State::Prose if self.syntax.start_markers().is_empty() => {
                if self.spoke {
                    let all = std::mem::take(&mut self.buf);
                    self.emit(CallPiece::Text(all));
                    return Step::Wait;
                }
                let Some(first) = self.buf.trim_start().chars().next() else {
                    return Step::Wait;
                };
                if first == '{' {
                    self.state = State::Head {
                        marker: "",
                        first: false,
                        list: true,
                    };
                } else {
                    let all = std::mem::take(&mut self.buf);
                    self.emit(CallPiece::Text(all));
                }
                Step::On
            }
            State::Prose | State::After => {
                let prose = matches!(self.state, State::Prose);
                let markers = self.syntax.start_markers();
                if let Some((at, marker)) = find_first(&self.buf, markers) {
                    let before = self.buf[..at].to_string();
                    self.buf.drain(..at + marker.len());
                    if prose {
                        self.emit(CallPiece::Text(before));
                    }
                    self.state = if marker == XML_FUNCTION {
                        State::XmlName { marker }
                    } else if marker == gemma4::CALL {
                        State::GemmaHead { marker }
                    } else if marker == pythonic::CALL {
                        State::PyName {
                            marker,
                            first: true,
                        }
                    } else {
                        State::Head {
                            marker,
                            first: true,
                            list: false,
                        }
                    };
                    return Step::On;
                }
                // The longest tail that may begin a marker stays.
                let keep = held_tail_len(&self.buf, markers);
                let gone: String = self.buf.drain(..self.buf.len() - keep).collect();
                if prose {
                    self.emit(CallPiece::Text(gone));
                }
                Step::Wait
            }
            // Calls named before a separator, the arguments bare after it:
            // Mistral's newer `[TOOL_CALLS]NAME[ARGS]{…}` (a JSON list or
            // object after the marker is the older shape), DeepSeek's
            // `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{…}` (after the list's
            // opening, each call's own), R1's `…function<｜tool▁sep｜>NAME
            // ```json {…}`.
            State::Head { marker, .. }
                if self.syntax.named_call().is_some()
                    && !self.buf.trim_start().starts_with(['{', '[']) =>
            {
                let (opener, sep) = self.syntax.named_call().unwrap_or_default();
                // The call's own opener, when the marker was the list's:
                // passed over, and drained only with the call's name (a
                // block that is no call is held whole).
                let lead = self.buf.trim_start();
                let start = if !opener.is_empty() && lead.starts_with(opener) {
                    self.buf.len() - lead.len() + opener.len()
                } else if !opener.is_empty() && !lead.is_empty() && opener.starts_with(lead) {
                    return Step::Wait;
                } else {
                    0
                };
                let (name, at) = match name_before(&self.buf[start..], &[sep]) {
                    NameAt::Name(name, at) => (name, at),
                    NameAt::Wait => return Step::Wait,
                    NameAt::No => {
                        self.state = State::Hold { marker };
                        return Step::On;
                    }
                };
                self.buf.drain(..start + at + sep.len());
                let value = State::Value {
                    marker,
                    list: false,
                    kind: None,
                    scan: Scan::default(),
                    bare: true,
                };
                if !self.take_call(name, value) {
                    return Step::Wait;
                }
                Step::On
            }
            // Gemma 4's call: `call:NAME{`, then the arguments in its notation.
            State::GemmaHead { marker } => {
                let lead = self.buf.trim_start();
                let skip = self.buf.len() - lead.len();
                let Some(rest) = lead.strip_prefix(gemma4::CALL_HEAD) else {
                    if gemma4::CALL_HEAD.starts_with(lead) {
                        return Step::Wait;
                    }
                    self.state = State::Hold { marker };
                    return Step::On;
                };
                let (name, at) = match name_before(rest, &["{"]) {
                    NameAt::Name(name, at) => (name, at),
                    NameAt::Wait => return Step::Wait,
                    NameAt::No => {
                        self.state = State::Hold { marker };
                        return Step::On;
                    }
                };
                // The `{` stays: the arguments open with it.
                self.buf.drain(..skip + gemma4::CALL_HEAD.len() + at);
                self.gemma = ArgsToJson::new();
                if !self.take_call(name, State::GemmaArgs { marker }) {
                    return Step::Wait;
                }
                Step::On
            }
            State::GemmaArgs { marker } => {
                let fed = self.gemma.feed(&self.buf);
                let Some(ended) = self.took_args(fed) else {
                    return Step::Wait;
                };
                self.state = if ended {
                    State::After
                } else {
                    State::Close { marker }
                };
                Step::On
            }
            // GLM's call: its name after the tag, to a newline or its
            // first key.
            State::Head { marker, .. }
                if self.syntax.is_glm() && !self.buf.trim_start().starts_with(['{', '[']) =>
            {
                let lead = self.buf.trim_start();
                let skip = self.buf.len() - lead.len();
                let (name, at) = match name_before(lead, &["\n", GLM_XML.key, GLM_XML.call_end]) {
                    NameAt::Name(name, at) => (name, at),
                    NameAt::Wait => return Step::Wait,
                    NameAt::No => {
                        self.state = State::Hold { marker };
                        return Step::On;
                    }
                };
                self.buf.drain(..skip + at);
                self.take_xml_call(name, marker)
            }
            // A Python call: `NAME(`, after the list's `[` at the block's
            // start.
            State::PyName { marker, first } => {
                let lead = self.buf.trim_start();
                let lead = match lead.strip_prefix('[') {
                    Some(rest) if first => rest.trim_start(),
                    _ => lead,
                };
                let skip = self.buf.len() - lead.len();
                let (name, at) = match name_before(lead, &["("]) {
                    NameAt::Name(name, at) => (name, at),
                    NameAt::Wait => return Step::Wait,
                    // Not a call: the block is text (or, after a call,
                    // skipped to its end).
                    NameAt::No => {
                        self.state = if first {
                            State::Hold { marker }
                        } else {
                            State::Close { marker }
                        };
                        return Step::On;
                    }
                };
                self.buf.drain(..skip + at + 1);
                self.python = pythonic::ArgsToJson::new();
                if !self.take_call(name, State::PyArgs { marker }) {
                    return Step::Wait;
                }
                Step::On
            }
            State::PyArgs { marker } => {
                let fed = self.python.feed(&self.buf);
                if self.took_args(fed).is_none() {
                    return Step::Wait;
                }
                self.state = State::PyBetween { marker };
                Step::On
            }
            State::PyBetween { marker } => {
                if !self.skip_ws() {
                    return Step::Wait;
                }
                self.state = if self.buf.starts_with(',') {
                    self.buf.drain(..1);
                    State::PyName {
                        marker,
                        first: false,
                    }
                } else {
                    State::Close { marker }
                };
                Step::On
            }
            // Qwen3-Coder's block: `<function=` after the tag.
            State::Head { marker, .. }
                if self.syntax == ToolSyntax::QwenXml
                    && !self.buf.trim_start().starts_with(['{', '[']) =>
            {
                let lead = self.buf.trim_start();
                if lead.starts_with(XML_FUNCTION) {
                    self.state = State::XmlName { marker };
                    return Step::On;
                }
                if XML_FUNCTION.starts_with(lead) {
                    return Step::Wait;
                }
                self.state = State::Hold { marker };
                Step::On
            }
            // The name follows `<function=` (in `buf` unless it was the
            // block's marker).
            State::XmlName { marker } => {
                let start = if marker == XML_FUNCTION {
                    0
                } else {
                    self.buf.len() - self.buf.trim_start().len() + XML_FUNCTION.len()
                };
                let Some(gt) = self.buf[start..].find('>').map(|g| g + start) else {
                    return Step::Wait;
                };
                let name = self.buf[start..gt].trim().to_string();
                self.buf.drain(..=gt);
                self.take_xml_call(name, marker)
            }
            State::XmlParams { marker, n } => {
                let tags = self.syntax.xml_tags().unwrap_or(&QWEN_XML);
                if !self.skip_ws() {
                    return Step::Wait;
                }
                if self.buf.starts_with(tags.key) {
                    let Some(ke) = self.buf.find(tags.key_end) else {
                        return Step::Wait;
                    };
                    let key = self.buf[tags.key.len()..ke].trim().to_string();
                    let mut end = ke + tags.key_end.len();
                    if !tags.value.is_empty() {
                        let rest = &self.buf[end..];
                        let lead = rest.trim_start();
                        if lead.starts_with(tags.value) {
                            end += rest.len() - lead.len() + tags.value.len();
                        } else if tags.value.starts_with(lead) {
                            return Step::Wait;
                        } else {
                            // A key with no value: the call ends there.
                            self.emit(CallPiece::Args(if n == 0 { "{}" } else { "}" }.into()));
                            self.state = State::Close { marker };
                            return Step::On;
                        }
                    }
                    self.param = key;
                    self.buf.drain(..end);
                    let text = self.param_type() == "string";
                    if text {
                        let head = self.arg_head(n);
                        self.emit(CallPiece::Args(format!("{head}\"")));
                    }
                    self.state = State::XmlValue {
                        marker,
                        n,
                        text,
                        lead: true,
                    };
                    return Step::On;
                }
                if [tags.key, tags.call_end]
                    .iter()
                    .any(|t| t.len() > self.buf.len() && t.starts_with(self.buf.as_str()))
                {
                    return Step::Wait;
                }
                // The call's end (the block's own close is left to
                // `Close`), or anything else: the call ends.
                if self.buf.starts_with(tags.call_end) && tags.call_end != close_of(marker) {
                    self.buf.drain(..tags.call_end.len());
                }
                let close = if n == 0 { "{}" } else { "}" };
                self.emit(CallPiece::Args(close.to_string()));
                self.state = State::Close { marker };
                Step::On
            }
            State::XmlValue {
                marker,
                n,
                text,
                lead,
            } => {
                let tags = self.syntax.xml_tags().unwrap_or(&QWEN_XML);
                if lead && tags.newlines {
                    if self.buf.is_empty() {
                        return Step::Wait;
                    }
                    if self.buf.starts_with('\n') {
                        self.buf.drain(..1);
                    }
                }
                let Some(at) = self.buf.find(tags.value_end) else {
                    if text {
                        // What may begin the closing tag (with the newline
                        // before it, where the layout writes one).
                        let mut keep = held_prefix_len(&self.buf, tags.value_end);
                        if tags.newlines {
                            let nl = format!("\n{}", tags.value_end);
                            keep = keep.max(held_prefix_len(&self.buf, &nl));
                        }
                        let out: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.emit(CallPiece::Args(escaped(&out)));
                    }
                    self.state = State::XmlValue {
                        marker,
                        n,
                        text,
                        lead: false,
                    };
                    return Step::Wait;
                };
                let raw: String = self.buf.drain(..at + tags.value_end.len()).collect();
                let value = &raw[..at];
                let value = if tags.newlines {
                    value.strip_suffix('\n').unwrap_or(value)
                } else {
                    value
                };
                let args = if text {
                    format!("{}\"", escaped(value))
                } else {
                    format!("{}{}", self.arg_head(n), typed(value, self.param_type()))
                };
                self.emit(CallPiece::Args(args));
                self.state = State::XmlParams { marker, n: n + 1 };
                Step::On
            }
            State::Head {
                marker,
                first,
                list,
            } => match head(&self.buf, first) {
                Err(NoHead::Partial) => Step::Wait,
                // A marker-less syntax's answer that is not a call: text.
                Err(NoHead::Fail) if marker.is_empty() && self.calls == 0 => {
                    let all = std::mem::take(&mut self.buf);
                    self.emit(CallPiece::Text(all));
                    self.spoke = true;
                    self.state = State::Prose;
                    Step::On
                }
                // Not the head we stream: the block is read whole.
                Err(NoHead::Fail) if first => {
                    self.state = State::Hold { marker };
                    Step::On
                }
                // A later list item: read whole.
                Err(NoHead::Fail) => {
                    self.state = State::Item { marker };
                    Step::On
                }
                Ok((name, end, opened)) => {
                    self.buf.drain(..end);
                    let value = State::Value {
                        marker,
                        list: list || opened,
                        kind: None,
                        scan: Scan::default(),
                        bare: false,
                    };
                    // A call past the last one taken: it and all after go.
                    if !self.take_call(name, value) {
                        return Step::Wait;
                    }
                    Step::On
                }
            },
            State::Item { marker } => {
                let lead = self.buf.len() - self.buf.trim_start().len();
                match self.buf.as_bytes().get(lead) {
                    None => return Step::Wait,
                    Some(b'{') => {}
                    // Not an object: no call; the rest is skipped.
                    Some(_) => {
                        self.state = State::Close { marker };
                        return Step::On;
                    }
                }
                let Some(end) = Scan::default().until_closed(&self.buf.as_bytes()[lead..]) else {
                    return Step::Wait;
                };
                let item: String = self.buf.drain(..=lead + end).collect();
                match call_of_text(&item) {
                    Some((name, args)) => {
                        if self.take_call(name, State::Between { marker, list: true }) {
                            self.emit(CallPiece::Args(args));
                        }
                    }
                    None => self.state = State::Close { marker },
                }
                Step::On
            }
            State::Hold { marker } => {
                let close = close_of(marker);
                let Some(at) = Some(close)
                    .filter(|c| !c.is_empty())
                    .and_then(|c| self.buf.find(c))
                else {
                    return Step::Wait;
                };
                let block: String = self.buf.drain(..at + close.len()).collect();
                self.whole_block(marker, &block[..at], close);
                Step::On
            }
            State::Value {
                marker,
                list,
                kind,
                mut scan,
                bare,
            } => {
                let kind = match kind {
                    Some(k) => k,
                    None if !self.skip_ws() => return Step::Wait,
                    None => match self.buf.as_bytes()[0] {
                        b'{' | b'[' => ValueKind::Nested,
                        b'"' => ValueKind::Str,
                        _ => ValueKind::Scalar,
                    },
                };
                let b = self.buf.as_bytes();
                // Where the arguments end (exclusive).
                let end = match kind {
                    ValueKind::Nested => scan.until_closed(b).map(|i| i + 1),
                    ValueKind::Str => {
                        // The string's closing quote (read from the start
                        // each time: nothing of it went out).
                        let mut s = Scan {
                            in_str: true,
                            ..Scan::default()
                        };
                        b.iter()
                            .skip(1)
                            .position(|&c| {
                                s.step(c);
                                !s.in_str
                            })
                            .map(|i| i + 2)
                    }
                    ValueKind::Scalar => b
                        .iter()
                        .position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace()),
                };
                let Some(end) = end else {
                    if kind == ValueKind::Nested {
                        let all = std::mem::take(&mut self.buf);
                        self.emit(CallPiece::Args(all));
                    }
                    self.state = State::Value {
                        marker,
                        list,
                        kind: Some(kind),
                        scan,
                        bare,
                    };
                    return Step::Wait;
                };
                let value: String = self.buf.drain(..end).collect();
                let args = match kind {
                    ValueKind::Str => serde_json::from_str::<String>(&value)
                        .ok()
                        .filter(|s| serde_json::from_str::<serde_json::Value>(s).is_ok())
                        .unwrap_or(value),
                    _ => value,
                };
                self.emit(CallPiece::Args(args));
                self.state = if bare {
                    // No object around the arguments: the next call opens
                    // with its own marker.
                    State::After
                } else {
                    State::Rest {
                        marker,
                        list,
                        scan: Scan {
                            depth: 1,
                            ..Scan::default()
                        },
                    }
                };
                Step::On
            }
            State::Rest {
                marker,
                list,
                mut scan,
            } => match scan.until_closed(self.buf.as_bytes()) {
                Some(end) => {
                    self.buf.drain(..=end);
                    self.state = State::Between { marker, list };
                    Step::On
                }
                None => {
                    self.buf.clear();
                    self.state = State::Rest { marker, list, scan };
                    Step::Wait
                }
            },
            State::Between { marker, list } => {
                if !list {
                    self.state = State::Close { marker };
                    return Step::On;
                }
                if !self.skip_ws() {
                    return Step::Wait;
                }
                // `,` in a JSON list; `;` between marker-less calls.
                self.state = if self.buf.starts_with([',', ';']) {
                    self.buf.drain(..1);
                    State::Head {
                        marker,
                        first: false,
                        list: true,
                    }
                } else {
                    State::Close { marker }
                };
                Step::On
            }
            State::Close { marker } => {
                let close = close_of(marker);
                if close.is_empty() {
                    // The block runs to the end: what follows is after it.
                    self.state = State::After;
                    return Step::On;
                }
                match self.buf.find(close) {
                    Some(at) => {
                        self.buf.drain(..at + close.len());
                        self.state = State::After;
                        Step::On
                    }
                    None => {
                        let keep = held_prefix_len(&self.buf, close);
                        self.buf.drain(..self.buf.len() - keep);
                        Step::Wait
                    }
                }
            }
        }
    }
}
