//! Reasoning models' thinking, split from their answer: a `<think>` block at
//! the start of the output (Qwen3, DeepSeek-R1 and the models trained on
//! their format), or a `[THINK]` one (Mistral's Magistral and Ministral 3).
//! gpt-oss thinks in harmony's `analysis` channel ([`ThinkTags::HARMONY`];
//! its output is read by [`crate::HarmonyReader`]).
//! A template whose generation prompt already opens the block
//! (DeepSeek-R1's ends with `<think>\n`) starts the output inside it.

/// The tag that opens a `<think>` block.
pub const THINK_OPEN: &str = "<think>";
/// The tag that closes it.
pub const THINK_CLOSE: &str = "</think>";

/// The tags of a model's thinking blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThinkTags {
    /// The opening tag.
    pub open: &'static str,
    /// The closing tag.
    pub close: &'static str,
}

impl Default for ThinkTags {
    /// `<think>`.
    fn default() -> Self {
        ThinkTags::ANGLE
    }
}

impl ThinkTags {
    /// `<think>…</think>` (Qwen3, DeepSeek-R1).
    pub const ANGLE: ThinkTags = ThinkTags {
        open: THINK_OPEN,
        close: THINK_CLOSE,
    };
    /// `[THINK]…[/THINK]` (Magistral, Ministral 3).
    pub const SQUARE: ThinkTags = ThinkTags {
        open: "[THINK]",
        close: "[/THINK]",
    };

    /// `<|START_THINKING|>…<|END_THINKING|>` (Cohere's Command R7B and
    /// Command A).
    pub const COHERE: ThinkTags = ThinkTags {
        open: "<|START_THINKING|>",
        close: "<|END_THINKING|>",
    };

    /// Gemma 4's thought channel: `<|channel>thought` … `<channel|>`.
    pub const GEMMA4: ThinkTags = ThinkTags {
        open: "<|channel>thought",
        close: crate::gemma4::CHANNEL_END,
    };

    /// gpt-oss's `analysis` channel (OpenAI's harmony format): its
    /// message's header, and the end of a message.
    pub const HARMONY: ThinkTags = ThinkTags {
        open: crate::harmony::HARMONY_ANALYSIS,
        close: "<|end|>",
    };

    /// The tags a chat template writes thinking in, if any.
    pub fn of_template(source: &str) -> Option<ThinkTags> {
        if crate::harmony::is_harmony(source) {
            return Some(ThinkTags::HARMONY);
        }
        [
            ThinkTags::ANGLE,
            ThinkTags::SQUARE,
            ThinkTags::COHERE,
            ThinkTags::GEMMA4,
        ]
        .into_iter()
        .find(|t| source.contains(t.open))
    }

    /// Lark rules whose `lead` derives the thinking a constrained answer
    /// may follow: a block in these tags (optional; required and already
    /// opened when `open`: the prompt opened it), any text inside, and the
    /// whitespace after it; for harmony, an optional analysis message and
    /// the final message's header.
    pub fn lead_grammar(self, open: bool) -> String {
        let lit = crate::tools::lark_literal;
        let thought = format!("thought[lazy]: /(.|\\n)*/ {}\n", lit(self.close));
        if self == ThinkTags::HARMONY {
            return format!(
                "lead: analysis? \"<|channel|>final<|message|>\"\n\
                 analysis: {} thought \"<|start|>assistant\"\n{thought}",
                lit(self.open)
            );
        }
        let ws = "ws: /[ \\t\\r\\n]+/\n";
        if open {
            format!("lead: thought ws?\n{thought}{ws}")
        } else {
            format!("lead: (ws? {} thought ws?)?\n{thought}{ws}", lit(self.open))
        }
    }

    /// Whether the model may think again after it began its answer: Gemma
    /// 4 writes another thought, or a bare closing token, after its answer
    /// now and then (llama.cpp's parser takes them so); those are thinking
    /// (the bare close, nothing), not answer. Other models' later tags are
    /// the answer's text.
    pub fn interleaved(self) -> bool {
        self == ThinkTags::GEMMA4
    }

