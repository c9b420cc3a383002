//! What a chat template needs beyond what `transformers` passes it, found by
//! rendering probe conversations once, when the template is compiled.
//!
//! Templates are written against the shapes their authors tried, and
//! OpenAI's clients send others: an assistant's call with `content: null`
//! (Qwen3's and QwQ's templates split it as text), arguments as an object
//! (DeepSeek-V3.1's and functionary's join them to text), call ids of any
//! length (Mistral's insist on 9 letters and digits), a tool without a
//! description (gpt-oss's joins it to text), a system message (Gemma's
//! refuse the role), a call with both text and thinking (gpt-oss's refuses
//! them together). Each adaptation is made only for a template that fails
//! without it and renders with it, so every other template sees what
//! `transformers` would give it.

use std::borrow::Cow;

use crate::Message;

/// The adaptations one template needs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Fit {
    /// A message without text has empty text (not `none`).
    pub(crate) empty_text: bool,
    /// A call's arguments are JSON text (not an object).
    pub(crate) text_args: bool,
    /// Call ids are 9 letters and digits (others are mapped to such ids,
    /// the same way for a call and its result).
    pub(crate) short_ids: bool,
    /// A tool without a description has an empty one.
    pub(crate) described: bool,
    /// System messages are folded into the first user message.
    pub(crate) fold_system: bool,
    /// A call's message with both text and thinking has its text joined
    /// to its thinking (gpt-oss's refuses both on one call).
    pub(crate) join_thought: bool,
}

impl Fit {
    /// The combinations of the call adaptations, fewest first.
    pub(crate) fn for_calls() -> impl Iterator<Item = Fit> {
        let mut all: Vec<Fit> = (0..8u8)
            .map(|bits| Fit {
                empty_text: bits & 1 != 0,
                text_args: bits & 2 != 0,
                short_ids: bits & 4 != 0,
                ..Fit::default()
            })
            .collect();
        all.sort_by_key(|f| u8::from(f.empty_text) + u8::from(f.text_args) + u8::from(f.short_ids));
        all.into_iter()
    }

    /// The adaptations that change how a chat is rendered, as a short list
    /// (for logs): `empty_text, short_ids`, …
    pub(crate) fn names(&self) -> Vec<&'static str> {
        [
            (self.empty_text, "empty_text"),
            (self.text_args, "text_args"),
            (self.short_ids, "short_ids"),
            (self.described, "described"),
            (self.fold_system, "fold_system"),
            (self.join_thought, "join_thought"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }

    /// `messages` adapted: system messages folded into the first user
    /// message (their texts, then a blank line, then the user's), when the
    /// template refuses the role; a call's text joined to its thinking (the
    /// thinking, a blank line, the text), when the template refuses both.
    pub(crate) fn messages<'a>(&self, messages: &'a [Message]) -> Cow<'a, [Message]> {
        let both =
            |m: &Message| !m.tool_calls.is_empty() && m.reasoning.is_some() && m.content.is_some();
        let messages: Cow<'a, [Message]> = if self.join_thought && messages.iter().any(both) {
            let joined = messages.iter().map(|m| {
                let mut m = m.clone();
                if both(&m) {
                    let text = m.content.take().unwrap_or_default();
                    let thought = m.reasoning.take().unwrap_or_default();
                    m.reasoning = Some(format!("{thought}\n\n{text}"));
                }
                m
            });
            Cow::Owned(joined.collect())
        } else {
            Cow::Borrowed(messages)
        };
        if !self.fold_system || !messages.iter().any(|m| m.role == "system") {
            return messages;
        }
        let system: Vec<&str> = messages
            .iter()
            .filter(|m| m.role == "system")
            .filter_map(|m| m.content.as_deref())
            .collect();
        let system = system.join("\n\n");
        let mut out: Vec<Message> = messages
            .iter()
            .filter(|m| m.role != "system")
            .cloned()
            .collect();
        match out.iter_mut().find(|m| m.role == "user") {
            Some(user) => {
                let text = user.content.as_deref().unwrap_or_default();
                user.content = Some(format!("{system}\n\n{text}"));
            }
            None => out.insert(0, Message::new("user", system)),
        }
        Cow::Owned(out)
    }

    /// A call id as the template sees it.
    pub(crate) fn id(&self, id: &str) -> String {
        if self.short_ids {
            short_id(id)
        } else {
            id.to_string()
        }
    }
}

/// 9 letters and digits: `id` itself when it is so already, else a hash of
/// it (FNV-1a, in base 62), so a call and the result that names it agree.
pub(crate) fn short_id(id: &str) -> String {
    if id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return id.to_string();
    }
    const DIGITS: &[u8; 62] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (0..9)
        .map(|_| {
            let d = DIGITS[(h % 62) as usize];
            h /= 62;
            char::from(d)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_ids_are_nine_letters_and_digits_and_stable() {
        assert_eq!(short_id("abc123XYZ"), "abc123XYZ");
        let a = short_id("call_18eedc3dd3393c090001");
        assert_eq!(a.len(), 9);
        assert!(a.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert_eq!(a, short_id("call_18eedc3dd3393c090001"));
        assert_ne!(a, short_id("call_18eedc3dd3393c090002"));
    }

    #[test]
    fn system_messages_fold_into_the_first_user_message() {
        let fit = Fit {
            fold_system: true,
            ..Fit::default()
        };
        let msgs = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello"),
            Message::new("user", "Bye"),
        ];
        let got = fit.messages(&msgs);
        let texts: Vec<(&str, &str)> = got
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_deref().unwrap_or_default()))
            .collect();
        assert_eq!(
            texts,
            [
                ("user", "Be brief.\n\nHi"),
                ("assistant", "Hello"),
                ("user", "Bye")
            ]
        );
        assert!(matches!(Fit::default().messages(&msgs), Cow::Borrowed(_)));
        let first = Fit::for_calls().next().unwrap();
        assert_eq!(first, Fit::default());
    }
}
