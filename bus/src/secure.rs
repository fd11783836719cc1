//! Credentials and TLS of a NATS connection: the secret type that never prints, URL
//! redaction, reading and checking the files named on the command line, and the per-user
//! reply inbox that the server's permissions expect (see `docs/security.md`).

use crate::{BusError, NatsArgs};
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// A secret (password) from the command line or the environment. `Debug` and `Display`
/// print `***`, so a logged configuration never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }
    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_string()))
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// `url` (one or several, comma-separated) with any password or token in the userinfo
/// replaced by `***`: `nats://agent-n1:***@host:4222`, `nats://***@host` (token).
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let (scheme, rest) = match one.find("://") {
                Some(i) => one.split_at(i + 3),
                None => ("", one),
            };
            let host_start = rest.find('/').unwrap_or(rest.len());
            match rest[..host_start].rfind('@') {
                Some(at) => {
                    let userinfo = &rest[..at];
                    let shown = match userinfo.split_once(':') {
                        Some((user, _)) => format!("{user}:***"),
                        None => "***".to_string(),
                    };
                    format!("{scheme}{shown}{}", &rest[at..])
                }
                None => one.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The user name in the first URL's userinfo (`nats://user:password@host`), if any. A
/// userinfo without `:` is a token, not a user.
pub fn url_user(url: &str) -> Option<String> {
    let first = url.split(',').next()?.trim();
    let rest = first.split_once("://").map_or(first, |(_, r)| r);
    let host_start = rest.find('/').unwrap_or(rest.len());
    let at = rest[..host_start].rfind('@')?;
    let (user, _) = rest[..at].split_once(':')?;
    (!user.is_empty()).then(|| user.to_string())
}

/// The credentials in the first URL's userinfo: `Some((Some(user), password))` for
/// `nats://user:password@host`, `Some((None, token))` for `nats://token@host`;
/// percent-escapes decoded. The client library does not read them from the URL itself.
fn url_credentials(url: &str) -> Option<(Option<String>, Secret)> {
    let first = url.split(',').next()?.trim();
    let rest = first.split_once("://").map_or(first, |(_, r)| r);
    let host_start = rest.find('/').unwrap_or(rest.len());
    let at = rest[..host_start].rfind('@')?;
    let userinfo = &rest[..at];
    match userinfo.split_once(':') {
        Some((user, password)) => Some((
            Some(percent_decode(user)),
            Secret::new(percent_decode(password)),
        )),
        None => Some((None, Secret::new(percent_decode(userinfo)))),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `s` is a subject without wildcards (an inbox prefix, a user name used in one).
fn valid_literal_subject(s: &str) -> bool {
    !s.is_empty()
        && s.split('.').all(|t| {
            !t.is_empty()
                && !t
                    .chars()
                    .any(|c| c.is_whitespace() || c == '*' || c == '>' || c.is_control())
        })
}

impl NatsArgs {
    /// The user name this process authenticates as, if known: `--nats-user`, else the URL's
    /// userinfo. Unknown with a credentials file or an nkey.
    pub fn user_name(&self) -> Option<String> {
        self.user.clone().or_else(|| url_user(&self.url))
    }

    /// The prefix of this connection's reply subjects: `--nats-inbox-prefix`, else
    /// `_INBOX.<user>` when the user name is known, else the client's default `_INBOX`. A
    /// server configured by `deploy/nats/gen-config.sh` lets each user subscribe to its
    /// own `_INBOX.<user>.>` only, so no user can read another's replies.
    pub fn inbox_prefix(&self) -> Result<String, BusError> {
        let prefix = match (&self.inbox_prefix, self.user_name()) {
            (Some(p), _) => p.clone(),
            (None, Some(user)) => format!("_INBOX.{user}"),
            (None, None) => "_INBOX".to_string(),
        };
        if !valid_literal_subject(&prefix) {
            return Err(BusError::Config(format!(
                "NATS inbox prefix {prefix:?} is not a subject without wildcards \
                 (it comes from --nats-inbox-prefix or the user name)"
            )));
        }
        Ok(prefix)
    }

    /// The URL for messages: passwords and tokens replaced by `***`.
    pub fn redacted_url(&self) -> String {
        redact_url(&self.url)
    }

    /// The servers of `--nats-url`, in the order given: every comma-separated URL (spaces
    /// around commas allowed), `nats://` and port 4222 assumed where left out. A malformed
    /// one is a [`BusError::Config`] that shows it (redacted).
    pub fn server_addrs(&self) -> Result<Vec<async_nats::ServerAddr>, BusError> {
        self.url
            .split(',')
            .map(str::trim)
            .map(|one| {
                if one.is_empty() {
                    return Err(BusError::Config(format!(
                        "--nats-url {:?} has an empty URL: give one or several \
                         nats://host:port or tls://host:port, separated by commas",
                        self.redacted_url()
                    )));
                }
                one.parse::<async_nats::ServerAddr>().map_err(|e| {
                    BusError::Config(format!(
                        "--nats-url: {}: {e} (give one or several nats://host:port or \
                         tls://host:port, separated by commas)",
                        redact_url(one)
                    ))
                })
            })
            .collect()
    }
}

fn read_file(what: &'static str, path: &Path) -> Result<String, BusError> {
    std::fs::read_to_string(path).map_err(|source| BusError::File {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn check_pem(what: &'static str, flag: &str, path: &Path, marker: &str) -> Result<(), BusError> {
    let text = read_file(what, path)?;
    if !text.contains("-----BEGIN") || !text.contains(marker) {
        return Err(BusError::Config(format!(
            "{what} {} ({flag}) is not a PEM file with a {marker}",
            path.display()
        )));
    }
    Ok(())
}

/// The password: `--nats-password` (or `CONVERGE_NATS_PASSWORD`), else the first line of
/// `--nats-password-file`.
fn password(args: &NatsArgs) -> Result<Option<Secret>, BusError> {
    match (&args.password, &args.password_file) {
        (Some(_), Some(_)) => Err(BusError::Config(
            "give either --nats-password or --nats-password-file, not both".into(),
        )),
        (Some(p), None) => Ok(Some(p.clone())),
        (None, Some(path)) => {
            let text = read_file("NATS password file (--nats-password-file)", path)?;
            let line = text.lines().next().unwrap_or("").trim_end_matches('\r');
            if line.is_empty() {
                return Err(BusError::Config(format!(
                    "NATS password file {} (--nats-password-file) is empty",
                    path.display()
                )));
            }
            Ok(Some(Secret::new(line)))
        }
        (None, None) => Ok(None),
    }
}

/// Connection options from `args`: authentication (user and password, credentials file or
/// nkey seed), TLS (CA, client certificate) and the reply inbox. Every file is read and
/// checked here, before any connection attempt, so a wrong path fails at once and says
/// which flag named it.
pub(crate) fn connect_options(args: &NatsArgs) -> Result<async_nats::ConnectOptions, BusError> {
    let methods = [
        args.user.is_some(),
        args.creds.is_some(),
        args.nkey.is_some(),
    ];
    if methods.iter().filter(|m| **m).count() > 1 {
        return Err(BusError::Config(
            "give only one of --nats-user, --nats-creds and --nats-nkey".into(),
        ));
    }
    let password = password(args)?;
    let mut opts = async_nats::ConnectOptions::new();
    if let Some((user, secret)) = url_credentials(&args.url) {
        if methods.iter().any(|m| *m) || password.is_some() {
            return Err(BusError::Config(
                "credentials in --nats-url and in --nats-user, --nats-password, --nats-creds \
                 or --nats-nkey: give them one way only"
                    .into(),
            ));
        }
        opts = match user {
            Some(user) => opts.user_and_password(user, secret.expose().to_string()),
            None => opts.token(secret.expose().to_string()),
        };
    }
    if let Some(user) = &args.user {
        if !valid_literal_subject(user) || user.contains('.') {
            return Err(BusError::Config(format!(
                "NATS user name {user:?} (--nats-user) may not contain dots, spaces or wildcards"
            )));
        }
        let Some(password) = password else {
            return Err(BusError::Config(format!(
                "--nats-user {user} needs a password: --nats-password-file, \
                 CONVERGE_NATS_PASSWORD_FILE or CONVERGE_NATS_PASSWORD"
            )));
        };
        opts = opts.user_and_password(user.clone(), password.expose().to_string());
    } else if password.is_some() {
        return Err(BusError::Config(
            "a NATS password was given without --nats-user".into(),
        ));
    }
    if let Some(path) = &args.creds {
        let text = read_file("NATS credentials file (--nats-creds)", path)?;
        opts = opts.credentials(&text).map_err(|e| {
            BusError::Config(format!(
                "{} (--nats-creds) is not a NATS credentials file (JWT and nkey seed): {e}",
                path.display()
            ))
        })?;
    }
    if let Some(path) = &args.nkey {
        let text = read_file("NATS nkey seed file (--nats-nkey)", path)?;
        let seed = text.trim();
        if !seed.starts_with("SU") || seed.lines().count() != 1 {
            return Err(BusError::Config(format!(
                "{} (--nats-nkey) does not hold a user nkey seed (one line starting with SU)",
                path.display()
            )));
        }
        opts = opts.nkey(seed.to_string());
    }
    if let Some(ca) = &args.tls_ca {
        check_pem(
            "TLS CA certificate",
            "--nats-tls-ca",
            ca,
            "CERTIFICATE-----",
        )?;
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => {
            check_pem(
                "TLS client certificate",
                "--nats-tls-cert",
                cert,
                "CERTIFICATE-----",
            )?;
            check_pem("TLS client key", "--nats-tls-key", key, "PRIVATE KEY-----")?;
            opts = opts
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        (None, None) => {}
        _ => {
            return Err(BusError::Config(
                "--nats-tls-cert and --nats-tls-key go together".into(),
            ));
        }
    }
    Ok(opts.custom_inbox_prefix(args.inbox_prefix()?))
}

/// Paths named by `args`, for messages.
pub(crate) fn describe_auth(args: &NatsArgs) -> String {
    let mut parts = Vec::new();
    if let Some(user) = args.user_name() {
        parts.push(format!("user {user}"));
    }
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.display().to_string());
    if let Some(p) = path(&args.creds) {
        parts.push(format!("credentials file {p}"));
    }
    if let Some(p) = path(&args.nkey) {
        parts.push(format!("nkey seed {p}"));
    }
    if parts.is_empty() {
        "no credentials".to_string()
    } else {
        parts.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("nats://agent-n1:s3cret@10.0.0.1:4222"),
            "nats://agent-n1:***@10.0.0.1:4222"
        );
        assert_eq!(redact_url("tls://tok3n@nats:4222"), "tls://***@nats:4222");
        assert_eq!(
            redact_url("nats://a:b@h1:1,nats://h2:2"),
            "nats://a:***@h1:1,nats://h2:2"
        );
        assert_eq!(redact_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redact_url("localhost"), "localhost");
        assert_eq!(url_user("nats://cli:pw@h:1"), Some("cli".into()));
        assert_eq!(url_user("nats://token@h:1"), None);
        assert_eq!(url_user("nats://h:1"), None);
        let (user, pw) = url_credentials("nats://cli:p%40ss@h:1,nats://x@y").unwrap();
        assert_eq!((user.as_deref(), pw.expose()), (Some("cli"), "p@ss"));
        let (user, token) = url_credentials("tls://t0k@h").unwrap();
        assert_eq!((user, token.expose()), (None, "t0k"));
        assert!(url_credentials("nats://h:1").is_none());
    }

    #[test]
    fn every_url_is_a_server() {
        let args = NatsArgs {
            url: "nats://n1:4222, nats://n2:4223,n3".into(),
            ..NatsArgs::default()
        };
        let addrs = args.server_addrs().unwrap();
        let shown: Vec<String> = addrs
            .iter()
            .map(|a| format!("{}:{}", a.host(), a.port()))
            .collect();
        assert_eq!(shown, ["n1:4222", "n2:4223", "n3:4222"]);
        assert!(addrs.iter().all(|a| !a.tls_required()));
        let args = NatsArgs {
            url: "tls://cli:pw@n1:4222,tls://n2:4222".into(),
            ..NatsArgs::default()
        };
        assert!(
            args.server_addrs()
                .unwrap()
                .iter()
                .all(|a| a.tls_required())
        );
        for bad in [
            "",
            "nats://n1:4222,,nats://n2",
            "http://n1:4222",
            "nats://a:b@n1:99999",
        ] {
            let args = NatsArgs {
                url: bad.into(),
                ..NatsArgs::default()
            };
            let e = args.server_addrs().unwrap_err().to_string();
            assert!(e.contains("--nats-url") && !e.contains(":b@"), "{bad}: {e}");
        }
    }

    #[test]
    fn secrets_never_print() {
        let s: Secret = "hunter2".parse().unwrap();
        assert_eq!(format!("{s:?} {s}"), "Secret(***) ***");
        let args = NatsArgs {
            url: "nats://cli:hunter2@h:1".into(),
            password: Some(s),
            ..NatsArgs::default()
        };
        let shown = format!("{args:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("cli:***@h:1"), "{shown}");
    }

    #[test]
    fn inbox_prefix_follows_the_user() {
        let mut args = NatsArgs::default();
        assert_eq!(args.inbox_prefix().unwrap(), "_INBOX");
        args.url = "nats://agent-n1:pw@h:1".into();
        assert_eq!(args.inbox_prefix().unwrap(), "_INBOX.agent-n1");
        args.user = Some("cli".into());
        assert_eq!(args.inbox_prefix().unwrap(), "_INBOX.cli");
        args.inbox_prefix = Some("_INBOX.ops".into());
        assert_eq!(args.inbox_prefix().unwrap(), "_INBOX.ops");
        args.inbox_prefix = Some("_INBOX.>".into());
        assert!(args.inbox_prefix().is_err());
    }

    #[test]
    fn unreadable_or_wrong_files_are_named() {
        let dir = tempfile_dir();
        let missing = dir.join("missing.pem");
        let args = NatsArgs {
            tls_ca: Some(missing.clone()),
            ..NatsArgs::default()
        };
        let e = connect_options(&args).unwrap_err().to_string();
        assert!(
            e.contains("TLS CA certificate") && e.contains("missing.pem"),
            "{e}"
        );

        let not_pem = dir.join("ca.txt");
        std::fs::write(&not_pem, "hello").unwrap();
        let args = NatsArgs {
            tls_ca: Some(not_pem),
            ..NatsArgs::default()
        };
        let e = connect_options(&args).unwrap_err().to_string();
        assert!(e.contains("--nats-tls-ca") && e.contains("PEM"), "{e}");

        let empty = dir.join("pw");
        std::fs::write(&empty, "\n").unwrap();
        let args = NatsArgs {
            user: Some("cli".into()),
            password_file: Some(empty),
            ..NatsArgs::default()
        };
        let e = connect_options(&args).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");

        let args = NatsArgs {
            user: Some("cli".into()),
            ..NatsArgs::default()
        };
        let e = connect_options(&args).unwrap_err().to_string();
        assert!(e.contains("needs a password"), "{e}");

        let args = NatsArgs {
            user: Some("cli".into()),
            password_file: Some(dir.join("nope")),
            ..NatsArgs::default()
        };
        let e = connect_options(&args).unwrap_err().to_string();
        assert!(
            e.contains("--nats-password-file") && e.contains("nope"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "converge-bus-secure-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