    /// The text that closes a block the model has thought in long enough
    /// (a thinking budget forces it): `"\n</think>\n\n"` as Qwen3's and
    /// DeepSeek-R1's templates write a closed block; for harmony, the end
    /// of the analysis message and the header of the final one; for Gemma
    /// 4, `"\n<channel|>"`, as its template closes a thought.
    pub fn forced_close(self) -> String {
        match self {
            ThinkTags::HARMONY => format!(
                "{}<|start|>assistant<|channel|>final<|message|>",
                self.close
            ),
            ThinkTags::GEMMA4 => format!("\n{}", self.close),
            _ => format!("\n{}\n\n", self.close),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: a block may still open.
    Start,
    /// Inside the block.
    Thinking,
    /// The block closed: whitespace before the answer is dropped.
    Closed,
    /// The answer.
    Answer,
}

/// Splits a stream of generated text into thinking and answer, holding back
/// only what may be part of a tag.
#[derive(Debug, Clone)]
pub struct ThinkSplitter {
    state: State,
    held: String,
    tags: ThinkTags,
    /// The answer began (a later thought, closed, goes back to it as is).
    answered: bool,
}

/// A piece of output, split.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    /// Thinking.
    pub reasoning: String,
    /// Answer.
    pub content: String,
}

impl ThinkSplitter {
    /// A splitter for output that starts inside a thinking block (`open`:
    /// the prompt opened it) or may open one.
    pub fn new(open: bool) -> Self {
        ThinkSplitter {
            state: if open { State::Thinking } else { State::Start },
            held: String::new(),
            tags: ThinkTags::default(),
            answered: false,
        }
    }

    /// This splitter, for blocks in `tags` (`<think>` by default).
    pub fn with_tags(mut self, tags: ThinkTags) -> Self {
        self.tags = tags;
        self
    }

    /// Whether the output is inside the thinking block now.
    pub fn thinking(&self) -> bool {
        self.state == State::Thinking
    }

    /// Whether the thinking is over: the block closed, or the answer began
    /// without one.
    pub fn settled(&self) -> bool {
        matches!(self.state, State::Closed | State::Answer)
    }

    /// Takes the model's next text; returns what of it can go out now.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.state {
                State::Start => {
                    let lead = self.held.trim_start();
                    let open = self.tags.open;
                    if lead.starts_with(open) {
                        let at = self.held.len() - lead.len() + open.len();
                        self.held.drain(..at);
                        self.state = State::Thinking;
                    } else if lead.is_empty() || open.starts_with(lead) {
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => match self.held.find(self.tags.close) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held.drain(..at + self.tags.close.len());
                        self.state = if self.answered {
                            State::Answer
                        } else {
                            State::Closed
                        };
                    }
                    None => {
                        let keep = siliceo_core::held_prefix_len(&self.held, self.tags.close);
                        let tail = self.held.split_off(self.held.len() - keep);
                        out.reasoning
                            .push_str(&std::mem::replace(&mut self.held, tail));
                        return out;
                    }
                },
                State::Closed => {
                    let lead = self.held.trim_start();
                    if lead.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = lead.to_string();
                    self.state = State::Answer;
                }
                State::Answer if self.tags.interleaved() => {
                    self.answered = true;
                    let tags = [self.tags.open, self.tags.close];
                    let Some((at, tag)) = crate::tools::find_first(&self.held, &tags) else {
                        let keep = crate::tools::held_tail_len(&self.held, &tags);
                        let tail = self.held.split_off(self.held.len() - keep);
                        out.content
                            .push_str(&std::mem::replace(&mut self.held, tail));
                        return out;
                    };
                    out.content.push_str(&self.held[..at]);
                    self.held.drain(..at + tag.len());
                    if tag == self.tags.open {
                        self.state = State::Thinking;
                    }
                }
                State::Answer => {
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// At the end: what was held back. An unclosed block is all thinking
    /// (the output ran out while the model thought).
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => Split {
                reasoning: held,
                content: String::new(),
            },
            State::Closed => Split::default(),
            State::Start | State::Answer => Split {
                reasoning: String::new(),
                content: held,
            },
        }
    }

