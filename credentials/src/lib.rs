//! Secrets read from files: the control plane's bearer tokens (each with a role), the data
//! plane's client API keys, and the token a data plane presents to the control plane.
//!
//! A file holds one secret per line, optionally followed by whitespace and a label (the
//! control plane's role); blank lines and lines starting with `#` are skipped. A [`Keyring`]
//! keeps only a keyed digest of each secret and compares a presented secret against every
//! entry in constant time. A [`SecretFile`] re-reads its file when its content changes (also
//! when it is replaced by a rename) and on SIGHUP, so secrets rotate without a restart; a file
//! that no longer parses is refused and the previous secrets keep working.
//!
//! Secrets never appear in errors or logs: messages name the file and the line number only.

pub mod throttle;

pub use throttle::Throttle;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use subtle::{ConditionallySelectable, ConstantTimeEq};

/// How often a [`SecretFile`] looks at its file (rotation takes effect within this).
pub const RELOAD_INTERVAL: Duration = Duration::from_millis(500);

/// Why a secret file cannot be used. Never carries a secret.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} line {line}: {message}")]
    Line {
        path: String,
        line: usize,
        message: String,
    },
    #[error("{path} holds no secret (every line is blank or a # comment)")]
    Empty { path: String },
}

/// A set of secrets, each with a label of type `L`, held as keyed digests.
#[derive(Debug, Clone)]
pub struct Keyring<L> {
    seed: u64,
    entries: Vec<([u8; 16], L)>,
}

impl<L: Clone> Keyring<L> {
    /// A keyring of `secrets`.
    pub fn new<'a>(secrets: impl IntoIterator<Item = (&'a [u8], L)>) -> Self {
        let seed = rand::random::<u64>();
        let entries = secrets
            .into_iter()
            .map(|(s, label)| (digest(seed, s), label))
            .collect();
        Keyring { seed, entries }
    }

    /// The label of `presented` if it is one of the secrets. Takes the same time whichever
    /// entry matches, or none: every entry is compared, on fixed-length digests (so the
    /// comparison does not reveal a secret's length either).
    pub fn check(&self, presented: &[u8]) -> Option<L> {
        let d = digest(self.seed, presented);
        let mut found = subtle::Choice::from(0);
        let mut index = 0u32;
        for (i, (entry, _)) in self.entries.iter().enumerate() {
            let hit = entry.ct_eq(&d);
            index.conditional_assign(&(i as u32), hit);
            found |= hit;
        }
        bool::from(found).then(|| self.entries[index as usize].1.clone())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Digest under a per-process random key: a presented secret is compared on this, never on its
/// bytes.
fn digest(seed: u64, secret: &[u8]) -> [u8; 16] {
    xxhash_rust::xxh3::xxh3_128_with_seed(secret, seed).to_le_bytes()
}

/// The secret of an `Authorization: Bearer SECRET` header value (scheme case-insensitive).
pub fn bearer(header: &[u8]) -> Option<&[u8]> {
    const SCHEME: &[u8] = b"bearer ";
    if header.len() <= SCHEME.len() || !header[..SCHEME.len()].eq_ignore_ascii_case(SCHEME) {
        return None;
    }
    let secret = header[SCHEME.len()..].trim_ascii();
    (!secret.is_empty()).then_some(secret)
}

/// The lines of a secret file: `(line number, secret, label)` for each line that is not blank
/// or a comment.
pub fn lines(text: &str) -> impl Iterator<Item = (usize, &str, Option<&str>)> {
    text.lines().enumerate().filter_map(|(i, line)| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let secret = line.split_whitespace().next()?;
        let rest = line[secret.len()..].trim();
        let label = (!rest.is_empty()).then_some(rest);
        Some((i + 1, secret, label))
    })
}

