//! A minimal Rust client: streams one generation and prints it as it arrives;
//! Ctrl-C cancels the request (dropping the stream frees its KV at once).
//!
//! ```text
//! cargo run -p siliceo-server --example client -- "Tell me a story" [http://127.0.0.1:50051]
//! ```
//! Set `SILICEO_API_KEY` when the server requires a key.

use std::io::Write;

use siliceo_server::pb::{
    self, GenerateRequest, generate_request::Input, inference_client::InferenceClient,
};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let prompt = args
        .next()
        .unwrap_or_else(|| "Write a haiku about the sea.".into());
    let addr = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:50051".into());
    let mut client = InferenceClient::connect(addr).await?;
    let mut req = tonic::Request::new(GenerateRequest {
        input: Some(Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: prompt,
                ..Default::default()
            }],
        })),
        max_tokens: 200,
        ..Default::default()
    });
    if let Ok(key) = std::env::var("SILICEO_API_KEY") {
        req.metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse()?);
    }
    let mut stream = client.generate(req).await?.into_inner();
    loop {
        tokio::select! {
            msg = stream.message() => match msg? {
                Some(m) => {
                    print!("{}", m.text);
                    std::io::stdout().flush()?;
                    if let Some(u) = m.usage {
                        let reason = pb::FinishReason::try_from(m.finish_reason)
                            .map(|r| r.as_str_name())
                            .unwrap_or("?");
                        eprintln!(
                            "\n[{reason}] prompt {} tokens ({} cached), {} generated, ttft {} ms",
                            u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens, u.ttft_ms
                        );
                    }
                }
                None => break,
            },
            _ = tokio::signal::ctrl_c() => {
                eprintln!("\n[cancelled]");
                break; // dropping the stream cancels the request
            }
        }
    }
    Ok(())
}
