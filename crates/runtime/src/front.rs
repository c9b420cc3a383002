//! The request layer: what both protocols' handlers call, on their own
//! threads, before a request reaches the engine thread. It renders chats with
//! the model's template, tokenizes, checks every limit (sampling values,
//! log-probabilities, logit bias, prompt and `max_tokens` against the
//! context) and compiles the constraint. The engine thread then only queues
//! token ids; what it can still refuse (a full queue, a duplicate id) depends
//! on its state.

use std::sync::Arc;

use siliceo_chat::{ChatEnd, ChatError, ChatTemplate, ThinkTags};
use siliceo_constrain::{Grammars, Matcher, Vocabulary};
use siliceo_core::{Constraint, SamplingParams, TokenId};
use siliceo_engine::Model;

use crate::think_budget::ThinkBudget;
use crate::{GenerateRequest, Input, RuntimeError};

/// The model's chat template, compiled for rendering on submitting threads.
#[derive(Debug)]
struct Chat {
    template: ChatTemplate,
    /// Tokenizing adds a BOS: a BOS the template prints is dropped.
    adds_bos: bool,
}

/// A request ready for the engine thread.
pub(crate) struct Prepared {
    pub(crate) req: GenerateRequest,
    pub(crate) tokens: Vec<TokenId>,
    pub(crate) matcher: Option<Matcher>,
    /// What `min_tokens` bans until then: the end-of-generation and stop
    /// tokens (empty without it).
    pub(crate) banned: Vec<TokenId>,
    /// Its thinking budget, where one applies.
    pub(crate) think: Option<ThinkBudget>,
    /// Control tokens its output renders as text (a chat's markup).
    pub(crate) preserved: Arc<[TokenId]>,
}

/// Templates, tokenizes, validates and compiles (see the module's doc).
#[derive(Debug)]
pub(crate) struct Front {
    model: Arc<Model>,
    grammars: Grammars,
    chat: Option<Chat>,
    /// The longest sequence, prompt plus generation.
    max_seq_len: u32,
    /// The model's end-of-generation tokens.
    end_of_generation: Vec<TokenId>,
    /// The tokens that close a thinking block for a model out of budget.
    think_close: Arc<[TokenId]>,
    /// The control tokens a chat's output renders as text: the markup of
    /// the template's tool syntax and thinking tags, where the vocabulary
    /// holds one as a single control token.
    preserved: Arc<[TokenId]>,
}

/// The tags a template thinks in (`<think>` without one).
fn tags_of(template: Option<&ChatTemplate>) -> ThinkTags {
    template
        .and_then(ChatTemplate::think_tags)
        .unwrap_or_default()
}

/// Which of `texts` the model's vocabulary holds as one control token
/// each, and those tokens.
pub(crate) fn control_tokens(model: &Model, texts: &[&str]) -> Vec<TokenId> {
    let mut out = Vec::new();
    for text in texts {
        if let Ok(ids) = model.tokenize(text, false)
            && let [id] = ids[..]
            && model.is_control(id)
            && !out.contains(&id)
        {
            out.push(id);
        }
    }
    out
}

fn invalid(field: &'static str, reason: impl Into<String>) -> RuntimeError {
    RuntimeError::InvalidRequest {
        field,
        reason: reason.into(),
    }
}

/// The model's vocabulary as the grammar compiler needs it.
fn vocabulary(model: &Model) -> Vocabulary {
    let n = model.geometry().n_vocab;
    let ids = (0..n).map(TokenId);
    Vocabulary {
        tokens: ids.clone().map(|t| model.token_bytes(t, true)).collect(),
        special: ids.clone().map(|t| model.is_control(t)).collect(),
        end_of_generation: ids.filter(|&t| model.is_eog(t)).collect(),
    }
}

impl Front {
    /// `chat_template`: a template to use instead of the GGUF's.
    pub(crate) fn new(model: Arc<Model>, max_seq_len: u32, chat_template: Option<String>) -> Front {
        let vocab = vocabulary(&model);
        let end_of_generation = vocab.end_of_generation.clone();
        let grammars = Grammars::new(vocab);
        let (bos, eos, adds_bos) = model.bos_eos();
        let source = chat_template.or_else(|| model.chat_template());
        let chat = source.and_then(|source| {
            match ChatTemplate::new(&source, &bos, &eos) {
                Ok(template) => {
                    let adapted = template.adaptations();
                    if !adapted.is_empty() {
                        tracing::info!(
                            ?adapted,
                            "chat template: messages are adapted to what it accepts"
                        );
                    }
                    Some(Chat { template, adds_bos })
                }
                Err(e) => {
                    // llama.cpp's built-in templates still serve plain chats.
                    tracing::warn!(error = %e, "chat template not usable: chats fall back to llama.cpp's template guess, without tools");
                    None
                }
            }
        });
        let template = chat.as_ref().map(|c| &c.template);
        let tags = tags_of(template);
        let think_close = model
            .tokenize(&tags.forced_close(), false)
            .unwrap_or_default()
            .into();
        let mut markup: Vec<&str> = Vec::new();
        if let Some(t) = template {
            markup.extend(t.tool_syntax().map_or(&[][..], |s| s.markup()));
            if let Some(tags) = t.think_tags() {
                markup.extend([tags.open, tags.close]);
            }
        }
        let preserved = control_tokens(&model, &markup).into();
        Front {
            model,
            grammars,
            chat,
            max_seq_len,
            end_of_generation,
            think_close,
            preserved,
        }
    }

