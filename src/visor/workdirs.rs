//! Workdirs and projects (VISOR.md §5): the folders sessions work in —
//! a project's own folder, its repository's main worktree, or a git
//! worktree of its own on its own branch — and the projects they belong
//! to.
//!
//! [`Registry`] is the sans-IO part: records, idempotency (by project,
//! kind and name), bounds and the removal rule ([`removal_allowed`]).
//! [`Workdirs`] wraps it with the I/O: canonical paths, `git` as a child process with a
//! deadline and a clean environment, and the registry file
//! `<home>/workdirs.json` (written whole, atomically), so the registry
//! survives a visor restart.
//!
//! The visor keeps one `Workdirs` behind an async lock: an operation
//! (including its git commands) runs alone, so two creates of one name
//! make one worktree, and a session that starts in a workdir holds the
//! lock until it has started, so the workdir cannot be archived under it.

use super::{Visor, VisorError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Projects the registry holds.
pub const MAX_PROJECTS: usize = 256;
/// Workdirs the registry holds (all projects, archived ones included).
pub const MAX_WORKDIRS: usize = 1024;
/// Largest registry file read.
const MAX_FILE: u64 = 4 << 20;
/// Longest path accepted for a project.
const MAX_PATH: usize = 4096;
/// How long one git command may take; its process group is killed after.
pub const GIT_DEADLINE: Duration = Duration::from_secs(30);
/// Output of one git command kept (each of stdout, stderr).
const GIT_OUTPUT: u64 = 1 << 20;
/// The registry file, in the visor's home.
pub const FILE: &str = "workdirs.json";
/// Where worktree workdirs live: `<home>/worktrees/<project id>/<name>`.
pub const WORKTREES: &str = "worktrees";
/// The branch of a worktree workdir when the request names none.
pub const BRANCH_PREFIX: &str = "bmx/";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkdirKind {
    /// The project's folder itself; no git needed.
    Folder,
    /// The main worktree of the project's git repository.
    Main,
    /// A git worktree of the project's repository on its own branch.
    Worktree,
}

impl WorkdirKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkdirKind::Folder => "folder",
            WorkdirKind::Main => "main",
            WorkdirKind::Worktree => "worktree",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkdirState {
    Active,
    Archived,
}

/// `Workdir` (VISOR.md §5). `project` is the project's canonical path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Workdir {
    pub id: String,
    pub project: String,
    pub project_id: String,
    pub kind: WorkdirKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    pub state: WorkdirState,
    pub created_at: String,
    pub updated_at: String,
}

/// A project: a folder that workdirs were made of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Project {
    pub id: String,
    pub path: String,
    pub name: String,
    pub created_at: String,
}

/// `POST /v1/workdirs`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSpec {
    pub project: String,
    pub kind: WorkdirKind,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub branch: Option<String>,
}

/// What the registry file holds.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Stored {
    version: u32,
    projects: Vec<Project>,
    workdirs: Vec<Workdir>,
}

fn invalid(m: impl Into<String>) -> VisorError {
    VisorError::Invalid(m.into())
}

/// A workdir name: 1-64 of `A-Z a-z 0-9 - _ .`, not starting with `.` or
/// `-` (it names a directory and a branch).
pub fn valid_name(n: &str) -> bool {
    super::agents::valid_name(n) && !n.starts_with(['.', '-'])
}

/// A branch name git would take (the rules of `git check-ref-format
/// --branch` that matter here), at most 200 bytes.
pub fn valid_branch(b: &str) -> bool {
    !b.is_empty()
        && b.len() <= 200
        && !b.starts_with(['-', '/', '.'])
        && !b.ends_with(['/', '.'])
        && !b.ends_with(".lock")
        && !b.contains("..")
        && !b.contains("//")
        && !b.contains("@{")
        && !b.contains("/.")
        && b != "@"
        && b.chars().all(|c| {
            !c.is_control()
                && !c.is_whitespace()
                && !matches!(c, '~' | '^' | ':' | '?' | '*' | '[' | '\\')
        })
}

