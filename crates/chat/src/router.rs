//! A chat's output read as it streams, for every protocol that serves
//! chats: a reasoning model's thinking split off first, then tool calls
//! read from the answer.

use crate::calls::{CallParser, CallPiece};
use crate::reasoning::ThinkSplitter;
use crate::tools::ToolSyntax;

/// Splits a chat's output into thinking, answer text and tool calls as it
/// streams ([`ThinkSplitter`], then [`CallParser`] on the answer).
#[derive(Debug, Default)]
pub struct OutputRouter {
    think: Option<ThinkSplitter>,
    calls: Option<CallParser>,
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
        OutputRouter {
            think: think.map(ThinkSplitter::new),
            calls: tools.map(CallParser::new),
        }
    }

    /// This router, typing XML calls' values by `tools`' schemas
    /// ([`CallParser::with_tools`]).
    pub fn with_tools(mut self, tools: &[crate::Tool]) -> Self {
        self.calls = self.calls.map(|c| c.with_tools(tools));
        self
    }

    /// This router, splitting thinking in `tags` (`<think>` by default).
    pub fn with_think_tags(mut self, tags: crate::ThinkTags) -> Self {
        self.think = self.think.map(|t| t.with_tags(tags));
        self
    }

    /// This router, taking only a chat's first call
    /// (`parallel_tool_calls: false`).
    pub fn single_call(mut self) -> Self {
        self.calls = self.calls.map(CallParser::single);
        self
    }

    /// Takes the model's next text (`end`: the output is over, and all
    /// held back goes out); returns what can go out now.
    pub fn push(&mut self, text: &str, end: bool) -> Routed {
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
