//! `bmx run "prompt"`: one agent turn through the harness API
//! (docs/agents.md). It follows the session's event stream (SSE), starts
//! the turn, prints the agent's text to stdout as it streams, tool uses and
//! errors to stderr, asks permission questions on the terminal, and exits
//! with the turn's outcome: 0 completed, 1 failed, 130 canceled (Ctrl-C
//! cancels the turn; a second Ctrl-C leaves at once).
//!
//! The turn id is minted here, so that the stream (opened before the turn
//! starts, so nothing is missed) can be filtered to this turn. A lost
//! stream is resumed with `Last-Event-ID`; deltas are best-effort and the
//! final `agent.message` is the truth: whatever the deltas missed is
//! printed from it.

use bmx::client::{encode_component, ApiClient};
use clap::Args;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::Duration;
use tokio::sync::mpsc;

use super::text::{self, warn_line};

/// Run one agent turn and stream its output.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The harness API.
    #[arg(long, env = "BMX_HARNESS", default_value = "http://127.0.0.1:7070")]
    pub harness: String,
    #[arg(long, env = "BMX_API_TOKEN", hide_env_values = true)]
    pub api_token: Option<String>,
    /// Which of the executor's agents runs the turn (default: its first).
    #[arg(long)]
    pub agent: Option<String>,
    /// The model, if the agent lets one choose.
    #[arg(long)]
    pub model: Option<String>,
    /// Run in this session (default: a new one, stopped at the end unless
    /// --keep).
    #[arg(long)]
    pub session: Option<String>,
    /// Create the session on this executor.
    #[arg(long)]
    pub executor: Option<String>,
    /// Keep the session this command created (and its agent), to go on
    /// with `bmx run --session ID`.
    #[arg(long)]
    pub keep: bool,
    /// Answer every permission question with this (allow, always or deny)
    /// instead of asking.
    #[arg(long, value_parser = ["allow", "always", "deny"])]
    pub permission: Option<String>,
    /// The prompt (words are joined with spaces).
    #[arg(required = true, value_name = "PROMPT")]
    pub prompt: Vec<String>,
}

/// An SSE event of the stream.
#[derive(Debug)]
struct SseEvent {
    name: Option<String>,
    id: Option<u64>,
    data: Value,
}

/// What the stream reader hands the main loop.
enum Feed {
    Event(SseEvent),
    /// The stream ended or failed: reconnect.
    Lost(String),
}

/// Read one SSE connection to its end, sending each event.
async fn read_stream(resp: reqwest::Response, tx: mpsc::Sender<Feed>) {
    use futures_util::StreamExt;
    let mut body = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    loop {
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let block: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&block);
            let (mut name, mut id, mut data) = (None, None, String::new());
            for line in text.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = Some(v.trim().to_owned());
                } else if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().parse().ok();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            if data.is_empty() {
                continue;
            }
            let Ok(data) = serde_json::from_str(&data) else {
                continue;
            };
            if tx
                .send(Feed::Event(SseEvent { name, id, data }))
                .await
                .is_err()
            {
                return;
            }
        }
        // A stream that never ends a line is not ours: do not grow forever.
        if buf.len() > 64 << 20 {
            let _ = tx.send(Feed::Lost("an event too large".into())).await;
            return;
        }
        match body.next().await {
            Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
            Some(Err(e)) => {
                let _ = tx.send(Feed::Lost(e.to_string())).await;
                return;
            }
            None => {
                let _ = tx.send(Feed::Lost("the stream ended".into())).await;
                return;
            }
        }
    }
}

struct Ctx {
    client: ApiClient,
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    session: String,
}

impl Ctx {
    /// Open the event stream after `last` (0: from the oldest kept).
    async fn connect(&self, last: u64, tx: mpsc::Sender<Feed>) -> Result<(), String> {
        let url = format!(
            "{}/v1/sessions/{}/events",
            self.base,
            encode_component(&self.session)
        );
        let mut req = self.http.get(url).header("accept", "text/event-stream");
        if last > 0 {
            req = req.header("last-event-id", last.to_string());
        }
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            let status = resp.status().as_u16();
            let body: Value = resp
                .bytes()
                .await
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null);
            return Err(format!("HTTP {status}: {}", api_error(&body)));
        }
        tokio::spawn(read_stream(resp, tx));
        Ok(())
    }

    fn session_path(&self) -> String {
        format!("/v1/sessions/{}", encode_component(&self.session))
    }
}

