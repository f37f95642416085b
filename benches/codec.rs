//! Wire benchmarks, each beside its raw baseline:
//! * `codec/*`: encode + decode of a `process.read` result with 64 KiB of
//!   data as a whole frame, JSON (base64) vs MessagePack (bin);
//! * `route/*`: a request through the real path (WebSocket framing over an
//!   in-process pipe, codec, router, a ractor actor, the answer back) vs a
//!   raw `tokio::sync::mpsc` + `oneshot` round trip, sequential and 64 in
//!   flight.

use bmx::wire::frame::{OutResult, JSONRPC};
use bmx::wire::types::{ProcState, ProcessReadResult, Stream};
use bmx::wire::{
    transport, Blob, Codec, Dispatch, Id, Inbound, Link, LinkLimits, Method, Responder, Subprotocol,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::Arc;
use std::time::Duration;
use tokio_tungstenite::tungstenite::Message;

fn read_result() -> ProcessReadResult {
    ProcessReadResult {
        process_id: "p1".into(),
        stream: Stream::Stdout,
        data: Blob::from((0..64 * 1024).map(|i| (i % 251) as u8).collect::<Vec<u8>>()),
        from_cursor: 1 << 20,
        next_cursor: (1 << 20) + 64 * 1024,
        earliest_cursor: 0,
        gap: false,
        truncated: false,
        eof: false,
        state: ProcState::Running,
        exit_code: None,
        exit_signal: None,
        ended_at: None,
        reason: None,
        file_transfer: None,
    }
}

fn codec(c: &mut Criterion) {
    let result = read_result();
    let id = Id::Str("h42".into());
    let mut group = c.benchmark_group("codec");
    group.throughput(Throughput::Bytes(64 * 1024));
    for codec in [Codec::Json, Codec::MsgPack] {
        group.bench_with_input(
            BenchmarkId::new("process_read_64k", format!("{codec:?}")),
            &codec,
            |b, &codec| {
                b.iter(|| {
                    let msg = codec
                        .encode(&OutResult {
                            jsonrpc: JSONRPC,
                            id: &id,
                            result: &result,
                        })
                        .unwrap();
                    let bytes = match msg {
                        Message::Text(t) => bytes::Bytes::from(t),
                        Message::Binary(b) => b,
                        _ => unreachable!(),
                    };
                    let frame = Inbound::parse(codec, bytes).unwrap();
                    let back: ProcessReadResult = frame.result().unwrap();
                    assert_eq!(back.data.len(), 64 * 1024);
                })
            },
        );
    }
    group.bench_function("baseline_memcpy_64k", |b| {
        let src = result.data.as_slice().to_vec();
        b.iter(|| std::hint::black_box(src.clone()))
    });
    group.finish();
}

/// The actor the router casts to: answers through the responder.
struct Echo;

impl Actor for Echo {
    type Msg = Responder;
    type State = ();
    type Arguments = ();
    async fn pre_start(&self, _: ActorRef<Responder>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }
    async fn handle(
        &self,
        _: ActorRef<Responder>,
        reply: Responder,
        _: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        reply.ok(&serde_json::json!({"accepted": true}));
        Ok(())
    }
}

struct Router(ActorRef<Responder>);

impl Dispatch for Router {
    fn dispatch(&self, _frame: Inbound, reply: Option<Responder>) {
        if let Some(r) = reply {
            let _ = self.0.cast(r);
        }
    }
}

fn route(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let (client, _echo) = rt.block_on(async {
        let (client, server) = transport::pipe(&[Subprotocol::ALL[0]], &Subprotocol::ALL, 1 << 20)
            .await
            .unwrap();
        let (echo, _) = Actor::spawn(None, Echo, ()).await.unwrap();
        let (_server_link, reader) = Link::start(server, "h", LinkLimits::default());
        let router = Arc::new(Router(echo.clone()));
        tokio::spawn(async move { reader.run(router).await });
        let (client_link, client_reader) = Link::start(client, "e", LinkLimits::default());
        struct Nothing;
        impl Dispatch for Nothing {
            fn dispatch(&self, _: Inbound, _: Option<Responder>) {}
        }
        tokio::spawn(async move { client_reader.run(Arc::new(Nothing)).await });
        (client_link, echo)
    });
    let params = serde_json::json!({"sessionId": "s", "processId": "p"});
    let mut group = c.benchmark_group("route");
    group.throughput(Throughput::Elements(1));
    group.bench_function("request_round_trip", |b| {
        b.to_async(&rt).iter(|| async {
            let _: serde_json::Value = client
                .request(Method::ProcessInterrupt, &params, Duration::from_secs(5))
                .await
                .unwrap();
        })
    });
    group.throughput(Throughput::Elements(64));
    group.bench_function("request_64_in_flight", |b| {
        b.to_async(&rt).iter(|| async {
            let calls = (0..64).map(|_| {
                client.request::<_, serde_json::Value>(
                    Method::ProcessInterrupt,
                    &params,
                    Duration::from_secs(5),
                )
            });
            for r in futures_util::future::join_all(calls).await {
                r.unwrap();
            }
        })
    });
    // Baseline: the same round trip over tokio channels only.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Sender<u64>>(1024);
    rt.spawn(async move {
        while let Some(reply) = rx.recv().await {
            let _ = reply.send(1);
        }
    });
    group.throughput(Throughput::Elements(1));
    group.bench_function("baseline_mpsc_round_trip", |b| {
        b.to_async(&rt).iter(|| async {
            let (otx, orx) = tokio::sync::oneshot::channel();
            tx.send(otx).await.unwrap();
            orx.await.unwrap();
        })
    });
    group.throughput(Throughput::Elements(64));
    group.bench_function("baseline_mpsc_64_in_flight", |b| {
        b.to_async(&rt).iter(|| async {
            let mut waits = Vec::with_capacity(64);
            for _ in 0..64 {
                let (otx, orx) = tokio::sync::oneshot::channel();
                tx.send(otx).await.unwrap();
                waits.push(orx);
            }
            for w in waits {
                w.await.unwrap();
            }
        })
    });
    group.finish();
}

criterion_group!(benches, codec, route);
criterion_main!(benches);