/// The removal rule of archive and delete (VISOR.md §5): refused while a
/// live session uses the workdir or its worktree has uncommitted changes,
/// unless `force`.
///
/// # Errors
/// `state` (409) naming the sessions, or saying the changes are there.
pub fn removal_allowed(users: &[String], dirty: bool, force: bool) -> Result<(), VisorError> {
    if force {
        return Ok(());
    }
    if !users.is_empty() {
        return Err(VisorError::State(format!(
            "the workdir is used by live session(s) {}; stop them, or use force",
            users.join(", ")
        )));
    }
    if dirty {
        return Err(VisorError::State(
            "the worktree has uncommitted changes; commit or discard them, or use force".into(),
        ));
    }
    Ok(())
}

/// A project's id: `p-` and 12 hex digits of the SHA-256 of its canonical
/// path, so forgetting a project and using it again gives the same id.
pub fn project_id(path: &str) -> String {
    use sha2::Digest;
    use std::fmt::Write as _;
    let d = sha2::Sha256::digest(path.as_bytes());
    let mut id = String::from("p-");
    for b in d.iter().take(6) {
        let _ = write!(id, "{b:02x}");
    }
    id
}

/// The records, their keys and bounds; no I/O.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    projects: Vec<Project>,
    workdirs: Vec<Workdir>,
}

impl Registry {
    pub fn workdirs(&self) -> &[Workdir] {
        &self.workdirs
    }

    pub fn projects(&self) -> &[Project] {
        &self.projects
    }

    pub fn get(&self, id: &str) -> Option<&Workdir> {
        self.workdirs.iter().find(|w| w.id == id)
    }

    /// The workdir of `project` + `kind` + `name` (the idempotency key).
    pub fn find(&self, project: &str, kind: WorkdirKind, name: Option<&str>) -> Option<&Workdir> {
        self.workdirs
            .iter()
            .find(|w| w.project == project && w.kind == kind && w.name.as_deref() == name)
    }

    /// An active workdir whose folder is `dir` or holds it (the innermost).
    pub fn containing(&self, dir: &Path) -> Option<&Workdir> {
        self.workdirs
            .iter()
            .filter(|w| w.state == WorkdirState::Active && dir.starts_with(&w.path))
            .max_by_key(|w| w.path.len())
    }

    /// May a new workdir (and maybe a new project) be added?
    ///
    /// # Errors
    /// `busy` past [`MAX_WORKDIRS`] or [`MAX_PROJECTS`].
    pub fn room_for(&self, project: &str) -> Result<(), VisorError> {
        if self.workdirs.len() >= MAX_WORKDIRS {
            return Err(VisorError::Busy(format!(
                "at most {MAX_WORKDIRS} workdirs; remove some first"
            )));
        }
        if !self.projects.iter().any(|p| p.path == project) && self.projects.len() >= MAX_PROJECTS {
            return Err(VisorError::Busy(format!(
                "at most {MAX_PROJECTS} projects; forget some first"
            )));
        }
        Ok(())
    }

    /// Add a workdir, and its project when new.
    pub fn insert(&mut self, wd: Workdir, now: &str) {
        if !self.projects.iter().any(|p| p.id == wd.project_id) {
            let name = Path::new(&wd.project)
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| wd.project.clone());
            self.projects.push(Project {
                id: wd.project_id.clone(),
                path: wd.project.clone(),
                name,
                created_at: now.to_owned(),
            });
        }
        self.workdirs.push(wd);
    }

    pub fn set_state(&mut self, id: &str, state: WorkdirState, now: &str) -> Option<Workdir> {
        let w = self.workdirs.iter_mut().find(|w| w.id == id)?;
        w.state = state;
        w.updated_at = now.to_owned();
        Some(w.clone())
    }

    pub fn remove(&mut self, id: &str) -> Option<Workdir> {
        let i = self.workdirs.iter().position(|w| w.id == id)?;
        Some(self.workdirs.remove(i))
    }

    /// Forget a project and its workdirs' records; the workdirs forgotten.
    pub fn forget(&mut self, project_id: &str) -> Option<(Project, Vec<Workdir>)> {
        let i = self.projects.iter().position(|p| p.id == project_id)?;
        let p = self.projects.remove(i);
        let (gone, keep) = std::mem::take(&mut self.workdirs)
            .into_iter()
            .partition(|w| w.project_id == project_id);
        self.workdirs = keep;
        Some((p, gone))
    }
}

