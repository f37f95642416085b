//! `bmx bench`: benchmarks that measure the raw baseline in the same run.

use super::text::warn_line;
use crate::bench::{buffering, computer, events, harness, mcp, rfb, scale, spawn, turns, visor};
use bmx::wire::Codec;
use clap::{Subcommand, ValueEnum};
use std::process::ExitCode;

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CodecChoice {
    Json,
    Msgpack,
    Both,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Process-output buffering: raw pipe vs ring vs end-to-end vs PTY.
    Buffering {
        /// Bytes the producer writes.
        #[arg(long, default_value_t = 1 << 30)]
        bytes: u64,
        /// Bytes through the PTY rows (PTYs are kernel-bound and slow).
        #[arg(long, default_value_t = 64 << 20)]
        pty_bytes: u64,
        #[arg(long, value_enum, default_value_t = CodecChoice::Both)]
        codec: CodecChoice,
        /// maxBytes of each process.read in the e2e rows.
        #[arg(long, default_value_t = 1 << 20)]
        read_bytes: u64,
        /// Ring bytes of the lossless e2e rows (their flow-control window).
        #[arg(long, default_value_t = 8 << 20)]
        window: usize,
        /// Runs per row (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Many sessions with live processes: memory per session/process and
    /// the time to assign, start and stop them.
    Scale {
        #[arg(long, default_value_t = 1000)]
        sessions: usize,
        #[arg(long, default_value_t = 10)]
        processes: usize,
        /// The sessions' sandbox (`off`: to measure what it costs).
        #[arg(long, default_value = "auto", value_name = "auto|off")]
        sandbox: bmx::sandbox::Mode,
        #[arg(long)]
        json: bool,
    },
    /// The cost of starting a process: `std::process::Command` (the raw
    /// baseline), bmx's spawner bare, and bmx's spawner in a session's
    /// sandbox (Landlock, cgroup, no capabilities).
    Spawn {
        /// Starts per row (each waited for before the next).
        #[arg(long, default_value_t = 2000)]
        starts: usize,
        #[arg(long)]
        json: bool,
    },
    /// Computer use: `computer_observe` and `computer_action` on a real
    /// Xvfb screen against the bare X call each is built on.
    Computer {
        #[arg(long, default_value_t = 1920)]
        width: u16,
        #[arg(long, default_value_t = 1080)]
        height: u16,
        /// Calls per row.
        #[arg(long, default_value_t = 200)]
        calls: usize,
        #[arg(long)]
        json: bool,
    },
    /// The display's VNC: connect to ServerInit through the harness's
    /// relay against the same handshake on x11vnc's Unix socket.
    Rfb {
        /// Connects per row.
        #[arg(long, default_value_t = 50)]
        connects: usize,
        #[arg(long)]
        json: bool,
    },
    /// MCP: tools/call echo through harness → executor → stdio server
    /// against the same call straight to the server.
    Mcp {
        /// The stdio MCP server (it must offer `echo`).
        #[arg(
            long,
            default_value = "tests/peers/node_modules/.bin/mcp-server-everything"
        )]
        command: std::path::PathBuf,
        /// Calls per row. Not 2 000 as before: at 32 in flight such a
        /// row lasts 0.1 s and its p99 rests on 20 calls, and at one in
        /// flight it catches the direct baseline in either of its two
        /// modes (docs/benchmarks.md, "Rows of 20 000 calls").
        #[arg(long, default_value_t = 20_000)]
        calls: usize,
        /// Requests in flight, one row each.
        #[arg(long, value_delimiter = ',', default_value = "1,32")]
        in_flight: Vec<usize>,
        /// Calls on each path, 32 at a time, before the rows: node's JIT
        /// warms up, so the rows measure the servers' steady state.
        #[arg(long, default_value_t = 5000)]
        warmup: usize,
        #[arg(long)]
        json: bool,
    },
    /// Agent event stream: `session.event` acknowledgements per second and
    /// their latency with the embedded store (and PostgreSQL with
    /// `--store`), against the same harness keeping events in memory.
    Events {
        /// Events of the rate measurement.
        #[arg(long, default_value_t = 20_000)]
        events: u64,
        /// Events sent one at a time for the latency.
        #[arg(long, default_value_t = 2_000)]
        latency_events: u64,
        /// Events outstanding at once in the rate measurement.
        #[arg(long, default_value_t = 32)]
        in_flight: usize,
        /// Runs per store (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// A PostgreSQL URL: a third row over it.
        #[arg(long)]
        store: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Agent turns: chunks per second from the agent to an SSE client
    /// through executor and harness, against the agent's ACP stream read
    /// directly.
    Turns {
        /// The ACP agent script (run with node; it must offer `many N`).
        #[arg(long, default_value = "tests/peers/agent/test-agent.mjs")]
        agent: std::path::PathBuf,
        /// Chunks per turn.
        #[arg(long, default_value_t = 20_000)]
        chunks: u64,
        /// Chunks per latency turn, one every `--gap-ms`.
        #[arg(long, default_value_t = 200)]
        paced: u64,
        #[arg(long, default_value_t = 10)]
        gap_ms: u64,
        /// Runs (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        #[arg(long)]
        json: bool,
    },
    /// `bmx visor`: PTY output to 1 and 10 attached clients against
    /// `script -qc`, event fan-out to many subscribers, memory per idle
    /// PTY session.
    Visor {
        /// Bytes the PTY session writes per run.
        #[arg(long, default_value_t = 256 << 20)]
        bytes: u64,
        /// Runs (the median is reported).
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Idle PTY sessions for the memory figure.
        #[arg(long, default_value_t = 50)]
        idle_sessions: usize,
        /// Event subscribers for the fan-out figure.
        #[arg(long, default_value_t = 100)]
        subscribers: usize,
        #[arg(long)]
        json: bool,
    },
    /// The harness under simulated executors heartbeating at 1 Hz: its
    /// share of one core against a bare peer, session assign/stop through
    /// the API, and a durable fencing-token bump against an in-memory one.
    Harness {
        /// Simulated executors, one row each (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1000,5000,10000")]
        executors: Vec<usize>,
        /// Seconds between connecting and measuring.
        #[arg(long, default_value_t = 5)]
        warmup_secs: u64,
        /// Seconds measured.
        #[arg(long, default_value_t = 10)]
        window_secs: u64,
        /// Seconds of session assign/stop pairs after each window (0: none).
        #[arg(long, default_value_t = 5)]
        assign_secs: u64,
        /// API callers in flight during assign/stop.
        #[arg(long, default_value_t = 16)]
        assign_concurrency: usize,
        /// An argument passed on to `bmx harness` (repeatable), e.g.
        /// `--harness-arg=--store --harness-arg=postgres://...`.
        #[arg(long = "harness-arg", allow_hyphen_values = true)]
        harness_args: Vec<String>,
        /// Skip the baseline peer.
        #[arg(long)]
        no_baseline: bool,
        /// Harness replicas over one PostgreSQL database (needs
        /// `--harness-arg=--store --harness-arg=postgres://...`), all on
        /// the server's core; the simulated executors are spread over them.
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// Token bumps of the fencing row.
        #[arg(long, default_value_t = 1_000_000)]
        fencing_ops: usize,
        #[arg(long)]
        json: bool,
    },
    /// The harness benchmark's baseline server.
    #[command(hide = true)]
    HarnessPeer {
        #[arg(long)]
        listen: String,
        #[arg(long)]
        tokens_file: std::path::PathBuf,
    },
    /// The harness benchmark's simulated executors.
    #[command(hide = true)]
    HarnessLoad {
        /// Executor i dials the i-th of these (comma-separated), round robin.
        #[arg(long)]
        url: String,
        #[arg(long)]
        api: String,
        #[arg(long)]
        executors: usize,
        #[arg(long)]
        warmup_secs: u64,
        #[arg(long)]
        window_secs: u64,
        #[arg(long)]
        assign_secs: u64,
        #[arg(long)]
        assign_concurrency: usize,
    },
    /// The benchmarks' producer: write N bytes to stdout.
    #[command(hide = true)]
    Produce {
        #[arg(long)]
        bytes: u64,
    },
}

