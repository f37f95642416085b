//! The display actor (issue 20, part 2): one virtual X display per session
//! that uses the computer tools, started with the session's first
//! `computer_*` call, a `temporary` child of the session that dies with it.
//!
//! The display is `Xvfb` from Debian on a free display number it picks
//! itself (`-displayfd 1`: it writes the number to its stdout), without
//! TCP. Screens are grabbed with a core `GetImage` and input goes through
//! the XTEST extension, both through `x11rb` (pure Rust, no libX11): one
//! dependency speaks the protocol instead of shelling out to `import` or
//! `xdotool` for every call. X calls block, so they run on the blocking
//! pool with a deadline.
//!
//! Xvfb carries the session's scope tag, so the session's final sweep kills
//! it with every X client the session's processes started.
//!
//! `display.rfb` (the display as VNC through the harness's relay) is in
//! [`rfb`]: x11vnc, started on the first request, is owned by this actor
//! and dies with it, as do the viewer streams (tasks of this actor).

pub mod rfb;

use crate::tools::computer::{self, Action};
use crate::tools::{Outcome as ToolOutcome, ToolOutput};
use crate::wire::types::ContentBlock;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use tokio::sync::oneshot;
use x11rb::connection::Connection;
use x11rb::protocol::xproto::{ConnectionExt as _, ImageFormat};
use x11rb::protocol::xtest::ConnectionExt as _;
use x11rb::rust_connection::RustConnection;
use x11rb::wrapper::ConnectionExt as _;

/// The virtual screen: big enough for desktop programs, small enough that
/// a grab stays a few megabytes.
pub const SCREEN: (u16, u16) = (1280, 800);
/// Time Xvfb has to say its display number and accept a connection.
const START: Duration = Duration::from_secs(10);
/// Time one observe or action may take.
const CALL: Duration = Duration::from_secs(10);

/// Whether an executable `name` is on `PATH`.
fn on_path(name: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::metadata(d.join(name))
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
    })
}

/// Whether `Xvfb` is on `PATH` (the capability is advertised only then).
pub fn xvfb_available() -> bool {
    on_path("Xvfb")
}

/// Whether `display.rfb` can work: `Xvfb` and `x11vnc` are on `PATH`
/// (`rfb: true` is advertised only then).
pub fn rfb_available() -> bool {
    xvfb_available() && on_path("x11vnc")
}

pub enum DisplayMsg {
    Observe {
        reply: oneshot::Sender<(ToolOutput, Vec<ContentBlock>)>,
    },
    Act {
        input: serde_json::Value,
        reply: oneshot::Sender<(ToolOutput, Vec<ContentBlock>)>,
    },
    /// `display.rfb`: relay this display's VNC to `host`; the stream
    /// answers `reply` once it has dialed.
    Rfb {
        host: crate::wire::types::AttachHost,
        reply: crate::wire::Responder,
    },
}

pub struct DisplayArgs {
    /// The session's scope tag (`BMX_SCOPE` of Xvfb).
    pub scope: String,
    /// The executor's child environment (Xvfb gets it, as every child).
    pub env: crate::process::env::ChildEnv,
}

/// A display as the session and its tool calls know it.
#[derive(Clone)]
pub struct DisplayHandle {
    pub actor: ActorRef<DisplayMsg>,
    /// `:N`, what `DISPLAY` is set to for the session's tools.
    pub name: String,
}

#[derive(Clone)]
pub struct Display;

pub struct DisplayState {
    xvfb: tokio::process::Child,
    x: Arc<Screen>,
    /// `:N`.
    name: String,
    /// Scope and environment, for x11vnc.
    args: DisplayArgs,
    /// x11vnc, from the first `display.rfb`.
    vnc: Option<rfb::Vnc>,
    /// The RFB viewer streams (at most [`rfb::MAX_STREAMS`]).
    streams: tokio::task::JoinSet<()>,
}

/// A connection to an X display: the screen grab and the XTEST input the
/// two tools use (public for `bmx bench computer`).
pub struct Screen {
    conn: Mutex<RustConnection>,
    root: u32,
    width: u16,
    height: u16,
    /// keysym → (keycode, shift) of the server's keymap.
    keymap: Vec<(u32, u8, bool)>,
}