/// Reads the first secret of `path` (the data plane's token for the control plane).
pub fn read_first(path: &Path) -> Result<String, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.display().to_string(),
        source,
    })?;
    let first = lines(&text).next().map(|(_, s, _)| s.to_string());
    first.ok_or_else(|| Error::Empty {
        path: path.display().to_string(),
    })
}

/// How a [`SecretFile`] turns a line's label into `L` (an error message names the bad label,
/// never the secret).
pub type LabelParser<L> = fn(Option<&str>) -> Result<L, String>;

/// A secret file kept current: [`SecretFile::keyring`] is the last version of the file that
/// parsed.
pub struct SecretFile<L> {
    path: PathBuf,
    parse_label: LabelParser<L>,
    keyring: ArcSwap<Keyring<L>>,
    content: std::sync::Mutex<u64>,
}

impl<L> std::fmt::Debug for SecretFile<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretFile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl<L: Clone + Send + Sync + 'static> SecretFile<L> {
    /// Reads and parses `path`; fails if it cannot be read, a line does not parse, or it holds
    /// no secret.
    pub fn open(path: impl Into<PathBuf>, parse_label: LabelParser<L>) -> Result<Self, Error> {
        let path = path.into();
        let (text, keyring) = load(&path, parse_label)?;
        Ok(SecretFile {
            content: std::sync::Mutex::new(xxhash_rust::xxh3::xxh3_64(text.as_bytes())),
            path,
            parse_label,
            keyring: ArcSwap::from_pointee(keyring),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current secrets.
    pub fn keyring(&self) -> arc_swap::Guard<Arc<Keyring<L>>> {
        self.keyring.load()
    }

    /// The label of `presented`, checked against the current secrets.
    pub fn check(&self, presented: &[u8]) -> Option<L> {
        self.keyring.load().check(presented)
    }

    /// Re-reads the file; `Ok(true)` if its content changed and the new secrets are in use.
    /// On an error the previous secrets stay in use.
    pub fn reload(&self) -> Result<bool, Error> {
        let text = std::fs::read_to_string(&self.path).map_err(|source| Error::Read {
            path: self.path.display().to_string(),
            source,
        })?;
        let hash = xxhash_rust::xxh3::xxh3_64(text.as_bytes());
        let mut last = self.content.lock().unwrap_or_else(|e| e.into_inner());
        if *last == hash {
            return Ok(false);
        }
        let keyring = parse(&self.path, &text, self.parse_label)?;
        self.keyring.store(Arc::new(keyring));
        *last = hash;
        Ok(true)
    }

    /// Re-reads the file every [`RELOAD_INTERVAL`] and on SIGHUP, until the returned task is
    /// aborted or the runtime ends. `what` names the file in logs ("auth token file").
    pub fn spawn_reload(self: &Arc<Self>, what: &'static str) -> tokio::task::JoinHandle<()> {
        let file = self.clone();
        spawn_reloader(self.path.clone(), what, move || file.reload())
    }
}

/// Calls `reload` every [`RELOAD_INTERVAL`] and on SIGHUP (off the runtime's threads), logging
/// what changed and the first of a run of errors, until the task is aborted or the runtime ends.
fn spawn_reloader(
    path: PathBuf,
    what: &'static str,
    reload: impl Fn() -> Result<bool, Error> + Send + Sync + 'static,
) -> tokio::task::JoinHandle<()> {
    let reload = Arc::new(reload);
    tokio::spawn(async move {
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut tick = tokio::time::interval(RELOAD_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failing = false;
        loop {
            #[cfg(unix)]
            {
                let hup = async {
                    match hangup.as_mut() {
                        Some(s) => {
                            s.recv().await;
                        }
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! { _ = tick.tick() => {}, _ = hup => {} }
            }
            #[cfg(not(unix))]
            tick.tick().await;
            let r = reload.clone();
            match tokio::task::spawn_blocking(move || r()).await {
                Ok(Ok(true)) => {
                    failing = false;
                    tracing::info!(file = %path.display(), "{what} re-read; new secrets in use");
                }
                Ok(Ok(false)) => failing = false,
                Ok(Err(e)) if !failing => {
                    failing = true;
                    tracing::error!("{what}: {e}; the previous secrets stay in use");
                }
                Ok(Err(_)) | Err(_) => {}
            }
        }
    })
}

/// The first secret of a file, turned into a `T` (e.g. the header an upstream receives) and
/// kept current like a [`SecretFile`]: re-read on change and on SIGHUP; a version that does not
/// parse is refused and the previous value stays in use.
pub struct SecretValue<T> {
    path: PathBuf,
    convert: fn(&str) -> Result<T, String>,
    value: ArcSwap<T>,
    content: std::sync::Mutex<u64>,
}

impl<T> std::fmt::Debug for SecretValue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretValue")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl<T: Send + Sync + 'static> SecretValue<T> {
    /// Reads `path`'s first secret and converts it (an error names the file, never the secret).
    pub fn open(
        path: impl Into<PathBuf>,
        convert: fn(&str) -> Result<T, String>,
    ) -> Result<Self, Error> {
        let path = path.into();
        let (hash, value) = Self::read(&path, convert)?;
        Ok(SecretValue {
            path,
            convert,
            value: ArcSwap::from_pointee(value),
            content: std::sync::Mutex::new(hash),
        })
    }

    fn read(path: &Path, convert: fn(&str) -> Result<T, String>) -> Result<(u64, T), Error> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.display().to_string(),
            source,
        })?;
        let (line, first, _) = lines(&text).next().ok_or_else(|| Error::Empty {
            path: path.display().to_string(),
        })?;
        let value = convert(first).map_err(|message| Error::Line {
            path: path.display().to_string(),
            line,
            message,
        })?;
        Ok((xxhash_rust::xxh3::xxh3_64(text.as_bytes()), value))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current value.
    pub fn get(&self) -> arc_swap::Guard<Arc<T>> {
        self.value.load()
    }

    /// Re-reads the file; `Ok(true)` if it changed and the new value is in use.
    pub fn reload(&self) -> Result<bool, Error> {
        let text = std::fs::read_to_string(&self.path).map_err(|source| Error::Read {
            path: self.path.display().to_string(),
            source,
        })?;
        let mut last = self.content.lock().unwrap_or_else(|e| e.into_inner());
        if *last == xxhash_rust::xxh3::xxh3_64(text.as_bytes()) {
            return Ok(false);
        }
        let (hash, value) = Self::read(&self.path, self.convert)?;
        self.value.store(Arc::new(value));
        *last = hash;
        Ok(true)
    }

    /// Re-reads the file every [`RELOAD_INTERVAL`] and on SIGHUP (see [`SecretFile::spawn_reload`]).
    pub fn spawn_reload(self: &Arc<Self>, what: &'static str) -> tokio::task::JoinHandle<()> {
        let file = self.clone();
        spawn_reloader(self.path.clone(), what, move || file.reload())
    }
}

fn load<L: Clone>(path: &Path, parse_label: LabelParser<L>) -> Result<(String, Keyring<L>), Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.display().to_string(),
        source,
    })?;
    let keyring = parse(path, &text, parse_label)?;
    Ok((text, keyring))
}

