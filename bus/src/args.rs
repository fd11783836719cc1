//! The NATS settings every binary takes on its command line ([`NatsArgs`]: URL, user and
//! password, creds, nkey, TLS, inbox prefix, connect timeout, replicas) and the duration
//! parser their flags use.

use crate::Secret;
use std::path::PathBuf;
use std::time::Duration;

/// Default NATS URL of every binary.
pub const DEFAULT_NATS_URL: &str = "nats://127.0.0.1:4222";

/// How to reach NATS and as whom; flattened into each binary's command line. Secrets never
/// appear in `Debug` output or error messages (the URL's password is shown as `***`).
/// See `docs/security.md` for the users and permissions of a secured cluster.
#[derive(Clone, clap::Args)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated: give every server of a NATS cluster
    /// (`nats://n1:4222,nats://n2:4222,nats://n3:4222`), so that this process connects to
    /// any of them and reconnects to a surviving one when its server goes away. With
    /// several URLs the client uses exactly these (servers the cluster announces are not
    /// added) and gives up on an unreachable one after 2 s. `nats://user:password@host:port`
    /// works too (credentials in the first URL), and `tls://host:port` requires TLS.
    #[arg(
        long = "nats-url",
        env = "CONVERGE_NATS_URL",
        default_value = DEFAULT_NATS_URL,
        hide_env_values = true
    )]
    pub url: String,
    /// NATS credentials file (JWT + nkey seed), if the server requires one.
    #[arg(
        long = "nats-creds",
        env = "CONVERGE_NATS_CREDS",
        id = "nats_creds",
        value_name = "FILE"
    )]
    pub creds: Option<PathBuf>,
    /// NATS user name (user and password authentication), e.g. `allocator`, `cli` or
    /// `agent-<host>` on a server configured by deploy/nats/gen-config.sh.
    #[arg(
        long = "nats-user",
        env = "CONVERGE_NATS_USER",
        id = "nats_user",
        value_name = "USER",
        conflicts_with_all = ["nats_creds", "nats_nkey"]
    )]
    pub user: Option<String>,
    /// Password of --nats-user. Prefer --nats-password-file: a command line is visible to
    /// every user of the host.
    #[arg(
        long = "nats-password",
        env = "CONVERGE_NATS_PASSWORD",
        id = "nats_password",
        value_name = "PASSWORD",
        hide_env_values = true,
        requires = "nats_user",
        conflicts_with = "nats_password_file"
    )]
    pub password: Option<Secret>,
    /// File holding the password of --nats-user (its first line).
    #[arg(
        long = "nats-password-file",
        env = "CONVERGE_NATS_PASSWORD_FILE",
        id = "nats_password_file",
        value_name = "FILE",
        requires = "nats_user"
    )]
    pub password_file: Option<PathBuf>,
    /// File holding this user's nkey seed (`SU…`), for servers with nkey users.
    #[arg(
        long = "nats-nkey",
        env = "CONVERGE_NATS_NKEY",
        id = "nats_nkey",
        value_name = "FILE",
        conflicts_with = "nats_creds"
    )]
    pub nkey: Option<PathBuf>,
    /// CA certificate (PEM) that signed the server's certificate; requires TLS.
    #[arg(
        long = "nats-tls-ca",
        env = "CONVERGE_NATS_TLS_CA",
        id = "nats_tls_ca",
        value_name = "FILE"
    )]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM), for servers that verify clients; with --nats-tls-key.
    #[arg(
        long = "nats-tls-cert",
        env = "CONVERGE_NATS_TLS_CERT",
        id = "nats_tls_cert",
        value_name = "FILE",
        requires = "nats_tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --nats-tls-cert.
    #[arg(
        long = "nats-tls-key",
        env = "CONVERGE_NATS_TLS_KEY",
        id = "nats_tls_key",
        value_name = "FILE",
        requires = "nats_tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// Prefix of this process's reply subjects; default `_INBOX.<user>` when the user name
    /// is known (--nats-user or the URL), else `_INBOX`. Needed with --nats-creds or
    /// --nats-nkey on a server that restricts inboxes per user.
    #[arg(
        long = "nats-inbox-prefix",
        env = "CONVERGE_NATS_INBOX_PREFIX",
        id = "nats_inbox_prefix",
        value_name = "PREFIX"
    )]
    pub inbox_prefix: Option<String>,
    /// Give up connecting after this long (e.g. `30s`); unset = keep retrying.
    #[arg(long = "nats-connect-timeout", env = "CONVERGE_NATS_CONNECT_TIMEOUT", value_parser = humantime_duration)]
    pub connect_timeout: Option<Duration>,
    /// Replicas (copies on distinct NATS servers) of the KV buckets and the progress
    /// stream: 1 for a single server, 3 for a three-server cluster (then any one server may
    /// fail), at most the number of JetStream servers in the cluster (1 to 5). The
    /// allocator creates them with this many and changes existing ones to it in place; an
    /// agent or the CLI uses it only when it creates a missing one.
    #[arg(
        long = "bus-replicas",
        env = "CONVERGE_BUS_REPLICAS",
        default_value_t = 1,
        value_name = "N",
        value_parser = clap::value_parser!(u8).range(1..=5)
    )]
    pub replicas: u8,
}

impl Default for NatsArgs {
    /// The default URL, no credentials, no TLS, retrying forever.
    fn default() -> Self {
        Self {
            url: DEFAULT_NATS_URL.to_string(),
            creds: None,
            user: None,
            password: None,
            password_file: None,
            nkey: None,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            inbox_prefix: None,
            connect_timeout: None,
            replicas: 1,
        }
    }
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsArgs")
            .field("url", &self.redacted_url())
            .field("creds", &self.creds)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("password_file", &self.password_file)
            .field("nkey", &self.nkey)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("inbox_prefix", &self.inbox_prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("replicas", &self.replicas)
            .finish()
    }
}

/// Parses a duration such as `500ms`, `10s` or `2m` (humantime syntax) for clap.
pub fn humantime_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (write e.g. 500ms, 10s or 2m)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(humantime_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(humantime_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(humantime_duration("fast").unwrap_err().contains("10s"));
    }
}
