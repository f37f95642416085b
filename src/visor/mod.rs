//! `bmx visor`: the local supervisor of agent and shell sessions
//! (VISOR.md). One daemon per home serves HTTP/1.1 and WebSocket on a 0600
//! Unix socket; every session is a supervised actor.
//!
//! ```text
//! visor root (supervisor)
//! └── sessions            owner: starts sessions, learns of their exits
//!     └── dynamic sup     restart type + budget per session = its restart policy
//!         └── session <id>  one run of the program: on a PTY (`session`)
//!                           or an ACP agent on stdio (`wire`)
//! ```
//!
//! A `confirm` bridge per local executor confirmation socket is a child of
//! the root too ([`confirm`]: held tool calls as `request` events).
//!
//! Beside the tree, not actors: the workdir registry ([`workdirs`], one
//! operation at a time behind an async lock) and observed sessions
//! ([`hooks`]: records with no process, fed by agents' hooks).
//!
//! Sans-IO cores: [`state`] (the session state machine), [`events`]
//! (numbering, retention, replay), [`lease`] (the writer lease). The HTTP
//! side ([`http`], [`attach`]) only parses, checks sizes and routes.

pub mod agents;
pub mod attach;
pub mod chat;
pub mod client;
pub mod confirm;
pub mod error;
pub mod events;
pub mod hooks;
pub mod http;
pub mod lease;
pub mod lock;
pub mod screen;
pub mod session;
pub mod sessions;
pub mod state;
pub mod types;
pub mod wire;
pub mod workdirs;

pub use error::VisorError;

use dashmap::DashMap;
use ractor::ActorRef;
use session::SessionData;
use sessions::{Sessions, SessionsMsg};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The daemon's shared state: addresses and read-mostly records. Each
/// session's record is written only by its own actor (or, once the actor
/// is gone for good, by the sessions owner).
pub struct Visor {
    pub home: PathBuf,
    pub socket: PathBuf,
    pub instance: String,
    pub build: String,
    pub hub: Arc<events::Hub>,
    pub sessions: DashMap<String, Arc<SessionData>>,
    pub owner: Mutex<Option<ActorRef<SessionsMsg>>>,
    pub shutdown: CancellationToken,
    /// Workdirs and projects (VISOR.md §5): one operation at a time.
    pub workdirs: tokio::sync::Mutex<workdirs::Workdirs>,
    /// Hook calls are taken one at a time (one observed session per
    /// vendor session, events in arrival order).
    pub hooks: tokio::sync::Mutex<()>,
    /// Observed sessions of executor confirmation sockets, by session id
    /// ([`confirm`]): `answer` on them goes to that socket.
    pub confirm_bridges: DashMap<String, ActorRef<confirm::BridgeMsg>>,
    closing: AtomicBool,
    next_client: AtomicU64,
}

impl Visor {
    pub fn new(home: PathBuf, socket: PathBuf) -> Arc<Visor> {
        Arc::new(Visor {
            workdirs: tokio::sync::Mutex::new(workdirs::Workdirs::new(home.clone())),
            hooks: tokio::sync::Mutex::new(()),
            confirm_bridges: DashMap::new(),
            home,
            socket,
            instance: uuid::Uuid::new_v4().simple().to_string(),
            build: env!("CARGO_PKG_VERSION").to_owned(),
            hub: events::Hub::new(events::RETAIN, events::RING),
            sessions: DashMap::new(),
            owner: Mutex::new(None),
            shutdown: CancellationToken::new(),
            closing: AtomicBool::new(false),
            next_client: AtomicU64::new(1),
        })
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    pub fn client_id(&self) -> u64 {
        self.next_client.fetch_add(1, Ordering::SeqCst)
    }

    pub fn owner(&self) -> Option<ActorRef<SessionsMsg>> {
        self.owner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The `BMX_SCOPE` prefix of every process this visor starts.
    pub fn scope_prefix(&self) -> String {
        format!("visor-{}", self.instance)
    }

    pub fn session_env(&self, id: &str, checked: &types::Checked) -> Vec<(String, String)> {
        vec![
            ("BMX_VISOR_SOCKET".into(), self.socket.display().to_string()),
            ("BMX_VISOR_SESSION".into(), id.to_owned()),
            (
                "BMX_VISOR_WORKDIR".into(),
                checked.cwd.display().to_string(),
            ),
        ]
    }

    pub fn session(&self, id: &str) -> Result<Arc<SessionData>, VisorError> {
        self.sessions
            .get(id)
            .map(|d| d.clone())
            .ok_or_else(|| VisorError::no_session(id))
    }
}

/// Where the visor lives: `--home`, else `$BMX_HOME`, else `~/.bmx`.
pub fn home_dir(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| std::env::var_os("BMX_HOME").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".bmx")))
        .unwrap_or_else(|| PathBuf::from(".bmx"))
}

