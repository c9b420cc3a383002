//! SMG's engine protocol (`vllm.grpc.engine.VllmEngine`, `proto/vllm/engine.proto`)
//! over a [`Runtime`], served beside `siliceo.v1.Inference` on the same port.
//!
//! SMG tokenizes in the gateway, renders chats with the template of the
//! tokenizer it got from `GetTokenizer` (ours, made from the GGUF's
//! vocabulary), and sends token ids; we stream token ids back. With the
//! cache_aware policy it also subscribes to our prefix cache's events and
//! routes each request to the replica that holds its blocks.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use siliceo_core::{Constraint, FinishReason, RequestId, SamplingParams, TokenId, unix_time_s};
use siliceo_runtime::kv_events::{CacheEvent, EventBatch};
use siliceo_runtime::{
    Event, GenerateRequest, Input, RequestStream, Runtime, RuntimeError, SchedulerLoad,
};
use tokio::sync::OnceCell;
use tokio_stream::{Stream, StreamMap};
use tonic::{Request, Response, Status};

use crate::status_of;

/// Generated types and server stub of `vllm.grpc.engine`.
#[allow(missing_docs, clippy::all)]
pub mod vpb {
    tonic::include_proto!("vllm.grpc.engine");

    /// The encoded file descriptor set (for reflection).
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("vllm_engine_descriptor");
}

/// Most choices one request may ask for (`n`).
const MAX_N: u32 = 16;
/// Bytes per `GetTokenizer` chunk (the gateway takes messages under 4 MiB).
const TOKENIZER_CHUNK: usize = 64 << 10;
/// A load record this often while no event flows (the gateway drops a
/// worker whose records stop for 15 s).
const HEARTBEAT: Duration = Duration::from_secs(1);

/// Requests with several choices and their counts.
type ChoiceCounts = Arc<Mutex<HashMap<String, u32>>>;

/// The tokenizer bundle, made once.
#[derive(Debug)]
struct Bundle {
    zip: Vec<u8>,
    sha256: String,
    eos_ids: Vec<u32>,
    bos_id: Option<u32>,
}

/// The service. Cheap to clone (shared state).
#[derive(Debug, Clone)]
pub struct VllmEngineService {
    rt: Arc<Runtime>,
    started: Instant,
    max_request_bytes: usize,
    bundle: Arc<OnceCell<Result<Bundle, Status>>>,
    /// Requests with several choices: their count, so `Abort` ends them all.
    choices: ChoiceCounts,
}

impl VllmEngineService {
    /// A service over `rt`; requests larger than `max_request_bytes` are
    /// refused with `INVALID_ARGUMENT`.
    pub fn new(rt: Arc<Runtime>, max_request_bytes: usize) -> Self {
        VllmEngineService {
            rt,
            started: Instant::now(),
            max_request_bytes,
            bundle: Arc::new(OnceCell::new()),
            choices: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    async fn bundle(&self) -> Result<&Bundle, Status> {
        let rt = self.rt.clone();
        self.bundle
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || make_bundle(&rt))
                    .await
                    .unwrap_or_else(|e| Err(Status::internal(e.to_string())))
            })
            .await
            .as_ref()
            .map_err(Clone::clone)
    }

    fn model_id(&self) -> String {
        self.rt.model_ids().swap_remove(0)
    }

    async fn load(&self) -> Result<SchedulerLoad, Status> {
        crate::blocking(&self.rt, Runtime::load).await
    }
}

/// Zips the tokenizer files made from the GGUF (stored, at the zip's root).
fn make_bundle(rt: &Runtime) -> Result<Bundle, Status> {
    use std::io::Write;
    let export = rt
        .tokenizer_files()
        .map_err(|e| Status::failed_precondition(e.to_string()))?;
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for f in &export.files {
        zip.start_file(f.name, opts)
            .and_then(|()| zip.write_all(&f.bytes).map_err(Into::into))
            .map_err(|e| Status::internal(format!("zipping the tokenizer: {e}")))?;
    }
    let zip = zip
        .finish()
        .map_err(|e| Status::internal(format!("zipping the tokenizer: {e}")))?
        .into_inner();
    let sha256 = {
        use sha2::Digest;
        let d = sha2::Sha256::digest(&zip);
        d.iter().map(|b| format!("{b:02x}")).collect()
    };
    Ok(Bundle {
        zip,
        sha256,
        eos_ids: export.eos_ids,
        bos_id: export.bos_id,
    })
}