#[derive(Debug, thiserror::Error)]
pub enum DisplayError {
    #[error("cannot start Xvfb: {0}")]
    Start(String),
    #[error("X: {0}")]
    X(String),
}

fn x_err(e: impl std::fmt::Display) -> DisplayError {
    DisplayError::X(e.to_string())
}

impl Screen {
    /// Connect to display `name` (`:N`) and read its keymap.
    ///
    /// # Errors
    /// No connection, no XTEST extension.
    pub fn connect(name: &str) -> Result<Screen, DisplayError> {
        let (conn, screen) = x11rb::connect(Some(name)).map_err(x_err)?;
        let s = &conn.setup().roots[screen];
        let (root, width, height) = (s.root, s.width_in_pixels, s.height_in_pixels);
        conn.xtest_get_version(2, 2)
            .map_err(x_err)?
            .reply()
            .map_err(|e| DisplayError::X(format!("no XTEST: {e}")))?;
        let (min, max) = (conn.setup().min_keycode, conn.setup().max_keycode);
        let map = conn
            .get_keyboard_mapping(min, max - min + 1)
            .map_err(x_err)?
            .reply()
            .map_err(x_err)?;
        let per = usize::from(map.keysyms_per_keycode.max(1));
        let mut keymap = Vec::new();
        for (i, syms) in map.keysyms.chunks(per).enumerate() {
            let code = min + i as u8;
            for (level, &sym) in syms.iter().take(2).enumerate() {
                if sym != 0 && !keymap.iter().any(|(s, _, _)| *s == sym) {
                    keymap.push((sym, code, level == 1));
                }
            }
        }
        Ok(Screen {
            conn: Mutex::new(conn),
            root,
            width,
            height,
            keymap,
        })
    }

    fn code(&self, keysym: u32) -> Result<(u8, bool), DisplayError> {
        // Letters given in upper case are the same key.
        self.keymap
            .iter()
            .find(|(s, _, _)| *s == keysym)
            .map(|(_, c, shift)| (*c, *shift))
            .ok_or_else(|| DisplayError::X(format!("no key for keysym {keysym:#x} in the keymap")))
    }

    /// The screen's size in pixels.
    pub fn size(&self) -> (u16, u16) {
        (self.width, self.height)
    }

    /// The whole screen as the X server sends it (`GetImage`, Z-pixmap):
    /// the bare grab `observe` starts with.
    ///
    /// # Errors
    /// The X request failed.
    pub fn grab(&self) -> Result<Vec<u8>, DisplayError> {
        let conn = self
            .conn
            .lock()
            .map_err(|_| DisplayError::X("poisoned".into()))?;
        let img = conn
            .get_image(
                ImageFormat::Z_PIXMAP,
                self.root,
                0,
                0,
                self.width,
                self.height,
                !0,
            )
            .map_err(x_err)?
            .reply()
            .map_err(x_err)?;
        Ok(img.data)
    }

    /// One XTEST pointer motion, waited for: the bare input call `act`
    /// is made of.
    ///
    /// # Errors
    /// The X request failed.
    pub fn nudge(&self, x: u16, y: u16) -> Result<(), DisplayError> {
        let conn = self
            .conn
            .lock()
            .map_err(|_| DisplayError::X("poisoned".into()))?;
        conn.xtest_fake_input(
            x11rb::protocol::xproto::MOTION_NOTIFY_EVENT,
            0,
            0,
            self.root,
            x as i16,
            y as i16,
            0,
        )
        .map_err(x_err)?;
        conn.sync().map_err(x_err)?;
        Ok(())
    }