    pub(crate) fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref().map(|c| &c.template)
    }

    /// The tags the model thinks in (`<think>` when it does not).
    pub(crate) fn think_tags(&self) -> ThinkTags {
        tags_of(self.chat_template())
    }

    /// Whether a chat's output holds a reasoning model's thinking to split
    /// off (`Some(open)`, `open` when the prompt opened the block). Not when
    /// the prompt opened the block and a constraint that writes the
    /// thinking itself holds the output from its first token (other
    /// constraints follow the thinking).
    pub(crate) fn thinking(&self, req: &GenerateRequest) -> Option<bool> {
        let t = self.chat_template()?;
        let tags = t.think_tags()?;
        let open = match (&req.chat_end, &req.input) {
            // The output goes on from the final message's text: inside a
            // thinking block that text opened and did not close, or in the
            // answer (nothing to split).
            (ChatEnd::Continue, Input::Chat(msgs)) => {
                let text = msgs.last().and_then(|m| m.content.as_deref());
                let text = text.unwrap_or_default();
                if text.rfind(tags.open) <= text.rfind(tags.close) {
                    return None;
                }
                true
            }
            (_, Input::Chat(_)) => t.opens_thinking(&req.chat_template_kwargs),
            _ => return None,
        };
        let held = req
            .constraint
            .as_ref()
            .is_some_and(|c| writes_thinking(c, tags));
        (!(open && held)).then_some(open)
    }

    /// `req`'s constraint as the engine holds the output to it: after the
    /// thinking, when the output may think (the prompt opened a block, or
    /// the model reasons and its thinking is not switched off) and the
    /// constraint does not write the thinking itself. `thinking`:
    /// [`Front::thinking`] of `req`.
    fn constraint_of(&self, req: &GenerateRequest, thinking: Option<bool>) -> Option<Constraint> {
        let c = req.constraint.clone()?;
        let template = self.chat_template();
        let tags = template.and_then(ChatTemplate::think_tags);
        // A block the prompt opened must close; else the model may open one
        // when its thinking is on (not when the switch turned it off).
        let may_think =
            |open: bool| open || template.is_some_and(|t| t.thinking_on(&req.chat_template_kwargs));
        match (thinking, tags) {
            (Some(open), Some(tags)) if may_think(open) && !writes_thinking(&c, tags) => {
                Some(Constraint::Led {
                    lead: tags.lead_grammar(open),
                    then: Box::new(c),
                })
            }
            _ => Some(c),
        }
    }

    /// `req`'s thinking budget: none where its output holds no thinking
    /// (the answer is constrained from the start, or continues after a
    /// closed block); refused where no thinking can happen at all.
    /// `thinking`: [`Front::thinking`] of `req`.
    fn think_budget(
        &self,
        req: &GenerateRequest,
        thinking: Option<bool>,
    ) -> Result<Option<ThinkBudget>, RuntimeError> {
        let Some(budget) = req.thinking_budget else {
            return Ok(None);
        };
        if !matches!(req.input, Input::Chat(_)) {
            return Err(invalid(
                "thinking_budget",
                "a thinking budget applies to chat messages",
            ));
        }
        if !self.chat_template().is_some_and(ChatTemplate::reasons) {
            return Err(invalid(
                "thinking_budget",
                "the model served does not think (its chat template knows no `<think>` or \
                 `[THINK]` block)",
            ));
        }
        let tags = self.think_tags();
        Ok(thinking.map(|open| ThinkBudget::new(tags, open, budget, self.think_close.clone())))
    }

    pub(crate) fn tokenize(
        &self,
        text: &str,
        add_special: bool,
    ) -> Result<Vec<TokenId>, RuntimeError> {
        self.model
            .tokenize(text, add_special)
            .map_err(|e| invalid("text", e.to_string()))
    }

    pub(crate) fn detokenize(&self, tokens: &[TokenId]) -> Result<String, RuntimeError> {
        self.check_ids("ids", tokens)?;
        Ok(self.model.detokenize(tokens, false))
    }

    /// The prompt tokens `req` would run on.
    pub(crate) fn request_tokens(
        &self,
        req: GenerateRequest,
    ) -> Result<Vec<TokenId>, RuntimeError> {
        Ok(self.rendered(req)?.1)
    }

    /// `req` with its chat rendered (its input then spent), and the prompt
    /// tokens its input gives.
    fn rendered(
        &self,
        req: GenerateRequest,
    ) -> Result<(GenerateRequest, Vec<TokenId>), RuntimeError> {
        let mut req = self.render(req)?;
        let input = std::mem::replace(&mut req.input, Input::Tokens(Vec::new()));
        let tokens = self.tokens_of(input)?;
        Ok((req, tokens))
    }

    fn check_ids(&self, field: &'static str, tokens: &[TokenId]) -> Result<(), RuntimeError> {
        match tokens.iter().find(|t| !self.model.is_valid_token(**t)) {
            Some(bad) => Err(invalid(
                field,
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.model.geometry().n_vocab
                ),
            )),
            None => Ok(()),
        }
    }

    /// Everything the engine thread needs, or the first thing wrong with
    /// the request.
    pub(crate) fn prepare(&self, req: GenerateRequest) -> Result<Prepared, RuntimeError> {
        // A request that scores its prompt may generate nothing.
        let scoring = req.prompt_logprobs.is_some() && req.sampling.max_tokens == 0;
        let checked = if scoring {
            SamplingParams {
                max_tokens: 1,
                ..req.sampling.clone()
            }
            .validate()
        } else {
            req.sampling.validate()
        };
        if let Err(siliceo_core::Error::InvalidParameter { field, reason }) = checked {
            return Err(invalid(field, reason));
        }
        for (k, field) in [
            (req.logprobs, "top_logprobs"),
            (req.prompt_logprobs, "prompt_logprobs"),
        ] {
            if k.is_some_and(|k| k > crate::MAX_TOP_LOGPROBS) {
                return Err(invalid(
                    field,
                    format!("at most {} alternatives per token", crate::MAX_TOP_LOGPROBS),
                ));
            }
        }
        self.check_ids("stop_token_ids", &req.sampling.stop_token_ids)?;
        let n_vocab = self.model.geometry().n_vocab;
        if let Some((t, _)) = req.sampling.logit_bias.iter().find(|(t, _)| t.0 >= n_vocab) {
            return Err(invalid(
                "logit_bias",
                format!("token id {} is outside the vocabulary of {n_vocab}", t.0),
            ));
        }
        // Read from the chat, before it is rendered; once (a template
        // argument makes it a render of its own).
        let thinking = (req.thinking_budget.is_some() || req.constraint.is_some())
            .then(|| self.thinking(&req))
            .flatten();
        let think = self.think_budget(&req, thinking)?;
        let constraint = self.constraint_of(&req, thinking);
        // A chat's markup is read from its output; other inputs' output is
        // text as before.
        let preserved = match req.input {
            Input::Chat(_) => self.preserved.clone(),
            _ => Arc::from([]),
        };
        let (mut req, tokens) = self.rendered(req)?;
        let (prompt, max_seq) = (tokens.len() as u64, u64::from(self.max_seq_len));
        if prompt >= max_seq {
            return Err(invalid(
                "prompt",
                format!("prompt of {prompt} tokens does not fit the context of {max_seq} tokens"),
            ));
        }
        // OpenAI and vLLM refuse a prompt plus `max_tokens` over the context
        // rather than cut the answer short; a default is cut to what is left.
        let max = u64::from(req.sampling.max_tokens);
        match req.max_tokens_field {
            Some(field) if prompt + max > max_seq => {
                return Err(RuntimeError::ContextLengthExceeded {
                    field,
                    prompt_tokens: prompt as u32,
                    max_tokens: max as u32,
                    n_ctx: self.max_seq_len,
                });
            }
            Some(_) => {}
            None => req.sampling.max_tokens = max.min(max_seq - prompt) as u32,
        }
        if req.min_tokens > req.sampling.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!(
                    "{} is more than the {} tokens the request may generate",
                    req.min_tokens, req.sampling.max_tokens
                ),
            ));
        }
        let matcher = self.compile(constraint.as_ref(), req.constraint_field)?;
        let banned = if req.min_tokens > 0 {
            let stops = req.sampling.stop_token_ids.iter();
            self.end_of_generation
                .iter()
                .chain(stops)
                .copied()
                .collect()
        } else {
            Vec::new()
        };
        Ok(Prepared {
            req,
            tokens,
            matcher,
            banned,
            think,
            preserved,
        })
    }

    /// Renders a chat request's messages and tools with the model's
    /// template; other inputs pass through.
    fn render(&self, mut req: GenerateRequest) -> Result<GenerateRequest, RuntimeError> {
        let kwargs = &req.chat_template_kwargs;
        let Input::Chat(msgs) = &req.input else {
            if !req.tools.is_empty() {
                return Err(invalid("tools", "tools need chat messages"));
            }
            if !kwargs.is_empty() {
                return Err(invalid(
                    "chat_template_kwargs",
                    "template arguments apply to chat messages",
                ));
            }
            match req.chat_end {
                ChatEnd::Answer => {}
                ChatEnd::Continue => {
                    return Err(invalid(
                        "continue_final_message",
                        "continues a chat's final message: it needs chat messages",
                    ));
                }
                ChatEnd::Closed => {
                    return Err(invalid(
                        "add_generation_prompt",
                        "ends a chat: it needs chat messages",
                    ));
                }
            }
            return Ok(req);
        };
        // Reserved names are refused by name, with a template or without.
        if let Some(why) = ChatTemplate::refused_kwarg(kwargs) {
            return Err(invalid("chat_template_kwargs", why));
        }
        if msgs.is_empty() {
            return Err(invalid("chat", "no messages"));
        }
        let Some(chat) = &self.chat else {
            let tool_turns = msgs
                .iter()
                .any(|m| !m.tool_calls.is_empty() || m.role == "tool");
            if !req.tools.is_empty() || tool_turns {
                return Err(invalid(
                    "tools",
                    "the model has no chat template siliceo can render with tools",
                ));
            }
            if !kwargs.is_empty() {
                return Err(invalid(
                    "chat_template_kwargs",
                    "the model has no chat template siliceo renders (give one with \
                     --chat-template-file)",
                ));
            }
            if req.chat_end != ChatEnd::Answer {
                return Err(invalid(
                    "messages",
                    "continuing or closing a chat needs a chat template siliceo renders \
                     (give one with --chat-template-file)",
                ));
            }
            return Ok(req);
        };
        let text = chat
            .template
            .render_ending(msgs, &req.tools, req.chat_end, kwargs)
            .map_err(|e| match e {
                ChatError::NoToolSyntax => invalid("tools", e.to_string()),
                ChatError::Continue(_) => invalid("messages", e.to_string()),
                other => invalid("chat", other.to_string()),
            })?;
        // Tokenizing puts the BOS back where the model wants one.
        let bos = chat.template.bos();
        let text = match text.strip_prefix(bos) {
            Some(rest) if chat.adds_bos && !bos.is_empty() => rest.to_string(),
            _ => text,
        };
        if text.is_empty() {
            return Err(invalid("chat", "the chat template rendered nothing"));
        }
        req.input = Input::Prompt(text);
        Ok(req)
    }

    /// The prompt's token ids.
    fn tokens_of(&self, input: Input) -> Result<Vec<TokenId>, RuntimeError> {
        let tokens = match input {
            Input::Prompt(p) => {
                if p.is_empty() {
                    return Err(invalid("prompt", "the prompt is empty"));
                }
                self.model
                    .tokenize(&p, true)
                    .map_err(|e| invalid("prompt", e.to_string()))?
            }
            Input::Chat(msgs) => {
                // Only without a usable Jinja template (chats are rendered
                // above otherwise): llama.cpp's built-in guess.
                let msgs: Vec<siliceo_engine::ChatMessage> = msgs
                    .into_iter()
                    .map(|m| {
                        siliceo_engine::ChatMessage::new(m.role, m.content.unwrap_or_default())
                    })
                    .collect();
                let text = self
                    .model
                    .apply_chat_template(&msgs, true)
                    .map_err(|e| invalid("chat", e.to_string()))?;
                self.model
                    .tokenize(&text, true)
                    .map_err(|e| invalid("chat", e.to_string()))?
            }
            Input::Tokens(t) => {
                self.check_ids("tokens", &t)?;
                t
            }
            Input::Infill { prefix, suffix } => self
                .model
                .infill_tokens(&prefix, &suffix)
                .map_err(|e| invalid("prompt", e.to_string()))?
                .ok_or_else(|| {
                    invalid(
                        "suffix",
                        "this model has no fill-in-the-middle tokens (a code model such as \
                         Qwen2.5-Coder has them)",
                    )
                })?,
        };
        if tokens.is_empty() {
            return Err(invalid("prompt", "the prompt is empty"));
        }
        Ok(tokens)
    }

    /// Compiles a request's constraint (as [`Front::constraint_of`] leads
    /// it); an invalid one names `field`, the request's `constraint_field`.
    fn compile(
        &self,
        c: Option<&Constraint>,
        field: &'static str,
    ) -> Result<Option<Matcher>, RuntimeError> {
        let Some(c) = c else {
            return Ok(None);
        };
        c.validate(field).map_err(|e| match e {
            siliceo_core::Error::InvalidParameter { reason, .. } => invalid(field, reason),
            other => invalid(field, other.to_string()),
        })?;
        match self.grammars.compile(c) {
            Ok(m) => Ok(Some(m)),
            Err(siliceo_constrain::ConstraintError::Invalid(reason)) => Err(invalid(field, reason)),
            Err(e) => Err(RuntimeError::Engine(e.to_string())),
        }
    }
}

