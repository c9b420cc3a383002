//! OpenAI's harmony format, in which gpt-oss writes its output: a series of
//! messages, each a header and a body,
//! `<|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…`.
//!
//! - A message on the `analysis` channel is thinking.
//! - One on `final` is the answer; one on `commentary` with no recipient is
//!   a preamble the user sees too (answer text).
//! - One with a recipient (` to=functions.NAME`, before or after the
//!   channel) is a tool call: its body is the arguments' JSON text.
//!
//! `<|return|>` and `<|call|>` end the generation (llama.cpp counts them as
//! end-of-generation tokens), so they are rarely seen; `<|end|>` ends one
//! message and `<|start|>` begins the next. An output that does not open
//! with a header (a model that ignores the format) is all answer.
//!
//! [`HarmonyReader`] reads the output as it streams, holding back only what
//! may be the start of a tag, and sends a call's name once its header is
//! read, then its arguments as they are written.

use crate::calls::CallPiece;
use crate::router::Routed;
use crate::tools::{find_first, held_tail_len};

/// The header that opens a thinking message (what the thinking budget
/// counts from: [`crate::ThinkTags::HARMONY`]'s opening tag).
pub(crate) const HARMONY_ANALYSIS: &str = "<|channel|>analysis<|message|>";
/// Whether a chat template writes OpenAI's harmony format.
pub(crate) fn is_harmony(template: &str) -> bool {
    template.contains(CHANNEL) && template.contains(MESSAGE)
}

/// What ends a message's header.
const MESSAGE: &str = "<|message|>";
/// What opens a message's header.
const START: &str = "<|start|>";
pub(crate) const CHANNEL: &str = "<|channel|>";
/// The format's tags a vocabulary may hold as control tokens.
pub(crate) const MARKUP: [&str; 5] = [START, "<|end|>", CHANNEL, MESSAGE, "<|constrain|>"];
/// The recipient's mark in a header.
const TO: &str = "to=";
/// What ends a message's body: its own end, the generation's (rarely
/// rendered), or the next message's start (when `<|end|>` is not rendered).
const BODY_ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", START];
/// What a header may open with.
const HEADER_OPENS: [&str; 3] = [START, CHANNEL, TO];
/// A header is short: text this long without `<|message|>` is no header.
const MAX_HEADER: usize = 512;

/// Where a message's body goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Reasoning,
    Answer,
    Call,
    /// A call past the ones taken, or answer text after a call.
    Dropped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before a message: a header may open (or the output is plain text).
    Start,
    /// A message's header, up to `<|message|>`.
    Header,
    /// A message's body.
    Body(Kind),
    /// Not in harmony's shape: all answer.
    Plain,
}

/// Reads harmony output as it streams; see the module's documentation.
#[derive(Debug, Clone)]
pub struct HarmonyReader {
    buf: String,
    state: State,
    /// Calls are read (tools were offered); else a call's body is thinking.
    tools: bool,
    calls: usize,
    max_calls: usize,
    /// The current call's arguments so far.
    args: String,
    /// A message of this kind went out: the next one of the kind is set
    /// apart by a newline.
    said: [bool; 2],
    /// A separator owed before the next text of this kind.
    owed: [bool; 2],
    cut: bool,
    out: Routed,
}

impl Default for HarmonyReader {
    fn default() -> Self {
        HarmonyReader::new(false)
    }
}

impl HarmonyReader {
    /// A reader; `tools`: calls are read (else a call's body is thinking).
    pub fn new(tools: bool) -> Self {
        HarmonyReader {
            buf: String::new(),
            state: State::Start,
            tools,
            calls: 0,
            max_calls: usize::MAX,
            args: String::new(),
            said: [false; 2],
            owed: [false; 2],
            cut: false,
            out: Routed::default(),
        }
    }

    /// This reader, taking only the first call.
    pub fn single(mut self) -> Self {
        self.max_calls = 1;
        self
    }

    /// The output ended inside a call's arguments (they are not whole
    /// JSON).
    pub fn cut_short(&self) -> bool {
        self.cut
    }