    /// The screen as a PNG scaled to the bounded image size, and that size.
    ///
    /// # Errors
    /// The grab failed or the image was not what a depth-24 screen sends.
    pub fn observe(&self) -> Result<(Vec<u8>, u16, u16), DisplayError> {
        let data = self.grab()?;
        let (w, h) = (usize::from(self.width), usize::from(self.height));
        // Xvfb at depth 24 uses 32 bits per pixel, least significant byte
        // first: B, G, R, pad.
        if data.len() < w * h * 4 {
            return Err(DisplayError::X(format!(
                "unexpected image of {} bytes for {w}x{h}",
                data.len()
            )));
        }
        let mut rgb = Vec::with_capacity(w * h * 3);
        for px in data.chunks_exact(4).take(w * h) {
            rgb.extend_from_slice(&[px[2], px[1], px[0]]);
        }
        let (iw, ih) = computer::image_size(self.width, self.height);
        let scaled = computer::scale_rgb(&rgb, w, h, usize::from(iw), usize::from(ih));
        let mut png = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut png, u32::from(iw), u32::from(ih));
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            enc.set_compression(png::Compression::Fast);
            let mut wr = enc.write_header().map_err(x_err)?;
            wr.write_image_data(&scaled).map_err(x_err)?;
        }
        Ok((png, iw, ih))
    }

    /// Send `action` through XTEST; returns once the server has it all.
    ///
    /// # Errors
    /// A key the keymap lacks (nothing sent then), or the X request failed.
    pub fn act(&self, action: &Action) -> Result<(), DisplayError> {
        use x11rb::protocol::xproto::{
            BUTTON_PRESS_EVENT, BUTTON_RELEASE_EVENT, KEY_PRESS_EVENT, KEY_RELEASE_EVENT,
            MOTION_NOTIFY_EVENT,
        };
        // Resolve every key first: an action either happens whole or not.
        let keys: Vec<(u8, bool)> = match action {
            Action::Key { keysyms } | Action::Type { keysyms } => keysyms
                .iter()
                .map(|k| self.code(*k))
                .collect::<Result<_, _>>()?,
            _ => Vec::new(),
        };
        let shift = self.code(0xffe1)?.0;
        let conn = self
            .conn
            .lock()
            .map_err(|_| DisplayError::X("poisoned".into()))?;
        let fake = |kind: u8, detail: u8, x: i16, y: i16| {
            conn.xtest_fake_input(kind, detail, 0, self.root, x, y, 0)
                .map(|_| ())
                .map_err(x_err)
        };
        let motion = |x: u16, y: u16| fake(MOTION_NOTIFY_EVENT, 0, x as i16, y as i16);
        match action {
            Action::Click { x, y, button } => {
                motion(*x, *y)?;
                fake(BUTTON_PRESS_EVENT, *button, 0, 0)?;
                fake(BUTTON_RELEASE_EVENT, *button, 0, 0)?;
            }
            Action::Drag {
                x,
                y,
                to_x,
                to_y,
                button,
            } => {
                motion(*x, *y)?;
                fake(BUTTON_PRESS_EVENT, *button, 0, 0)?;
                motion(*to_x, *to_y)?;
                fake(BUTTON_RELEASE_EVENT, *button, 0, 0)?;
            }
            Action::Scroll { at, button, clicks } => {
                if let Some((x, y)) = at {
                    motion(*x, *y)?;
                }
                for _ in 0..*clicks {
                    fake(BUTTON_PRESS_EVENT, *button, 0, 0)?;
                    fake(BUTTON_RELEASE_EVENT, *button, 0, 0)?;
                }
            }
            Action::Key { .. } => {
                for (code, _) in &keys {
                    fake(KEY_PRESS_EVENT, *code, 0, 0)?;
                }
                for (code, _) in keys.iter().rev() {
                    fake(KEY_RELEASE_EVENT, *code, 0, 0)?;
                }
            }
            Action::Type { .. } => {
                for (code, shifted) in &keys {
                    if *shifted {
                        fake(KEY_PRESS_EVENT, shift, 0, 0)?;
                    }
                    fake(KEY_PRESS_EVENT, *code, 0, 0)?;
                    fake(KEY_RELEASE_EVENT, *code, 0, 0)?;
                    if *shifted {
                        fake(KEY_RELEASE_EVENT, shift, 0, 0)?;
                    }
                }
            }
        }
        // Every fake event reached the server before the call returns.
        conn.sync().map_err(x_err)?;
        Ok(())
    }
}