/// One git command's result.
#[derive(Debug)]
pub struct GitOut {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

impl GitOut {
    /// The failure as a `state` error: git refused what was asked.
    fn refused(&self, what: &str) -> VisorError {
        let msg: String = self.stderr.trim().chars().take(2000).collect();
        VisorError::State(format!("git {what} failed: {msg}"))
    }
}

async fn read_bounded<R: tokio::io::AsyncRead + Unpin>(r: Option<R>) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Some(r) = r {
        let _ = r.take(GIT_OUTPUT).read_to_end(&mut buf).await;
    }
    buf
}

/// Run `git -C dir args…` with a clean environment (`PATH`, `HOME`, the C
/// locale, no prompts), in its own process group, within
/// [`GIT_DEADLINE`] (the group is killed past it).
///
/// # Errors
/// `unsupported` when git cannot be run at all; `state` past the deadline.
pub async fn git(dir: &Path, args: &[&str]) -> Result<GitOut, VisorError> {
    let mut cmd = tokio::process::Command::new("git");
    cmd.arg("-C").arg(dir).args(args).env_clear();
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/local/bin:/usr/bin:/bin".into());
    cmd.env("PATH", path);
    if let Some(home) = std::env::var_os("HOME") {
        cmd.env("HOME", home);
    }
    cmd.env("LC_ALL", "C")
        .env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_OPTIONAL_LOCKS", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = cmd
        .spawn()
        .map_err(|e| VisorError::Unsupported(format!("cannot run git: {e}")))?;
    let pid = child.id();
    let (out, err) = (child.stdout.take(), child.stderr.take());
    let work = async {
        let (o, e) = tokio::join!(read_bounded(out), read_bounded(err));
        (o, e, child.wait().await)
    };
    match tokio::time::timeout(GIT_DEADLINE, work).await {
        Ok((o, e, status)) => Ok(GitOut {
            ok: status.is_ok_and(|s| s.success()),
            stdout: String::from_utf8_lossy(&o).into_owned(),
            stderr: String::from_utf8_lossy(&e).into_owned(),
        }),
        Err(_) => {
            if let Some(pid) = pid {
                crate::process::sys::signal_group(pid as i32, nix::sys::signal::Signal::SIGKILL);
            }
            Err(VisorError::State(format!(
                "git {} did not finish within {} s",
                args.first().copied().unwrap_or(""),
                GIT_DEADLINE.as_secs()
            )))
        }
    }
}

/// Does the worktree at `path` have uncommitted changes (untracked files
/// included: removing the folder would lose them)? A folder that is gone
/// has nothing to lose.
pub async fn dirty(path: &Path) -> Result<bool, VisorError> {
    if !path.is_dir() {
        return Ok(false);
    }
    let out = git(path, &["status", "--porcelain", "--untracked-files=normal"]).await?;
    if !out.ok {
        return Err(out.refused("status"));
    }
    Ok(!out.stdout.trim().is_empty())
}

/// The registry with its file and its git operations.
#[derive(Debug)]
pub struct Workdirs {
    home: PathBuf,
    reg: Registry,
}

impl Workdirs {
    /// An empty registry for `home`; [`Workdirs::load`] reads the file
    /// (once the home's lock is held).
    pub fn new(home: PathBuf) -> Workdirs {
        Workdirs {
            home,
            reg: Registry::default(),
        }
    }

    pub fn registry(&self) -> &Registry {
        &self.reg
    }

    fn file(&self) -> PathBuf {
        self.home.join(FILE)
    }