    /// Takes the model's next text; returns what can go out now.
    pub fn push(&mut self, text: &str) -> Routed {
        self.buf.push_str(text);
        while self.step() {}
        std::mem::take(&mut self.out)
    }

    /// The output is over: returns all that was held back.
    pub fn finish(&mut self) -> Routed {
        let rest = std::mem::take(&mut self.buf);
        match self.state {
            State::Start if !rest.trim().is_empty() => self.emit(Kind::Answer, &rest),
            State::Plain => self.emit(Kind::Answer, &rest),
            State::Body(kind) => {
                self.emit(kind, &rest);
                if kind == Kind::Call {
                    self.end_call();
                }
            }
            // An unfinished header is markup, not text.
            State::Start | State::Header => {}
        }
        self.out.cut = self.cut;
        std::mem::take(&mut self.out)
    }

    /// Reads on; false when more text is needed.
    fn step(&mut self) -> bool {
        match self.state {
            State::Start => {
                let lead = self.buf.trim_start();
                if lead.is_empty() {
                    return false;
                }
                if HEADER_OPENS.iter().any(|o| lead.starts_with(o)) {
                    self.buf = lead.to_string();
                    self.state = State::Header;
                } else if HEADER_OPENS.iter().any(|o| o.starts_with(lead)) {
                    return false;
                } else {
                    self.state = State::Plain;
                }
                true
            }
            State::Header => {
                let Some(at) = self.buf.find(MESSAGE) else {
                    if self.buf.len() > MAX_HEADER {
                        self.state = State::Plain;
                        return true;
                    }
                    return false;
                };
                let header: String = self.buf.drain(..at + MESSAGE.len()).collect();
                let kind = self.open(&header[..at]);
                self.state = State::Body(kind);
                true
            }
            State::Body(kind) => {
                let Some((at, tag)) = find_first(&self.buf, &BODY_ENDS) else {
                    let keep = held_tail_len(&self.buf, &BODY_ENDS);
                    let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.emit(kind, &text);
                    return false;
                };
                let text: String = self.buf.drain(..at).collect();
                self.emit(kind, &text);
                if kind == Kind::Call {
                    self.end_call();
                }
                if tag == START {
                    // The next header (its role first) follows at once.
                    self.state = State::Header;
                } else {
                    self.buf.drain(..tag.len());
                    self.state = State::Start;
                }
                true
            }
            State::Plain => {
                let text = std::mem::take(&mut self.buf);
                self.emit(Kind::Answer, &text);
                false
            }
        }
    }

    /// A message's header read (`header`: its text before `<|message|>`):
    /// where its body goes.
    fn open(&mut self, header: &str) -> Kind {
        let word = |after: &str| -> Option<&str> {
            let at = header.find(after)? + after.len();
            let rest = &header[at..];
            let end = rest
                .find(|c: char| c.is_whitespace() || c == '<')
                .unwrap_or(rest.len());
            Some(&rest[..end])
        };
        let recipient = word(TO).filter(|r| !r.is_empty() && *r != "assistant");
        let channel = word(CHANNEL).unwrap_or_default();
        let kind = match (recipient, channel) {
            (Some(to), _) if self.tools => {
                if self.calls >= self.max_calls {
                    return Kind::Dropped;
                }
                let name = to.strip_prefix("functions.").unwrap_or(to);
                self.calls += 1;
                self.args.clear();
                push_piece(&mut self.out.calls, CallPiece::Call(name.to_string()));
                return Kind::Call;
            }
            // A call with no tools offered is the model's own business.
            (Some(_), _) | (None, "analysis") => Kind::Reasoning,
            _ if self.calls > 0 => return Kind::Dropped,
            _ => Kind::Answer,
        };
        let i = kind as usize;
        self.owed[i] = self.said[i];
        kind
    }

    /// A call's body ended: it is cut short unless its arguments are JSON.
    fn end_call(&mut self) {
        let args = self.args.trim();
        self.cut = serde_json::from_str::<serde_json::Value>(args).is_err();
    }