/// `Xvfb` on a display number it picks and writes to its stdout, no TCP,
/// one `width`×`height` screen at depth 24.
///
/// No abstract socket either (`-nolisten local`), only
/// `/tmp/.X11-unix/X<n>`: the session's sandbox scopes abstract Unix
/// sockets (Landlock), and libxcb falls back to the path socket only when
/// the abstract one is refused (`ECONNREFUSED`), not when it is forbidden
/// (`EPERM`).
pub fn xvfb_command(width: u16, height: u16) -> tokio::process::Command {
    let mut c = tokio::process::Command::new("Xvfb");
    c.args([
        "-displayfd",
        "1",
        "-screen",
        "0",
        &format!("{width}x{height}x24"),
        "-nolisten",
        "tcp",
        "-nolisten",
        "local",
        "-noreset",
    ]);
    c
}

/// Start Xvfb and learn its display number.
async fn start_xvfb(args: &DisplayArgs) -> Result<(tokio::process::Child, String), DisplayError> {
    let env = args
        .env
        .build(None, crate::process::env::Tty::No, &args.scope)
        .map_err(|e| DisplayError::Start(e.to_string()))?;
    let mut child = xvfb_command(SCREEN.0, SCREEN.1)
        .env_clear()
        .envs(env)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .process_group(0)
        .spawn()
        .map_err(|e| DisplayError::Start(e.to_string()))?;
    let name = display_name(&mut child).await?;
    Ok((child, name))
}

/// Read the display number Xvfb (started with `-displayfd 1` and a piped
/// stdout) writes once it listens: `:N`.
///
/// # Errors
/// Nothing said within the start deadline, or not a number.
pub async fn display_name(child: &mut tokio::process::Child) -> Result<String, DisplayError> {
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| DisplayError::Start("no stdout".into()))?;
    let mut line = String::new();
    let mut r = tokio::io::BufReader::new(stdout).take(64);
    let read = tokio::time::timeout(START, r.read_line(&mut line)).await;
    let n: u32 = match read {
        Ok(Ok(_)) => line
            .trim()
            .parse()
            .map_err(|_| DisplayError::Start(format!("Xvfb said {:?}", line.trim())))?,
        _ => return Err(DisplayError::Start("Xvfb did not say its display".into())),
    };
    Ok(format!(":{n}"))
}

use tokio::io::AsyncReadExt as _;

/// Run `f` on the blocking pool with the call deadline.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, DisplayError> + Send + 'static,
) -> Result<T, DisplayError> {
    match tokio::time::timeout(CALL, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(DisplayError::X(e.to_string())),
        Err(_) => Err(DisplayError::X(
            "the X server did not answer in time".into(),
        )),
    }
}

fn failed(e: impl std::fmt::Display, reason: &str) -> (ToolOutput, Vec<ContentBlock>) {
    (
        ToolOutput {
            outcome: ToolOutcome::Failed,
            is_error: true,
            text: e.to_string(),
            reason: Some(reason.to_owned()),
        },
        Vec::new(),
    )
}

impl Actor for Display {
    type Msg = DisplayMsg;
    type State = DisplayState;
    type Arguments = (DisplayArgs, oneshot::Sender<String>);