fn api_error(v: &Value) -> String {
    match v.get("error") {
        Some(e) => {
            let mut s = format!(
                "{} (code {})",
                e["message"].as_str().unwrap_or("error"),
                e["code"]
            );
            if let Some(r) = e["data"]["reason"].as_str() {
                s.push_str(&format!(", reason {r}"));
            }
            s
        }
        None => v.to_string(),
    }
}

/// The agent's text on stdout: its line breaks and tabs kept, every
/// other control character escaped ([`text::lines`]): an agent's answer is
/// text, not terminal commands.
fn out(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = o
        .write_all(text::lines(s).as_bytes())
        .and_then(|_| o.flush());
}

/// One line on stderr, escaped whole ([`text::one_line`]): tool names,
/// inputs, error messages and ids in it came from the wire.
fn err_line(s: &str) {
    let mut e = std::io::stderr().lock();
    let _ = writeln!(e, "{}", text::one_line(s)).and_then(|_| e.flush());
}

/// A short one-line rendering of a JSON value.
fn brief(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 200 {
        let cut = (0..=200)
            .rev()
            .find(|i| s.is_char_boundary(*i))
            .unwrap_or(0);
        format!("{}…", &s[..cut])
    } else {
        s
    }
}

/// Ask a permission question on the terminal (blocking: run off the
/// runtime). `None`: no terminal.
fn ask(question: &str) -> Option<&'static str> {
    if !std::io::stdin().is_terminal() {
        return None;
    }
    loop {
        eprint!(
            "{} [y]es once / [a]lways this session / [n]o: ",
            text::one_line(question)
        );
        let _ = std::io::stderr().flush();
        let mut line = String::new();
        match std::io::stdin().read_line(&mut line) {
            Ok(0) | Err(_) => return Some("deny"),
            Ok(_) => {}
        }
        match line.trim().to_ascii_lowercase().as_str() {
            "y" | "yes" => return Some("allow"),
            "a" | "always" => return Some("always"),
            "n" | "no" => return Some("deny"),
            _ => {}
        }
    }
}

