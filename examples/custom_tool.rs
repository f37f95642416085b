//! A platform's own tool next to the built-ins: implement `Tool`, register it
//! by name, start the executor with the registry. `tool.call {tool: "upper"}`
//! then runs it like any built-in (at most once, result retried until
//! acknowledged).
//!
//! Run: `cargo run --release --example custom_tool -- ws://127.0.0.1:7070/v1/executor/connect TOKEN`

use bmx::executor::{Executor, ExecutorConfig, TokenSource};
use bmx::tools::{Tool, ToolContext, ToolOutput, ToolRegistry};
use bmx::wire::Endpoint;
use serde_json::Value;
use std::sync::Arc;

/// Upper-cases `input.text`.
struct Upper;

#[async_trait::async_trait]
impl Tool for Upper {
    fn name(&self) -> &str {
        "upper"
    }

    async fn run(&self, _ctx: ToolContext, input: Value) -> ToolOutput {
        match input.get("text").and_then(Value::as_str) {
            Some(text) => ToolOutput::success(text.to_uppercase()),
            None => ToolOutput::invalid_input("`text` (a string) is required"),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "ws://127.0.0.1:7070/v1/executor/connect".into());
    let token = args.next().ok_or("usage: custom_tool URL TOKEN")?;
    let mut tools = ToolRegistry::builtin();
    tools.register(Arc::new(Upper));
    let config = ExecutorConfig::new(Endpoint::parse(&url)?, TokenSource::Static(token));
    let executor = Executor::start_with_tools(config, tools).await?;
    let exit = executor.run_until_signal().await;
    std::process::exit(exit.exit_code().into());
}