/// The socket: `--socket`, else `<home>/visor.sock`.
pub fn socket_path(home: &Path, flag: Option<PathBuf>) -> PathBuf {
    flag.unwrap_or_else(|| home.join("visor.sock"))
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Lock(#[from] lock::LockError),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the visor's actors: {0}")]
    Spawn(String),
}

fn private_dir(path: &Path) -> Result<(), ServeError> {
    let io = |what, source| ServeError::Io {
        what,
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(path).map_err(|e| io("cannot create", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| io("cannot restrict", e))
}

/// Run the daemon until `stop` fires (SIGTERM/SIGINT in the CLI): take the
/// home lock, bind the socket, start the actors, serve; then end every
/// session (and its process tree) and remove the socket.
///
/// # Errors
/// The lock is held by another visor, or the home or socket cannot be set
/// up.
pub async fn serve(
    home: PathBuf,
    socket: PathBuf,
    confirm_sockets: Vec<PathBuf>,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), ServeError> {
    private_dir(&home)?;
    if let Some(parent) = socket.parent().filter(|p| !p.as_os_str().is_empty()) {
        if parent != home {
            private_dir(parent)?;
        }
    }
    let visor = Visor::new(home.clone(), socket.clone());
    let _lock = lock::acquire(&home, &visor.instance)?;
    // The workdir registry is read once the home is ours.
    match visor.workdirs.lock().await.load() {
        Ok(n) => tracing::debug!(workdirs = n, "workdir registry loaded"),
        Err(e) => tracing::warn!(error = %e, "workdir registry not loaded"),
    }
    crate::process::sys::become_subreaper();
    crate::process::sys::reserve_spare_fd();
    // We hold the lock: a socket file here is a dead visor's.
    if std::fs::symlink_metadata(&socket).is_ok() {
        let _ = std::fs::remove_file(&socket);
    }
    let io = |what, source| ServeError::Io {
        what,
        path: socket.clone(),
        source,
    };
    let listener = tokio::net::UnixListener::bind(&socket).map_err(|e| io("cannot bind", e))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io("cannot restrict", e))?;
    let mut children = vec![crate::supervisor::ChildSpec::restartable(
        "sessions",
        crate::supervisor::Restart::Permanent,
        Sessions,
        visor.clone(),
    )
    .shutdown_timeout(Duration::from_secs(25))];
    for (i, path) in confirm_sockets.into_iter().enumerate() {
        children.push(crate::supervisor::ChildSpec::restartable(
            format!("confirm-{i}"),
            crate::supervisor::Restart::Permanent,
            confirm::Bridge,
            (visor.clone(), path),
        ));
    }
    let (root, _exit) = crate::supervisor::Supervisor::start(crate::supervisor::SupervisorSpec {
        strategy: crate::supervisor::Strategy::OneForOne,
        intensity: Some(crate::supervisor::Intensity::default()),
        children,
    })
    .await
    .map_err(|e| ServeError::Spawn(e.to_string()))?;
    // Hooks spooled while no visor ran, in order, before any new call is
    // served (those wait in the socket's backlog).
    hooks::replay_spool(&visor).await;
    tracing::info!(home = %home.display(), socket = %socket.display(), instance = %visor.instance, "visor serving");
    let app = http::router(visor.clone());
    let token = visor.shutdown.clone();
    let server = tokio::spawn(async move {
        let _ = axum::serve(http::OwnUserOnly::new(listener), app)
            .with_graceful_shutdown(async move { token.cancelled().await })
            .await;
    });
    stop.await;
    tracing::info!("visor shutting down");
    visor.closing.store(true, Ordering::SeqCst);
    visor.shutdown.cancel();
    let _ = root
        .get_cell()
        .stop_and_wait(
            Some(crate::supervisor::SHUTDOWN.into()),
            Some(Duration::from_secs(30)),
        )
        .await;
    // Anything tagged by this visor that survived its session.
    let scope = visor.scope_prefix();
    let _ =
        tokio::task::spawn_blocking(move || crate::process::sys::kill_scope(None, &scope)).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}
