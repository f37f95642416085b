//! A minimal harness peer for benchmarks: accepts one executor on
//! 127.0.0.1, answers its register and heartbeats, and hands the link to the
//! benchmark. The full harness would add HTTP and lease bookkeeping to the
//! measured path; this keeps the path to the bytes: socket, codec, router,
//! actor, ring.

use bmx::wire::types::{
    now_rfc3339, Accepted, HeartbeatResult, Limits, RegisterParams, RegisterResult,
};
use bmx::wire::{transport, Dispatch, Inbound, Link, LinkLimits, Method, Responder, Subprotocol};
use std::sync::Arc;
use tokio::sync::mpsc;

pub struct Answer;

impl Dispatch for Answer {
    fn dispatch(&self, frame: Inbound, reply: Option<Responder>) {
        let Some(reply) = reply else { return };
        match frame.method().and_then(Method::from_name) {
            Some(Method::ExecutorRegister) => {
                let protocol = frame
                    .params::<RegisterParams>()
                    .map(|p| p.protocol)
                    .unwrap_or_else(|_| "1.1".into());
                reply.ok(&RegisterResult {
                    executor_id: "bench".into(),
                    connection_id: "bench-1".into(),
                    protocol,
                    heartbeat_interval_ms: 10_000,
                    lease_ttl_ms: 30_000,
                    limits: Limits::default(),
                    max_control_frame_bytes: RegisterResult::DEFAULT_CONTROL_FRAME_BYTES,
                    max_mcp_frame_bytes: RegisterResult::DEFAULT_MCP_FRAME_BYTES,
                    server_time: now_rfc3339(),
                    drain: false,
                })
            }
            Some(Method::ExecutorHeartbeat) => reply.ok(&HeartbeatResult {
                lease_ttl_ms: 30_000,
                server_time: now_rfc3339(),
                drain: false,
            }),
            _ => reply.ok(&Accepted::YES),
        }
    }
}

/// A listening bench peer.
pub struct BenchPeer {
    pub url: String,
    pub token: String,
    links: mpsc::UnboundedReceiver<Link>,
}

impl BenchPeer {
    /// Listen on 127.0.0.1 offering only `protocol`.
    pub async fn start(protocol: Subprotocol) -> std::io::Result<BenchPeer> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("ws://{}{}", listener.local_addr()?, transport::CONNECT_PATH);
        let token = uuid::Uuid::new_v4().to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        let expected = token.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                let (tx, expected) = (tx.clone(), expected.clone());
                tokio::spawn(async move {
                    let auth = |t: Option<&str>| {
                        (t == Some(expected.as_str())).then(|| "bench".to_owned())
                    };
                    let Ok((t, _)) =
                        transport::accept(Box::new(stream), &[protocol], 8 << 20, auth).await
                    else {
                        return;
                    };
                    let (link, reader) = Link::start(t, "h", LinkLimits::default());
                    let _ = tx.send(link);
                    reader.run(Arc::new(Answer)).await;
                });
            }
        });
        Ok(BenchPeer {
            url,
            token,
            links: rx,
        })
    }

    /// The executor's connection, once it dialed.
    pub async fn link(&mut self) -> Option<Link> {
        self.links.recv().await
    }
}