    /// Read `<home>/workdirs.json`. A file that cannot be read as a
    /// registry is moved aside (`workdirs.json.bad`) and the registry
    /// starts empty: the visor still serves, and the file is kept for a
    /// person to look at.
    ///
    /// # Errors
    /// What was wrong with the file (already moved aside), to be logged.
    pub fn load(&mut self) -> Result<usize, String> {
        let file = self.file();
        let text = match std::fs::metadata(&file) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(format!("{}: {e}", file.display())),
            Ok(m) if m.len() > MAX_FILE => Err(format!("larger than {MAX_FILE} bytes")),
            Ok(_) => std::fs::read(&file).map_err(|e| e.to_string()),
        };
        let parsed = text.and_then(|t| {
            let s: Stored = serde_json::from_slice(&t).map_err(|e| e.to_string())?;
            if s.version != 1 {
                return Err(format!("unknown version {}", s.version));
            }
            if s.workdirs.len() > MAX_WORKDIRS || s.projects.len() > MAX_PROJECTS {
                return Err("more records than the bounds allow".into());
            }
            Ok(s)
        });
        match parsed {
            Ok(s) => {
                self.reg = Registry {
                    projects: s.projects,
                    workdirs: s.workdirs,
                };
                Ok(self.reg.workdirs.len())
            }
            Err(e) => {
                let aside = self.home.join(format!("{FILE}.bad"));
                let _ = std::fs::rename(&file, &aside);
                Err(format!(
                    "{}: {e} (moved to {}; the registry starts empty)",
                    file.display(),
                    aside.display()
                ))
            }
        }
    }

    /// Write the registry whole: a temporary file, fsync, rename.
    fn save(&self) -> Result<(), VisorError> {
        let stored = Stored {
            version: 1,
            projects: self.reg.projects.clone(),
            workdirs: self.reg.workdirs.clone(),
        };
        let fail = |e: std::io::Error| {
            VisorError::Internal(format!("cannot write {}: {e}", self.file().display()))
        };
        let text = serde_json::to_vec_pretty(&stored)
            .map_err(|e| VisorError::Internal(format!("cannot encode the registry: {e}")))?;
        let mut tmp = tempfile::NamedTempFile::new_in(&self.home).map_err(fail)?;
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(fail)?;
        tmp.write_all(&text).map_err(fail)?;
        tmp.as_file().sync_all().map_err(fail)?;
        tmp.persist(self.file()).map_err(|e| fail(e.error))?;
        Ok(())
    }

    /// `GET /v1/projects`: each project with its workdir count.
    pub fn projects_view(&self) -> Value {
        let list: Vec<Value> = self
            .reg
            .projects
            .iter()
            .map(|p| {
                let n = self
                    .reg
                    .workdirs
                    .iter()
                    .filter(|w| w.project_id == p.id)
                    .count();
                json!({"id": p.id, "path": p.path, "name": p.name, "createdAt": p.created_at, "workdirs": n})
            })
            .collect();
        json!({ "projects": list })
    }

    /// The working directory of a session started with `workdir: id`:
    /// the workdir's path, or `working_dir` when it lies inside it.
    ///
    /// # Errors
    /// `invalid` for an unknown workdir or a `working_dir` outside it;
    /// `state` for an archived one.
    pub fn session_dir(&self, id: &str, working_dir: Option<&str>) -> Result<String, VisorError> {
        if id.len() > 64 {
            return Err(invalid("workdir is an id (w- and 12 hex digits)"));
        }
        let wd = self
            .reg
            .get(id)
            .ok_or_else(|| invalid(format!("no workdir {id:?}")))?;
        if wd.state != WorkdirState::Active {
            return Err(VisorError::State(format!(
                "workdir {id} is archived; restore it first"
            )));
        }
        match working_dir {
            None => Ok(wd.path.clone()),
            Some(p) if Path::new(p).starts_with(&wd.path) => Ok(p.to_owned()),
            Some(p) => Err(invalid(format!(
                "workingDir {p} is not inside workdir {id} ({})",
                wd.path
            ))),
        }
    }

    /// `POST /v1/workdirs`: the workdir, and whether it was made now
    /// (`false`: it existed, the call is idempotent).
    ///
    /// # Errors
    /// `invalid` for a bad spec, a project that is not a directory, or a
    /// git kind on a folder outside any repository; `state` when git
    /// refuses or the key exists on another branch; `busy` past the bounds.
    pub async fn create(&mut self, spec: CreateSpec) -> Result<(Workdir, bool), VisorError> {
        if spec.project.is_empty() || spec.project.len() > MAX_PATH || spec.project.contains('\0') {
            return Err(invalid(format!(
                "project is a path of 1..={MAX_PATH} bytes"
            )));
        }
        if !Path::new(&spec.project).is_absolute() {
            return Err(invalid(format!(
                "project {} is not an absolute path",
                spec.project
            )));
        }
        if let Some(n) = spec.name.as_deref().filter(|n| !valid_name(n)) {
            return Err(invalid(format!(
                "name {n:?}: 1-64 of A-Z a-z 0-9 - _ ., not starting with . or -"
            )));
        }
        if let Some(b) = &spec.branch {
            if spec.kind != WorkdirKind::Worktree {
                return Err(invalid("branch is for worktree workdirs"));
            }
            if !valid_branch(b) {
                return Err(invalid(format!("branch {b:?} is not a valid branch name")));
            }
        }
        let canon = tokio::fs::canonicalize(&spec.project)
            .await
            .ok()
            .filter(|p| p.is_dir())
            .ok_or_else(|| invalid(format!("project {} is not a directory", spec.project)))?;
        let project = canon.display().to_string();
        if let Some(w) = self.reg.find(&project, spec.kind, spec.name.as_deref()) {
            if spec.branch.is_some() && spec.branch != w.branch {
                return Err(VisorError::State(format!(
                    "workdir {} ({}) exists on branch {}",
                    w.id,
                    w.name.as_deref().unwrap_or(""),
                    w.branch.as_deref().unwrap_or("(none)")
                )));
            }
            return Ok((w.clone(), false));
        }
        self.reg.room_for(&project)?;
        let pid = project_id(&project);
        let (path, branch, name) = match spec.kind {
            WorkdirKind::Folder => (project.clone(), None, spec.name.clone()),
            WorkdirKind::Main => {
                let (main, branch) = main_worktree(&canon).await?;
                (main, branch, spec.name.clone())
            }
            WorkdirKind::Worktree => {
                let name = spec.name.clone().unwrap_or_else(|| {
                    format!("wt-{}", &uuid::Uuid::new_v4().simple().to_string()[..8])
                });
                let branch = spec
                    .branch
                    .clone()
                    .unwrap_or_else(|| format!("{BRANCH_PREFIX}{name}"));
                let path = self.add_worktree(&canon, &pid, &name, &branch).await?;
                (path, Some(branch), Some(name))
            }
        };
        let now = crate::wire::types::now_rfc3339();
        let wd = Workdir {
            id: format!("w-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            project,
            project_id: pid,
            kind: spec.kind,
            name,
            path,
            branch,
            state: WorkdirState::Active,
            created_at: now.clone(),
            updated_at: now.clone(),
        };
        self.reg.insert(wd.clone(), &now);
        self.save()?;
        Ok((wd, true))
    }

    /// `git worktree add` of a new worktree workdir; its canonical path.
    async fn add_worktree(
        &self,
        project: &Path,
        pid: &str,
        name: &str,
        branch: &str,
    ) -> Result<String, VisorError> {
        let top = git(project, &["rev-parse", "--show-toplevel"]).await?;
        if !top.ok {
            return Err(invalid(format!(
                "project {} is not in a git repository: a worktree workdir needs one",
                project.display()
            )));
        }
        let parent = self.home.join(WORKTREES).join(pid);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&parent)
            .map_err(|e| {
                VisorError::Internal(format!("cannot create {}: {e}", parent.display()))
            })?;
        let path = parent.join(name);
        if std::fs::symlink_metadata(&path).is_ok() {
            return Err(VisorError::State(format!(
                "{} exists already (a workdir forgotten earlier?); remove it first",
                path.display()
            )));
        }
        let p = path.display().to_string();
        let exists = git(
            project,
            &[
                "rev-parse",
                "--verify",
                "--quiet",
                &format!("refs/heads/{branch}"),
            ],
        )
        .await?
        .ok;
        let out = if exists {
            git(project, &["worktree", "add", "--", &p, branch]).await?
        } else {
            git(project, &["worktree", "add", "-b", branch, "--", &p]).await?
        };
        if !out.ok {
            return Err(out.refused("worktree add"));
        }
        Ok(std::fs::canonicalize(&path)
            .map(|c| c.display().to_string())
            .unwrap_or(p))
    }

    /// `POST /v1/workdirs/{id}/archive`: a worktree's folder is removed
    /// (`git worktree remove`), its branch kept; other kinds only change
    /// state. `users`: the live sessions using it.
    ///
    /// # Errors
    /// `not_found`; `state` when archived already, by the removal rule, or
    /// when git refuses.
    pub async fn archive(
        &mut self,
        id: &str,
        users: &[String],
        force: bool,
    ) -> Result<Workdir, VisorError> {
        let wd = self
            .reg
            .get(id)
            .cloned()
            .ok_or_else(|| VisorError::NotFound(format!("no workdir {id:?}")))?;
        if wd.state == WorkdirState::Archived {
            return Err(VisorError::State(format!(
                "workdir {id} is archived already"
            )));
        }
        let is_tree = wd.kind == WorkdirKind::Worktree;
        let dirty = is_tree && !force && dirty(Path::new(&wd.path)).await?;
        removal_allowed(users, dirty, force)?;
        if is_tree {
            remove_worktree(&wd, force).await?;
        }
        let now = crate::wire::types::now_rfc3339();
        let wd = self
            .reg
            .set_state(id, WorkdirState::Archived, &now)
            .ok_or_else(|| VisorError::NotFound(format!("no workdir {id:?}")))?;
        self.save()?;
        Ok(wd)
    }

    /// `POST /v1/workdirs/{id}/restore`: a worktree is added again on its
    /// branch at its path.
    ///
    /// # Errors
    /// `not_found`; `state` when active, or when git refuses (its branch
    /// was deleted, the path is taken).
    pub async fn restore(&mut self, id: &str) -> Result<Workdir, VisorError> {
        let wd = self
            .reg
            .get(id)
            .cloned()
            .ok_or_else(|| VisorError::NotFound(format!("no workdir {id:?}")))?;
        if wd.state == WorkdirState::Active {
            return Err(VisorError::State(format!("workdir {id} is not archived")));
        }
        let project = Path::new(&wd.project);
        match (wd.kind, &wd.branch) {
            (WorkdirKind::Worktree, Some(branch)) => {
                if !project.is_dir() {
                    return Err(VisorError::State(format!(
                        "the project {} is gone",
                        wd.project
                    )));
                }
                let _ = git(project, &["worktree", "prune"]).await?;
                let out = git(project, &["worktree", "add", "--", &wd.path, branch]).await?;
                if !out.ok {
                    return Err(out.refused("worktree add"));
                }
            }
            _ => {
                if !Path::new(&wd.path).is_dir() {
                    return Err(VisorError::State(format!("{} is gone", wd.path)));
                }
            }
        }
        let now = crate::wire::types::now_rfc3339();
        let wd = self
            .reg
            .set_state(id, WorkdirState::Active, &now)
            .ok_or_else(|| VisorError::NotFound(format!("no workdir {id:?}")))?;
        self.save()?;
        Ok(wd)
    }

    /// `DELETE /v1/workdirs/{id}`: an active worktree's folder is removed
    /// (its branch kept: commits are never deleted); the record goes.
    ///
    /// # Errors
    /// `not_found`; `state` by the removal rule or when git refuses.
    pub async fn remove(
        &mut self,
        id: &str,
        users: &[String],
        force: bool,
    ) -> Result<Workdir, VisorError> {
        let wd = self
            .reg
            .get(id)
            .cloned()
            .ok_or_else(|| VisorError::NotFound(format!("no workdir {id:?}")))?;
        let tree = wd.kind == WorkdirKind::Worktree && wd.state == WorkdirState::Active;
        let dirty = tree && !force && dirty(Path::new(&wd.path)).await?;
        removal_allowed(users, dirty, force)?;
        if tree {
            remove_worktree(&wd, force).await?;
        } else if wd.kind == WorkdirKind::Worktree && Path::new(&wd.project).is_dir() {
            let _ = git(Path::new(&wd.project), &["worktree", "prune"]).await;
        }
        let wd = self
            .reg
            .remove(id)
            .ok_or_else(|| VisorError::NotFound(format!("no workdir {id:?}")))?;
        self.save()?;
        Ok(wd)
    }

    /// `DELETE /v1/projects/{id}`: forget the project and its workdirs'
    /// records; no file is touched (worktrees stay on disk and in git).
    /// `users`: the live sessions using each workdir.
    ///
    /// # Errors
    /// `not_found`; `state` while a live session uses one of its workdirs.
    pub fn forget(
        &mut self,
        id: &str,
        users: impl Fn(&Workdir) -> Vec<String>,
    ) -> Result<Value, VisorError> {
        if !self.reg.projects.iter().any(|p| p.id == id) {
            return Err(VisorError::NotFound(format!("no project {id:?}")));
        }
        let busy: Vec<String> = self
            .reg
            .workdirs
            .iter()
            .filter(|w| w.project_id == id)
            .flat_map(&users)
            .collect();
        removal_allowed(&busy, false, false)?;
        let (p, gone) = self
            .reg
            .forget(id)
            .ok_or_else(|| VisorError::NotFound(format!("no project {id:?}")))?;
        self.save()?;
        let ids: Vec<&str> = gone.iter().map(|w| w.id.as_str()).collect();
        Ok(json!({"forgotten": p.id, "path": p.path, "workdirs": ids}))
    }
}

