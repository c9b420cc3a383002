//! A chat's output read as it streams, for every protocol that serves
//! chats: a reasoning model's thinking split off first, then tool calls
//! read from the answer; or, for a model that writes OpenAI's harmony
//! format (gpt-oss), its messages read by channel.

use crate::calls::{CallParser, CallPiece};
use crate::harmony::HarmonyReader;
use crate::reasoning::ThinkSplitter;
use crate::tools::ToolSyntax;

/// Splits a chat's output into thinking, answer text and tool calls as it
/// streams ([`ThinkSplitter`], then [`CallParser`] on the answer).
#[derive(Debug, Default)]
pub struct OutputRouter {
    think: Option<ThinkSplitter>,
    calls: Option<CallParser>,
    /// A harmony model's output: read whole by this reader instead.
    harmony: Option<HarmonyReader>,
}

/// What [`OutputRouter::push`] lets out: thinking, then answer text, then
/// calls (all the answer's text comes before its first call).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Routed {
    /// Thinking.
    pub reasoning: String,
    /// Answer text (none of a tool call).
    pub answer: String,
    /// Calls begun ([`CallPiece::Call`]) and their arguments as they grow
    /// ([`CallPiece::Args`]).
    pub calls: Vec<CallPiece>,
    /// At the end: the output ended inside a call's arguments.
    pub cut: bool,
}

impl OutputRouter {
    /// A router reading calls in `tools`' syntax (none: no calls), and
    /// splitting thinking off when `think` is `Some(open)` (`open`: the
    /// prompt opened the block).
    pub fn new(tools: Option<ToolSyntax>, think: Option<bool>) -> Self {
        if tools == Some(ToolSyntax::Harmony) {
            return OutputRouter {
                harmony: Some(HarmonyReader::new(true)),
                ..OutputRouter::default()
            };
        }
        OutputRouter {
            think: think.map(ThinkSplitter::new),
            calls: tools.map(CallParser::new),
            harmony: None,
        }
    }

    /// This router, typing XML calls' values by `tools`' schemas
    /// ([`CallParser::with_tools`]).
    pub fn with_tools(mut self, tools: &[crate::Tool]) -> Self {
        self.calls = self.calls.map(|c| c.with_tools(tools));
        self
    }

    /// This router, splitting thinking in `tags` (`<think>` by default).
    /// [`crate::ThinkTags::HARMONY`] reads the output as harmony messages
    /// when thinking is split off.
    pub fn with_think_tags(mut self, tags: crate::ThinkTags) -> Self {
        if tags == crate::ThinkTags::HARMONY && self.think.take().is_some() {
            self.harmony.get_or_insert_with(HarmonyReader::default);
        }
        self.think = self.think.map(|t| t.with_tags(tags));
        self
    }

    /// This router, taking only a chat's first call
    /// (`parallel_tool_calls: false`).
    pub fn single_call(mut self) -> Self {
        self.calls = self.calls.map(CallParser::single);
        self.harmony = self.harmony.map(HarmonyReader::single);
        self
    }

    /// Takes the model's next text (`end`: the output is over, and all
    /// held back goes out); returns what can go out now.
    pub fn push(&mut self, text: &str, end: bool) -> Routed {
        if let Some(h) = self.harmony.as_mut() {
            let mut out = h.push(text);
            if end {
                let tail = h.finish();
                out.reasoning.push_str(&tail.reasoning);
                out.answer.push_str(&tail.answer);
                out.calls.extend(tail.calls);
                out.cut = tail.cut;
            }
            return out;
        }
        let mut out = Routed::default();
        let answer = match self.think.as_mut() {
            None => text.to_string(),
            Some(sp) => {
                let mut split = sp.push(text);
                if end {
                    let tail = sp.finish();
                    split.reasoning.push_str(&tail.reasoning);
                    split.content.push_str(&tail.content);
                }
                out.reasoning = split.reasoning;
                split.content
            }
        };
        let Some(parser) = self.calls.as_mut() else {
            out.answer = answer;
            return out;
        };
        let mut pieces = parser.push(&answer);
        if end {
            pieces.extend(parser.finish());
            out.cut = parser.cut_short();
        }
        for piece in pieces {
            match piece {
                CallPiece::Text(t) => out.answer.push_str(&t),
                p => out.calls.push(p),
            }
        }
        out
    }
}