/// Print a report as one JSON object or as its table.
fn report<R: serde::Serialize, E: std::fmt::Display>(
    name: &str,
    json: bool,
    result: Result<R, E>,
    table: impl FnOnce(&R) -> String,
) -> ExitCode {
    match result {
        Ok(r) if json => {
            println!("{}", serde_json::to_string(&r).unwrap_or_default());
            ExitCode::SUCCESS
        }
        Ok(r) => {
            print!("{}", table(&r));
            ExitCode::SUCCESS
        }
        Err(e) => {
            warn_line!("bmx bench {name}: {e}");
            ExitCode::from(1)
        }
    }
}

pub async fn run(cmd: BenchCommand) -> ExitCode {
    match cmd {
        BenchCommand::Produce { bytes } => match buffering::produce(bytes) {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::from(1),
        },
        BenchCommand::Buffering {
            bytes,
            pty_bytes,
            codec,
            read_bytes,
            window,
            runs,
            json,
        } => {
            let codecs = match codec {
                CodecChoice::Json => vec![Codec::Json],
                CodecChoice::Msgpack => vec![Codec::MsgPack],
                CodecChoice::Both => vec![Codec::Json, Codec::MsgPack],
            };
            let opts = buffering::BufferingOptions {
                bytes,
                read_bytes,
                runs,
                pty_bytes: pty_bytes.min(bytes),
                codecs,
                window,
            };
            report("buffering", json, buffering::run(&opts).await, |r| {
                r.table()
            })
        }
        BenchCommand::Computer {
            width,
            height,
            calls,
            json,
        } => {
            let opts = computer::ComputerOptions {
                width,
                height,
                calls: calls.max(1),
            };
            report("computer", json, computer::run(&opts).await, |r| r.table())
        }
        BenchCommand::Rfb { connects, json } => {
            let opts = rfb::RfbOptions {
                connects: connects.max(1),
            };
            report("rfb", json, rfb::run(&opts).await, |r| r.table())
        }
        BenchCommand::Mcp {
            command,
            calls,
            in_flight,
            warmup,
            json,
        } => {
            let opts = mcp::McpOptions {
                command,
                calls: calls.max(1),
                warmup,
                concurrency: in_flight.into_iter().filter(|&k| k > 0).collect(),
            };
            report("mcp", json, mcp::run(&opts).await, |r| r.table())
        }
        BenchCommand::Events {
            events,
            latency_events,
            in_flight,
            runs,
            store,
            json,
        } => {
            let opts = events::EventsOptions {
                events: events.max(1),
                latency_events: latency_events.max(1),
                in_flight: in_flight.max(1),
                runs,
                store,
            };
            report("events", json, events::run(&opts).await, |r| r.table())
        }
        BenchCommand::Turns {
            agent,
            chunks,
            paced,
            gap_ms,
            runs,
            json,
        } => {
            let opts = turns::TurnsOptions {
                agent,
                chunks: chunks.max(1),
                runs,
                paced: paced.max(1),
                gap_ms,
            };
            report("turns", json, turns::run(&opts).await, |r| r.table())
        }
        BenchCommand::Visor {
            bytes,
            runs,
            idle_sessions,
            subscribers,
            json,
        } => {
            let opts = visor::VisorOptions {
                bytes: bytes.max(1),
                runs,
                idle_sessions: idle_sessions.max(1),
                subscribers,
            };
            report("visor", json, visor::run(&opts).await, |r| r.table())
        }
        BenchCommand::Harness {
            executors,
            warmup_secs,
            window_secs,
            assign_secs,
            assign_concurrency,
            harness_args,
            no_baseline,
            replicas,
            fencing_ops,
            json,
        } => {
            let opts = harness::HarnessOptions {
                replicas: replicas.max(1),
                executors: executors.into_iter().filter(|&n| n > 0).collect(),
                warmup_secs,
                window_secs: window_secs.max(1),
                assign_secs,
                assign_concurrency: assign_concurrency.max(1),
                harness_args,
                fencing_ops,
                baseline: !no_baseline,
            };
            report("harness", json, harness::run(&opts).await, |r| r.table())
        }
        BenchCommand::HarnessPeer {
            listen,
            tokens_file,
        } => match harness::peer_main(&listen, &tokens_file).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                warn_line!("bmx bench harness-peer: {e}");
                ExitCode::from(1)
            }
        },
        BenchCommand::HarnessLoad {
            url,
            api,
            executors,
            warmup_secs,
            window_secs,
            assign_secs,
            assign_concurrency,
        } => {
            let opts = harness::LoadOptions {
                url,
                api,
                executors,
                warmup_secs,
                window_secs,
                assign_secs,
                assign_concurrency,
            };
            match harness::load_main(&opts).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    warn_line!("bmx bench harness-load: {e}");
                    ExitCode::from(1)
                }
            }
        }
        BenchCommand::Spawn { starts, json } => {
            report("spawn", json, spawn::run(starts.max(10)).await, |r| {
                r.table()
            })
        }
        BenchCommand::Scale {
            sessions,
            processes,
            sandbox,
            json,
        } => match scale::run(sessions, processes, sandbox).await {
            Ok(r) if json => {
                println!("{}", serde_json::to_string(&r).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Ok(r) => {
                println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(e) => {
                warn_line!("bmx bench scale: {e}");
                ExitCode::from(1)
            }
        },
    }
}