fn invalid(field: &str, reason: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {reason}"))
}

/// A regex matching exactly one of `choices`.
fn choice_regex(choices: &[String]) -> String {
    let escape = |s: &str| {
        let mut out = String::with_capacity(s.len());
        for c in s.chars() {
            if "\\.+*?()|[]{}^$#&-~".contains(c) {
                out.push('\\');
            }
            out.push(c);
        }
        out
    };
    let alts: Vec<String> = choices.iter().map(|c| escape(c)).collect();
    format!("({})", alts.join("|"))
}

/// The request a `Generate` describes, and its choice count.
fn to_runtime(r: vpb::GenerateRequest) -> Result<(GenerateRequest, u32), Status> {
    use vpb::generate_request::Input as In;
    use vpb::sampling_params::Constraint as C;
    if r.request_id.is_empty() {
        return Err(invalid("request_id", "is empty"));
    }
    let input = match r.input {
        Some(In::Tokenized(t)) => Input::Tokens(t.input_ids.into_iter().map(TokenId).collect()),
        Some(In::Text(t)) => Input::Prompt(t),
        None => return Err(invalid("input", "one of tokenized or text is required")),
    };
    let s = r.sampling_params.unwrap_or_default();
    let n = s.n.max(1);
    if n > MAX_N {
        return Err(invalid(
            "sampling_params.n",
            format!("must be in 1..={MAX_N}"),
        ));
    }
    let top = |k: Option<i32>, field: &str| match k {
        None => Ok(None),
        Some(k) => u32::try_from(k).map(Some).map_err(|_| {
            invalid(
                field,
                "must be 0 or more (all alternatives, -1, is not supported)",
            )
        }),
    };
    let logprobs = top(s.logprobs, "sampling_params.logprobs")?;
    let prompt_logprobs = top(s.prompt_logprobs, "sampling_params.prompt_logprobs")?;
    let mut logit_bias = Vec::with_capacity(s.logit_bias.len());
    for (&t, &b) in &s.logit_bias {
        let t = u32::try_from(t)
            .map_err(|_| invalid("sampling_params.logit_bias", format!("token id {t}")))?;
        logit_bias.push((TokenId(t), b));
    }
    logit_bias.sort_by_key(|(t, _)| *t);
    let (constraint, constraint_field) = match s.constraint {
        None => (None, "constraint"),
        Some(C::JsonSchema(schema)) => (
            Some(Constraint::JsonSchema {
                schema,
                strict: true,
            }),
            "sampling_params.json_schema",
        ),
        Some(C::Regex(r)) => (Some(Constraint::Regex(r)), "sampling_params.regex"),
        Some(C::Grammar(g)) => (Some(Constraint::Lark(g)), "sampling_params.grammar"),
        Some(C::JsonObject(true)) => (Some(Constraint::JsonObject), "sampling_params.json_object"),
        Some(C::JsonObject(false)) => (None, "constraint"),
        Some(C::Choice(c)) => {
            if c.choices.is_empty() {
                return Err(invalid("sampling_params.choice", "lists no choice"));
            }
            (
                Some(Constraint::Regex(choice_regex(&c.choices))),
                "sampling_params.choice",
            )
        }
        Some(C::StructuralTag(_)) => {
            return Err(invalid(
                "sampling_params.structural_tag",
                "is not supported",
            ));
        }
    };
    let d = SamplingParams::greedy();
    let sampling = SamplingParams {
        // vLLM's default, as OpenAI's: sample at temperature 1.
        temperature: s.temperature.unwrap_or(1.0),
        top_k: s.top_k,
        // proto3 zeros: unset.
        top_p: if s.top_p == 0.0 { 1.0 } else { s.top_p },
        min_p: s.min_p,
        seed: s.seed.map(|v| u64::from(v as u32)),
        repetition_penalty: if s.repetition_penalty == 0.0 {
            1.0
        } else {
            s.repetition_penalty
        },
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        penalty_last_n: d.penalty_last_n,
        // Unset: until the model stops or the context ends (the runtime cuts it).
        max_tokens: s.max_tokens.unwrap_or(u32::MAX),
        stop: s.stop,
        stop_token_ids: s.stop_token_ids.into_iter().map(TokenId).collect(),
        ignore_eos: s.ignore_eos,
        logit_bias,
    };
    if s.max_tokens == Some(0) {
        return Err(invalid("sampling_params.max_tokens", "must be at least 1"));
    }
    let mut req = GenerateRequest::new(input);
    req.id = Some(RequestId(r.request_id));
    req.sampling = sampling;
    req.constraint = constraint;
    req.constraint_field = constraint_field;
    req.logprobs = logprobs;
    req.prompt_logprobs = prompt_logprobs;
    req.max_tokens_field = s.max_tokens.map(|_| "sampling_params.max_tokens");
    req.min_tokens = s.min_tokens;
    Ok((req, n))
}