fn parse<L: Clone>(
    path: &Path,
    text: &str,
    parse_label: LabelParser<L>,
) -> Result<Keyring<L>, Error> {
    let mut secrets = Vec::new();
    for (line, secret, label) in lines(text) {
        let label = parse_label(label).map_err(|message| Error::Line {
            path: path.display().to_string(),
            line,
            message,
        })?;
        secrets.push((secret.as_bytes(), label));
    }
    if secrets.is_empty() {
        return Err(Error::Empty {
            path: path.display().to_string(),
        });
    }
    Ok(Keyring::new(secrets))
}

/// A label parser for files whose lines carry no label (API keys): refuses any.
pub fn no_label(label: Option<&str>) -> Result<(), String> {
    match label {
        None => Ok(()),
        Some(l) => Err(format!(
            "unexpected text after the key: {:?} (one key per line)",
            l.chars().take(16).collect::<String>()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Role(u8);
    fn role(label: Option<&str>) -> Result<Role, String> {
        match label {
            None | Some("admin") => Ok(Role(1)),
            Some("reader") => Ok(Role(2)),
            Some(other) => Err(format!("unknown role {other:?}")),
        }
    }

    #[test]
    fn keyring_matches_exact_secrets_only() {
        let k = Keyring::new([(&b"alpha"[..], Role(1)), (&b"beta"[..], Role(2))]);
        assert_eq!(k.check(b"alpha"), Some(Role(1)));
        assert_eq!(k.check(b"beta"), Some(Role(2)));
        for wrong in [&b"alph"[..], b"alphaa", b"", b"ALPHA", b"gamma"] {
            assert_eq!(k.check(wrong), None, "{wrong:?}");
        }
    }

    #[test]
    fn bearer_header_values() {
        assert_eq!(bearer(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer(b"Basic abc"), None);
        assert_eq!(bearer(b"Bearer "), None);
        assert_eq!(bearer(b"abc"), None);
    }

    #[test]
    fn files_parse_with_labels_comments_and_errors_without_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(
            &path,
            "# ops\n\ns3cret-admin admin\ns3cret-read reader\nplain\n",
        )
        .unwrap();
        let f = SecretFile::open(&path, role).unwrap();
        assert_eq!(f.check(b"s3cret-admin"), Some(Role(1)));
        assert_eq!(f.check(b"s3cret-read"), Some(Role(2)));
        assert_eq!(f.check(b"plain"), Some(Role(1)));
        assert_eq!(f.keyring().len(), 3);

        std::fs::write(&path, "ok admin\nhunter2 writer\n").unwrap();
        let e = f.reload().unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("writer"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        // the previous secrets stay in use
        assert_eq!(f.check(b"s3cret-admin"), Some(Role(1)));

        std::fs::write(&path, "# nothing\n").unwrap();
        assert!(matches!(f.reload(), Err(Error::Empty { .. })));
        let missing = SecretFile::open(dir.path().join("nope"), role).unwrap_err();
        assert!(missing.to_string().contains("nope"), "{missing}");
    }

    #[test]
    fn reload_picks_up_a_renamed_replacement() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "old-key\n").unwrap();
        let f = SecretFile::open(&path, no_label).unwrap();
        assert!(!f.reload().unwrap(), "unchanged content is not a change");
        let tmp = dir.path().join("keys.new");
        std::fs::write(&tmp, "new-key\n").unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        assert!(f.reload().unwrap());
        assert_eq!(f.check(b"new-key"), Some(()));
        assert_eq!(f.check(b"old-key"), None);
        std::fs::write(&path, "k extra words\n").unwrap();
        let e = f.reload().unwrap_err().to_string();
        assert!(
            e.contains("one key per line") && !e.contains("k extra"),
            "{e}"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_reload_task_rotates_within_the_interval() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys");
        std::fs::write(&path, "first\n").unwrap();
        let f = Arc::new(SecretFile::open(&path, no_label).unwrap());
        let task = f.spawn_reload("test keys");
        std::fs::write(&path, "second\n").unwrap();
        let deadline = tokio::time::Instant::now() + RELOAD_INTERVAL * 8;
        while f.check(b"second").is_none() {
            assert!(tokio::time::Instant::now() < deadline, "not re-read");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(f.check(b"first"), None);
        task.abort();
    }

    #[test]
    fn first_secret() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t");
        std::fs::write(&path, "# mine\n tok-1 admin\ntok-2\n").unwrap();
        assert_eq!(read_first(&path).unwrap(), "tok-1");
    }
}