    fn emit(&mut self, kind: Kind, text: &str) {
        if text.is_empty() {
            return;
        }
        match kind {
            // All the answer comes before the first call (text after
            // calls, even outside any message, is dropped).
            Kind::Answer if self.calls > 0 => {}
            Kind::Reasoning | Kind::Answer => {
                let i = kind as usize;
                let to = if kind == Kind::Reasoning {
                    &mut self.out.reasoning
                } else {
                    &mut self.out.answer
                };
                if std::mem::take(&mut self.owed[i]) {
                    to.push('\n');
                }
                to.push_str(text);
                self.said[i] = true;
            }
            Kind::Call => {
                self.args.push_str(text);
                push_piece(&mut self.out.calls, CallPiece::Args(text.to_string()));
            }
            Kind::Dropped => {}
        }
    }
}

/// Adds `piece`, joining arguments to the arguments before them.
fn push_piece(pieces: &mut Vec<CallPiece>, piece: CallPiece) {
    match (pieces.last_mut(), piece) {
        (Some(CallPiece::Args(a)), CallPiece::Args(b)) => a.push_str(&b),
        (_, p) => pieces.push(p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Xorshift, read_alike_at_every_cut, read_alike_cut_at_random};
    use crate::tools::ParsedOutput;

    /// A whole reading: (reasoning, answer, calls, cut).
    fn read(tools: bool, parts: &[&str]) -> (String, String, ParsedOutput) {
        let mut r = HarmonyReader::new(tools);
        let mut all = Routed::default();
        let mut add = |p: Routed| {
            all.reasoning.push_str(&p.reasoning);
            all.answer.push_str(&p.answer);
            all.calls.extend(p.calls);
            all.cut |= p.cut;
        };
        for p in parts {
            add(r.push(p));
        }
        add(r.finish());
        let calls = ParsedOutput::from_pieces(all.calls, all.cut);
        (all.reasoning, all.answer, calls)
    }

    /// The text read whole, cut in two anywhere, and a character at a time
    /// all read alike; returns the reading.
    fn same_in_pieces(tools: bool, text: &str) -> (String, String, ParsedOutput) {
        read_alike_at_every_cut(text, |parts| read(tools, parts))
    }

    fn calls(p: &ParsedOutput) -> Vec<(&str, &str)> {
        p.calls
            .iter()
            .map(|(n, a)| (n.as_str(), a.as_str()))
            .collect()
    }

    #[test]
    fn analysis_is_thinking_and_final_the_answer() {
        let (r, a, c) = same_in_pieces(
            false,
            "<|channel|>analysis<|message|>User asks 2+2. <|e|> is no tag.<|end|>\
             <|start|>assistant<|channel|>final<|message|>It is 4.",
        );
        assert_eq!(r, "User asks 2+2. <|e|> is no tag.");
        assert_eq!(a, "It is 4.");
        assert!(c.calls.is_empty() && !c.cut_short);
        // `<|return|>` rendered, and `<|end|>` not rendered between messages.
        let (r, a, _) = same_in_pieces(
            false,
            "<|channel|>analysis<|message|>Hm.<|start|>assistant<|channel|>final<|message|>Yes.<|return|>",
        );
        assert_eq!((r.as_str(), a.as_str()), ("Hm.", "Yes."));
        // No analysis at all.
        let (r, a, _) = same_in_pieces(false, "<|channel|>final<|message|>Straight.");
        assert_eq!((r.as_str(), a.as_str()), ("", "Straight."));
    }

    #[test]
    fn a_call_is_read_from_its_header_and_body() {
        let text = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant\
                    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
                    {\"city\": \"Paris\"}";
        let (r, a, c) = same_in_pieces(true, text);
        assert_eq!((r.as_str(), a.as_str()), ("Need weather.", ""));
        assert_eq!(calls(&c), [("get_weather", "{\"city\": \"Paris\"}")]);
        assert!(!c.cut_short);
        // The recipient before the channel (as the template renders calls),
        // and the generation's own `<|call|>` rendered.
        let text =
            "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>";
        let (_, _, c) = same_in_pieces(true, text);
        assert_eq!(calls(&c), [("f", "{}")]);
        // Cut short: its arguments so far.
        let (_, _, c) = same_in_pieces(
            true,
            "<|channel|>commentary to=functions.f<|message|>{\"a\": ",
        );
        assert_eq!(calls(&c), [("f", "{\"a\": ")]);
        assert!(c.cut_short);
        // No tools offered: a call's body is the model's own thinking.
        let (r, a, c) = same_in_pieces(false, "<|channel|>commentary to=python<|message|>print(1)");
        assert_eq!((r.as_str(), a.as_str()), ("print(1)", ""));
        assert!(c.calls.is_empty());
    }

    #[test]
    fn a_preamble_is_answer_and_calls_past_the_first_can_be_dropped() {
        let text = "<|channel|>commentary<|message|>Let me look.<|end|>\
                    <|start|>assistant<|channel|>commentary to=functions.a<|message|>{\"x\": 1}<|end|>\
                    <|start|>assistant<|channel|>commentary to=functions.b<|message|>{}<|end|>\
                    <|start|>assistant<|channel|>final<|message|>Late text.";
        let (_, a, c) = same_in_pieces(true, text);
        assert_eq!(a, "Let me look.");
        assert_eq!(calls(&c), [("a", "{\"x\": 1}"), ("b", "{}")]);
        let mut r = HarmonyReader::new(true).single();
        let mut got = r.push(text);
        got.calls.extend(r.finish().calls);
        assert_eq!(
            ParsedOutput::from_pieces(got.calls, false).calls,
            [("a".to_string(), "{\"x\": 1}".to_string())]
        );
    }

    #[test]
    fn two_messages_of_a_kind_are_set_apart_and_plain_text_is_the_answer() {
        let (r, a, _) = same_in_pieces(
            false,
            "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>\
             <|start|>assistant<|channel|>final<|message|>Done.",
        );
        assert_eq!((r.as_str(), a.as_str()), ("One.\nTwo.", "Done."));
        let (r, a, _) = same_in_pieces(false, "  Hello <|channel|> there.");
        assert_eq!((r.as_str(), a.as_str()), ("", "  Hello <|channel|> there."));
        // A header cut short is markup, not text.
        let (r, a, _) = same_in_pieces(false, "<|channel|>analy");
        assert_eq!((r.as_str(), a.as_str()), ("", ""));
    }

    #[test]
    fn text_goes_out_as_soon_as_it_cannot_be_a_tag() {
        let mut r = HarmonyReader::new(false);
        assert_eq!(
            r.push("<|channel|>analysis<|message|>Hm <|e").reasoning,
            "Hm "
        );
        assert_eq!(r.push("x").reasoning, "<|ex");
        assert_eq!(
            r.push("<|end|><|start|>assistant<|channel|>final<|message|>A")
                .answer,
            "A"
        );
    }

    /// Random texts of harmony's pieces (headers, tags, bodies, broken
    /// ones) read alike whole, a character at a time, and cut in three
    /// anywhere, with and without tools.
    #[test]
    fn random_texts_read_alike_however_cut() {
        const PARTS: [&str; 18] = [
            "<|channel|>",
            "analysis",
            "final",
            "commentary",
            "<|message|>",
            "<|end|>",
            "<|start|>",
            "assistant",
            " to=functions.f",
            "to=python ",
            " <|constrain|>json",
            "<|call|>",
            "<|return|>",
            "{\"a\": 1}",
            "Hm, ",
            "<|",
            "é",
            "\n",
        ];
        let mut rng = Xorshift(0x2545_F491_4F6C_DD1D);
        let (mut thought, mut called) = (0, 0);
        for round in 0..3000 {
            let tools = round % 2 == 0;
            let opener = [
                "",
                "<|channel|>analysis<|message|>",
                "<|channel|>commentary to=functions.f<|message|>",
            ][rng.below(3)];
            let len = rng.below(20);
            let text: String = std::iter::once(opener)
                .chain((0..len).map(|_| PARTS[rng.below(PARTS.len())]))
                .collect();
            let whole = read_alike_cut_at_random(&text, &mut rng, |parts| read(tools, parts));
            thought += usize::from(!whole.0.is_empty());
            called += usize::from(!whole.2.calls.is_empty());
        }
        assert!(thought > 500 && called > 500, "{thought} {called}");
    }
}