/// Whether `c` writes a thinking block in `tags` itself (a grammar or a
/// regex that names the opening tag, escaped or not): it then holds the
/// output from its first token.
fn writes_thinking(c: &Constraint, tags: ThinkTags) -> bool {
    match c {
        Constraint::Regex(text) | Constraint::Lark(text) => {
            let mut plain = String::with_capacity(text.len());
            let mut chars = text.chars().peekable();
            while let Some(ch) = chars.next() {
                match chars.peek() {
                    Some(&next) if ch == '\\' && !next.is_alphanumeric() => {}
                    _ => plain.push(ch),
                }
            }
            plain.contains(tags.open)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use siliceo_chat::{Tool, ToolChoice, ToolSyntax};
    use siliceo_constrain::{Grammars, Vocabulary};
    use siliceo_core::{Constraint, TokenId};

    const EOS: TokenId = TokenId(256);

    /// Grammars over a vocabulary of one token per byte and [`EOS`].
    fn byte_grammars() -> Grammars {
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.push(b"<eos>".to_vec());
        Grammars::new(Vocabulary {
            special: (0..tokens.len()).map(|i| i == 256).collect(),
            tokens,
            end_of_generation: vec![EOS],
        })
    }

    /// Whether `c` takes `text` (a token per byte), then the end.
    fn accepts(grammars: &Grammars, c: &Constraint, text: &str) -> bool {
        let mut m = grammars.compile(c).unwrap();
        let mut ids: Vec<TokenId> = text.bytes().map(|b| TokenId(b.into())).collect();
        ids.push(EOS);
        m.valid_prefix(&ids) == ids.len()
    }

    /// Markup held as one control token is found, and only that: on
    /// SmolLM2, `<|im_start|>` is a control token, `<tool_call>` is text in
    /// several tokens.
    #[test]
    fn control_tokens_are_single_control_tokens_only() {
        let dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
            || env!("CARGO_MANIFEST_DIR").into(),
            std::path::PathBuf::from,
        );
        let path = dir.join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        let model = siliceo_engine::Model::load(&path, &Default::default()).unwrap();
        let start = model.tokenize("<|im_start|>", false).unwrap();
        let got = super::control_tokens(
            &model,
            &["<tool_call>", "<|im_start|>", "x", "<|im_start|>"],
        );
        assert_eq!(got, start);
        assert!(model.is_control(got[0]));
    }

    fn tool(name: &str, parameters: &str) -> Tool {
        Tool {
            name: name.into(),
            description: None,
            parameters: parameters.into(),
        }
    }

    /// `get_weather`, whose one required argument is a string `city`.
    /// `syntax`'s constraint forcing a call to one of `tools`.
    fn forced(syntax: ToolSyntax, tools: &[Tool], parallel: bool) -> Constraint {
        syntax
            .constraint(tools, &ToolChoice::Required, parallel)
            .unwrap()
    }

    fn city_tool() -> Tool {
        tool(
            "get_weather",
            r#"{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}"#,
        )
    }

    /// Qwen3-Coder's forced XML calls: the grammar takes a call as its
    /// template writes one (or several), each value of its schema's type,
    /// a string's `enum` and length bounds held, and nothing else.
    #[test]
    fn forced_xml_calls_take_the_calls_the_template_writes() {
        let grammars = byte_grammars();
        let tools = [
            tool(
                "get_weather",
                r#"{"type": "object", "properties": {"city": {"type": "string"},
                    "days": {"type": "integer"}}, "required": ["city", "days"]}"#,
            ),
            tool(
                "write",
                r#"{"type": "object", "properties": {"text": {"type": "string"},
                    "n": {"type": "integer"}}}"#,
            ),
        ];
        let Some(lark) = ToolSyntax::QwenXml.constraint(&tools, &ToolChoice::Required, true) else {
            panic!()
        };
        let takes = |text: &str| accepts(&grammars, &lark, text);
        let written = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
                       <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        let other = "<tool_call>\n<function=write>\n<parameter=text>\na </b>\nb\n</parameter>\n\
                     <parameter=n>\n7\n</parameter>\n</function>\n</tool_call>";
        assert!(takes(written));
        assert!(takes(&format!("{written}\n{other}")));
        // Not a value of its type; a parameter the schema lacks; no call.
        assert!(!takes(&written.replace(">\n3\n<", ">\nthree\n<")));
        assert!(!takes(&written.replace("city>", "town>")));
        assert!(!takes("Paris is sunny."));
        let bounded = tool(
            "f",
            r#"{"type": "object", "properties": {"unit": {"type": "string", "enum": ["C", "F"]},
                "city": {"type": "string", "maxLength": 5}}, "required": ["unit", "city"]}"#,
        );
        let Some(lark) = ToolSyntax::QwenXml.constraint(&[bounded], &ToolChoice::Required, false)
        else {
            panic!()
        };
        let call = |unit: &str, city: &str| {
            let text = format!(
                "<tool_call>\n<function=f>\n<parameter=unit>\n{unit}\n</parameter>\n\
                 <parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
            );
            accepts(&grammars, &lark, &text)
        };
        assert!(call("C", "Paris") && call("F", ""));
        assert!(!call("K", "Paris") && !call("C", "Lisbon"));
    }

    /// GLM's forced calls, in GLM-4.5's layout and GLM-4.7's: the name,
    /// then each parameter's key and value in their tags, a value of its
    /// schema's type (a string's text bounded as the schema says); what
    /// the grammar takes reads back.
    #[test]
    fn forced_glm_calls_take_keys_and_values_in_tags() {
        let grammars = byte_grammars();
        let tools = [tool(
            "get_weather",
            r#"{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer"}}, "required": ["city"]}"#,
        )];
        for (syntax, nl) in [(ToolSyntax::Glm45, "\n"), (ToolSyntax::Glm47, "")] {
            let call = |city: &str, days: &str| {
                let days = if days.is_empty() {
                    String::new()
                } else {
                    format!("<arg_key>days</arg_key>{nl}<arg_value>{days}</arg_value>{nl}")
                };
                format!(
                    "<tool_call>get_weather{nl}<arg_key>city</arg_key>{nl}\
                     <arg_value>{city}</arg_value>{nl}{days}</tool_call>"
                )
            };
            let lark = |parallel| forced(syntax, &tools, parallel);
            let takes = |parallel, text: &str| accepts(&grammars, &lark(parallel), text);
            assert!(takes(false, &call("Paris", "3")), "{syntax:?}");
            assert!(takes(false, &call("New\nYork", "")), "{syntax:?}");
            let two = format!("{}{nl}{}", call("Rome", ""), call("Oslo", "-1"));
            assert!(takes(true, &two), "{syntax:?}");
            assert!(!takes(false, &two), "{syntax:?}");
            assert!(!takes(false, &call("Paris", "three")), "{syntax:?}");
            assert!(
                !takes(false, &call("Llanfairpwllgwyngyll", "")),
                "{syntax:?}"
            );
            assert!(!takes(false, "Paris is sunny."), "{syntax:?}");
            let read = syntax.parse(&two, &tools);
            assert_eq!(
                read.calls,
                [
                    ("get_weather".into(), r#"{"city": "Rome"}"#.into()),
                    (
                        "get_weather".into(),
                        r#"{"city": "Oslo", "days": -1}"#.into()
                    )
                ],
                "{syntax:?}"
            );
        }
    }

    /// LFM2's forced calls: a Python list of calls in its tags, keyword
    /// arguments in the schema's order, the required ones always, each of
    /// its type (a double-quoted string within its bounds, an integer, an
    /// `enum`'s texts, `True`/`False`, JSON for other values); what the
    /// grammar takes reads back as JSON.
    #[test]
    fn forced_python_calls_take_keyword_arguments_by_the_schema() {
        let grammars = byte_grammars();
        let tools = [
            tool(
                "get_weather",
                r#"{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer"}, "unit": {"type": "string", "enum": ["C", "F"]},
                    "alerts": {"type": "boolean"}, "opts": {"type": "object"}},
                    "required": ["city"]}"#,
            ),
            tool("now", r#"{"type": "object", "properties": {}}"#),
        ];
        let lark = |parallel| forced(ToolSyntax::Lfm2, &tools, parallel);
        let takes = |parallel, text: &str| accepts(&grammars, &lark(parallel), text);
        let list = |calls: &str| format!("<|tool_call_start|>[{calls}]<|tool_call_end|>");
        let full =
            r#"get_weather(city="Rio \"de\" J", days=3, unit="C", alerts=True, opts={"a": [1]})"#;
        let short = r#"get_weather(city="Oslo", alerts=False)"#;
        assert!(takes(false, &list(full)));
        assert!(takes(false, &list(short)));
        assert!(takes(false, &list("now()")));
        assert!(takes(true, &list(&format!("{short}, now(), {full}"))));
        assert!(!takes(false, &list(&format!("{short}, now()"))));
        // Out of order, the required one missing, another type, a text not
        // in the enum, too long, no call.
        assert!(!takes(false, &list(r#"get_weather(days=3, city="Oslo")"#)));
        assert!(!takes(false, &list("get_weather(days=3)")));
        assert!(!takes(
            false,
            &list(r#"get_weather(city="Oslo", days="3")"#)
        ));
        assert!(!takes(
            false,
            &list(r#"get_weather(city="Oslo", unit="K")"#)
        ));
        assert!(!takes(
            false,
            &list(r#"get_weather(city="Llanfairpwllgwyngyll")"#)
        ));
        assert!(!takes(false, "It is sunny."));
        let read = ToolSyntax::Lfm2.parse(&list(&format!("{short}, {full}")), &tools);
        let args: Vec<serde_json::Value> = read
            .calls
            .iter()
            .map(|(_, a)| serde_json::from_str(a).unwrap())
            .collect();
        assert_eq!(
            args[0],
            serde_json::json!({"city": "Oslo", "alerts": false})
        );
        assert_eq!(
            args[1],
            serde_json::json!({"city": "Rio \"de\" J", "days": 3, "unit": "C",
                "alerts": true, "opts": {"a": [1]}})
        );
    }

    /// Mistral's newer forced calls: `[TOOL_CALLS]NAME[ARGS]` and the
    /// arguments by the tool's schema, once or (parallel) more.
    #[test]
    fn forced_mistral_calls_take_name_args_then_json() {
        let grammars = byte_grammars();
        let tools = [city_tool()];
        let lark = |parallel| forced(ToolSyntax::MistralArgs, &tools, parallel);
        let one = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#;
        assert!(accepts(&grammars, &lark(false), one));
        assert!(accepts(&grammars, &lark(true), &format!("{one}{one}")));
        assert!(!accepts(&grammars, &lark(false), &format!("{one}{one}")));
        assert!(!accepts(
            &grammars,
            &lark(true),
            r#"[TOOL_CALLS]now[ARGS]{}"#
        ));
        assert!(!accepts(
            &grammars,
            &lark(true),
            r#"[TOOL_CALLS]get_weather[ARGS]{"town": "Paris"}"#
        ));
        // Granite's list after its marker, one call or (parallel) more.
        let granite = |parallel| forced(ToolSyntax::Granite, &tools, parallel);
        let call = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        assert!(accepts(
            &grammars,
            &granite(false),
            &format!("<|tool_call|>[{call}]")
        ));
        assert!(accepts(
            &grammars,
            &granite(true),
            &format!("<|tool_call|>[{call}, {call}]")
        ));
        assert!(!accepts(
            &grammars,
            &granite(false),
            &format!("<|tool_call|>[{call}, {call}]")
        ));
        assert!(!accepts(
            &grammars,
            &granite(true),
            &format!("[TOOL_CALLS] [{call}]")
        ));
        // Nemotron's list, in its tags.
        let nemotron = forced(ToolSyntax::Nemotron, &tools, false);
        let text = format!("<TOOLCALL>[{call}]</TOOLCALL>");
        assert!(accepts(&grammars, &nemotron, &text));
        assert!(!accepts(
            &grammars,
            &nemotron,
            &format!("<TOOLCALL>[{call}]")
        ));
    }

    /// DeepSeek's forced calls, V3.1's and R1's: the list's tags around
    /// one call or (parallel) more, each named and then its arguments by
    /// the tool's schema; what the grammar writes reads back.
    #[test]
    fn forced_deepseek_calls_are_tagged_lists_of_named_calls() {
        let grammars = byte_grammars();
        let tools = [city_tool()];
        let args = r#"{"city": "Paris"}"#;
        for (syntax, call) in [
            (
                ToolSyntax::DeepSeek,
                format!("<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"),
            ),
            (
                ToolSyntax::DeepSeekR1,
                format!(
                    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{args}\n```<｜tool▁call▁end｜>"
                ),
            ),
        ] {
            let lark = |parallel| forced(syntax, &tools, parallel);
            let list = |calls: &str| format!("<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>");
            let one = list(&call);
            let two = list(&format!("{call}{call}"));
            assert!(accepts(&grammars, &lark(false), &one), "{syntax:?}");
            assert!(accepts(&grammars, &lark(true), &two), "{syntax:?}");
            assert!(!accepts(&grammars, &lark(false), &two), "{syntax:?}");
            assert!(
                !accepts(&grammars, &lark(true), &one.replace("\"Paris\"", "7")),
                "{syntax:?}"
            );
            assert!(!accepts(&grammars, &lark(true), &call), "{syntax:?}");
            let read = syntax.parse(&two, &tools);
            assert_eq!(read.calls.len(), 2, "{syntax:?}");
            assert_eq!(read.calls[1], ("get_weather".into(), args.into()));
        }
    }

    /// Command R's forced calls: a list in its action tags, each item led by
    /// a call id, `tool_name` and `parameters` by the tool's schema.
    #[test]
    fn forced_command_r_calls_are_lists_of_numbered_calls() {
        let grammars = byte_grammars();
        let tools = [city_tool()];
        let lark = |parallel| forced(ToolSyntax::CommandR, &tools, parallel);
        let call = |id: &str| {
            format!(
                r#"{{"tool_call_id": "{id}", "tool_name": "get_weather", "parameters": {{"city": "Paris"}}}}"#
            )
        };
        let one = format!("<|START_ACTION|>[{}]<|END_ACTION|>", call("0"));
        let two = format!(
            "<|START_ACTION|>[{}, {}]<|END_ACTION|>",
            call("0"),
            call("1")
        );
        assert!(accepts(&grammars, &lark(false), &one));
        assert!(accepts(&grammars, &lark(true), &two));
        assert!(!accepts(&grammars, &lark(false), &two));
        assert!(!accepts(
            &grammars,
            &lark(true),
            &one.replace("\"0\"", "\"x\"")
        ));
        assert!(!accepts(
            &grammars,
            &lark(true),
            &one.replace("tool_name", "name")
        ));
        let read = ToolSyntax::CommandR.parse(&two, &tools);
        assert_eq!(read.calls.len(), 2);
        assert_eq!(
            read.calls[1],
            ("get_weather".into(), r#"{"city": "Paris"}"#.into())
        );
    }

    /// Gemma 4's forced calls: its notation, the keys in the order its
    /// template writes them (sorted), each value as the schema types it
    /// (strings between quote tokens, an `enum`'s texts, integers,
    /// booleans, other values in the notation's general form), the
    /// required ones always; what the grammar takes reads back as JSON.
    #[test]
    fn forced_gemma4_calls_take_the_notation_typed_by_the_schema() {
        let grammars = byte_grammars();
        let tools = [
            tool(
                "get_weather",
                r#"{"type": "object", "properties": {"days": {"type": "integer"},
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"type": "string", "enum": ["C", "F"]},
                    "opts": {"type": "object"}}, "required": ["city", "days"]}"#,
            ),
            tool("now", r#"{"type": "object", "properties": {}}"#),
        ];
        let q = "<|\"|>";
        let call = |args: &str| format!("<|tool_call>call:get_weather{{{args}}}<tool_call|>");
        let full = call(&format!(
            "city:{q}Rio \"de\" }}Janeiro{q},days:3,opts:{{a:[1,{q}x{q},true],b:null}},unit:{q}C{q}"
        ));
        let short = call(&format!("city:{q}Oslo{q},days:-2"));
        let now = "<|tool_call>call:now{}<tool_call|>";
        let lark = |parallel| forced(ToolSyntax::Gemma4, &tools, parallel);
        let takes = |parallel, text: &str| accepts(&grammars, &lark(parallel), text);
        assert!(takes(false, &full));
        assert!(takes(false, &short));
        assert!(takes(false, now));
        assert!(takes(true, &format!("{short}{now}{full}")));
        assert!(!takes(false, &format!("{short}{now}")));
        // Out of order, a required key missing, a value of another type,
        // a text not in the enum, a key the schema lacks, no call.
        assert!(!takes(false, &call(&format!("days:3,city:{q}Oslo{q}"))));
        assert!(!takes(false, &call(&format!("city:{q}Oslo{q}"))));
        assert!(!takes(
            false,
            &call(&format!("city:{q}Oslo{q},days:{q}3{q}"))
        ));
        assert!(!takes(
            false,
            &call(&format!("city:{q}Oslo{q},days:3,unit:{q}K{q}"))
        ));
        assert!(!takes(
            false,
            &call(&format!("city:{q}Oslo{q},days:3,town:1"))
        ));
        let long = "Llanfairpwllgwyngyllgogerych";
        assert!(!takes(false, &call(&format!("city:{q}{long}{q},days:3"))));
        assert!(!takes(false, "It is sunny."));
        let read = ToolSyntax::Gemma4.parse(&format!("{short}{full}"), &tools);
        let args: Vec<serde_json::Value> = read
            .calls
            .iter()
            .map(|(_, a)| serde_json::from_str(a).unwrap())
            .collect();
        assert_eq!(args[0], serde_json::json!({"city": "Oslo", "days": -2}));
        assert_eq!(
            args[1],
            serde_json::json!({"city": "Rio \"de\" }Janeiro", "days": 3,
                "opts": {"a": [1, "x", true], "b": null}, "unit": "C"})
        );
    }

    /// gpt-oss's forced calls (harmony): the call's header and its
    /// arguments by the tool's schema, after an analysis message if the
    /// model thinks first; one call, and what a harmony reader reads back.
    #[test]
    fn forced_harmony_calls_take_a_header_and_json_after_thinking() {
        let grammars = byte_grammars();
        let tools = [
            city_tool(),
            tool("now", r#"{"type": "object", "properties": {}}"#),
        ];
        let lark = forced(ToolSyntax::Harmony, &tools, true);
        let call = r#"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}"#;
        let thought = "<|channel|>analysis<|message|>User wants <b> weather.
<|end|><|start|>assistant";
        let takes = |text: &str| accepts(&grammars, &lark, text);
        assert!(takes(call));
        assert!(takes(&format!("{thought}{call}")));
        assert!(takes(
            "<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}"
        ));
        // One call; a name or key the tools lack; prose; an answer.
        assert!(!takes(&format!("{call}{call}")));
        assert!(!takes(&call.replace("get_weather", "get_time")));
        assert!(!takes(&call.replace("city", "town")));
        assert!(!takes("Paris is sunny."));
        assert!(!takes("<|channel|>final<|message|>Sunny."));
        let mut r = siliceo_chat::HarmonyReader::new(true);
        let mut got = r.push(&format!("{thought}{call}"));
        let tail = r.finish();
        got.calls.extend(tail.calls);
        assert_eq!(got.reasoning, "User wants <b> weather.\n");
        assert_eq!(
            siliceo_chat::ParsedOutput::from_pieces(got.calls, tail.cut).calls,
            [(
                "get_weather".to_string(),
                r#"{"city": "Paris"}"#.to_string()
            )]
        );
    }

    /// A constraint led by each format's thinking: the answer it holds
    /// comes after a free thinking block (optional, or already open), and
    /// only then; a constraint that writes the thinking itself is not led.
    #[test]
    fn a_led_constraint_holds_the_answer_after_free_thinking() {
        use siliceo_chat::ThinkTags;
        let grammars = byte_grammars();
        let schema = Constraint::JsonSchema {
            schema:
                r#"{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}"#
                    .into(),
            strict: true,
        };
        let led = |tags: ThinkTags, open: bool, then: &Constraint| Constraint::Led {
            lead: tags.lead_grammar(open),
            then: Box::new(then.clone()),
        };
        let json = r#"{"a": 1}"#;
        let c = led(ThinkTags::ANGLE, false, &schema);
        let takes = |c: &Constraint, t: &str| accepts(&grammars, c, t);
        assert!(takes(&c, json));
        assert!(takes(
            &c,
            &format!("<think>\nhm </b> {{x}}\n</think>\n\n{json}")
        ));
        assert!(takes(&c, &format!("\n<think>x</think>{json}")));
        assert!(!takes(&c, "<think>x</think>\n\nnope"));
        assert!(!takes(&c, &format!("hello {json}")));
        assert!(!takes(&c, &format!(" {json}")));
        assert!(!takes(&c, "<think>x"));
        // Opened by the prompt: the block must close first.
        let c = led(ThinkTags::ANGLE, true, &schema);
        assert!(takes(&c, &format!("x\n</think>\n\n{json}")));
        assert!(!takes(&c, json));
        let c = led(ThinkTags::SQUARE, false, &schema);
        assert!(takes(&c, &format!("[THINK]a[/THINK]\n{json}")) && takes(&c, json));
        let c = led(ThinkTags::HARMONY, false, &schema);
        assert!(takes(&c, &format!("<|channel|>final<|message|>{json}")));
        assert!(takes(
            &c,
            &format!(
                "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant\
                 <|channel|>final<|message|>{json}"
            )
        ));
        assert!(!takes(&c, json));
        // Regexes and grammars follow alike.
        let c = led(
            ThinkTags::ANGLE,
            false,
            &Constraint::Regex("Paris is [a-z]+\\.".into()),
        );
        assert!(takes(&c, "<think>Hm.</think>\nParis is big."));
        assert!(!takes(&c, "<think>Hm.</think>\nRome is big."));
        let yes_no = Constraint::Lark("start: \"yes\" | \"no\"".into());
        let c = led(ThinkTags::ANGLE, false, &yes_no);
        assert!(takes(&c, "<think>a</think> no") && !takes(&c, "<think>a</think> maybe"));
        // Which constraints write the thinking themselves.
        let writes = |c: &str, tags| super::writes_thinking(&Constraint::Regex(c.into()), tags);
        assert!(writes("<think>[a-z]*</think>ok", ThinkTags::ANGLE));
        assert!(writes("\\[THINK\\][a-z]*", ThinkTags::SQUARE));
        assert!(writes(
            "<\\|channel\\|>analysis<\\|message\\|>.*",
            ThinkTags::HARMONY
        ));
        assert!(!writes("Paris is [a-z]+", ThinkTags::ANGLE));
        assert!(!super::writes_thinking(&schema, ThinkTags::ANGLE));
    }
}