/// The id of choice `i` of request `id` (choice 0 keeps the gateway's id).
fn choice_id(id: &str, i: u32) -> RequestId {
    if i == 0 {
        RequestId(id.to_string())
    } else {
        RequestId(format!("{id}#{i}"))
    }
}

fn finish_name(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
        FinishReason::Error => "error",
    }
}

/// A choice's events as a [`Stream`] (for [`StreamMap`]).
struct ChoiceEvents(RequestStream);

impl Stream for ChoiceEvents {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        self.0.poll_next(cx)
    }
}

/// One choice's progress.
#[derive(Debug, Default)]
struct ChoiceState {
    tokens: Vec<u32>,
    logprobs: vpb::OutputLogProbs,
    /// The prompt's log-probabilities, until a chunk or `Complete` takes
    /// them.
    prompt: Option<vpb::InputLogProbs>,
}

/// The prompt's log-probabilities on the wire: its first token without a
/// value, then every later one's.
fn input_logprobs_pb(
    first: siliceo_core::TokenId,
    lps: &[siliceo_runtime::TokenLogprob],
) -> vpb::InputLogProbs {
    let mut p = vpb::InputLogProbs {
        token_logprobs: vec![vpb::InputTokenLogProb { value: None }],
        token_ids: vec![first.0],
        top_logprobs: vec![vpb::TopLogProbs::default()],
    };
    let mut rest = vpb::OutputLogProbs::default();
    logprobs_pb(lps, &mut rest);
    p.token_logprobs.extend(
        rest.token_logprobs
            .into_iter()
            .map(|v| vpb::InputTokenLogProb { value: Some(v) }),
    );
    p.token_ids.extend(rest.token_ids);
    p.top_logprobs.extend(rest.top_logprobs);
    p
}

fn logprobs_pb(lps: &[siliceo_runtime::TokenLogprob], into: &mut vpb::OutputLogProbs) {
    for l in lps {
        into.token_logprobs.push(l.logprob);
        into.token_ids.push(l.token.0);
        into.top_logprobs.push(vpb::TopLogProbs {
            values: l.top.iter().map(|t| t.2).collect(),
            token_ids: l.top.iter().map(|t| t.0.0).collect(),
        });
    }
}

/// The response stream of one `Generate`: its choices' events merged, as
/// chunks (streaming) or one `Complete` per choice. Dropping it drops the
/// choices' streams, which cancels them and frees their KV.
pub struct VllmGenerateStream {
    choices: StreamMap<u32, ChoiceEvents>,
    state: HashMap<u32, ChoiceState>,
    stream: bool,
    want_logprobs: bool,
    /// A request with several choices, to forget when it ends.
    multi: Option<(String, ChoiceCounts)>,
    failed: bool,
}

impl std::fmt::Debug for VllmGenerateStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmGenerateStream")
            .field("choices", &self.choices.len())
            .finish()
    }
}

impl Drop for VllmGenerateStream {
    fn drop(&mut self) {
        if let Some((id, map)) = &self.multi {
            map.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        }
    }
}