    /// Splits a whole output.
    pub fn split(open: bool, text: &str) -> Split {
        let mut s = ThinkSplitter::new(open);
        let mut a = s.push(text);
        let b = s.finish();
        a.reasoning.push_str(&b.reasoning);
        a.content.push_str(&b.content);
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::read_alike_at_every_cut;

    /// Every way of cutting `text` into two pushes gives the whole split.
    fn same_in_pieces(open: bool, text: &str, want: (&str, &str)) {
        same_in_pieces_in(ThinkTags::ANGLE, open, text, want);
    }

    /// Pushes `parts` into a splitter for `tags`, then finishes it.
    fn split_parts(tags: ThinkTags, open: bool, parts: &[&str]) -> Split {
        let mut s = ThinkSplitter::new(open).with_tags(tags);
        let mut got = Split::default();
        let mut add = |part: Split| {
            got.reasoning.push_str(&part.reasoning);
            got.content.push_str(&part.content);
        };
        for p in parts {
            add(s.push(p));
        }
        add(s.finish());
        got
    }

    /// [`same_in_pieces`] for blocks in `tags`; a character at a time too.
    fn same_in_pieces_in(tags: ThinkTags, open: bool, text: &str, want: (&str, &str)) {
        let whole = read_alike_at_every_cut(text, |parts| split_parts(tags, open, parts));
        assert_eq!(
            (whole.reasoning.as_str(), whole.content.as_str()),
            want,
            "{text:?}"
        );
    }

    #[test]
    fn a_leading_block_is_thinking_and_the_rest_the_answer() {
        same_in_pieces(
            false,
            "<think>\nParis is the capital.\n</think>\n\nParis.",
            ("\nParis is the capital.\n", "Paris."),
        );
        same_in_pieces(false, "  <think>a < b</think>ok", ("a < b", "ok"));
        // No block: all answer, even a tag later on.
        same_in_pieces(
            false,
            "Paris. <think>x</think>",
            ("", "Paris. <think>x</think>"),
        );
        same_in_pieces(false, "<thin", ("", "<thin"));
        same_in_pieces(false, "", ("", ""));
    }

    #[test]
    fn a_prompt_that_opens_the_block_starts_the_output_inside_it() {
        same_in_pieces(
            true,
            "Let me see.</think>\nIt is 4.",
            ("Let me see.", "It is 4."),
        );
        // Cut off while thinking: all thinking.
        same_in_pieces(true, "Let me see. </thi", ("Let me see. </thi", ""));
        same_in_pieces(true, "é</think>é", ("é", "é"));
    }

    #[test]
    fn square_tags_split_alike() {
        same_in_pieces_in(
            ThinkTags::SQUARE,
            false,
            " [THINK]Mistral thinks.[/THINK]\n\nIt is 4. <think>",
            ("Mistral thinks.", "It is 4. <think>"),
        );
        assert_eq!(
            ThinkTags::of_template("{{ '[THINK]' }}"),
            Some(ThinkTags::SQUARE)
        );
        assert_eq!(
            ThinkTags::of_template("{{ '<think>' }}"),
            Some(ThinkTags::ANGLE)
        );
        assert_eq!(ThinkTags::of_template("{{ m.content }}"), None);
    }

    /// Gemma 4's thought channel: a leading thought, and the thoughts and
    /// bare closes it writes after its answer, are thinking; other models'
    /// later tags stay answer text (above).
    #[test]
    fn gemma4_thoughts_after_the_answer_are_thinking() {
        same_in_pieces_in(
            ThinkTags::GEMMA4,
            false,
            "<|channel>thought\nPlan.<channel|>Paris.<|channel>thought\nMore.<channel|> Yes.<channel|>",
            ("\nPlan.\nMore.", "Paris. Yes."),
        );
        same_in_pieces_in(
            ThinkTags::GEMMA4,
            false,
            "It is <b>4</b>.<channel|>",
            ("", "It is <b>4</b>."),
        );
        same_in_pieces_in(ThinkTags::GEMMA4, false, "4 <|chan", ("", "4 <|chan"));
    }

    #[test]
    fn text_goes_out_as_soon_as_it_cannot_be_a_tag() {
        let mut s = ThinkSplitter::new(false);
        assert_eq!(s.push("<th"), Split::default());
        assert_eq!(
            s.push("ink>Hmm <"),
            Split {
                reasoning: "Hmm ".into(),
                content: String::new()
            }
        );
        assert_eq!(
            s.push("b"),
            Split {
                reasoning: "<b".into(),
                content: String::new()
            }
        );
        assert_eq!(s.push("</think>"), Split::default());
        assert_eq!(s.push("\n"), Split::default());
        assert_eq!(
            s.push("Yes"),
            Split {
                reasoning: String::new(),
                content: "Yes".into()
            }
        );
    }
}