/// The main worktree of the repository `dir` is in, and its branch
/// (`None` when detached).
async fn main_worktree(dir: &Path) -> Result<(String, Option<String>), VisorError> {
    let out = git(dir, &["worktree", "list", "--porcelain"]).await?;
    if !out.ok {
        return Err(invalid(format!(
            "project {} is not in a git repository: a main workdir needs one",
            dir.display()
        )));
    }
    // The first entry is the main worktree.
    let first = out.stdout.split("\n\n").next().unwrap_or("");
    let mut path = None;
    let mut branch = None;
    for line in first.lines() {
        if let Some(p) = line.strip_prefix("worktree ") {
            path = Some(p.to_owned());
        } else if let Some(b) = line.strip_prefix("branch refs/heads/") {
            branch = Some(b.to_owned());
        } else if line == "bare" {
            return Err(invalid(format!(
                "the repository of {} is bare: it has no main worktree",
                dir.display()
            )));
        }
    }
    let path = path.ok_or_else(|| invalid("git worktree list gave no main worktree"))?;
    Ok((path, branch))
}

/// `git worktree remove` (with `--force` when forced); a folder already
/// gone is pruned instead.
async fn remove_worktree(wd: &Workdir, force: bool) -> Result<(), VisorError> {
    let project = Path::new(&wd.project);
    if !project.is_dir() {
        // The repository is gone: only the folder is left to remove.
        if force {
            let _ = std::fs::remove_dir_all(&wd.path);
            return Ok(());
        }
        return Err(VisorError::State(format!(
            "the project {} is gone; use force to remove the folder",
            wd.project
        )));
    }
    if !Path::new(&wd.path).exists() {
        let _ = git(project, &["worktree", "prune"]).await?;
        return Ok(());
    }
    let mut args = vec!["worktree", "remove"];
    if force {
        args.push("--force");
    }
    args.extend(["--", wd.path.as_str()]);
    let out = git(project, &args).await?;
    if !out.ok {
        return Err(out.refused("worktree remove"));
    }
    Ok(())
}