    async fn pre_start(
        &self,
        _myself: ActorRef<DisplayMsg>,
        (args, name_tx): (DisplayArgs, oneshot::Sender<String>),
    ) -> Result<DisplayState, ActorProcessingErr> {
        let (mut xvfb, name) = start_xvfb(&args).await?;
        let n = name.clone();
        let x = match blocking(move || {
            // Xvfb says its number once it listens; retry briefly anyway.
            let mut last = None;
            for _ in 0..50 {
                match Screen::connect(&n) {
                    Ok(x) => return Ok(x),
                    Err(e) => last = Some(e),
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(last.unwrap_or_else(|| DisplayError::Start("no connection".into())))
        })
        .await
        {
            Ok(x) => x,
            Err(e) => {
                let _ = xvfb.start_kill();
                return Err(e.into());
            }
        };
        tracing::info!(display = %name, "display started");
        let _ = name_tx.send(name.clone());
        Ok(DisplayState {
            xvfb,
            x: Arc::new(x),
            name,
            args,
            vnc: None,
            streams: tokio::task::JoinSet::new(),
        })
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<DisplayMsg>,
        state: &mut DisplayState,
    ) -> Result<(), ActorProcessingErr> {
        // The viewers, then x11vnc, then Xvfb's group and Xvfb itself; the
        // X clients lose their server and the session's sweep kills what
        // carries its tag.
        state.streams.abort_all();
        if let Some(mut vnc) = state.vnc.take() {
            vnc.stop().await;
        }
        if let Some(pid) = state.xvfb.id() {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = state.xvfb.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(2), state.xvfb.wait()).await;
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<DisplayMsg>,
        msg: DisplayMsg,
        state: &mut DisplayState,
    ) -> Result<(), ActorProcessingErr> {
        let x = state.x.clone();
        match msg {
            DisplayMsg::Observe { reply } => {
                let (w, h, name) = (x.width, x.height, state.name.clone());
                let out = match blocking(move || x.observe()).await {
                    Ok((png, iw, ih)) => {
                        let image = ContentBlock {
                            kind: crate::wire::types::ContentType::Image,
                            text: None,
                            data: Some(base64_simd::STANDARD.encode_to_string(&png)),
                            mime_type: Some("image/png".into()),
                            url: None,
                            artifact_id: None,
                        };
                        (
                            ToolOutput::success(format!(
                                "display {name}, screen {w}x{h}, image {iw}x{ih} (x and y of computer_action are screen pixels)"
                            )),
                            vec![image],
                        )
                    }
                    Err(e) => failed(e, "display_error"),
                };
                let _ = reply.send(out);
            }
            DisplayMsg::Act { input, reply } => {
                let out = match computer::parse_action(&input, x.width, x.height) {
                    Err(e) => failed(e, "invalid_input"),
                    Ok(action) => match blocking(move || x.act(&action)).await {
                        Ok(()) => (ToolOutput::success("done"), Vec::new()),
                        Err(e @ DisplayError::X(_)) if e.to_string().contains("no key") => {
                            failed(e, "invalid_input")
                        }
                        Err(e) => failed(e, "display_error"),
                    },
                };
                let _ = reply.send(out);
            }
            DisplayMsg::Rfb { host, reply } => self.rfb(state, host, reply).await,
        }
        Ok(())
    }
}

impl Display {
    /// Start a viewer stream: x11vnc first if it is not running (it may
    /// have died: then a new one), then a task that dials the relay.
    async fn rfb(
        &self,
        state: &mut DisplayState,
        host: crate::wire::types::AttachHost,
        reply: crate::wire::Responder,
    ) {
        while state.streams.try_join_next().is_some() {}
        if state.streams.len() >= rfb::MAX_STREAMS {
            return reply.err(rfb::RfbError::Full.rpc());
        }
        let running = state.vnc.as_mut().map(|v| (v.alive(), v.socket()));
        let socket = match running {
            Some((true, socket)) => socket,
            _ => {
                if let Some(mut dead) = state.vnc.take() {
                    dead.stop().await;
                }
                let env = match state.args.env.build(
                    None,
                    crate::process::env::Tty::No,
                    &state.args.scope,
                ) {
                    Ok(env) => env,
                    Err(e) => return reply.err(rfb::RfbError::Start(e.to_string()).rpc()),
                };
                match rfb::Vnc::start(&state.name, env).await {
                    Ok(v) => {
                        let socket = v.socket();
                        state.vnc = Some(v);
                        socket
                    }
                    Err(e) => {
                        tracing::warn!(display = %state.name, error = %e, "no VNC server");
                        return reply.err(e.rpc());
                    }
                }
            }
        };
        let span = tracing::info_span!("rfb", display = %state.name);
        state.streams.spawn(tracing::Instrument::instrument(
            rfb::serve(socket, host, state.name.clone(), reply),
            span,
        ));
    }
}
