//! The listener: executors arrive through the HTTP router's upgrade route
//! (`GET /v1/executor/connect`, see `harness::http`) or, if configured, on a
//! Unix socket with the same handshake. Both end in
//! [`connection::start`](super::connection::start).

use crate::harness::{actors::connection, runtime::Shared};
use crate::wire::transport;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

/// Time allowed for the upgrade handshake on a raw socket.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bind `path` and accept executors on it until the harness shuts down.
pub fn serve_unix(shared: Arc<Shared>, path: &Path) -> std::io::Result<JoinHandle<()>> {
    if path.exists() {
        // A stale socket of an earlier run; a live one would still refuse
        // nothing here, so only remove sockets.
        use std::os::unix::fs::FileTypeExt;
        if std::fs::metadata(path)?.file_type().is_socket() {
            std::fs::remove_file(path)?;
        }
    }
    let listener = UnixListener::bind(path)?;
    let path = path.to_owned();
    Ok(tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                a = listener.accept() => a,
                _ = shared.shutdown.cancelled() => break,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "unix accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let shared = shared.clone();
            tokio::spawn(async move {
                let auth = shared.clone();
                let handshake = transport::accept(
                    Box::new(stream),
                    &shared.config.subprotocols,
                    shared.config.max_mcp_frame_bytes,
                    move |token| auth.authenticate(token),
                );
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                    Ok(Ok((transport, executor_id))) => {
                        connection::start(shared, transport, executor_id).await
                    }
                    Ok(Err(e)) => tracing::info!(error = %e, "unix upgrade refused"),
                    Err(_) => tracing::info!("unix upgrade timed out"),
                }
            });
        }
        let _ = std::fs::remove_file(&path);
    }))
}