/// Answer interaction `view` (asking if needed), in a task of its own.
fn answer(ctx: &Ctx, view: &Value, fixed: Option<String>) {
    let id = view["interactionId"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let tool = view["toolName"].as_str().unwrap_or("a tool").to_owned();
    let input = brief(&view["toolInput"]);
    let offers_session = view["scopes"]
        .as_array()
        .is_some_and(|s| s.iter().any(|x| x == "session"));
    let client = ctx.client.clone();
    let path = format!(
        "{}/interactions/{}",
        ctx.session_path(),
        encode_component(&id)
    );
    tokio::spawn(async move {
        let question = format!("bmx run: the agent asks to use {tool} {input}.");
        let choice = match fixed {
            Some(c) => {
                err_line(&format!("{question} Answered {c} (--permission)."));
                c
            }
            None => match tokio::task::spawn_blocking(move || ask(&question)).await {
                Ok(Some(c)) => c.to_owned(),
                _ => {
                    err_line(&format!(
                        "bmx run: the agent asks to use {tool} {input}; no terminal to ask: denied."
                    ));
                    "deny".to_owned()
                }
            },
        };
        let body = match choice.as_str() {
            "allow" => json!({"outcome": "allow", "scope": "once"}),
            "always" if offers_session => json!({"outcome": "allow", "scope": "session"}),
            "always" => json!({"outcome": "allow", "scope": "once"}),
            _ => json!({"outcome": "deny", "denyMessage": "denied at the terminal"}),
        };
        match client.post(&path, &body).await {
            Ok((200, _)) => {}
            Ok((_, v)) => err_line(&format!(
                "bmx run: the answer was not taken: {}",
                api_error(&v)
            )),
            Err(e) => err_line(&format!("bmx run: the answer was not sent: {e}")),
        }
    });
}

/// Where the turn is, from its events.
#[derive(Default)]
struct Turn {
    /// Text printed so far per message event (from deltas).
    printed: HashMap<String, String>,
    asked: HashSet<String>,
    /// The last final sequence seen (to resume the stream).
    last: u64,
    /// Whether stdout needs a newline before the exit.
    open_line: bool,
}

/// What one stream event means for the run: `Some(code)` when it is over.
fn on_event(
    ctx: &Ctx,
    turn_id: &str,
    t: &mut Turn,
    e: SseEvent,
    fixed: &Option<String>,
) -> Option<u8> {
    if let Some(id) = e.id {
        t.last = t.last.max(id);
    }
    let d = &e.data;
    let ours = d["turnId"].as_str() == Some(turn_id);
    match e.name.as_deref() {
        Some("delta") if ours => {
            let text = d["text"].as_str().unwrap_or_default();
            let event_id = d["eventId"].as_str().unwrap_or_default().to_owned();
            match d["eventType"].as_str() {
                Some("agent.message") => {
                    out(text);
                    t.open_line = !text.ends_with('\n');
                    t.printed.entry(event_id).or_default().push_str(text);
                }
                Some("agent.thinking") => {
                    t.printed.entry(event_id).or_default().push_str(text);
                }
                _ => {}
            }
            None
        }
        Some("interaction") if ours => {
            let i = &d["interaction"];
            let id = i["interactionId"].as_str().unwrap_or_default().to_owned();
            match i["state"].as_str() {
                Some("pending") if t.asked.insert(id.clone()) => answer(ctx, i, fixed.clone()),
                Some("expired") | Some("canceled") => err_line(&format!(
                    "bmx run: the permission question {id} went away ({})",
                    i["reason"].as_str().unwrap_or("canceled")
                )),
                _ => {}
            }
            None
        }
        Some("end") => {
            err_line(&format!(
                "bmx run: the session ended ({})",
                d["reason"].as_str().unwrap_or("?")
            ));
            Some(1)
        }
        None if ours => {
            let ev = &d["event"];
            let event_id = d["eventId"].as_str().unwrap_or_default();
            match ev["type"].as_str().unwrap_or_default() {
                "agent.message" => {
                    let full = ev["text"].as_str().unwrap_or_default();
                    let printed = t.printed.remove(event_id).unwrap_or_default();
                    // The final text is the truth: print what the deltas missed.
                    let rest = full.strip_prefix(printed.as_str()).unwrap_or_else(|| {
                        if !printed.is_empty() {
                            out("\n");
                        }
                        full
                    });
                    out(rest);
                    if !full.is_empty() {
                        t.open_line = !full.ends_with('\n');
                    }
                }
                "agent.thinking" => {
                    t.printed.remove(event_id);
                }
                "agent.tool_use" | "agent.mcp_tool_use" => {
                    if t.open_line {
                        out("\n");
                        t.open_line = false;
                    }
                    err_line(&format!(
                        "[tool] {} {}",
                        ev["name"].as_str().unwrap_or("?"),
                        brief(&ev["input"])
                    ));
                }
                "agent.tool_result" | "agent.mcp_tool_result" => {
                    err_line(&format!(
                        "[tool] {} {}",
                        ev["toolUseId"].as_str().unwrap_or("?"),
                        ev["status"].as_str().unwrap_or("done")
                    ));
                }
                "session.error" => {
                    err_line(&format!(
                        "bmx run: agent error: {} ({})",
                        ev["error"]["message"].as_str().unwrap_or("?"),
                        ev["error"]["type"].as_str().unwrap_or("?")
                    ));
                }
                "session.status_idle" => {
                    if t.open_line {
                        out("\n");
                        t.open_line = false;
                    }
                    return Some(match ev["turnOutcome"].as_str() {
                        Some("completed") => 0,
                        Some("canceled") => 130,
                        _ => 1,
                    });
                }
                _ => {}
            }
            None
        }
        _ => None,
    }
}

pub async fn run(args: RunArgs) -> ExitCode {
    let client = match ApiClient::new(&args.harness) {
        Ok(c) => c.token(args.api_token.clone()),
        Err(e) => {
            warn_line!("bmx run: {e}");
            return ExitCode::from(2);
        }
    };
    let http = match reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
    {
        Ok(h) => h,
        Err(e) => {
            warn_line!("bmx run: {e}");
            return ExitCode::from(2);
        }
    };
    let (session, created) = match &args.session {
        Some(s) => (s.clone(), false),
        None => {
            let mut body = json!({});
            if let Some(e) = &args.executor {
                body["executorId"] = json!(e);
            }
            match client.post("/v1/sessions", &body).await {
                Ok((201, v)) => (v["sessionId"].as_str().unwrap_or_default().to_owned(), true),
                Ok((_, v)) => {
                    warn_line!("bmx run: cannot create a session: {}", api_error(&v));
                    return ExitCode::from(1);
                }
                Err(e) => {
                    warn_line!("bmx run: {}: {e}", args.harness);
                    return ExitCode::from(1);
                }
            }
        }
    };
    let ctx = Ctx {
        client,
        http,
        base: args.harness.trim_end_matches('/').to_owned(),
        token: args.api_token.clone(),
        session,
    };
    let code = run_in(&ctx, &args).await;
    if created {
        if args.keep {
            warn_line!(
                "bmx run: session {} kept (go on with --session {})",
                ctx.session,
                ctx.session
            );
        } else if let Err(e) = ctx.client.delete(&ctx.session_path()).await {
            warn_line!("bmx run: stopping session {}: {e}", ctx.session);
        }
    }
    ExitCode::from(code)
}

async fn run_in(ctx: &Ctx, args: &RunArgs) -> u8 {
    // One listener for the whole turn: a fresh `ctrl_c()` per loop pass
    // would miss a Ctrl-C that lands while an event is being handled.
    let mut interrupts =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()) {
            Ok(s) => s,
            Err(e) => {
                warn_line!("bmx run: cannot listen for Ctrl-C: {e}");
                return 1;
            }
        };
    let turn_id = format!("turn-{}", uuid::Uuid::new_v4().simple());
    let (tx, mut rx) = mpsc::channel(1024);
    // Follow the stream first: nothing of the turn can be missed.
    if let Err(e) = ctx.connect(0, tx.clone()).await {
        warn_line!("bmx run: cannot follow the session's events: {e}");
        return 1;
    }
    let mut config = json!({});
    if let Some(a) = &args.agent {
        config["agent"] = json!(a);
    }
    if let Some(m) = &args.model {
        config["model"] = json!(m);
    }
    let body = json!({"input": args.prompt.join(" "), "turnId": turn_id, "config": config});
    match ctx
        .client
        .post(&format!("{}/turns", ctx.session_path()), &body)
        .await
    {
        Ok((201, _)) => {}
        Ok((_, v)) => {
            warn_line!("bmx run: cannot start the turn: {}", api_error(&v));
            return 1;
        }
        Err(e) => {
            warn_line!("bmx run: cannot start the turn: {e}");
            return 1;
        }
    }
    let fixed = args.permission.clone();
    let mut turn = Turn::default();
    let mut canceling = false;
    let mut reconnects = 0u32;
    loop {
        let feed = tokio::select! {
            f = rx.recv() => f,
            _ = interrupts.recv() => {
                if canceling {
                    warn_line!("bmx run: interrupted");
                    return 130;
                }
                canceling = true;
                warn_line!("bmx run: canceling the turn (Ctrl-C again to leave now)");
                let path = format!("{}/turns/{}/cancel", ctx.session_path(), encode_component(&turn_id));
                if let Ok((status, v)) = ctx.client.post(&path, &json!({"reason": "user"})).await {
                    if status != 200 {
                        warn_line!("bmx run: cancel: {}", api_error(&v));
                    }
                }
                continue;
            }
        };
        let why = match feed {
            Some(Feed::Event(e)) => {
                if e.name.as_deref() == Some("error") {
                    // Cut for being slow (or the stream restarted): resume.
                    let _ = ctx.connect(turn.last, tx.clone()).await;
                    continue;
                }
                if let Some(code) = on_event(ctx, &turn_id, &mut turn, e, &fixed) {
                    return code;
                }
                continue;
            }
            Some(Feed::Lost(why)) => why,
            None => "the stream closed".to_owned(),
        };
        reconnects += 1;
        if reconnects > 10 {
            warn_line!("bmx run: lost the event stream: {why}");
            return 1;
        }
        tokio::time::sleep(Duration::from_millis(200 * u64::from(reconnects))).await;
        if let Err(e) = ctx.connect(turn.last, tx.clone()).await {
            warn_line!("bmx run: reconnecting: {e}");
        }
        // Questions asked while the stream was away.
        if let Ok((200, v)) = ctx
            .client
            .get(&format!("{}/interactions", ctx.session_path()))
            .await
        {
            for i in v["interactions"].as_array().into_iter().flatten() {
                let id = i["interactionId"].as_str().unwrap_or_default().to_owned();
                if i["turnId"].as_str() == Some(turn_id.as_str())
                    && i["state"] == "pending"
                    && turn.asked.insert(id)
                {
                    answer(ctx, i, fixed.clone());
                }
            }
        }
    }
}