impl Stream for VllmGenerateStream {
    type Item = Result<vpb::GenerateResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        use vpb::generate_response::Response as R;
        let this = &mut *self;
        loop {
            if this.failed {
                return Poll::Ready(None);
            }
            let (index, event) = match Pin::new(&mut this.choices).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Ready(Some(x)) => x,
            };
            let st = this.state.entry(index).or_default();
            match event {
                Event::Prompt { first, logprobs } => {
                    st.prompt = Some(input_logprobs_pb(first.0, &logprobs));
                }
                Event::Text {
                    tokens, logprobs, ..
                } => {
                    let ids: Vec<u32> = tokens.iter().map(|t| t.0).collect();
                    if !this.stream {
                        st.tokens.extend(&ids);
                        logprobs_pb(&logprobs, &mut st.logprobs);
                        continue;
                    }
                    if ids.is_empty() {
                        continue;
                    }
                    let mut lp = vpb::OutputLogProbs::default();
                    logprobs_pb(&logprobs, &mut lp);
                    let chunk = vpb::StreamChunk {
                        completion_tokens: ids.len() as u32,
                        token_ids: ids,
                        output_logprobs: this.want_logprobs.then_some(lp),
                        input_logprobs: st.prompt.take(),
                        index,
                        ..Default::default()
                    };
                    return Poll::Ready(Some(Ok(vpb::GenerateResponse {
                        response: Some(R::Chunk(chunk)),
                    })));
                }
                Event::Done {
                    finish_reason,
                    usage,
                    error,
                    ..
                } => {
                    if let Some(e) = error
                        && !matches!(e, RuntimeError::Engine(_))
                    {
                        // Refused before it ran (a full queue, a duplicate id).
                        this.failed = true;
                        return Poll::Ready(Some(Err(status_of(&e))));
                    }
                    let st = std::mem::take(st);
                    let complete = vpb::Complete {
                        // Streamed tokens were sent in chunks already.
                        output_ids: if this.stream { Vec::new() } else { st.tokens },
                        finish_reason: finish_name(finish_reason).to_string(),
                        prompt_tokens: usage.prompt_tokens,
                        completion_tokens: usage.completion_tokens,
                        cached_tokens: usage.cached_prompt_tokens,
                        output_logprobs: (this.want_logprobs && !this.stream)
                            .then_some(st.logprobs),
                        input_logprobs: st.prompt,
                        index,
                        spec_accepted_tokens: usage.accepted_draft_tokens,
                        spec_draft_tokens: usage.draft_tokens,
                    };
                    return Poll::Ready(Some(Ok(vpb::GenerateResponse {
                        response: Some(R::Complete(complete)),
                    })));
                }
            }
        }
    }
}

/// A `KvEventBatch` for a published batch, with the load now.
fn batch_pb(b: &EventBatch, block_size: u32, load: Option<vpb::EngineLoad>) -> vpb::KvEventBatch {
    use vpb::kv_cache_event::Data;
    let mut events = Vec::with_capacity(b.events.len());
    for (i, e) in b.events.iter().enumerate() {
        let data = match e {
            CacheEvent::Stored {
                hash,
                parent,
                tokens,
            } => Data::Stored(vpb::KvBlocksStored {
                blocks: vec![vpb::KvBlock {
                    block_hash: *hash as i64,
                    token_ids: tokens.to_vec(),
                    block_size: block_size as i32,
                }],
                parent_block_hash: parent.map(|p| p as i64),
            }),
            CacheEvent::Removed { hash } => Data::Removed(vpb::KvBlocksRemoved {
                block_hashes: vec![*hash as i64],
            }),
            CacheEvent::Cleared => Data::Cleared(vpb::KvCacheCleared {}),
        };
        events.push(vpb::KvCacheEvent {
            event_id: (b.seq << 20) | i as u64,
            data: Some(data),
        });
    }
    vpb::KvEventBatch {
        sequence_number: b.seq,
        timestamp: b.timestamp,
        events,
        load,
    }
}

/// A batch without events that repeats sequence `seq`: a load record.
fn load_only(seq: u64, load: Option<vpb::EngineLoad>) -> vpb::KvEventBatch {
    vpb::KvEventBatch {
        sequence_number: seq,
        timestamp: unix_time_s(),
        events: Vec::new(),
        load,
    }
}

/// A subscriber's load records. Event batches come as often as engine
/// steps: they reuse a sample up to [`LOAD_REUSE`] old (its age says so)
/// rather than ask the engine thread for its stats every step; load-only
/// records take a new one.
struct LoadSampler {
    svc: VllmEngineService,
    sample: u64,
    last: Option<(Instant, SchedulerLoad)>,
}

