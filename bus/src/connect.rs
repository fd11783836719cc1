//! Connecting to NATS with retry ([`connect`], [`connect_tracked`]): refused credentials
//! and TLS failures told apart from an unreachable server, and the connection's events
//! logged (permission violations reported to its [`Denials`]).

use crate::{BusError, Denial, DenialKind, Denials, NatsArgs, secure};
use backon::{ExponentialBuilder, Retryable};
use std::time::Duration;

/// Connects to NATS as `name`, retrying with capped exponential backoff (0.1 s doubling up
/// to 5 s) until connected or `connect_timeout` passes. Reconnects after a later
/// disconnect are handled by the client. Credentials the server refuses, and TLS failures,
/// end the attempt at once ([`BusError::Refused`]); files named by `args` are read first
/// and a missing or malformed one is reported with the flag that named it.
pub async fn connect(args: &NatsArgs, name: &str) -> Result<async_nats::Client, BusError> {
    connect_tracked(args, name).await.map(|(client, _)| client)
}

/// [`connect`], also returning the connection's permission violations.
pub async fn connect_tracked(
    args: &NatsArgs,
    name: &str,
) -> Result<(async_nats::Client, Denials), BusError> {
    let base = secure::connect_options(args)?;
    let servers = args.server_addrs()?;
    // One server: wait for it as long as a slow TLS handshake may take. Several (a
    // cluster): these and no others (the addresses a cluster announces may not be
    // reachable from here, and an unreachable one would cost a timeout per reconnect), and
    // a dead one abandoned after 2 s (nats.go's default) for the next.
    let several = servers.len() > 1;
    let attempt_timeout = Duration::from_secs(if several { 2 } else { 5 });
    let inbox = format!("{}.", args.inbox_prefix()?);
    let denials = Denials::new();
    let url = args.redacted_url();
    let attempt = || async {
        let reporter = denials.clone();
        let inbox = inbox.clone();
        let mut opts = base
            .clone()
            .name(name)
            .connection_timeout(attempt_timeout)
            .max_reconnects(None)
            .event_callback(move |event| {
                let reporter = reporter.clone();
                let inbox = inbox.clone();
                async move { on_event(event, &reporter, &inbox) }
            });
        if several {
            opts = opts.ignore_discovered_servers();
        }
        opts.connect(servers.clone()).await.map_err(|source| {
            use async_nats::ConnectErrorKind as K;
            let kind = if is_tls_failure(&source) {
                K::Tls
            } else {
                source.kind()
            };
            let hint = match kind {
                K::AuthorizationViolation | K::Authentication => {
                    "check the user and password (--nats-user, --nats-password-file), \
                     --nats-creds or --nats-nkey against the server's configuration"
                }
                K::Tls => {
                    "check --nats-tls-ca (the CA that signed the server's certificate, whose \
                     names must include the host in --nats-url) and the client certificate"
                }
                _ => {
                    return BusError::Connect {
                        url: url.clone(),
                        source,
                    };
                }
            };
            BusError::Refused {
                url: url.clone(),
                auth: secure::describe_auth(args),
                hint,
                source,
            }
        })
    };
    let mut backoff = ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .without_max_times();
    if let Some(limit) = args.connect_timeout {
        backoff = backoff.with_total_delay(Some(limit));
    }
    let client = attempt
        .retry(backoff)
        .when(|e| matches!(e, BusError::Connect { .. }))
        .notify(|e, after| tracing::warn!("{e}; retrying in {after:?}"))
        .await?;
    let info = client.server_info();
    tracing::info!(
        server = %info.server_name,
        cluster = info.cluster.as_deref().unwrap_or("-"),
        servers = servers.len(),
        "connected to NATS server {} of {}",
        info.server_name,
        url
    );
    Ok((client, denials))
}

/// Whether connecting failed in the TLS handshake (an untrusted or mismatched certificate,
/// a refused client certificate): the client reports most of these as I/O errors.
fn is_tls_failure(e: &async_nats::ConnectError) -> bool {
    if e.kind() == async_nats::ConnectErrorKind::Tls {
        return true;
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = cause {
        if err.is::<async_nats::rustls::Error>() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>()
            && io
                .get_ref()
                .is_some_and(|inner| inner.is::<async_nats::rustls::Error>())
        {
            return true;
        }
        cause = err.source();
    }
    false
}

fn on_event(event: async_nats::Event, denials: &Denials, inbox: &str) {
    use async_nats::{Event, ServerError};
    match event {
        Event::Disconnected => tracing::warn!("disconnected from NATS"),
        Event::Connected => tracing::info!("connected to NATS"),
        Event::ServerError(ServerError::Other(text)) => match Denial::parse(&text) {
            Some(denial) => {
                if denial.subject.starts_with("$JS.API.CONSUMER.DELETE.") {
                    // An ordered consumer re-created after a reconnect first deletes its
                    // predecessor; users without delete rights (agents) leave that to the
                    // server, which removes idle consumers by itself.
                    tracing::debug!("NATS refused deleting a replaced consumer: {denial}");
                } else if denial.kind == DenialKind::Subscribe && denial.subject.starts_with(inbox)
                {
                    tracing::error!(
                        "NATS refused this client's reply inbox ({denial}): every request \
                         will time out; set --nats-inbox-prefix to the prefix this user may \
                         subscribe to (default _INBOX.<user>)"
                    );
                } else {
                    tracing::warn!("NATS refused an operation: {denial}");
                }
                denials.report(denial);
            }
            None => tracing::warn!("NATS server error: {text}"),
        },
        Event::ServerError(e) => tracing::warn!("NATS server error: {e}"),
        other => tracing::debug!(event = %other, "NATS event"),
    }
}
