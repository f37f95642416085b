//! The full local pair for end-to-end benchmarks: a harness on 127.0.0.1
//! with an API token and one executor registered with it, in this process
//! (what `bmx up` runs), plus the few API calls the benchmarks make.

use bmx::executor::{Executor, ExecutorConfig, ExecutorHandle, TokenSource};
use bmx::harness::{Harness, HarnessHandle};
use serde_json::Value;
use std::time::Duration;

pub struct Local {
    pub harness: HarnessHandle,
    executor: ExecutorHandle,
    pub http: reqwest::Client,
    api_token: String,
    /// The API's Unix socket (`HarnessBuilder::api_unix`), in a directory
    /// of its own, out of the sessions' workspaces.
    pub api_unix: std::path::PathBuf,
    _work: tempfile::TempDir,
    _sockets: tempfile::TempDir,
}

impl Local {
    /// Start both; `tweak` adjusts the executor's config (agents, ...).
    pub async fn start(tweak: impl FnOnce(&mut ExecutorConfig)) -> Result<Local, String> {
        let api_token = format!("bench-{}", uuid::Uuid::new_v4().simple());
        let sockets = tempfile::tempdir().map_err(|e| e.to_string())?;
        let api_unix = sockets.path().join("api.sock");
        let harness = Harness::builder()
            .listen("127.0.0.1:0".parse().map_err(|e| format!("{e}"))?)
            .api_unix(&api_unix)
            .token("bench", "bench-token")
            .api_token(Some(api_token.clone()))
            .build()
            .await
            .map_err(|e| format!("harness: {e}"))?;
        let work = tempfile::tempdir().map_err(|e| e.to_string())?;
        // The executor dials the in-process endpoint, as `bmx up`'s does.
        let mut config = ExecutorConfig::new(
            harness.in_process_endpoint(),
            TokenSource::Static("bench-token".into()),
        );
        config.work_root = work.path().to_owned();
        tweak(&mut config);
        let executor = Executor::start(config).await.map_err(|e| e.to_string())?;
        if !harness
            .wait_for_executor(Some("bench"), Duration::from_secs(10))
            .await
        {
            return Err("the executor did not register".into());
        }
        Ok(Local {
            harness,
            executor,
            http: reqwest::Client::new(),
            api_token,
            api_unix,
            _work: work,
            _sockets: sockets,
        })
    }

    /// `Bearer <api token>`.
    pub fn auth(&self) -> String {
        format!("Bearer {}", self.api_token)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.harness.api_url())
    }

    /// POST a JSON body to the API; the answer's JSON (error on non-2xx).
    pub async fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let resp = self
            .http
            .post(self.url(path))
            .header("authorization", self.auth())
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let bytes = resp.bytes().await.map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!(
                "POST {path}: HTTP {status}: {}",
                String::from_utf8_lossy(&bytes)
            ));
        }
        serde_json::from_slice(&bytes).map_err(|e| format!("POST {path}: {e}"))
    }

    /// Create a session with `body`; its id.
    pub async fn session(&self, body: &Value) -> Result<String, String> {
        let created = self.post("/v1/sessions", body).await?;
        created["sessionId"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| "no sessionId".to_owned())
    }

    pub async fn shutdown(self) {
        self.executor.shutdown().await;
        self.harness.shutdown().await;
    }
}