/// How old a load sample an event batch may carry.
const LOAD_REUSE: Duration = Duration::from_millis(200);

impl LoadSampler {
    async fn record(&mut self, load_only: bool) -> Option<vpb::EngineLoad> {
        let fresh = match self.last {
            Some((at, _)) => load_only || at.elapsed() > LOAD_REUSE,
            None => true,
        };
        if fresh {
            self.last = self.svc.load().await.ok().map(|l| (Instant::now(), l));
        }
        let (at, l) = self.last?;
        self.sample += 1;
        let mut rec = engine_load(&l, self.sample, load_only);
        rec.age_ms = at.elapsed().as_millis().min(u128::from(u32::MAX)) as u32;
        Some(rec)
    }
}

fn engine_load(l: &SchedulerLoad, sample: u64, load_only: bool) -> vpb::EngineLoad {
    vpb::EngineLoad {
        running_requests: l.num_running_reqs,
        waiting_requests: l.num_waiting_reqs,
        token_usage: l.token_usage,
        gen_throughput: l.gen_throughput,
        max_running_requests: l.max_running_requests,
        age_ms: 0,
        sample,
        load_only,
        cache_hit_rate: Some(l.cache_hit_rate),
        num_used_tokens: Some(l.num_used_tokens.min(i32::MAX as u64) as i32),
        max_total_num_tokens: Some(l.max_total_num_tokens.min(i32::MAX as u64) as i32),
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl vpb::vllm_engine_server::VllmEngine for VllmEngineService {
    type GenerateStream = VllmGenerateStream;
    type GetTokenizerStream = BoxStream<vpb::TokenizerChunk>;
    type SubscribeKvEventsStream = BoxStream<vpb::KvEventBatch>;

    async fn generate(
        &self,
        request: Request<vpb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let r: Result<Response<VllmGenerateStream>, Status> = async {
            let wire = request.into_inner();
            crate::check_size(&wire, self.max_request_bytes)?;
            let stream = wire.stream;
            let id = wire.request_id.clone();
            let (req, n) = to_runtime(wire)?;
            let want_logprobs = req.logprobs.is_some();
            let mut choices = StreamMap::new();
            for i in 0..n {
                let mut r = req.clone();
                r.id = Some(choice_id(&id, i));
                if let (Some(s), true) = (r.sampling.seed, i > 0) {
                    r.sampling.seed = Some(s.wrapping_add(u64::from(i)));
                }
                // Choice 0 is queued first: the others find its prompt's
                // blocks once they are cached.
                let (s, _) = self
                    .rt
                    .submit_accepted(r)
                    .await
                    .map_err(|e| status_of(&e))?;
                choices.insert(i, ChoiceEvents(s));
            }
            let multi = (n > 1).then(|| {
                self.choices
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id.clone(), n);
                (id, self.choices.clone())
            });
            Ok(Response::new(VllmGenerateStream {
                choices,
                state: HashMap::new(),
                stream,
                want_logprobs,
                multi,
                failed: false,
            }))
        }
        .await;
        let status = match &r {
            Ok(_) => "OK".to_string(),
            Err(s) => format!("{:?}", s.code()),
        };
        self.rt
            .metrics()
            .api_request("grpc", "vllm.Generate", &status);
        r
    }

    async fn health_check(
        &self,
        _request: Request<vpb::HealthCheckRequest>,
    ) -> Result<Response<vpb::HealthCheckResponse>, Status> {
        // The engine thread answers between steps: a live, serving engine.
        let healthy = self.load().await;
        Ok(Response::new(vpb::HealthCheckResponse {
            healthy: healthy.is_ok(),
            message: match healthy {
                Ok(_) => "serving".into(),
                Err(s) => s.message().to_string(),
            },
        }))
    }

    async fn abort(
        &self,
        request: Request<vpb::AbortRequest>,
    ) -> Result<Response<vpb::AbortResponse>, Status> {
        let mut ids = Vec::new();
        {
            let multi = self.choices.lock().unwrap_or_else(|p| p.into_inner());
            for id in request.into_inner().request_ids {
                let n = multi.get(&id).copied().unwrap_or(1);
                ids.extend((0..n).map(|i| choice_id(&id, i)));
            }
        }
        // Unknown ids (already finished) are not an error: aborting races
        // the request's end.
        crate::blocking(&self.rt, move |rt| {
            for id in &ids {
                let _ = rt.cancel(id);
            }
            Ok(())
        })
        .await?;
        Ok(Response::new(vpb::AbortResponse {}))
    }

    async fn get_model_info(
        &self,
        _request: Request<vpb::GetModelInfoRequest>,
    ) -> Result<Response<vpb::GetModelInfoResponse>, Status> {
        let info = self.rt.info();
        let (eos, bos) = match self.bundle().await {
            Ok(b) => (
                b.eos_ids.iter().map(|&e| e as i32).collect(),
                b.bos_id.map_or(-1, |b| b as i32),
            ),
            Err(_) => (Vec::new(), -1),
        };
        let id = self.model_id();
        Ok(Response::new(vpb::GetModelInfoResponse {
            // Not a path on the gateway's host: the gateway then asks us
            // for the tokenizer (GetTokenizer).
            model_path: id.clone(),
            is_generation: true,
            max_context_length: info.n_ctx,
            vocab_size: info.geometry.n_vocab,
            supports_vision: false,
            served_model_name: id,
            tokenizer_path: String::new(),
            model_type: info.architecture.clone(),
            architectures: vec![info.architecture.clone()],
            eos_token_ids: eos,
            pad_token_id: -1,
            bos_token_id: bos,
            max_req_input_len: info.n_ctx.saturating_sub(1) as i32,
        }))
    }

    async fn get_server_info(
        &self,
        _request: Request<vpb::GetServerInfoRequest>,
    ) -> Result<Response<vpb::GetServerInfoResponse>, Status> {
        let l = self.load().await?;
        let info = self.rt.info();
        Ok(Response::new(vpb::GetServerInfoResponse {
            active_requests: l.num_total_reqs,
            is_paused: false,
            last_receive_timestamp: unix_time_s(),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            server_type: "siliceo-grpc".into(),
            data_parallel_size: 1,
            kv_cache_dtype: info.kv_format.clone(),
            block_size: info.block_size as i32,
            attention_backend: info.kv_backend.to_string(),
            max_num_seqs: info.max_running_seqs as i32,
        }))
    }

    async fn get_loads(
        &self,
        _request: Request<vpb::GetLoadsRequest>,
    ) -> Result<Response<vpb::GetLoadsResponse>, Status> {
        let l = self.load().await?;
        let clamp = |v: u64| v.min(i32::MAX as u64) as i32;
        Ok(Response::new(vpb::GetLoadsResponse {
            timestamp: rfc3339_now(),
            version: env!("CARGO_PKG_VERSION").into(),
            dp_rank_count: 1,
            loads: vec![vpb::SchedulerLoad {
                dp_rank: 0,
                num_running_reqs: l.num_running_reqs as i32,
                num_waiting_reqs: l.num_waiting_reqs as i32,
                num_total_reqs: l.num_total_reqs as i32,
                num_used_tokens: clamp(l.num_used_tokens),
                max_total_num_tokens: clamp(l.max_total_num_tokens),
                token_usage: l.token_usage,
                gen_throughput: l.gen_throughput,
                cache_hit_rate: l.cache_hit_rate,
                utilization: l.utilization,
                max_running_requests: l.max_running_requests as i32,
            }],
        }))
    }

    async fn get_tokenizer(
        &self,
        _request: Request<vpb::GetTokenizerRequest>,
    ) -> Result<Response<Self::GetTokenizerStream>, Status> {
        let b = self.bundle().await?;
        let n = b.zip.len().div_ceil(TOKENIZER_CHUNK).max(1);
        let chunks: Vec<Result<vpb::TokenizerChunk, Status>> = (0..n)
            .map(|i| {
                let end = ((i + 1) * TOKENIZER_CHUNK).min(b.zip.len());
                Ok(vpb::TokenizerChunk {
                    data: b.zip[i * TOKENIZER_CHUNK..end].to_vec(),
                    sha256: if i + 1 == n {
                        b.sha256.clone()
                    } else {
                        String::new()
                    },
                })
            })
            .collect();
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn subscribe_kv_events(
        &self,
        request: Request<vpb::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let r = request.into_inner();
        let hub = self.rt.kv_events().clone();
        let sub = hub
            .subscribe(r.start_sequence_number)
            .map_err(|e| Status::out_of_range(e.to_string()))?;
        let svc = self.clone();
        let block_size = self.rt.info().block_size;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<vpb::KvEventBatch, Status>>(64);
        tokio::spawn(async move {
            let mut loads = LoadSampler {
                svc,
                sample: 0,
                last: None,
            };
            let mut last_seq = sub.last_seq;
            // A load record first: the gateway learns our load before any event.
            if r.load_records_before_first_batch {
                let first = load_only(0, loads.record(true).await);
                if tx.send(Ok(first)).await.is_err() {
                    return;
                }
            }
            for b in &sub.backlog {
                last_seq = b.seq;
                let l = loads.record(false).await;
                if tx.send(Ok(batch_pb(b, block_size, l))).await.is_err() {
                    return;
                }
            }
            let mut live = sub.live;
            let mut tick = tokio::time::interval(HEARTBEAT);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let msg = tokio::select! {
                    b = live.recv() => match b {
                        Ok(b) if b.seq <= last_seq => continue,
                        Ok(b) => {
                            last_seq = b.seq;
                            Ok(batch_pb(&b, block_size, loads.record(false).await))
                        }
                        // Fell behind: end the stream; the gateway resumes
                        // after the last batch it applied.
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                            Err(Status::data_loss(format!("subscriber fell {n} batches behind; resume")))
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    },
                    _ = tick.tick() => Ok(load_only(last_seq, loads.record(true).await)),
                    () = tx.closed() => return,
                };
                let end = msg.is_err();
                if tx.send(msg).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// Now as RFC 3339 (UTC, seconds).
fn rfc3339_now() -> String {
    siliceo_core::rfc3339(unix_time_s() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_become_an_escaped_alternation() {
        assert_eq!(
            choice_regex(&["a.b".into(), "yes".into(), "(no)".into()]),
            r"(a\.b|yes|\(no\))"
        );
    }

    #[test]
    fn wire_requests_map_to_runtime_requests() {
        let req = |s: vpb::SamplingParams| vpb::GenerateRequest {
            request_id: "r".into(),
            input: Some(vpb::generate_request::Input::Tokenized(
                vpb::TokenizedInput {
                    original_text: String::new(),
                    input_ids: vec![1, 2, 3],
                },
            )),
            sampling_params: Some(s),
            stream: true,
        };
        let (r, n) = to_runtime(req(vpb::SamplingParams {
            top_p: 0.0,
            max_tokens: Some(8),
            n: 3,
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(n, 3);
        assert_eq!(r.sampling.temperature, 1.0);
        assert_eq!(r.sampling.top_p, 1.0);
        assert_eq!(r.sampling.max_tokens, 8);
        assert_eq!(r.max_tokens_field, Some("sampling_params.max_tokens"));
        assert!(matches!(r.input, Input::Tokens(ref t) if t.len() == 3));
        let bad = |s: vpb::SamplingParams, field: &str| {
            let e = to_runtime(req(s)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with(field), "{}", e.message());
        };
        bad(
            vpb::SamplingParams {
                logprobs: Some(-1),
                ..Default::default()
            },
            "sampling_params.logprobs",
        );
        bad(
            vpb::SamplingParams {
                prompt_logprobs: Some(-1),
                ..Default::default()
            },
            "sampling_params.prompt_logprobs",
        );
        let (r, _) = to_runtime(req(vpb::SamplingParams {
            prompt_logprobs: Some(3),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!((r.prompt_logprobs, r.logprobs), (Some(3), None));
        bad(
            vpb::SamplingParams {
                n: 17,
                ..Default::default()
            },
            "sampling_params.n",
        );
        let (r, _) = to_runtime(req(vpb::SamplingParams {
            min_tokens: 2,
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(r.min_tokens, 2);
    }

    #[test]
    fn timestamps_are_rfc3339() {
        let t = rfc3339_now();
        assert_eq!(t.len(), 20, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z'), "{t}");
    }
}