/// The live sessions that use `wd`: started with `workdir: id`, or whose
/// working directory (as given) is its folder or inside it.
pub fn users(v: &Visor, wd: &Workdir) -> Vec<String> {
    let root = Path::new(&wd.path);
    let mut out: Vec<String> = v
        .sessions
        .iter()
        .filter(|d| d.state().live())
        .filter(|d| {
            d.checked.spec.workdir.as_deref() == Some(wd.id.as_str())
                || d.checked.cwd.starts_with(root)
        })
        .map(|d| d.id.clone())
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn wd(id: &str, project: &str, kind: WorkdirKind, name: Option<&str>) -> Workdir {
        Workdir {
            id: id.into(),
            project: project.into(),
            project_id: project_id(project),
            kind,
            name: name.map(str::to_owned),
            path: format!("{project}/{}", name.unwrap_or("")),
            branch: None,
            state: WorkdirState::Active,
            created_at: String::new(),
            updated_at: String::new(),
        }
    }

    #[test]
    fn names_and_branches() {
        assert!(valid_name("feat-1.x_y"));
        for n in ["-x", ".x", "a/b", ""] {
            assert!(!valid_name(n), "{n}");
        }
        assert!(valid_branch("bmx/feat-1"));
        for b in [
            "-x", "a..b", "a b", "a:b", "x.lock", "a/", "a//b", "@", "a@{1}", "a/.b",
        ] {
            assert!(!valid_branch(b), "{b}");
        }
    }

    #[test]
    fn the_removal_rule() {
        let users = vec!["s-1".to_owned()];
        assert!(matches!(
            removal_allowed(&users, false, false),
            Err(VisorError::State(_))
        ));
        assert!(matches!(
            removal_allowed(&[], true, false),
            Err(VisorError::State(_))
        ));
        assert!(removal_allowed(&users, true, true).is_ok());
        assert!(removal_allowed(&[], false, false).is_ok());
    }

    #[test]
    fn project_ids_are_stable() {
        assert_eq!(project_id("/a/b"), project_id("/a/b"));
        assert_ne!(project_id("/a/b"), project_id("/a/c"));
        assert_eq!(project_id("/a").len(), 14);
    }

    #[test]
    fn containing_picks_the_innermost_active() {
        let mut r = Registry::default();
        r.insert(wd("w-1", "/p", WorkdirKind::Folder, None), "t");
        r.insert(wd("w-2", "/p", WorkdirKind::Worktree, Some("x")), "t");
        assert_eq!(r.containing(Path::new("/p/x/src")).unwrap().id, "w-2");
        assert_eq!(r.containing(Path::new("/p/y")).unwrap().id, "w-1");
        r.set_state("w-2", WorkdirState::Archived, "t");
        assert_eq!(r.containing(Path::new("/p/x/src")).unwrap().id, "w-1");
        assert!(r.containing(Path::new("/q")).is_none());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u8, Option<u8>),
        Remove(u8),
        Forget(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..4u8, 0..3u8, proptest::option::of(0..4u8))
                .prop_map(|(p, k, n)| Op::Insert(p, k, n)),
            (0..64u8).prop_map(Op::Remove),
            (0..4u8).prop_map(Op::Forget),
        ]
    }

    proptest! {
        /// Driven as the service drives it (find the key first, insert
        /// only when absent and there is room): keys stay unique, every
        /// workdir has its project, and the bounds hold.
        #[test]
        fn keys_stay_unique_and_projects_complete(ops in proptest::collection::vec(op(), 0..200)) {
            let kinds = [WorkdirKind::Folder, WorkdirKind::Main, WorkdirKind::Worktree];
            let mut r = Registry::default();
            for (i, o) in ops.into_iter().enumerate() {
                match o {
                    Op::Insert(p, k, n) => {
                        let project = format!("/p{p}");
                        let name = n.map(|n| format!("n{n}"));
                        if r.find(&project, kinds[k as usize], name.as_deref()).is_none()
                            && r.room_for(&project).is_ok()
                        {
                            r.insert(wd(&format!("w-{i}"), &project, kinds[k as usize], name.as_deref()), "t");
                        }
                    }
                    Op::Remove(i) => { r.remove(&format!("w-{i}")); }
                    Op::Forget(p) => { r.forget(&project_id(&format!("/p{p}"))); }
                }
                let mut keys: Vec<_> = r.workdirs().iter().map(|w| (w.project.clone(), w.kind.as_str(), w.name.clone())).collect();
                let n = keys.len();
                keys.sort();
                keys.dedup();
                prop_assert_eq!(keys.len(), n);
                for w in r.workdirs() {
                    prop_assert!(r.projects().iter().any(|p| p.id == w.project_id));
                }
                prop_assert!(r.workdirs().len() <= MAX_WORKDIRS && r.projects().len() <= MAX_PROJECTS);
            }
        }
    }
}
